package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
)

// The overflow answers compactproxy recognizes, and the look-alikes it must
// not (DESIGN § Window: a learned n_ctx comes only from a recognized
// overflow with consistent sizes; CRAFT habit 25).
func TestParseOverflow(t *testing.T) {
	cases := []struct {
		name   string
		status int
		body   string
		ok     bool
		prompt int
		nCtx   int
	}{
		{"llama.cpp exceed_context_size_error", 400,
			`{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}`,
			true, 9000, 8192},
		{"llama.cpp with inconsistent sizes learns nothing", 400,
			`{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":100,"n_ctx":8192}}`,
			true, 0, 0},
		{"OpenAI context_length_exceeded, resulted in", 400,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			true, 9000, 8192},
		{"OpenAI messages and functions and completion", 400,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 9300 tokens (8000 in the messages, 300 in the functions, and 1000 in the completion). Please reduce the length of the messages, functions, or completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			true, 8300, 8192},
		{"OpenAI without sizes", 400,
			`{"error":{"message":"Your input exceeds the context window of this model. Please adjust your input and try again.","type":"invalid_request_error","param":"input","code":"context_length_exceeded"}}`,
			true, 0, 0},
		{"DeepSeek (OpenAI wording, no code)", 400,
			`{"error":{"message":"This model's maximum context length is 65536 tokens. However, you requested 70000 tokens (69000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"invalid_request_error","param":null,"code":"invalid_request_error"}}`,
			true, 69000, 65536},
		{"vLLM flat, input tokens", 400,
			`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}`,
			true, 5000, 4096},
		{"vLLM requested M < N is no overflow", 400,
			`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 100 tokens (90 in the messages, 10 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"vLLM max_tokens too large is no overflow", 400,
			`{"object":"error","message":"'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum context length is 4096 tokens and your request has 20 input tokens (5000 > 4096 - 20).","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"Anthropic prompt is too long", 400,
			`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}`,
			true, 210000, 200000},
		{"Anthropic with M < N learns nothing", 400,
			`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 10 tokens > 200000 maximum"}}`,
			false, 0, 0},
		{"a validation error quoting a size", 400,
			`{"error":{"message":"Invalid value for 'user': 'This model's maximum context length is 300 tokens. However, your messages resulted in 9000 tokens.'","type":"invalid_request_error","param":"user","code":"invalid_value"}}`,
			false, 0, 0},
		{"pydantic echo of a client's input", 400,
			`{"object":"error","message":"[{'type': 'string_too_long', 'input': 'maximum context length is 300'}]","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"a 500 is never an overflow", 500,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}`,
			false, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			info, ok := parseOverflow(tc.status, []byte(tc.body))
			if ok != tc.ok || info.prompt != tc.prompt || info.nCtx != tc.nCtx {
				t.Errorf("parseOverflow = %+v %v, want prompt %d n_ctx %d ok %v", info, ok, tc.prompt, tc.nCtx, tc.ok)
			}
		})
	}
}

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
	if w := p.srv.windows.get("m"); w != 4000 {
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
	if w := p.srv.windows.get("m"); w != 4000 {
		t.Errorf("window %d after a quoted size, want the configured 4000", w)
	}
}
