package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// The wire tests drive the real binary with plain HTTP against mock
// upstreams that send what OpenAI's and Anthropic's servers send: stream
// events that echo the whole response object (20+ KB with Codex's
// instructions and tools), the providers' own error events.

// codexInstructions is the size of Codex's instructions (~20 KB), which a
// Responses server echoes in response.created, response.in_progress and
// response.failed.
var codexInstructions = strings.Repeat("You are Codex, a coding agent running in the user's terminal. Follow AGENTS.md. ", 250)

// codexTools are Codex's function tools, echoed likewise.
var codexTools = func() string {
	var t []string
	for _, name := range []string{"shell", "apply_patch", "update_plan", "view_image", "read_file", "list_dir", "grep_files"} {
		t = append(t, fmt.Sprintf(`{"type":"function","name":%q,"description":%q,"strict":false,"parameters":{"type":"object","properties":{"command":{"type":"array","items":{"type":"string"}},"workdir":{"type":"string"},"timeout_ms":{"type":"number"}},"required":["command"]}}`,
			name, strings.Repeat("Runs a command in the sandbox and returns its output. ", 8)))
	}
	return "[" + strings.Join(t, ",") + "]"
}()

// responseObject is a Responses response object as the stream events carry
// it.
func responseObject(status, errJSON, usage string) string {
	return fmt.Sprintf(`{"id":"resp_e2e","object":"response","created_at":1764979200,"status":%q,"error":%s,"incomplete_details":null,"instructions":%s,"max_output_tokens":null,"model":"gpt-5-codex","output":[],"parallel_tool_calls":false,"reasoning":{"effort":"medium","summary":"auto"},"store":false,"tool_choice":"auto","tools":%s,"usage":%s}`,
		status, errJSON, mustJSON(codexInstructions), codexTools, usage)
}

// sseEvent writes one named event.
func sseEvent(w io.Writer, name, data string) {
	fmt.Fprintf(w, "event: %s\ndata: %s\n\n", name, data)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// codexUpstream is a Responses server with a window it enforces, counting
// a prompt as 5/8 of its body's bytes (2.5x the proxy's estimate, as a
// small-vocabulary tokenizer does): over the window, a stream fails with
// response.failed (context_length_exceeded) after response.created and
// response.in_progress, full size, as OpenAI's servers report it.
type codexUpstream struct {
	window int
	mu     sync.Mutex
	// streams are the prompt sizes of the streamed (agent) requests;
	// summaries counts the proxy's summarize calls (not streamed).
	streams   []int
	summaries int
}

func (u *codexUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path != "/v1/responses" {
		http.NotFound(w, r) // discovery: the window is configured
		return
	}
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	tokens := len(body) * 5 / 8
	if !req.Stream {
		u.mu.Lock()
		u.summaries++
		u.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"resp_sum","object":"response","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Goal: fix the retry bug. Done: read the handlers. Next: patch retry.go."}]}],"usage":{"input_tokens":%d,"output_tokens":20}}`, tokens)
		return
	}
	u.mu.Lock()
	u.streams = append(u.streams, tokens)
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	sseEvent(w, "response.created", `{"type":"response.created","sequence_number":0,"response":`+responseObject("in_progress", "null", "null")+`}`)
	sseEvent(w, "response.in_progress", `{"type":"response.in_progress","sequence_number":1,"response":`+responseObject("in_progress", "null", "null")+`}`)
	if tokens > u.window {
		msg := fmt.Sprintf("This model's maximum context length is %d tokens. However, your messages resulted in %d tokens. Please reduce the length of the messages.", u.window, tokens)
		sseEvent(w, "response.failed", `{"type":"response.failed","sequence_number":2,"response":`+
			responseObject("failed", `{"code":"context_length_exceeded","message":`+mustJSON(msg)+`}`, "null")+`}`)
		return
	}
	sseEvent(w, "response.output_item.added", `{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}`)
	sseEvent(w, "response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Patched."}`)
	sseEvent(w, "response.completed", `{"type":"response.completed","sequence_number":4,"response":`+
		responseObject("completed", "null", fmt.Sprintf(`{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":3,"total_tokens":%d}`, tokens, tokens+3))+`}`)
}

