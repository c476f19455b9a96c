package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"go.uber.org/zap"
)

// A body exercising everything that must survive untouched: unknown
// top-level fields, temperature 0, number literals as written, content part
// arrays, reasoning_content, null content on a tool-call turn.
const fidelityBody = `{"model":"qwen","temperature":0,"top_p":1.0E+0,"seed":12345678901234567890,"cache_prompt":true,"id_slot":2,"vendor_x":{"a":[1,2.50,-0]},
 "messages":[
  {"role":"system","content":"You are terse."},
  {"role":"user","content":[{"type":"text","text":"caf\u00e9 日本"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]},
  {"role":"assistant","content":null,"reasoning_content":"think","tool_calls":[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"path\":\".\"}"}}]},
  {"role":"tool","tool_call_id":"call_1","content":"a.go\nb.go"}
 ]}`

func TestPassThroughFidelity(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/chat/completions", fidelityBody, "Authorization", "Bearer sk-client")
	body := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if string(body) != okCompletion {
		t.Errorf("client body changed:\n%s", body)
	}
	got := up.last(t)
	if !bytes.Equal(got.Body, []byte(fidelityBody)) {
		t.Errorf("upstream body differs from the client's:\n got %s\nwant %s", got.Body, fidelityBody)
	}
	if got.Header.Get("Authorization") != "Bearer sk-client" {
		t.Errorf("Authorization not passed through: %q", got.Header.Get("Authorization"))
	}
	if got.Path != "/v1/chat/completions" {
		t.Errorf("path %q", got.Path)
	}
	if resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Errorf("X-Compactproxy-Compaction = %q", resp.Header.Get("X-Compactproxy-Compaction"))
	}
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("no X-Request-Id")
	}
}

func TestUIOnlyRemovedAndStripped(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	keep := `{"role":"user","content":"hi  there","x":1.50}`
	body := `{"model":"m","messages":[{"role":"system","content":"s"},{"role":"assistant","content":"compacting...","ui_only":true},` +
		keep + `,{"role":"assistant","ui_only":false,"content":"ok"}]}`
	resp := p.post(t, "/v1/chat/completions", body, "X-Compactproxy-Conversation", "conv-1")
	readAll(t, resp)
	got := up.last(t)
	var out struct {
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(got.Body, &out); err != nil {
		t.Fatal(err)
	}
	if len(out.Messages) != 3 {
		t.Fatalf("forwarded %d messages, want 3: %s", len(out.Messages), got.Body)
	}
	if string(out.Messages[1]) != keep {
		t.Errorf("untouched message bytes changed: %s", out.Messages[1])
	}
	if bytes.Contains(got.Body, []byte("ui_only")) || bytes.Contains(got.Body, []byte("compacting")) {
		t.Errorf("ui_only content or key forwarded: %s", got.Body)
	}
	if got.Header.Get("X-Compactproxy-Conversation") != "" {
		t.Error("X-Compactproxy-Conversation forwarded upstream")
	}
	if v := counter(t, p.reg, "compactproxy_ui_only_removed_total", nil); v != 1 {
		t.Errorf("ui_only_removed_total = %v", v)
	}
}

func TestBadInput(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Limits.MaxBodyBytes = 4096
	p := newTestProxy(t, cfg)
	cases := []struct {
		name, body string
		status     int
		param      string
	}{
		{"invalid json", `{"model":`, 400, ""},
		{"not an object", `[1,2]`, 400, ""},
		{"missing messages", `{"model":"m"}`, 400, "messages"},
		{"messages not array", `{"model":"m","messages":{}}`, 400, "messages"},
		{"message not object", `{"model":"m","messages":[{"role":"user","content":"a"},3]}`, 400, "messages[1]"},
		{"role missing", `{"model":"m","messages":[{"content":"a"}]}`, 400, "messages[0].role"},
		{"too large", `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", 5000) + `"}]}`, 413, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := p.post(t, "/v1/chat/completions", tc.body)
			b := readAll(t, resp)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, b)
			}
			var env struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
				} `json:"error"`
			}
			if err := json.Unmarshal(b, &env); err != nil || env.Error.Message == "" || env.Error.Type != "invalid_request_error" {
				t.Fatalf("not an OpenAI error envelope: %s", b)
			}
			gotParam := ""
			if env.Error.Param != nil {
				gotParam = *env.Error.Param
			}
			if gotParam != tc.param {
				t.Errorf("param %q, want %q (%s)", gotParam, tc.param, b)
			}
		})
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("bad input reached the upstream %d times", n)
	}
}

