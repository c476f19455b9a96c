package proxy

import (
	"bytes"
	"io"
	"net/http"
	"testing"
)

// One client's bad stream_options must not turn usage injection off for
// everyone: the switch is learned only when the resend without the proxy's
// stream_options succeeded, and only for that model identity (issue 9
// item 2).
func TestStreamOptionsLearnedOnProofPerModel(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if bytes.Contains(body, []byte(`"bogus"`)) ||
			(bytes.Contains(body, []byte(`"model":"old"`)) && bytes.Contains(body, []byte("stream_options"))) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"invalid stream_options","type":"invalid_request_error"}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"hi"}}]}`)
		sse(w, "[DONE]")
	})
	p := newTestProxy(t, testConfig(up.URL))
	send := func(body string) (int, []byte) {
		t.Helper()
		n := len(up.requests())
		resp := p.post(t, "/v1/chat/completions", body)
		readAll(t, resp)
		var got []byte
		if rs := up.requests(); len(rs) > n {
			got = rs[len(rs)-1].Body
		}
		return resp.StatusCode, got
	}
	injected := func(b []byte) bool { return bytes.Contains(b, []byte(`"include_usage":true`)) }

	// A client whose own stream_options the upstream rejects gets the 400...
	if st, _ := send(`{"model":"m","stream":true,"stream_options":{"bogus":1},"messages":[{"role":"user","content":"x"}]}`); st != http.StatusBadRequest {
		t.Fatalf("bad stream_options: status %d, want the upstream's 400", st)
	}
	// ...and the next tenant still gets usage injected.
	if _, b := send(`{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`); !injected(b) {
		t.Errorf("one client's bad stream_options turned injection off: %s", b)
	}
	// An upstream model that really rejects stream_options: learned after
	// the resend succeeded...
	if st, b := send(`{"model":"old","stream":true,"messages":[{"role":"user","content":"x"}]}`); st != 200 || injected(b) {
		t.Fatalf("fallback for model old: status %d, resend %s", st, b)
	}
	n := len(up.requests())
	if _, b := send(`{"model":"old","stream":true,"messages":[{"role":"user","content":"x"}]}`); injected(b) || len(up.requests()) != n+1 {
		t.Errorf("model old: injected again or resent (%d calls): %s", len(up.requests())-n, b)
	}
	// ...for that model only.
	if _, b := send(`{"model":"new","stream":true,"messages":[{"role":"user","content":"x"}]}`); !injected(b) {
		t.Errorf("model new lost injection because model old lacks it: %s", b)
	}
}
