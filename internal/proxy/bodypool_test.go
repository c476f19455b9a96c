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

// A closed request body may still be read by a transport (Go issue 46866;
// the HTTP/2 transport closes from another goroutine): after Close, a Read
// must touch nothing of the pooled buffer (issue 9 item 10).
func TestTrackedReaderReadAfterClose(t *testing.T) {
	pb := getBody(1 << 16)
	copy(pb.buf, "secret of the first request")
	r := pb.reader(pb.buf)
	if pb.open.Load() != 1 {
		t.Fatal("reader not tracked")
	}
	r.Close()
	r.Close() // twice is fine
	if pb.open.Load() != 0 {
		t.Fatalf("open = %d after Close", pb.open.Load())
	}
	p := make([]byte, 64)
	if n, err := r.Read(p); n != 0 || err == nil {
		t.Fatalf("Read after Close = %d, %v (%q): the buffer may be reused by another request by now", n, err, p[:n])
	}
}

// Under an HTTP/2 upstream that answers before reading the request body
// (the transport then closes the body while its writer may still read it),
// every request's upstream bytes are its own, never a reused buffer's new
// contents. Run with -race: a Read racing a reuse is reported.
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
	p.srv.transport.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} // the test server's own certificate
	p.srv.transport.ForceAttemptHTTP2 = true

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