// sse writes one SSE event and flushes.
func sse(w http.ResponseWriter, data string) {
	fmt.Fprintf(w, "data: %s\n\n", data)
	w.(http.Flusher).Flush()
}

func TestStreamFlushesPerEvent(t *testing.T) {
	release := make(chan struct{})
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"one"}}]}`)
		select {
		case <-release:
		case <-time.After(5 * time.Second):
			return
		}
		io.WriteString(w, ": ping\n\n")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"two"}}]}`)
		sse(w, "[DONE]")
	})
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(first, "one") {
		t.Fatalf("first line %q", first)
	}
	// The client saw chunk 1 before the upstream sent chunk 2.
	close(release)
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), ": ping") || !strings.Contains(string(rest), "two") || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("rest of stream: %q", rest)
	}
}

func TestStreamLongLine(t *testing.T) {
	long := strings.Repeat("x", 8<<20)
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"`+long+`"}}]}`)
		sse(w, "[DONE]")
	})
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	b := readAll(t, resp)
	if !bytes.Contains(b, []byte(long)) || !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
		t.Fatalf("8 MiB line not relayed intact (got %d bytes)", len(b))
	}
}

const usageChunk = `{"id":"c","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":2,"total_tokens":52}}`

func streamingUpstream(t *testing.T) *fakeUpstream {
	return newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}`)
		sse(w, `{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
		if bytes.Contains(body, []byte(`"include_usage":true`)) {
			sse(w, usageChunk)
		}
		sse(w, "[DONE]")
	})
}

func TestStreamUsageInjectedAndHidden(t *testing.T) {
	up := streamingUpstream(t)
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	b := readAll(t, resp)
	if !bytes.Contains(up.last(t).Body, []byte(`"stream_options":{"include_usage":true}`)) {
		t.Fatalf("include_usage not injected: %s", up.last(t).Body)
	}
	if bytes.Contains(b, []byte(`"usage"`)) {
		t.Errorf("client that did not ask for usage received it: %s", b)
	}
	if !bytes.Contains(b, []byte("[DONE]")) || !bytes.Contains(b, []byte(`"hi"`)) {
		t.Errorf("stream incomplete: %s", b)
	}
	if v := counter(t, p.reg, "compactproxy_usage_input_tokens_total", map[string]string{"kind": "uncached"}); v != 50 {
		t.Errorf("usage_input_tokens_total{uncached} = %v, want 50", v)
	}

	// A client that asked for usage gets it untouched.
	resp = p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}`)
	b = readAll(t, resp)
	if !bytes.Contains(b, []byte(usageChunk)) {
		t.Errorf("usage chunk not relayed to a client that asked: %s", b)
	}
}

func TestStreamOptionsFallback(t *testing.T) {
	var calls atomic.Int32
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		calls.Add(1)
		if bytes.Contains(body, []byte("stream_options")) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"Unrecognized request argument supplied: stream_options","type":"invalid_request_error"}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"hi"}}]}`)
		sse(w, "[DONE]")
	})
	p := newTestProxy(t, testConfig(up.URL))
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`
	resp := p.post(t, "/v1/chat/completions", body)
	b := readAll(t, resp)
	if resp.StatusCode != 200 || !bytes.Contains(b, []byte("[DONE]")) {
		t.Fatalf("fallback failed: %d %s", resp.StatusCode, b)
	}
	if got := up.last(t).Body; string(got) != body {
		t.Errorf("retry was not the client's request: %s", got)
	}
	// Remembered: the next request goes out without stream_options at once.
	readAll(t, p.post(t, "/v1/chat/completions", body))
	if calls.Load() != 3 {
		t.Errorf("upstream calls = %d, want 3", calls.Load())
	}
	if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "stream_options"}); v != 1 {
		t.Errorf("retries{stream_options} = %v", v)
	}
}