// codexBody is a Codex request: its instructions and tools, and a history
// of steps tool calls with outputs of size bytes.
func codexBody(steps, size int) string {
	items := []string{`{"type":"message","role":"user","content":[{"type":"input_text","text":"Fix the retry bug in the handlers."}]}`}
	for i := 1; i <= steps; i++ {
		out := fmt.Sprintf("// handler_%d.go\n%s", i, strings.Repeat(fmt.Sprintf("func h%d() error { return retry(%d) }\n", i, i), size/40))
		items = append(items,
			fmt.Sprintf(`{"type":"reasoning","id":"rs_%d","summary":[],"encrypted_content":"gAAAA%d"}`, i, i),
			fmt.Sprintf(`{"type":"function_call","call_id":"call_%d","name":"shell","arguments":"{\"command\":[\"cat\",\"handler_%d.go\"]}"}`, i, i),
			fmt.Sprintf(`{"type":"function_call_output","call_id":"call_%d","output":%s}`, i, mustJSON(out)))
	}
	return fmt.Sprintf(`{"model":"gpt-5-codex","instructions":%s,"tools":%s,"tool_choice":"auto","parallel_tool_calls":false,"reasoning":{"effort":"medium","summary":"auto"},"store":false,"stream":true,"include":["reasoning.encrypted_content"],"input":[%s]}`,
		mustJSON(codexInstructions), codexTools, strings.Join(items, ","))
}

// postRaw sends body to the proxy and reads the whole answer; readErr is
// how the body ended (nil: a clean end).
func postRaw(t *testing.T, url, body string, hdr ...string) (resp *http.Response, got []byte, readErr error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+apiKey)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, readErr = io.ReadAll(resp.Body)
	return resp, got, readErr
}

// metricValue sums the proxy's /metrics samples of name whose labels
// contain every one of labels (`key="value"`).
func metricValue(t *testing.T, base, name string, labels ...string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
sample:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(line, l) {
				continue sample
			}
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// TestCodexOverflowAfterFullSizeEvents: Codex's overflow as OpenAI reports
// it, a response.failed after a response.created and a
// response.in_progress of 20+ KB each, is recovered: the proxy learns the
// window, compacts and retries before the client has seen a byte; the
// client gets the retried answer, a clean end, no error event.
func TestCodexOverflowAfterFullSizeEvents(t *testing.T) {
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &codexUpstream{window: 40000}
	srv := httptest.NewServer(up)
	defer srv.Close()
	p := startProxy(t, bin, srv.URL+"/v1",
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=128000", // overstated: the upstream enforces 40,000
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=2000",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS=300",
	)
	if len(responseObject("in_progress", "null", "null")) < 20<<10 {
		t.Fatal("the mock's response object is under 20 KB")
	}
	body := codexBody(30, 3000)
	resp, got, readErr := postRaw(t, p.URL+"/v1/responses", body)
	if readErr != nil {
		t.Errorf("the client's stream did not end cleanly: %v", readErr)
	}
	if resp.StatusCode != 200 || !bytes.Contains(got, []byte("event: response.completed")) || !bytes.Contains(got, []byte(`"delta":"Patched."`)) {
		t.Errorf("status %d; the client did not get the retried answer:\n%.400s", resp.StatusCode, got)
	}
	if bytes.Contains(got, []byte("response.failed")) || bytes.Contains(got, []byte("event: error")) || bytes.Contains(got, []byte("compactproxy:")) {
		t.Errorf("the overflow or an error of the proxy's reached the client:\n%.400s", got)
	}
	if n := bytes.Count(got, []byte("event: response.created")); n != 1 {
		t.Errorf("%d response.created events reached the client, want the retried answer's one", n)
	}
	if a := resp.Header.Get("X-Compactproxy-Compaction"); a == "" || a == "none" {
		t.Errorf("X-Compactproxy-Compaction = %q, want a compaction", a)
	}
	up.mu.Lock()
	streams, summaries := append([]int(nil), up.streams...), up.summaries
	up.mu.Unlock()
	t.Logf("client body %d bytes; upstream prompts %v (window %d); %d summarize calls", len(body), streams, up.window, summaries)
	if len(streams) != 2 || streams[0] <= up.window || streams[1] > up.window {
		t.Errorf("upstream prompts %v: want one overflow then one retry within %d", streams, up.window)
	}
	if v := metricValue(t, p.URL, "compactproxy_upstream_retries_total", `reason="context_overflow"`); v != 1 {
		t.Errorf("upstream_retries_total{reason=context_overflow} = %v, want 1", v)
	}
	if v := metricValue(t, p.URL, "compactproxy_stream_aborts_total"); v != 0 {
		t.Errorf("stream_aborts_total = %v, want 0", v)
	}
	if t.Failed() {
		t.Logf("proxy log (tail):\n%s", p.LogTail())
	}
}

// TestUpstreamErrorEventsEndCleanly: an upstream's own terminal error
// event (Anthropic's event: error, a Responses response.failed after the
// output began) reaches the client as it came, ends the stream cleanly,
// and is not counted as a broken stream.
func TestUpstreamErrorEventsEndCleanly(t *testing.T) {
	root := repoRoot(t)
	bin := buildBinary(t, root)
	streams := map[string]string{
		"/v1/messages": "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_e2e\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":0,\"cache_creation_input_tokens\":0,\"output_tokens\":1}}}\n\n" +
			"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n" +
			"event: ping\ndata: {\"type\":\"ping\"}\n\n" +
			"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Let me\"}}\n\n" +
			"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"},\"request_id\":\"req_e2e\"}\n\n",
		"/v1/responses": "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":" + responseObject("in_progress", "null", "null") + "}\n\n" +
			"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Let me\"}\n\n" +
			"event: response.failed\ndata: {\"type\":\"response.failed\",\"sequence_number\":2,\"response\":" + responseObject("failed", `{"code":"server_error","message":"The model produced invalid content."}`, "null") + "}\n\n",
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		s, ok := streams[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, s)
	}))
	defer srv.Close()
	p := startProxy(t, bin, srv.URL+"/v1")
	bodies := map[string]string{
		"/v1/messages":  `{"model":"claude-sonnet-4-5","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Refactor the retry loop."}]}`,
		"/v1/responses": `{"model":"gpt-5-codex","stream":true,"store":false,"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"Refactor the retry loop."}]}]}`,
	}
	for path, want := range streams {
		resp, got, readErr := postRaw(t, p.URL+path, bodies[path], "Anthropic-Version", "2023-06-01")
		if readErr != nil {
			t.Errorf("%s: the stream did not end cleanly: %v", path, readErr)
		}
		if resp.StatusCode != 200 || string(got) != want {
			t.Errorf("%s: status %d, the client got\n%.1000s\nwant the upstream's events as they came", path, resp.StatusCode, got)
		}
	}
	if v := metricValue(t, p.URL, "compactproxy_stream_aborts_total"); v != 0 {
		t.Errorf("stream_aborts_total = %v, want 0", v)
	}
	if t.Failed() {
		t.Logf("proxy log (tail):\n%s", p.LogTail())
	}
}

