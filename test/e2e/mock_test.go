package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// The texts and ids the mock answers with; client.mjs expects the same.
const (
	plainText        = "Hello from the mock upstream."
	toolFinalText    = "It is sunny in Paris, 21 degrees."
	toolCallID       = "call_e2e_weather"
	streamToolCallID = "call_e2e_stream_weather"
	toolName         = "get_weather"
	toolResult       = `{"city":"Paris","forecast":"sunny","celsius":21}`
)

// streamPieces are the content deltas of a streamed text answer; they join
// to client.mjs's expect.stream.
var streamPieces = []string{"Hello", ", ", "streamed", " world!"}

// recorded is one request as the mock upstream received it.
type recorded struct {
	Method string
	Path   string
	Header http.Header
	Body   []byte
}

// chatView is the part of a chat request the mock decides on.
type chatView struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Messages []struct {
		Role       string          `json:"role"`
		Content    json.RawMessage `json:"content"`
		ToolCallID string          `json:"tool_call_id"`
	} `json:"messages"`
}

// text returns a message's content when it is a JSON string.
func text(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

// marker returns the "[e2e:NAME]" scenario marker of the last user message.
func (v chatView) marker() string {
	for i := len(v.Messages) - 1; i >= 0; i-- {
		if v.Messages[i].Role != "user" {
			continue
		}
		s := text(v.Messages[i].Content)
		if j := strings.Index(s, "[e2e:"); j >= 0 {
			if k := strings.Index(s[j:], "]"); k > 0 {
				return s[j+len("[e2e:") : j+k]
			}
		}
		return ""
	}
	return ""
}

// mockUpstream is an OpenAI-compatible upstream that records every request
// and answers scripted responses chosen by the last message: a role "tool"
// message gets the tool loop's final text; otherwise the user message's
// marker picks plain text, a stream, or a tool call. Streams carry a
// usage-only chunk when the request set stream_options.include_usage, as
// OpenAI does.
type mockUpstream struct {
	srv *httptest.Server

	mu   sync.Mutex
	reqs []recorded
	seq  int
}

func newMockUpstream(t *testing.T) *mockUpstream {
	t.Helper()
	m := &mockUpstream{}
	m.srv = httptest.NewServer(http.HandlerFunc(m.serve))
	t.Cleanup(m.srv.Close)
	return m
}

// baseURL is the mock's base URL including /v1.
func (m *mockUpstream) baseURL() string { return m.srv.URL + "/v1" }

// chats returns the recorded chat-completions requests, in arrival order.
func (m *mockUpstream) chats() []recorded {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []recorded
	for _, r := range m.reqs {
		if r.Method == http.MethodPost && r.Path == "/v1/chat/completions" {
			out = append(out, r)
		}
	}
	return out
}

func (m *mockUpstream) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	m.mu.Lock()
	m.reqs = append(m.reqs, recorded{Method: r.Method, Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
	m.seq++
	id := fmt.Sprintf("chatcmpl-e2e-%d", m.seq)
	m.mu.Unlock()

	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"object":"list","data":[{"id":"e2e-model","object":"model","created":1700000000,"owned_by":"mock"}]}`)
		return
	case r.Method == http.MethodPost && r.URL.Path == "/v1/chat/completions":
	default:
		mockError(w, http.StatusNotFound, "mock: no route "+r.Method+" "+r.URL.Path)
		return
	}

	var v chatView
	if err := json.Unmarshal(body, &v); err != nil || len(v.Messages) == 0 {
		mockError(w, http.StatusBadRequest, fmt.Sprintf("mock: bad chat body: %v", err))
		return
	}
	usage := map[string]any{
		"prompt_tokens":     len(body)/4 + 1,
		"completion_tokens": 9,
		"total_tokens":      len(body)/4 + 10,
		"prompt_tokens_details": map[string]any{
			"cached_tokens": 0,
		},
	}
	includeUsage := v.StreamOptions != nil && v.StreamOptions.IncludeUsage
	last := v.Messages[len(v.Messages)-1]

	switch {
	case last.Role == "tool":
		if v.Stream {
			m.streamText(w, id, v.Model, []string{toolFinalText}, includeUsage, usage)
		} else {
			mockJSON(w, id, v.Model, map[string]any{"role": "assistant", "content": toolFinalText}, "stop", usage)
		}
	case v.marker() == "plain":
		mockJSON(w, id, v.Model, map[string]any{"role": "assistant", "content": plainText}, "stop", usage)
	case v.marker() == "stream":
		m.streamText(w, id, v.Model, streamPieces, includeUsage, usage)
	case v.marker() == "tool":
		mockJSON(w, id, v.Model, map[string]any{
			"role":    "assistant",
			"content": nil,
			"tool_calls": []any{map[string]any{
				"id":       toolCallID,
				"type":     "function",
				"function": map[string]any{"name": toolName, "arguments": `{"city":"Paris"}`},
			}},
		}, "tool_calls", usage)
	case v.marker() == "stream_tool":
		m.streamToolCall(w, id, v.Model, includeUsage, usage)
	default:
		mockError(w, http.StatusBadRequest, "mock: no scenario for this request")
	}
}

func mockError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "code": nil}})
}

func mockJSON(w http.ResponseWriter, id, model string, msg map[string]any, finish string, usage map[string]any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"id":      id,
		"object":  "chat.completion",
		"created": time.Now().Unix(),
		"model":   model,
		"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": finish, "logprobs": nil}},
		"usage":   usage,
	})
}

// sse writes chat.completion.chunk events, one flush per event.
type sse struct {
	w            http.ResponseWriter
	id, model    string
	includeUsage bool
}

func newSSE(w http.ResponseWriter, id, model string, includeUsage bool) *sse {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w, id: id, model: model, includeUsage: includeUsage}
}

func (s *sse) chunk(choices []any, usage map[string]any) {
	c := map[string]any{
		"id":      s.id,
		"object":  "chat.completion.chunk",
		"created": time.Now().Unix(),
		"model":   s.model,
		"choices": choices,
	}
	if s.includeUsage {
		// OpenAI sends "usage": null on every chunk but the last when the
		// client asked for usage.
		c["usage"] = nil
		if usage != nil {
			c["usage"] = usage
		}
	}
	b, _ := json.Marshal(c)
	fmt.Fprintf(s.w, "data: %s\n\n", b)
	s.w.(http.Flusher).Flush()
}

func (s *sse) delta(delta map[string]any, finish any) {
	s.chunk([]any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": nil}}, nil)
}

func (s *sse) done(usage map[string]any) {
	if s.includeUsage {
		s.chunk([]any{}, usage)
	}
	io.WriteString(s.w, "data: [DONE]\n\n")
	s.w.(http.Flusher).Flush()
}

func (m *mockUpstream) streamText(w http.ResponseWriter, id, model string, pieces []string, includeUsage bool, usage map[string]any) {
	s := newSSE(w, id, model, includeUsage)
	s.delta(map[string]any{"role": "assistant", "content": ""}, nil)
	// A comment line, as some servers send keep-alives; it must pass.
	io.WriteString(w, ": ping\n\n")
	for _, p := range pieces {
		s.delta(map[string]any{"content": p}, nil)
	}
	s.delta(map[string]any{}, "stop")
	s.done(usage)
}

func (m *mockUpstream) streamToolCall(w http.ResponseWriter, id, model string, includeUsage bool, usage map[string]any) {
	s := newSSE(w, id, model, includeUsage)
	s.delta(map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
		"index": 0, "id": streamToolCallID, "type": "function",
		"function": map[string]any{"name": toolName, "arguments": ""},
	}}}, nil)
	for _, part := range []string{`{"city":`, `"Paris"}`} {
		s.delta(map[string]any{"tool_calls": []any{map[string]any{
			"index": 0, "function": map[string]any{"arguments": part},
		}}}, nil)
	}
	s.delta(map[string]any{}, "tool_calls")
	s.done(usage)
}