func TestRetries(t *testing.T) {
	cases := []struct {
		name     string
		attempts int
		script   []int // statuses answered in order; last repeats
		header   [2]string
		want     int // status the client gets
		calls    int
		reason   string
	}{
		{"503 then ok", 3, []int{503, 503, 200}, [2]string{}, 200, 3, "status_5xx"},
		{"429 retry-after-ms", 3, []int{429, 200}, [2]string{"Retry-After-Ms", "1"}, 200, 2, "status_429"},
		{"attempts=1 no retry", 1, []int{503}, [2]string{}, 503, 1, ""},
		{"exhausted", 2, []int{502}, [2]string{}, 502, 2, "status_5xx"},
		{"400 never retried", 3, []int{400}, [2]string{}, 400, 1, ""},
		{"500 never retried", 3, []int{500}, [2]string{}, 500, 1, ""},
		{"retry-after beyond max_elapsed", 3, []int{429}, [2]string{"Retry-After", "120"}, 429, 1, ""},
		// 1e20 s overflowed time.Duration to a negative wait: three tries at once.
		{"retry-after overflowing a Duration", 3, []int{429}, [2]string{"Retry-After", "100000000000000000000"}, 429, 1, ""},
		{"retry-after-ms overflowing a Duration", 3, []int{429}, [2]string{"Retry-After-Ms", "1e300"}, 429, 1, ""},
		{"retry-after out of float range", 3, []int{429}, [2]string{"Retry-After", "1e400"}, 429, 1, ""},
		{"retry-after malformed", 3, []int{503}, [2]string{"Retry-After", "soon"}, 503, 1, ""},
		{"retry-after negative", 3, []int{503}, [2]string{"Retry-After", "-5"}, 503, 1, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var n atomic.Int32
			up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				i := int(n.Add(1)) - 1
				st := tc.script[min(i, len(tc.script)-1)]
				if tc.header[0] != "" {
					w.Header().Set(tc.header[0], tc.header[1])
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(st)
				if st == 200 {
					io.WriteString(w, okCompletion)
				} else {
					fmt.Fprintf(w, `{"error":{"message":"status %d","type":"server_error"}}`, st)
				}
			})
			cfg := testConfig(up.URL)
			cfg.Retry.Attempts = tc.attempts
			p := newTestProxy(t, cfg)
			resp := p.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
			b := readAll(t, resp)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.want, b)
			}
			if int(n.Load()) != tc.calls {
				t.Errorf("upstream calls %d, want %d", n.Load(), tc.calls)
			}
			if tc.reason != "" {
				if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": tc.reason}); int(v) != tc.calls-1 {
					t.Errorf("retries{%s} = %v, want %d", tc.reason, v, tc.calls-1)
				}
			}
		})
	}
}

func TestConnectErrorRetriedThen502(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	cfg := testConfig("http://" + addr)
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	b := readAll(t, resp)
	if resp.StatusCode != 502 || !bytes.Contains(b, []byte(`"error"`)) {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "connect"}); v != 2 {
		t.Errorf("connect retries = %v, want 2", v)
	}
}

