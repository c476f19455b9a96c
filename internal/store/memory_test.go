package store

import (
	"context"
	"fmt"
	"testing"
	"time"
)

func TestMemoryBoundsAndTTL(t *testing.T) {
	ctx := context.Background()
	now := time.Unix(1000, 0)
	m := NewMemory[int](3, time.Minute)
	m.now = func() time.Time { return now }
	for i := 0; i < 5; i++ {
		if err := m.Save(ctx, fmt.Sprint(i), i); err != nil {
			t.Fatal(err)
		}
	}
	if m.Len() != 3 {
		t.Fatalf("len = %d, want 3", m.Len())
	}
	if _, ok, _ := m.Load(ctx, "0"); ok {
		t.Fatal("oldest entry should have been evicted")
	}
	if v, ok, _ := m.Load(ctx, "4"); !ok || v != 4 {
		t.Fatalf("load 4 = %v %v", v, ok)
	}
	// Touching "2" makes "3" the least recently used.
	m.Load(ctx, "2")
	m.Save(ctx, "5", 5)
	if _, ok, _ := m.Load(ctx, "3"); ok {
		t.Fatal("LRU entry 3 should have been evicted")
	}
	if _, ok, _ := m.Load(ctx, "2"); !ok {
		t.Fatal("recently used entry 2 was evicted")
	}
	now = now.Add(2 * time.Minute)
	if _, ok, _ := m.Load(ctx, "2"); ok {
		t.Fatal("entry should have expired")
	}
}

func TestMemoryUpdateAndDelete(t *testing.T) {
	ctx := context.Background()
	m := NewMemory[[]int](0, 0)
	for i := 0; i < 3; i++ {
		m.Update(ctx, "k", func(v *[]int) { *v = append(*v, i) })
	}
	v, ok, _ := m.Load(ctx, "k")
	if !ok || len(v) != 3 || v[2] != 2 {
		t.Fatalf("update result %v %v", v, ok)
	}
	m.Delete(ctx, "k")
	if _, ok, _ := m.Load(ctx, "k"); ok {
		t.Fatal("deleted entry still there")
	}
}
