package bufpool

import (
	"testing"
	"time"
)

func TestIdlePool(t *testing.T) {
	p := New[int](2, 100, 30*time.Millisecond)
	if _, ok := p.Get(0); ok {
		t.Fatal("empty pool gave an entry")
	}
	p.Put(0, 1, 40)
	p.Put(0, 2, 40)
	p.Put(1, 3, 40) // over the bound: left to the GC
	if got := p.Held.Load(); got != 80 {
		t.Fatalf("held %d bytes, want 80", got)
	}
	if v, ok := p.Get(1); ok {
		t.Fatalf("an entry over the bound was kept: %d", v)
	}
	if v, _ := p.Get(0); v != 2 {
		t.Fatalf("get = %d, want the most recent (2)", v)
	}
	p.Put(1, 4, 40)
	// Unused for the ttl, everything goes, and the timer with it.
	deadline := time.Now().Add(5 * time.Second)
	for p.Held.Load() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	p.mu.Lock()
	held, timer := p.Held.Load(), p.timer
	p.mu.Unlock()
	if held != 0 || timer != nil {
		t.Fatalf("after the ttl: %d bytes held, timer %v", held, timer)
	}
	for c := range 2 {
		if v, ok := p.Get(c); ok {
			t.Fatalf("class %d kept %d past the ttl", c, v)
		}
	}
}

// An entry put later than the others survives their sweep.
func TestIdlePoolSweepsOnlyTheIdle(t *testing.T) {
	p := New[int](1, 100, 60*time.Millisecond)
	p.Put(0, 1, 1)
	time.Sleep(40 * time.Millisecond)
	p.Put(0, 2, 1)
	deadline := time.Now().Add(5 * time.Second)
	for p.Held.Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if v, ok := p.Get(0); !ok || v != 2 {
		t.Fatalf("after the first entry's ttl: get = %d, %v; want the later entry (2)", v, ok)
	}
}
