package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestIdlePool(t *testing.T) {
	p := newIdlePool[int](2, 100, 30*time.Millisecond)
	if _, ok := p.get(0); ok {
		t.Fatal("empty pool gave an entry")
	}
	p.put(0, 1, 40)
	p.put(0, 2, 40)
	p.put(1, 3, 40) // over the bound: left to the GC
	if got := p.bytes(); got != 80 {
		t.Fatalf("held %d bytes, want 80", got)
	}
	if v, ok := p.get(1); ok {
		t.Fatalf("an entry over the bound was kept: %d", v)
	}
	if v, _ := p.get(0); v != 2 {
		t.Fatalf("get = %d, want the most recent (2)", v)
	}
	p.put(1, 4, 40)
	// Unused for the ttl, everything goes, and the timer with it.
	deadline := time.Now().Add(5 * time.Second)
	for p.bytes() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	p.mu.Lock()
	held, timer := p.held, p.timer
	p.mu.Unlock()
	if held != 0 || timer != nil {
		t.Fatalf("after the ttl: %d bytes held, timer %v", held, timer)
	}
	for c := range 2 {
		if v, ok := p.get(c); ok {
			t.Fatalf("class %d kept %d past the ttl", c, v)
		}
	}
}

// An entry put later than the others survives their sweep.
func TestIdlePoolSweepsOnlyTheIdle(t *testing.T) {
	p := newIdlePool[int](1, 100, 60*time.Millisecond)
	p.put(0, 1, 1)
	time.Sleep(40 * time.Millisecond)
	p.put(0, 2, 1)
	deadline := time.Now().Add(5 * time.Second)
	for p.bytes() != 1 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if v, ok := p.get(0); !ok || v != 2 {
		t.Fatalf("after the first entry's ttl: get = %d, %v; want the later entry (2)", v, ok)
	}
}

// shortPoolIdle makes the proxy's pools forget idle buffers after d.
func shortPoolIdle(t *testing.T, d time.Duration) {
	setTTL := func(d time.Duration) (prev [2]time.Duration) {
		bodyPool.mu.Lock()
		prev[0], bodyPool.ttl = bodyPool.ttl, d
		bodyPool.mu.Unlock()
		readerPool.mu.Lock()
		prev[1], readerPool.ttl = readerPool.ttl, d
		readerPool.mu.Unlock()
		return prev
	}
	prev := setTTL(d)
	t.Cleanup(func() { setTTL(prev[0]); readerPool.mu.Lock(); readerPool.ttl = prev[1]; readerPool.mu.Unlock() })
}

// waitPoolsIdle waits until the proxy's pools hold nothing.
func waitPoolsIdle(t *testing.T) {
	deadline := time.Now().Add(10 * time.Second)
	for bodyPool.bytes() != 0 || readerPool.bytes() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("pools still hold %d bytes of bodies and %d of readers", bodyPool.bytes(), readerPool.bytes())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestIdleProxyReleasesBurstMemory: after a burst of 1 MiB requests and
// streams, an idle proxy holds none of the burst's buffers, so one
// collection frees them (an idle Go process collects every two minutes).
// With sync.Pool the buffers survived that collection (its victim cache)
// and a soak's RSS stayed up for three to four minutes after the load.
func TestIdleProxyReleasesBurstMemory(t *testing.T) {
	shortPoolIdle(t, 50*time.Millisecond)
	up := newFakeUpstreamDiscarding(t)
	cfg := testConfig(up.URL)
	cfg.Compaction.Enabled = false
	p := newTestProxy(t, cfg)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}]}`
	stream := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	send := func(body string) {
		resp, err := client.Post(p.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Error(err)
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("status %d", resp.StatusCode)
		}
	}
	send(big) // warm: connections, metrics, code paths
	send(stream)
	waitPoolsIdle(t)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)

	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				send(big)
			} else {
				send(stream)
			}
		}()
	}
	wg.Wait()
	client.CloseIdleConnections()
	p.srv.up.Transport.CloseIdleConnections()
	waitPoolsIdle(t)
	runtime.GC() // one collection, as an idle process gets every two minutes
	runtime.ReadMemStats(&after)
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("heap %d KiB before the burst, %d KiB after it, idle, one GC later", before.HeapAlloc>>10, after.HeapAlloc>>10)
	if grew > 16<<20 {
		t.Errorf("an idle proxy still holds %d MiB more heap than before a burst of 32 1 MiB requests and 32 streams", grew>>20)
	}
}

// newFakeUpstreamDiscarding answers chat completions (a short SSE stream for
// "stream":true) and keeps nothing of what it received.
func newFakeUpstreamDiscarding(t *testing.T) *httptest.Server {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		head := make([]byte, 64)
		n, _ := io.ReadFull(r.Body, head)
		io.Copy(io.Discard, r.Body)
		if strings.Contains(string(head[:n]), `"stream":true`) {
			w.Header().Set("Content-Type", "text/event-stream")
			sse(w, `{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}`)
			sse(w, `{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
			sse(w, "[DONE]")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	}))
	t.Cleanup(up.Close)
	return up
}
