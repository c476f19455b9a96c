package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/pairing"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
)

// dialectUpstream is a Responses + Messages provider with an enforced
// window: it counts a prompt as its body's bytes / 4, refuses one over the
// window in the API's own overflow shape (a Responses stream: a
// response.failed event inside a 200, when failInStream), and answers the
// proxy's summarize calls (not streamed, tool_choice none) with a summary.
type dialectUpstream struct {
	*fakeUpstream
	window       int
	perToken     int // bytes per token the upstream counts (4 when 0)
	failInStream bool
	overflows    atomic.Int32
	summaries    atomic.Int32
}

func newDialectUpstream(t *testing.T, window int) *dialectUpstream {
	u := &dialectUpstream{window: window}
	u.fakeUpstream = newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		per := u.perToken
		if per == 0 {
			per = 4
		}
		tokens := len(body) / per
		var req struct {
			Stream     bool            `json:"stream"`
			ToolChoice json.RawMessage `json:"tool_choice"`
		}
		_ = json.Unmarshal(body, &req)
		// The proxy's summarize calls: prefix-shaped (tool_choice none) or
		// a transcript (no tools); the agent always declares its tools.
		summarize := bytes.Contains(req.ToolChoice, []byte("none")) || !bytes.Contains(body, []byte(`"tools"`))
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/responses":
			if tokens > u.window {
				u.overflows.Add(1)
				if req.Stream && u.failInStream {
					w.Header().Set("Content-Type", "text/event-stream")
					// Full-size events, as OpenAI sends them: each carries
					// the response object with the request's instructions
					// and tools (20+ KB for Codex).
					io.WriteString(w, "event: response.created\ndata: {\"type\":\"response.created\",\"response\":"+fullResponse("in_progress", "null")+"}\n\n")
					// Members in sorted order, as an encoder that sorts keys
					// writes them: "type" last.
					fmt.Fprintf(w, "event: response.failed\ndata: {\"response\":{\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"This model's maximum context length is %d tokens. However, your messages resulted in %d tokens.\"},\"id\":\"r\",\"instructions\":%q,\"status\":\"failed\"},\"sequence_number\":1,\"type\":\"response.failed\"}\n\n", u.window, tokens, strings.Repeat("You are a coding agent. ", 1000))
					return
				}
				w.WriteHeader(400)
				fmt.Fprintf(w, `{"error":{"message":"This model's maximum context length is %d tokens. However, your messages resulted in %d tokens.","type":"invalid_request_error","param":"input","code":"context_length_exceeded"}}`, u.window, tokens)
				return
			}
			usage := fmt.Sprintf(`{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":3}`, tokens)
			text := "ok"
			if summarize {
				u.summaries.Add(1)
				text = "Goal: review the files. Done: read some. Next: read the rest."
			}
			if req.Stream {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\n\n")
				fmt.Fprintf(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":%q}\n\n", text)
				fmt.Fprintf(w, "event: response.completed\ndata: {\"response\":{\"id\":\"r\",\"status\":\"completed\",\"usage\":%s},\"sequence_number\":3,\"type\":\"response.completed\"}\n\n", usage)
				return
			}
			fmt.Fprintf(w, `{"id":"r","object":"response","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":%q}]}],"usage":%s}`, text, usage)
		case "/v1/messages":
			if tokens > u.window {
				u.overflows.Add(1)
				w.WriteHeader(400)
				fmt.Fprintf(w, `{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: %d tokens > %d maximum"}}`, tokens, u.window)
				return
			}
			text := "ok"
			if summarize {
				u.summaries.Add(1)
				text = "Goal: review the files. Done: read some. Next: read the rest."
			}
			if req.Stream {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprintf(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":%d,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n", tokens)
				fmt.Fprintf(w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":%q}}\n\n", text)
				io.WriteString(w, "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":3}}\n\n")
				io.WriteString(w, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
				return
			}
			fmt.Fprintf(w, `{"id":"m","type":"message","role":"assistant","content":[{"type":"text","text":%q}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"cache_read_input_tokens":0,"output_tokens":3}}`, text, tokens)
		default:
			w.WriteHeader(404)
		}
	})
	return u
}

// dialectAgent grows a tool loop in one dialect: each step a turn with a
// reasoning item or thinking block and a tool call, then its result.
type dialectAgent struct {
	d     chat.Dialect
	items []string
	step  int
}