// TestInvalidUTF8Refused: a body whose text is not UTF-8 (raw bytes, a
// lone surrogate escape) gets a 400 in the route's own envelope naming the
// byte, and never reaches the upstream.
func TestInvalidUTF8Refused(t *testing.T) {
	root := repoRoot(t)
	bin := buildBinary(t, root)
	var mu sync.Mutex
	posts := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.Method == http.MethodPost {
			mu.Lock()
			posts++
			mu.Unlock()
		}
		http.NotFound(w, r)
	}))
	defer srv.Close()
	p := startProxy(t, bin, srv.URL+"/v1")
	for _, tc := range []struct{ path, body, envelope string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"caf` + "\xff\xfe" + `"}]}`, `{"error":{"message":`},
		{"/v1/responses", `{"model":"m","input":[{"role":"user","content":"caf\ud800"}]}`, `{"error":{"message":`},
		{"/v1/messages", `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"caf` + "\xff\xfe" + `"}]}`, `{"type":"error","error":{"type":"invalid_request_error","message":`},
	} {
		at := fmt.Sprintf("invalid UTF-8 at byte %d", strings.Index(tc.body, "caf")+3)
		resp, got, _ := postRaw(t, p.URL+tc.path, tc.body, "Anthropic-Version", "2023-06-01")
		if resp.StatusCode != 400 || !bytes.HasPrefix(got, []byte(tc.envelope)) || !bytes.Contains(got, []byte(at)) {
			t.Errorf("%s: %d %s, want 400 in %s… naming %q", tc.path, resp.StatusCode, got, tc.envelope, at)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if posts != 0 {
		t.Errorf("%d request(s) with text that is not UTF-8 reached the upstream", posts)
	}
}
