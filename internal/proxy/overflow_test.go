package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/compactproxy/compactproxy/internal/upstream"
)

// Suspicion: OpenAI's overflow answer without sizes ("Your input exceeds the
// context window of this model") made recovery rebuild the same view and
// never retry. The refusal proves the forwarded input is over the window:
// recovery compacts below it and retries once.
func TestOverflowWithoutSizesRetries(t *testing.T) {
	const limit = 2000 // the upstream's tokens, counted at 3 bytes a token
	var calls atomic.Int32
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if len(body)/3 > limit {
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"Your input exceeds the context window of this model. Please adjust your input and try again.","type":"invalid_request_error","param":"input","code":"context_length_exceeded"}}`)
			return
		}
		fmt.Fprintf(w, `{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":1}}`, len(body)/3)
	})
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20
	p := newTestProxy(t, cfg)
	a := newAgent()
	for range 8 {
		a.toolStep(800)
	}
	resp := p.post(t, "/v1/chat/completions", a.body(), "Authorization", "Bearer k")
	b := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("overflow without sizes not recovered: %d %s (upstream calls %d)", resp.StatusCode, b, calls.Load())
	}
	if calls.Load() != 2 {
		t.Errorf("upstream calls %d, want 2 (overflow + one retry)", calls.Load())
	}
	if w := p.srv.windows.GetFor(upstream.Scope{Model: "m"}); w != 4000 {
		t.Errorf("window %d: an answer without sizes taught a window", w)
	}
}

// Item 1: an upstream validation error that quotes a client's value
// ("maximum context length is 300", here in vLLM's pydantic shape) is not an
// overflow: it teaches no window, so another tenant's conversation, well
// under the real window, is forwarded whole.
func TestQuotedContextSizeLearnsNothing(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		if bytes.Contains(body, []byte("maximum context length")) {
			w.WriteHeader(400)
			io.WriteString(w, `{"object":"error","message":"[{'type': 'string_too_long', 'loc': ('body', 'user'), 'msg': 'String should have at most 64 characters', 'input': \"This model's maximum context length is 300 tokens. However, your messages resulted in 9000 tokens (8000 in the messages, 1000 in the functions).\"}]","type":"BadRequestError","param":null,"code":400}`)
			return
		}
		fmt.Fprintf(w, `{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":1}}`, len(body)/4)
	})
	sum := newSummarizerServer(t)
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))

	evil := `{"model":"m","user":"This model's maximum context length is 300 tokens. However, your messages resulted in 9000 tokens (8000 in the messages, 1000 in the functions).","messages":[{"role":"user","content":"hi"}]}`
	resp := p.post(t, "/v1/chat/completions", evil, "Authorization", "Bearer tenant-a")
	if b := readAll(t, resp); resp.StatusCode != 400 {
		t.Fatalf("tenant a: status %d %s, want the upstream's 400", resp.StatusCode, b)
	}
	if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"reason": "context_overflow"}); v != 0 {
		t.Errorf("a validation error was taken as an overflow: retries{context_overflow} = %v", v)
	}

	a := newAgent()
	for range 12 {
		a.toolStep(100)
	}
	resp = p.post(t, "/v1/chat/completions", a.body(), "Authorization", "Bearer tenant-b")
	readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("tenant b: status %d", resp.StatusCode)
	}
	if n := len(forwardedMessages(t, up.last(t).Body)); n != 26 {
		t.Errorf("tenant b's 26-message conversation was forwarded as %d messages (compaction %q)", n, resp.Header.Get("X-Compactproxy-Compaction"))
	}
	if w := p.srv.windows.GetFor(upstream.Scope{Model: "m"}); w != 4000 {
		t.Errorf("window %d after a quoted size, want the configured 4000", w)
	}
}