func (a *dialectAgent) body(stream bool) string {
	if a.d == chat.DialectResponses {
		return fmt.Sprintf(`{"model":"m","instructions":"You are a coding agent.","store":false,"stream":%v,"tools":[{"type":"function","name":"read","parameters":{"type":"object"}}],"input":[%s]}`,
			stream, strings.Join(a.items, ","))
	}
	return fmt.Sprintf(`{"model":"m","max_tokens":256,"system":[{"type":"text","text":"You are a coding agent.","cache_control":{"type":"ephemeral"}}],"stream":%v,"tools":[{"name":"read","input_schema":{"type":"object"}}],"messages":[%s]}`,
		stream, strings.Join(a.items, ","))
}

func (a *dialectAgent) start() {
	if a.d == chat.DialectResponses {
		a.items = []string{`{"role":"user","content":[{"type":"input_text","text":"Review every file of the project."}]}`}
	} else {
		a.items = []string{`{"role":"user","content":"Review every file of the project."}`}
	}
}

// toolStep adds one turn and its result of n bytes; the result it returns
// is the newest tool output's text.
func (a *dialectAgent) toolStep(n int) string {
	a.step++
	id := fmt.Sprintf("call_%d", a.step)
	out := fmt.Sprintf("// file %d\n%s", a.step, strings.Repeat("x", n))
	o, _ := json.Marshal(out)
	if a.d == chat.DialectResponses {
		a.items = append(a.items,
			fmt.Sprintf(`{"type":"reasoning","id":"rs_%d","summary":[],"encrypted_content":"enc%d"}`, a.step, a.step),
			fmt.Sprintf(`{"type":"function_call","call_id":%q,"name":"read","arguments":"{\"path\":\"f%d.go\"}"}`, id, a.step),
			fmt.Sprintf(`{"type":"function_call_output","call_id":%q,"output":%s}`, id, o))
	} else {
		a.items = append(a.items,
			fmt.Sprintf(`{"role":"assistant","content":[{"type":"thinking","thinking":"read next","signature":"sig%d"},{"type":"tool_use","id":%q,"name":"read","input":{"path":"f%d.go"}}]}`, a.step, id, a.step),
			fmt.Sprintf(`{"role":"user","content":[{"type":"tool_result","tool_use_id":%q,"content":%s}]}`, id, o))
	}
	return out
}

// TestDialectLoopsCompact drives a 30-step tool loop in the Responses and
// Messages dialects through the proxy at its defaults (only the window
// known) against an upstream that enforces it: every step is answered,
// the proxy summarizes in the upstream's own dialect, and what reaches the
// upstream is well paired, keeps the client's instructions, tools and the
// newest tool result as sent, and keeps the tail's reasoning byte for byte.
func TestDialectLoopsCompact(t *testing.T) {
	for _, tc := range []struct {
		name     string
		d        chat.Dialect
		inStream bool
	}{
		{"responses", chat.DialectResponses, false},
		{"responses-failed-event", chat.DialectResponses, true},
		{"messages", chat.DialectMessages, false},
		// The proxy is told a larger window than the upstream enforces:
		// the first overflow reaches the upstream, which names its window;
		// the proxy learns it and recovers (the stream's response.failed
		// like a 400) before the client sees anything.
		{"responses-overstated", chat.DialectResponses, false},
		{"responses-failed-event-overstated", chat.DialectResponses, true},
		{"messages-overstated", chat.DialectMessages, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newDialectUpstream(t, 4000)
			up.failInStream = tc.inStream
			cfg := testConfig(up.URL)
			cfg.Upstream.ContextWindow = 4000
			overstated := strings.HasSuffix(tc.name, "overstated")
			if overstated {
				cfg.Upstream.ContextWindow = 8000
			}
			p := newTestProxy(t, cfg)
			path := "/v1/" + tc.d.String()
			a := &dialectAgent{d: tc.d}
			a.start()
			summarized := 0
			for step := 0; step < 30; step++ {
				newest := a.toolStep(1500)
				stream := step%2 == 0 || tc.inStream
				body := a.body(stream)
				resp := p.post(t, path+"?beta=true", body, "Anthropic-Version", "2023-06-01")
				got := readAll(t, resp)
				if resp.StatusCode != 200 {
					t.Fatalf("step %d: %d %s", step, resp.StatusCode, got)
				}
				switch resp.Header.Get("X-Compactproxy-Compaction") {
				case "summarized", "reused":
					summarized++
				}
				if stream && (!bytes.Contains(got, []byte("ok")) || bytes.Contains(got, []byte("broke off"))) {
					t.Fatalf("step %d: stream not relayed whole: %s", step, got)
				}
				fwd := lastAgentRequest(t, up, path)
				checkForwarded(t, tc.d, step, []byte(body), fwd, newest)
			}
			retries := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": tc.d.String(), "reason": "context_overflow"})
			t.Logf("overflows %d, recovered %v, summarize calls %d, compacted answers %d", up.overflows.Load(), retries, up.summaries.Load(), summarized)
			if overstated && (up.overflows.Load() == 0 || retries != float64(up.overflows.Load())) {
				t.Errorf("overstated window: %d overflows, %v recovered (want every one)", up.overflows.Load(), retries)
			}
			if up.overflows.Load() != 0 && !overstated {
				t.Errorf("%d overflows reached the upstream; the proxy knew the window", up.overflows.Load())
			}
			if summarized == 0 || up.summaries.Load() == 0 {
				t.Fatalf("no summary in 30 steps of %d KB (summarized %d, summarize calls %d)", 30*1500/1000, summarized, up.summaries.Load())
			}
			for _, r := range up.requests() {
				if r.Path != path {
					t.Errorf("a request went to %s, not the client's dialect %s", r.Path, path)
				}
				if isAgentRequest(r.Body) && r.Query != "beta=true" {
					t.Errorf("the client's query string was not forwarded: %q", r.Query)
				}
			}
			if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "dropped"}); v != 0 {
				t.Errorf("%v drops while the summarizer answers", v)
			}
			if v := counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": tc.d.String(), "code": "200"}); v != 30 {
				t.Errorf("http_requests_total{route=%q,code=200} = %v, want 30", tc.d.String(), v)
			}
		})
	}
}

