package wire

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// MessagesAPI is POST /v1/messages.
var MessagesAPI = &API{Dialect: chat.DialectMessages, Route: "/v1/messages",
	UpstreamPath: "messages", HistoryKey: "messages", Rules: Messages{}}

// Messages is Anthropic's Messages API (POST /v1/messages; Claude Code):
// Anthropic's error envelope {"type":"error","error":{"type","message"}};
// typed events, the input usage in message_start, the output in
// message_delta, the stream complete at message_stop or an error event.
type Messages struct{ defaults }

// ErrorBody implements Rules: Anthropic's envelope, its error type from the
// status (param and code have no place in it).
func (Messages) ErrorBody(status int, typ, _, _, msg string) []byte {
	return anthropicError(anthropicErrorType(status, typ), msg)
}

// StreamError implements Rules: Anthropic's error event.
func (Messages) StreamError(_, msg string) []byte {
	return sseEvent("error", anthropicError("api_error", msg))
}

// anthropicError is Anthropic's error envelope.
func anthropicError(typ, msg string) []byte {
	type detail struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	}
	body, _ := json.Marshal(struct {
		Type  string `json:"type"`
		Error detail `json:"error"`
	}{"error", detail{typ, msg}})
	return body
}

// anthropicErrorType maps an answer to Anthropic's error types.
func anthropicErrorType(status int, typ string) string {
	switch {
	case status == 401:
		return "authentication_error"
	case status == 403:
		return "permission_error"
	case status == 404:
		return "not_found_error"
	case status == 413:
		return "request_too_large"
	case status == 429:
		return "rate_limit_error"
	case status == 504:
		return "timeout_error"
	case status >= 500:
		return "api_error"
	case typ == "invalid_request_error":
		return typ
	}
	return "invalid_request_error"
}

// DescribePairing implements Rules: tool_use blocks answered by tool_result
// blocks in the next user message.
func (Messages) DescribePairing(v pairing.Violation, param string, _ int) string {
	switch v.Kind {
	case pairing.OrphanToolResult:
		return fmt.Sprintf("%s: tool_result block with tool_use_id %q answers no tool_use block of the previous assistant message (%s)", param, v.ID, v.Kind)
	case pairing.UnansweredToolCall:
		return fmt.Sprintf("%s: tool_use block %q has no tool_result block in the next user message (%s)", param, v.ID, v.Kind)
	case pairing.DuplicateToolCallID:
		return fmt.Sprintf("%s: tool_use id %q is used twice (%s)", param, v.ID, v.Kind)
	case pairing.InterleavedMessage:
		return fmt.Sprintf("%s: the tool_result blocks answering an assistant message must come first in the next user message (%s)", param, v.Kind)
	}
	return fmt.Sprintf("%s: tool use pairing is broken (%s)", param, v.Kind)
}

// SummaryFields implements Rules: max_tokens, tool_choice none when the
// request has tools, no extended thinking (its budget must stay under
// max_tokens) and no stop sequences.
func (Messages) SummaryFields(req *chat.Request, maxTokens int, _ string) []chat.Field {
	set := append([]chat.Field{{Key: "response_format"}}, serverOutputFields...)
	set = append(set, chat.Field{Key: "stream", Value: []byte("false")}, chat.Field{Key: "max_tokens", Value: []byte(strconv.Itoa(maxTokens))},
		chat.Field{Key: "thinking"}, chat.Field{Key: "stop_sequences"}, chat.Field{Key: "tool_choice"})
	if hasTools(req) {
		set[len(set)-1].Value = []byte(`{"type":"none"}`)
	}
	return set
}

// SummaryRequest implements Rules: a top-level system and one user
// message.
func (Messages) SummaryRequest(model, system, user string, maxTokens int, _ string) ([]byte, error) {
	return json.Marshal(map[string]any{"model": model, "system": system, "max_tokens": maxTokens,
		"messages": []map[string]any{{"role": "user", "content": user}}})
}

// SummaryText implements Rules: the text blocks.
func (Messages) SummaryText(body []byte) (string, string, error) { return typedText(body, false) }

// NewStream implements Rules.
func (Messages) NewStream(bool) Stream { return &messagesStream{} }

type messagesStream struct {
	// input is the input usage message_start reported (message_delta
	// carries the output).
	input anchor.Usage
	done  bool
}

// Event implements Stream: the stream ends cleanly at message_stop or at
// the upstream's own error event (relayed as it came).
func (s *messagesStream) Event(ev []byte) Step {
	st := Step{Relay: ev}
	data := EventData(ev)
	if len(data) > 0 && bytes.Contains(data, usageKey) {
		st.Usage, st.HasUsage = s.usage(data)
	}
	if !s.done && (bytes.Contains(data, []byte(`message_stop"`)) || bytes.Contains(data, []byte(`"error"`))) {
		if t := eventType(data); t == "message_stop" || t == "error" {
			s.done, st.Complete, st.Report = true, true, true
		}
	}
	return st
}

// usage reads message_start's usage (the input) or message_delta's (the
// output, with message_start's input unless the delta's own input
// figures, cumulative, are there and not lower).
func (s *messagesStream) usage(data []byte) (anchor.Usage, bool) {
	var ev struct {
		Type    string          `json:"type"`
		Message json.RawMessage `json:"message"`
	}
	if json.Unmarshal(data, &ev) != nil {
		return anchor.Usage{}, false
	}
	switch ev.Type {
	case "message_start":
		u, ok := anchor.UsageFromJSON(ev.Message)
		if ok {
			s.input = u
		}
		return u, ok
	case "message_delta":
		u, ok := anchor.UsageFromJSON(data)
		if !ok {
			return anchor.Usage{}, false
		}
		if !u.HasInput || u.Input < s.input.Input {
			in := s.input
			in.Output, in.HasOutput = u.Output, u.HasOutput
			return in, in.HasInput || in.HasOutput
		}
		return u, true
	}
	return anchor.Usage{}, false
}
