package proxy

import (
	"io"
	"net/http"
	"sync/atomic"
	"testing"
)

// Retries are counted with the route they serve (DESIGN § External
// contract): a Messages or Responses request retried on a 503 counts under
// op="messages"/"responses", which the alert rules divide by the route's
// own requests. Before, every retry was op="chat" and a Claude Code or
// Codex outage never reached the retry alert.
func TestRetriesCountedWithTheirRoute(t *testing.T) {
	bodies := map[string]struct{ req, ok string }{
		"chat": {`{"model":"m","messages":[{"role":"user","content":"x"}]}`, okCompletion},
		"responses": {`{"model":"m","input":[{"role":"user","content":"x"}]}`,
			`{"id":"r1","object":"response","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]}],"usage":{"input_tokens":12,"output_tokens":2,"total_tokens":14}}`},
		"messages": {`{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"x"}]}`,
			`{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":12,"output_tokens":2}}`},
	}
	for route, b := range bodies {
		t.Run(route, func(t *testing.T) {
			var n atomic.Int32
			up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Content-Type", "application/json")
				if n.Add(1) == 1 {
					w.WriteHeader(http.StatusServiceUnavailable)
					io.WriteString(w, `{"error":{"message":"loading","type":"unavailable"}}`)
					return
				}
				io.WriteString(w, b.ok)
			})
			p := newTestProxy(t, testConfig(up.URL))
			path := "/v1/chat/completions"
			if route != "chat" {
				path = "/v1/" + route
			}
			resp := p.post(t, path, b.req, "Anthropic-Version", "2023-06-01")
			if got := readAll(t, resp); resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			for _, op := range []string{"chat", "responses", "messages", "summarize"} {
				want := 0.0
				if op == route {
					want = 1
				}
				if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": op, "reason": "status_5xx"}); v != want {
					t.Errorf("upstream_retries_total{op=%q,reason=status_5xx} = %v, want %v (a %s request was retried once)", op, v, want, route)
				}
			}
		})
	}
}
