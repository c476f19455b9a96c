package proxy

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Under an HTTP/2 upstream that answers half the requests before reading
// their bodies, every request's upstream bytes are its own. A smoke test of
// pooled bodies over HTTP/2 under load: it passes on a pool that reuses a
// buffer its reader may still read too (such a reuse needs a client that
// leaves at the wrong moment), so TestBodyPoolNotReusedWhileHTTP2Reads is
// the test of that.
func TestBodyPoolUnderHTTP2Upstream(t *testing.T) {
	var mu sync.Mutex
	var mixed []string
	var h2 atomic.Int32
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tag := r.Header.Get("X-Test-Tag")
		if r.ProtoMajor == 2 {
			h2.Add(1)
		}
		// Half the requests are answered before their body is read (the
		// transport aborts the body write); the rest read a part of it and
		// check it is theirs.
		if strings.HasSuffix(tag, "0") || strings.HasSuffix(tag, "2") || strings.HasSuffix(tag, "4") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"early","type":"invalid_request_error"}}`)
			return
		}
		b, _ := io.ReadAll(r.Body)
		if !bytes.Contains(b, []byte(`"content":"`+tag)) || bytes.Count(b, []byte(tag)) < 1000 {
			mu.Lock()
			mixed = append(mixed, tag)
			mu.Unlock()
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	}))
	up.EnableHTTP2 = true
	up.Config.ErrorLog = log.New(io.Discard, "", 0)
	up.StartTLS()
	t.Cleanup(up.Close)

	cfg := testConfig(up.URL)
	cfg.Compaction.Enabled = false
	p := newTestProxy(t, cfg)
	p.srv.up.Transport.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} // the test server's own certificate
	p.srv.up.Transport.ForceAttemptHTTP2 = true

	var wg sync.WaitGroup
	const clients, each = 8, 12
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				tag := fmt.Sprintf("t%02d%03d", c, i)
				content := strings.Repeat(tag, 40000) // ~280 KiB: a pooled class, several h2 frames
				body := `{"model":"m","messages":[{"role":"user","content":"` + content + `"}]}`
				req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("X-Test-Tag", tag)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	if len(mixed) > 0 {
		t.Errorf("upstream received another request's bytes for %v", mixed)
	}
	if h2.Load() != clients*each {
		t.Errorf("%d of %d upstream requests were HTTP/2", h2.Load(), clients*each)
	}
}