func TestClientDisconnectCancelsUpstream(t *testing.T) {
	canceled := make(chan struct{})
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"one"}}]}`)
		select {
		case <-r.Context().Done():
			close(canceled)
		case <-time.After(5 * time.Second):
		}
	})
	p := newTestProxy(t, testConfig(up.URL))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	bufio.NewReader(resp.Body).ReadString('\n')
	cancel()
	resp.Body.Close()
	select {
	case <-canceled:
	case <-time.After(3 * time.Second):
		t.Fatal("upstream request not canceled after the client left")
	}
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": "chat", "code": "499"}) == 1 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Error("client disconnect not recorded as 499")
}

// A stream the upstream breaks off must not reach the client as a clean,
// complete end (it did: status 200, half an answer, no [DONE], no error).
// The client gets what arrived, an error event and a broken-off response;
// usage that arrived is still recorded.
func TestUpstreamDropsMidStream(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"index":0,"delta":{"content":"one"}}]}`)
		sse(w, usageChunk)
		hj, ok := w.(http.Hijacker)
		if !ok {
			t.Error("upstream cannot hijack")
			return
		}
		c, _, _ := hj.Hijack()
		c.Close()
	})
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Fatalf("client stream ended cleanly after the upstream broke it off: %q", b)
	}
	if !bytes.Contains(b, []byte("one")) {
		t.Errorf("chunk before the drop lost: %q", b)
	}
	if bytes.Contains(b, []byte("[DONE]")) {
		t.Errorf("client got [DONE] for a broken stream: %q", b)
	}
	if !bytes.Contains(b, []byte(`"code":"upstream_connection_closed"`)) {
		t.Errorf("no error event before the abort: %q", b)
	}
	if bytes.Contains(b, []byte(`"usage"`)) {
		t.Errorf("injected usage reached the client: %q", b)
	}
	if v := counter(t, p.reg, "compactproxy_stream_aborts_total", nil); v != 1 {
		t.Errorf("stream_aborts_total = %v, want 1", v)
	}
	if v := counter(t, p.reg, "compactproxy_usage_input_tokens_total", map[string]string{"kind": "uncached"}); v != 50 {
		t.Errorf("usage that arrived before the drop not recorded: uncached = %v", v)
	}
	waitFor(t, func() bool { return p.logs.FilterMessage("request").FilterField(zap.Bool("aborted", true)).Len() == 1 })
}

// waitFor polls cond for up to 5 s (handlers finish after the client saw
// the response end).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatal("condition not reached within 5s")
}

func TestAuthWithUpstreamKey(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Upstream.APIKey = "sk-upstream-secret"
	cfg.Auth.ClientKeys = []config.Secret{"client-key-1"}
	p := newTestProxy(t, cfg)
	body := `{"model":"m","messages":[{"role":"user","content":"x"}]}`
	resp := p.post(t, "/v1/chat/completions", body)
	readAll(t, resp)
	if resp.StatusCode != 401 {
		t.Fatalf("no key: status %d, want 401", resp.StatusCode)
	}
	resp = p.post(t, "/v1/chat/completions", body, "Authorization", "Bearer wrong")
	readAll(t, resp)
	if resp.StatusCode != 401 {
		t.Fatalf("wrong key: status %d, want 401", resp.StatusCode)
	}
	resp = p.post(t, "/v1/models", "", "Authorization", "Bearer wrong")
	readAll(t, resp)
	if resp.StatusCode != 401 {
		t.Fatalf("pass-through with a wrong key: status %d, want 401", resp.StatusCode)
	}
	if n := len(up.requests()); n != 0 {
		t.Fatalf("unauthorized requests reached the upstream: %d", n)
	}
	resp = p.post(t, "/v1/chat/completions", body, "Authorization", "Bearer client-key-1")
	readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("listed key: status %d", resp.StatusCode)
	}
	if got := up.last(t).Header.Get("Authorization"); got != "Bearer sk-upstream-secret" {
		t.Errorf("upstream Authorization = %q", got)
	}
}

