package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Issue 20 ("Robustness II"): each test here failed against the code before
// its fix.

// Item 3: the client keeps the proxy's X-Request-Id (the one in the logs);
// the upstream's own id comes back as X-Upstream-Request-Id, on chat and on
// pass-through.
func TestRequestIDNotReplacedByUpstreams(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("X-Request-Id", "req_upstream_42")
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	})
	p := newTestProxy(t, testConfig(up.URL))
	for _, path := range []string{"/v1/chat/completions", "/v1/embeddings"} {
		t.Run(path, func(t *testing.T) {
			resp := p.post(t, path, `{"model":"m","messages":[{"role":"user","content":"x"}],"input":"x"}`, "X-Request-Id", "client-id-7")
			readAll(t, resp)
			if got := resp.Header.Get("X-Request-Id"); got != "client-id-7" {
				t.Errorf("X-Request-Id %q, want the proxy's client-id-7", got)
			}
			if got := resp.Header.Get("X-Upstream-Request-Id"); got != "req_upstream_42" {
				t.Errorf("X-Upstream-Request-Id %q, want req_upstream_42", got)
			}
		})
	}
}

// Suspicion: pass-through stripped the hard-coded X-Compactproxy-Conversation
// rather than the configured conversation header.
func TestPassThroughStripsConfiguredConversationHeader(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Compaction.ConversationHeaders = []string{"X-Team-Conversation", "X-Session-Id"}
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/embeddings", `{"model":"m","input":"x"}`, "X-Team-Conversation", "c1", "X-Session-Id", "s1")
	readAll(t, resp)
	h := up.last(t).Header
	if h.Get("X-Team-Conversation") != "" {
		t.Error("the configured conversation header reached the upstream on pass-through")
	}
	if h.Get("X-Session-Id") != "s1" {
		t.Error("an agent's own conversation header was not forwarded on pass-through")
	}
}

// Suspicion: a pass-through body had no read time limit; a client that
// trickles it gets 408 within limits.body_read_timeout, as on chat.
func TestPassThroughBodyReadTimeout(t *testing.T) {
	var calls atomic.Int32
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		calls.Add(1)
		io.WriteString(w, `{}`)
	})
	cfg := testConfig(up.URL)
	cfg.Limits.BodyReadTimeout = 200 * time.Millisecond
	p := newTestProxy(t, cfg)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	// 100 bytes promised, 22 sent, then nothing.
	io.WriteString(c, "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":\"m\",\"input\":\"")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer within 10 s to a body that stopped arriving (body_read_timeout 200ms): %v", err)
	}
	b := readAll(t, resp)
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("status %d %s, want 408", resp.StatusCode, b)
	}
	if e := envelope(t, b); e.Code == nil || *e.Code != "request_timeout" {
		t.Errorf("envelope %+v, want code request_timeout", e)
	}
}