// lastAgentRequest is the newest upstream request that is not a summarize
// call.
func lastAgentRequest(t *testing.T, up *dialectUpstream, path string) []byte {
	t.Helper()
	rs := up.requests()
	for i := len(rs) - 1; i >= 0; i-- {
		if rs[i].Path == path && isAgentRequest(rs[i].Body) {
			return rs[i].Body
		}
	}
	t.Fatal("no agent request reached the upstream")
	return nil
}

func checkForwarded(t *testing.T, d chat.Dialect, step int, client, fwd []byte, newest string) {
	t.Helper()
	r, err := chat.ParseDialect(d, fwd)
	if err != nil {
		t.Fatalf("step %d: forwarded body does not parse: %v\n%s", step, err, fwd)
	}
	if vs := pairing.Check(compaction.PairingView(r.Messages)); len(vs) > 0 {
		t.Fatalf("step %d: forwarded body breaks pairing: %+v\n%s", step, vs, fwd)
	}
	var c, f map[string]json.RawMessage
	_ = json.Unmarshal(client, &c)
	_ = json.Unmarshal(fwd, &f)
	for _, k := range []string{"tools", "instructions", "system"} {
		if !bytes.Equal(c[k], f[k]) {
			t.Fatalf("step %d: %s changed upstream:\n%s\n%s", step, k, c[k], f[k])
		}
	}
	o, _ := json.Marshal(newest)
	if !bytes.Contains(fwd, o) {
		t.Fatalf("step %d: the newest tool result is not forwarded verbatim", step)
	}
	// Every reasoning item / thinking block forwarded is the client's,
	// byte for byte.
	key := []byte(`{"type":"reasoning"`)
	if d == chat.DialectMessages {
		key = []byte(`{"type":"thinking"`)
	}
	for rest := fwd; ; {
		i := bytes.Index(rest, key)
		if i < 0 {
			break
		}
		j := bytes.IndexByte(rest[i:], '}')
		item := rest[i : i+j+1]
		if !bytes.Contains(client, item) {
			t.Fatalf("step %d: forwarded %s is not the client's", step, item)
		}
		rest = rest[i+j+1:]
	}
}

