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

	"github.com/compactproxy/compactproxy/internal/bufpool"
)

// shortPoolIdle makes the proxy's pools forget idle buffers after d.
func shortPoolIdle(t *testing.T, d time.Duration) {
	prevBody, prevReader := bufpool.Bodies.TTL.Swap(int64(d)), readerPool.TTL.Swap(int64(d))
	t.Cleanup(func() { bufpool.Bodies.TTL.Store(prevBody); readerPool.TTL.Store(prevReader) })
}

// waitPoolsIdle waits until the proxy's pools hold nothing.
func waitPoolsIdle(t *testing.T) {
	deadline := time.Now().Add(10 * time.Second)
	for bufpool.Bodies.Held.Load() != 0 || readerPool.Held.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("pools still hold %d bytes of bodies and %d of readers", bufpool.Bodies.Held.Load(), readerPool.Held.Load())
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