func TestPassThroughPaths(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		io.WriteString(w, "path="+r.URL.Path)
	})
	p := newTestProxy(t, testConfig(up.URL))
	cases := []struct{ method, path, want string }{
		{"GET", "/v1/models", "path=/v1/models"},
		{"POST", "/v1/embeddings", "path=/v1/embeddings"},
		// Compacted: POST /v1/responses and /v1/messages; their other
		// paths pass through.
		{"GET", "/v1/responses/resp_1", "path=/v1/responses/resp_1"},
		{"POST", "/v1/responses/compact", "path=/v1/responses/compact"},
		{"POST", "/v1/messages/count_tokens", "path=/v1/messages/count_tokens"},
		{"GET", "/props", "path=/props"},
		{"POST", "/tokenize", "path=/tokenize"},
		{"GET", "/slots", "path=/slots"},
	}
	for _, tc := range cases {
		req, _ := http.NewRequest(tc.method, p.URL+tc.path, strings.NewReader(`{"input":"x"}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp)
		if string(b) != tc.want {
			t.Errorf("%s %s: got %q want %q", tc.method, tc.path, b, tc.want)
		}
	}
	// The access log counts a request after its handler returned, which
	// may be just after the client read the last byte: wait briefly.
	want := float64(len(cases))
	v := 0.0
	for deadline := time.Now().Add(time.Second); ; time.Sleep(5 * time.Millisecond) {
		v = counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": "passthrough", "code": "200"})
		if v == want || time.Now().After(deadline) {
			break
		}
	}
	if v != want {
		t.Errorf("passthrough requests counted %v", v)
	}
}

func TestHealthAndReady(t *testing.T) {
	var status atomic.Int32
	status.Store(401)
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.WriteHeader(int(status.Load()))
	})
	p := newTestProxy(t, testConfig(up.URL))
	get := func(path string) int {
		resp, err := http.Get(p.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		return resp.StatusCode
	}
	if get("/healthz") != 200 {
		t.Fatal("healthz")
	}
	if n := len(up.requests()); n != 0 {
		t.Fatalf("/healthz called the upstream")
	}
	if c := get("/readyz"); c != 200 {
		t.Fatalf("readyz with a 401 upstream = %d, want 200", c)
	}
	status.Store(503)
	time.Sleep(1100 * time.Millisecond) // past the 1 s cache
	if c := get("/readyz"); c != 503 {
		t.Fatalf("readyz with a 503 upstream = %d, want 503", c)
	}
	if get("/metrics") != 200 {
		t.Fatal("metrics")
	}
}

func TestLogsNeverCarrySecretsOrContent(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Upstream.APIKey = "sk-upstream-TOPSECRET"
	cfg.Auth.ClientKeys = []config.Secret{"client-SECRET-key"}
	p := newTestProxy(t, cfg)
	marker := "MARKER-CONTENT-7f3a"
	for _, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":"` + marker + `"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"` + marker + `"`, // bad JSON
	} {
		readAll(t, p.post(t, "/v1/chat/completions", body, "Authorization", "Bearer client-SECRET-key"))
	}
	readAll(t, p.post(t, "/v1/chat/completions", `{"model":"m","messages":[]}`, "Authorization", "Bearer client-SECRET-key-wrong"))
	if p.logs.Len() == 0 {
		t.Fatal("no log lines recorded")
	}
	for _, e := range p.logs.All() {
		line := e.Message
		for k, v := range e.ContextMap() {
			line += fmt.Sprintf(" %s=%v", k, v)
		}
		for _, bad := range []string{"TOPSECRET", "SECRET-key", marker} {
			if strings.Contains(line, bad) {
				t.Errorf("log line leaks %q: %s", bad, line)
			}
		}
	}
}

func TestStreamUsageModes(t *testing.T) {
	for _, mode := range []string{"never", "always"} {
		t.Run(mode, func(t *testing.T) {
			up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				if bytes.Contains(body, []byte("stream_options")) {
					w.WriteHeader(400)
					io.WriteString(w, `{"error":{"message":"unknown field stream_options","type":"invalid_request_error"}}`)
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				sse(w, `{"choices":[{"index":0,"delta":{"content":"hi"}}]}`)
				sse(w, "[DONE]")
			})
			cfg := testConfig(up.URL)
			cfg.Upstream.StreamUsage = mode
			p := newTestProxy(t, cfg)
			resp := p.post(t, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
			readAll(t, resp)
			n := len(up.requests())
			switch mode {
			case "never":
				if resp.StatusCode != 200 || n != 1 || bytes.Contains(up.last(t).Body, []byte("stream_options")) {
					t.Errorf("never: status %d, %d calls, body %s", resp.StatusCode, n, up.last(t).Body)
				}
			case "always":
				// No fallback in always mode: the client sees the upstream's answer.
				if resp.StatusCode != 400 || n != 1 {
					t.Errorf("always: status %d, %d calls", resp.StatusCode, n)
				}
			}
		})
	}
}