// TestDialectErrorsInOwnEnvelope: the proxy's own answers (a pairing
// violation) come in the dialect's envelope, naming the client's item.
func TestDialectErrorsInOwnEnvelope(t *testing.T) {
	up := newDialectUpstream(t, 4000)
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/messages", `{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t9","content":"x"}]}]}`)
	got := readAll(t, resp)
	var env struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if resp.StatusCode != 400 || json.Unmarshal(got, &env) != nil || env.Type != "error" || env.Error.Type != "invalid_request_error" ||
		!strings.Contains(env.Error.Message, "messages[1]") || !strings.Contains(env.Error.Message, "t9") {
		t.Fatalf("%d %s", resp.StatusCode, got)
	}
	resp = p.post(t, "/v1/responses", `{"model":"m","input":[{"role":"user","content":"hi"},{"type":"function_call_output","call_id":"c9","output":"x"}]}`)
	got = readAll(t, resp)
	var oe struct {
		Error struct {
			Code  string `json:"code"`
			Param string `json:"param"`
		} `json:"error"`
	}
	if resp.StatusCode != 400 || json.Unmarshal(got, &oe) != nil || oe.Error.Code != "invalid_tool_pairing" || oe.Error.Param != "input[1]" {
		t.Fatalf("%d %s", resp.StatusCode, got)
	}
	if n := len(up.requests()); n != 0 {
		t.Fatalf("%d requests forwarded that the proxy knew would fail", n)
	}
	// previous_response_id: the upstream holds the history; passed as is.
	body := `{"model":"m","previous_response_id":"resp_1","input":[{"type":"function_call_output","call_id":"c9","output":"x"}]}`
	resp = p.post(t, "/v1/responses", body)
	readAll(t, resp)
	if resp.StatusCode != 200 || string(up.last(t).Body) != body {
		t.Fatalf("previous_response_id request: %d, forwarded %s", resp.StatusCode, up.last(t).Body)
	}
}

// TestDialectPreviewAndSelfCompaction: the preview reads a Messages body
// and answers the view in its own dialect; an agent's own compaction
// request is forwarded with its whole history while it fits, though a
// stored summary would apply to it.
func TestDialectPreviewAndSelfCompaction(t *testing.T) {
	up := newDialectUpstream(t, 4000)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 4000
	p := newTestProxy(t, cfg)
	a := &dialectAgent{d: chat.DialectMessages}
	a.start()
	// Steps until the first compaction: the history is then over the
	// trigger, not over the window.
	for step := 0; ; step++ {
		a.toolStep(1000)
		resp := p.post(t, "/v1/messages", a.body(false))
		readAll(t, resp)
		if resp.StatusCode != 200 || step > 20 {
			t.Fatalf("step %d: %d", step, resp.StatusCode)
		}
		if resp.Header.Get("X-Compactproxy-Compaction") != "none" {
			break
		}
	}
	resp := p.post(t, "/v1/compactproxy/preview", a.body(false), "Anthropic-Version", "2023-06-01")
	got := readAll(t, resp)
	var pv struct {
		Messages []json.RawMessage `json:"messages"`
		Action   string            `json:"action"`
	}
	if resp.StatusCode != 200 || json.Unmarshal(got, &pv) != nil || len(pv.Messages) == 0 {
		t.Fatalf("preview: %d %s", resp.StatusCode, got)
	}
	if pv.Action == "none" || !bytes.HasPrefix(pv.Messages[0], []byte(`{"role":"user","content":`)) || bytes.Contains(got, []byte(`"role":"tool"`)) {
		t.Fatalf("preview is not a compacted Messages view: %s", got)
	}
	// The agent asks to summarize: the whole history fits the window, so
	// it is forwarded whole, stored summary or not.
	a.items = append(a.items, `{"role":"user","content":"Your task is to create a detailed summary of the conversation so far."}`)
	full := a.body(false)
	resp = p.post(t, "/v1/messages", full)
	readAll(t, resp)
	if resp.StatusCode != 200 || !bytes.Equal(up.last(t).Body, []byte(full)) || resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Fatalf("self-compaction request: %d %s; forwarded whole: %v", resp.StatusCode, resp.Header.Get("X-Compactproxy-Compaction"), bytes.Equal(up.last(t).Body, []byte(full)))
	}
}

// isAgentRequest tells the agent's requests from the proxy's summarize
// calls (tool_choice none, or a transcript without tools).
func isAgentRequest(body []byte) bool {
	return bytes.Contains(body, []byte(`"tools"`)) && !bytes.Contains(body, []byte(`"tool_choice"`))
}

// TestAnthropicUpstreamKey: with upstream.dialect anthropic, the proxy's
// upstream key goes in Anthropic's own header, the client's never.
func TestAnthropicUpstreamKey(t *testing.T) {
	up := newDialectUpstream(t, 4000)
	cfg := testConfig(up.URL)
	cfg.Upstream.Dialect = "anthropic"
	cfg.Upstream.APIKey = "sk-ant-upstream"
	cfg.Auth.AllowAnonymous = true
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "X-Api-Key", "sk-client")
	readAll(t, resp)
	h := up.last(t).Header
	if resp.StatusCode != 200 || h.Get("X-Api-Key") != "sk-ant-upstream" || h.Get("Authorization") != "" {
		t.Fatalf("%d: upstream got X-Api-Key %q, Authorization %q", resp.StatusCode, h.Get("X-Api-Key"), h.Get("Authorization"))
	}
}

// TestAnthropicUpstreamKeyOnPassThrough: pass-through routes (Claude
// Code's count_tokens, models) carry the proxy's upstream key in
// Anthropic's own header too, never as a Bearer token Anthropic ignores.
func TestAnthropicUpstreamKeyOnPassThrough(t *testing.T) {
	up := newDialectUpstream(t, 4000)
	cfg := testConfig(up.URL)
	cfg.Upstream.Dialect = "anthropic"
	cfg.Upstream.APIKey = "sk-ant-upstream"
	cfg.Auth.AllowAnonymous = true
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "X-Api-Key", "sk-client")
	readAll(t, resp)
	h := up.last(t).Header
	if h.Get("X-Api-Key") != "sk-ant-upstream" || h.Get("Authorization") != "" {
		t.Fatalf("%d: count_tokens reached the upstream with X-Api-Key %q, Authorization %q; want the upstream key in X-Api-Key only", resp.StatusCode, h.Get("X-Api-Key"), h.Get("Authorization"))
	}
}

// TestDialectSummarizeCallShape: the summarize call continues the client's
// own request in its dialect, without the fields that would shape or cut
// the summary (llama-server's n_predict, Anthropic's thinking budget).
func TestDialectSummarizeCallShape(t *testing.T) {
	for _, d := range []chat.Dialect{chat.DialectResponses, chat.DialectMessages} {
		up := newDialectUpstream(t, 4000)
		cfg := testConfig(up.URL)
		cfg.Upstream.ContextWindow = 4000
		p := newTestProxy(t, cfg)
		a := &dialectAgent{d: d}
		a.start()
		for step := 0; step < 12 && up.summaries.Load() == 0; step++ {
			a.toolStep(1500)
			body := strings.Replace(a.body(true), `"stream":true`, `"stream":true,"n_predict":16,"thinking":{"type":"enabled","budget_tokens":2000},"text":{"format":{"type":"json_object"}}`, 1)
			readAll(t, p.post(t, "/v1/"+d.String(), body))
		}
		var sum []byte
		for _, r := range up.requests() {
			if !isAgentRequest(r.Body) {
				sum = r.Body
			}
		}
		if sum == nil {
			t.Fatalf("%s: no summarize call", d)
		}
		gone := []string{`"n_predict"`, `"stream":true`}
		if d == chat.DialectResponses {
			gone = append(gone, `"text":{"format"`)
		} else {
			gone = append(gone, `"thinking":{"type":"enabled"`)
		}
		for _, k := range gone {
			if bytes.Contains(sum, []byte(k)) {
				t.Errorf("%s: the summarize call carries %s: %.300s", d, k, sum)
			}
		}
		if !bytes.Contains(sum, []byte(`"stream":false`)) || !bytes.Contains(sum, []byte(`"tools"`)) {
			t.Errorf("%s: the summarize call is not the client's request continued: %.300s", d, sum)
		}
	}
}

// TestStreamErrorEventPerDialect: a stream the upstream broke off ends
// with the dialect's own error event.
func TestStreamErrorEventPerDialect(t *testing.T) {
	for d, want := range map[chat.Dialect]string{
		chat.DialectChat:      `data: {"error":{"message":"compactproxy: the upstream broke off the stream (upstream timed out)","type":"upstream_error","param":null,"code":"upstream_timeout"}}`,
		chat.DialectResponses: `event: error` + "\n" + `data: {"type":"error","code":"upstream_timeout","message":"compactproxy: the upstream broke off the stream (upstream timed out)"}`,
		chat.DialectMessages:  `event: error` + "\n" + `data: {"type":"error","error":{"type":"api_error","message":"compactproxy: the upstream broke off the stream (upstream timed out)"}}`,
	} {
		if got := string(streamErrorEvent(wire.For(d), upstream.FailTimeout)); got != want+"\n\n" {
			t.Errorf("%s: %q, want %q", d, got, want+"\n\n")
		}
	}
}
