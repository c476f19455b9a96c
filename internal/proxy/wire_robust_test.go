package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/wire"
)

// fullResponse is a Responses response object as OpenAI's stream events
// carry it: the whole request echoed (Codex's instructions and tools, ~20
// KB), so response.created, response.in_progress and response.failed are
// each one long data line.
func fullResponse(status, errJSON string) string {
	instr := strings.Repeat("You are Codex, a coding agent. Follow the repository's AGENTS.md. ", 300)
	var tools []string
	for i := 0; i < 20; i++ {
		tools = append(tools, fmt.Sprintf(`{"type":"function","name":"tool_%d","description":%q,"parameters":{"type":"object","properties":{"path":{"type":"string"}}}}`, i, strings.Repeat("Runs a command in the sandbox. ", 10)))
	}
	return fmt.Sprintf(`{"id":"resp_1","object":"response","created_at":1,"status":%q,"error":%s,"instructions":%q,"tools":[%s],"output":[],"usage":null}`,
		status, errJSON, instr, strings.Join(tools, ","))
}

const overflowError = `{"code":"context_length_exceeded","message":"Your input exceeds the context window of this model. Please adjust your input and try again."}`

// TestEarlyFailureHoldsFullSizeEvents: a response.failed after a
// response.created and response.in_progress of 20+ KB each is found (the
// early-failure reader must not take a long line for the answer's start).
func TestEarlyFailureHoldsFullSizeEvents(t *testing.T) {
	created := fullResponse("in_progress", "null")
	if len(created) < 20<<10 {
		t.Fatalf("response object is %d bytes, want 20+ KB", len(created))
	}
	stream := "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":" + created + "}\n\n" +
		"event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":" + created + "}\n\n" +
		"event: response.failed\ndata: {\"type\":\"response.failed\",\"sequence_number\":2,\"response\":" + fullResponse("failed", overflowError) + "}\n\n"
	replay, env := wire.ResponsesAPI.HoldEarly(io.NopCloser(strings.NewReader(stream)))
	if failed := env != nil; !failed || !bytes.Contains(env, []byte("context_length_exceeded")) {
		t.Fatalf("failed = %v, envelope %.200s: the response.failed after 20 KB events was not found", failed, env)
	}
	all, _ := io.ReadAll(replay)
	if string(all) != stream {
		t.Errorf("the held events are not replayed whole (%d bytes of %d)", len(all), len(stream))
	}
}

// endless is a hostile upstream's one endless line.
type endless struct{ n int64 }

func (e *endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	e.n += int64(len(p))
	return len(p), nil
}

// TestEarlyFailureBounded: an endless first line is held up to a bound,
// then relayed (not held in memory whole).
func TestEarlyFailureBounded(t *testing.T) {
	src := &endless{}
	replay, env := wire.ResponsesAPI.HoldEarly(io.NopCloser(io.MultiReader(strings.NewReader("data: "), src)))
	if env != nil {
		t.Fatal("an endless line read as a failure")
	}
	if src.n > wire.MaxEarlyHold+64<<10 {
		t.Fatalf("%d bytes read before the answer was relayed; the bound is %d", src.n, wire.MaxEarlyHold)
	}
	head := make([]byte, 10)
	if _, err := io.ReadFull(replay, head); err != nil || string(head) != "data: aaaa" {
		t.Fatalf("replay starts %q (%v)", head, err)
	}
}

// TestUpstreamTerminalErrorEvent: an upstream's own terminal error event
// (Anthropic's event: error, a Responses response.failed or error after
// output began) is a clean end of the stream: relayed as it came, nothing
// added, no abort, stream_aborts_total unchanged.
func TestUpstreamTerminalErrorEvent(t *testing.T) {
	for _, tc := range []struct {
		name, path, stream string
	}{
		{"messages-overloaded", "/v1/messages",
			"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n" +
				"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n" +
				"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n" +
				"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"},
		{"messages-error-first", "/v1/messages",
			"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"},
		{"responses-failed-after-output", "/v1/responses",
			"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":" + fullResponse("in_progress", "null") + "}\n\n" +
				"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"Hel\"}\n\n" +
				"event: response.failed\ndata: {\"type\":\"response.failed\",\"sequence_number\":2,\"response\":" + fullResponse("failed", `{"code":"server_error","message":"The model failed."}`) + "}\n\n"},
		{"responses-error-after-output", "/v1/responses",
			"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"r\"}}\n\n" +
				"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"Hel\"}\n\n" +
				"event: error\ndata: {\"type\":\"error\",\"sequence_number\":2,\"code\":\"server_error\",\"message\":\"The server had an error.\"}\n\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, tc.stream)
			})
			p := newTestProxy(t, testConfig(up.URL))
			body := `{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hi"}]}`
			if strings.HasSuffix(tc.path, "responses") {
				body = `{"model":"m","stream":true,"input":"hi"}`
			}
			resp := p.post(t, tc.path, body, "Anthropic-Version", "2023-06-01")
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Errorf("the client's stream did not end cleanly: %v", err)
			}
			if resp.StatusCode != 200 || string(got) != tc.stream {
				t.Errorf("status %d; the client got\n%.600s\nwant the upstream's stream as it came", resp.StatusCode, got)
			}
			if v := counter(t, p.reg, "compactproxy_stream_aborts_total", nil); v != 0 {
				t.Errorf("stream_aborts_total = %v, want 0", v)
			}
		})
	}
}

// TestInvalidUTF8Refused: a body whose text is not UTF-8 (raw bytes, a
// lone surrogate escape) is the client's 400, in the route's own envelope,
// naming the byte; nothing reaches the upstream (llama-server answers such
// a body with a 500). A surrogate pair is text like any other.
func TestInvalidUTF8Refused(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	bodies := map[string]func(text string) string{
		"/v1/chat/completions": func(s string) string { return `{"model":"m","messages":[{"role":"user","content":"` + s + `"}]}` },
		"/v1/responses":        func(s string) string { return `{"model":"m","input":[{"role":"user","content":"` + s + `"}]}` },
		"/v1/messages": func(s string) string {
			return `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"` + s + `"}]}`
		},
	}
	for path, body := range bodies {
		for _, text := range []string{"ab\xff\xfecd", `ab\ud800cd`, `\udc00`} {
			b := body(text)
			resp := p.post(t, path, b, "Anthropic-Version", "2023-06-01")
			got := readAll(t, resp)
			off := strings.Index(b, text)
			if strings.HasPrefix(text, "ab") {
				off += 2
			}
			at := fmt.Sprintf("at byte %d", off)
			if resp.StatusCode != 400 || !bytes.Contains(got, []byte("invalid UTF-8 "+at)) {
				t.Errorf("%s %q: %d %s, want 400 naming %q", path, text, resp.StatusCode, got, at)
			}
			envelope := `{"error":{"message":`
			if path == "/v1/messages" {
				envelope = `{"type":"error","error":{"type":"invalid_request_error","message":`
			}
			if !bytes.HasPrefix(got, []byte(envelope)) {
				t.Errorf("%s: %s is not in the route's envelope (%s…)", path, got, envelope)
			}
		}
		resp := p.post(t, path, body(`\ud83d\ude42 \u00e9 é`), "Anthropic-Version", "2023-06-01")
		if got := readAll(t, resp); resp.StatusCode != 200 {
			t.Errorf("%s: a surrogate pair refused: %d %s", path, resp.StatusCode, got)
		}
	}
	n := 0
	for _, r := range up.requests() {
		if r.Method == http.MethodPost {
			n++
		}
	}
	if n != 3 {
		t.Errorf("%d requests reached the upstream, want the 3 valid ones", n)
	}
}
