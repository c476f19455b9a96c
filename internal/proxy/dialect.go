package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// The dialect seam (DESIGN § Other APIs): one pipeline (handleChat), one
// planner, one state, one set of metrics for chat completions, the
// Responses API and Anthropic Messages. What differs per dialect is here:
// the route, the upstream path, the error envelope, how a stream reports
// its usage and its end, how a Responses stream announces an overflow, and
// the pairing error's words. Parsing and rendering are internal/chat's
// (ParseDialect, Request.Build).

// dialectOf is the dialect of a compacted route.
func dialectOf(r *http.Request) chat.Dialect {
	switch strings.TrimSuffix(r.URL.Path, "/") {
	case "/v1/responses":
		return chat.DialectResponses
	case "/v1/messages":
		return chat.DialectMessages
	}
	if r.URL.Path == "/v1/compactproxy/preview" {
		return previewDialect(r)
	}
	return chat.DialectChat
}

// previewDialects are the values of preview's ?dialect= (another is the
// client's error: 400 naming the parameter).
var previewDialects = map[string]chat.Dialect{"chat": chat.DialectChat, "responses": chat.DialectResponses, "messages": chat.DialectMessages}

// previewDialect is the dialect a preview body is read in: ?dialect=
// (chat, responses, messages), else Anthropic's version header names
// Messages, else chat completions.
func previewDialect(r *http.Request) chat.Dialect {
	if d, ok := previewDialects[r.URL.Query().Get("dialect")]; ok {
		return d
	}
	if r.Header.Get("Anthropic-Version") != "" {
		return chat.DialectMessages
	}
	return chat.DialectChat
}

// upstreamPath is where a dialect's requests go under upstream.url.
func upstreamPath(d chat.Dialect) string {
	switch d {
	case chat.DialectResponses:
		return "responses"
	case chat.DialectMessages:
		return "messages"
	}
	return "chat/completions"
}

// writeErrorIn answers in the dialect's own error envelope: OpenAI's for
// chat completions and Responses, Anthropic's
// {"type":"error","error":{"type":…,"message":…}} for Messages.
func writeErrorIn(d chat.Dialect, w http.ResponseWriter, status int, typ, code, param, msg string) {
	if d != chat.DialectMessages {
		writeError(w, status, typ, code, param, msg)
		return
	}
	body := anthropicError(anthropicErrorType(status, typ), msg)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
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
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusForbidden:
		return "permission_error"
	case status == http.StatusNotFound:
		return "not_found_error"
	case status == http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status == http.StatusGatewayTimeout:
		return "timeout_error"
	case status >= 500:
		return "api_error"
	case typ == "invalid_request_error":
		return typ
	}
	return "invalid_request_error"
}

// describePairing is a pairing violation in the dialect's own words.
func describePairing(d chat.Dialect, v pairing.Violation, param string, clientIndex int) string {
	switch d {
	case chat.DialectResponses:
		switch v.Kind {
		case pairing.OrphanToolResult:
			return fmt.Sprintf("%s: the output item with call_id %q answers no tool call of the turn before it (%s); every output must follow the call it answers", param, v.ID, v.Kind)
		case pairing.UnansweredToolCall:
			return fmt.Sprintf("%s: tool call %q is not answered (%s); every call must be answered by an output item with its call_id before the next message", param, v.ID, v.Kind)
		case pairing.DuplicateToolCallID:
			return fmt.Sprintf("%s: call_id %q is used twice (%s)", param, v.ID, v.Kind)
		case pairing.InterleavedMessage:
			return fmt.Sprintf("%s: a message comes between tool calls and their outputs (%s); answer every call before the next message", param, v.Kind)
		}
		return fmt.Sprintf("%s: tool call pairing is broken (%s)", param, v.Kind)
	case chat.DialectMessages:
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
	return v.Describe(clientIndex)
}

// streamRules is how one dialect's event stream reports its usage and its
// end.
type streamRules struct {
	d chat.Dialect
	// input is the input usage a Messages stream reported in message_start
	// (its message_delta carries the output).
	input anchor.Usage
}

// usage reads the usage an event's data carries, if any, given the usage
// read so far.
func (sr *streamRules) usage(data []byte, last anchor.Usage) (anchor.Usage, bool) {
	switch sr.d {
	case chat.DialectResponses:
		// response.completed / response.incomplete / response.failed
		// carry the response object, its usage inside.
		if !bytes.Contains(data, []byte(`"response.`)) {
			return last, false
		}
		var ev struct {
			Response json.RawMessage `json:"response"`
		}
		if json.Unmarshal(data, &ev) != nil || len(ev.Response) == 0 {
			return last, false
		}
		return anchor.UsageFromJSON(ev.Response)
	case chat.DialectMessages:
		var ev struct {
			Type    string          `json:"type"`
			Message json.RawMessage `json:"message"`
		}
		if json.Unmarshal(data, &ev) != nil {
			return last, false
		}
		switch ev.Type {
		case "message_start":
			u, ok := anchor.UsageFromJSON(ev.Message)
			if ok {
				sr.input = u
			}
			return u, ok
		case "message_delta":
			u, ok := anchor.UsageFromJSON(data)
			if !ok {
				return last, false
			}
			if !u.HasInput || u.Input < sr.input.Input {
				// The delta counts the output; the input is message_start's
				// (a delta's own input figures, when present, are
				// cumulative and win).
				in := sr.input
				in.Output, in.HasOutput = u.Output, u.HasOutput
				return in, in.HasInput || in.HasOutput
			}
			return u, true
		}
		return last, false
	}
	return anchor.UsageFromJSON(data)
}

// ends tells whether an event ends the dialect's stream cleanly: [DONE]
// or a finish reason (chat), response.completed or response.incomplete
// (Responses), message_stop (Messages), or the upstream's own terminal
// error event (Responses response.failed or error, Messages error), which
// the client gets as it came: the stream was not broken off, it ended in
// an error the upstream reported. Only an event that names one of those is
// decoded (never a text delta).
func (sr *streamRules) ends(data []byte) bool {
	switch sr.d {
	case chat.DialectResponses:
		if !bytes.Contains(data, []byte(`response.completed"`)) && !bytes.Contains(data, []byte(`response.incomplete"`)) &&
			!bytes.Contains(data, []byte(`response.failed"`)) && !bytes.Contains(data, []byte(`"error"`)) {
			return false
		}
		switch eventType(data) {
		case "response.completed", "response.incomplete", "response.failed", "error":
			return true
		}
		return false
	case chat.DialectMessages:
		if !bytes.Contains(data, []byte(`message_stop"`)) && !bytes.Contains(data, []byte(`"error"`)) {
			return false
		}
		t := eventType(data)
		return t == "message_stop" || t == "error"
	}
	return bytes.Equal(data, doneData) || (bytes.Contains(data, finishReasonKey) && finished(data))
}

// eventType is an event's top-level "type" member, wherever the upstream
// put it among the members (an encoder that sorts keys writes it last).
func eventType(data []byte) string {
	var ev struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(data, &ev) != nil {
		return ""
	}
	return ev.Type
}

// earlyFailure reads the first events of a Responses stream, up to the first
// output (the upstream has started answering) or a response.failed event.
// A response.failed before any output is returned as failed, its error
// envelope as errBody ({"error":{…}}, what recoverOnce reads), with the
// bytes read and the rest of the body; otherwise failed is false and body
// replays the events read before the rest. A Responses upstream reports a
// context overflow either as a 400 or this way (DESIGN § Other APIs):
// holding these first events lets recovery retry before the client has
// seen a byte.
func earlyFailure(body io.ReadCloser) (replay io.ReadCloser, failed bool, errBody []byte) {
	br := bufio.NewReaderSize(body, streamReaderSize)
	var read []byte
	evStart := 0     // where the event being read starts in read
	partial := false // the last ReadSlice ended mid-line
hold:
	for len(read) < maxEarlyHold {
		// response.created and response.in_progress carry the whole
		// response object (Codex's instructions and tools: ~20 KB), so
		// a line is held whatever its length, up to maxEarlyHold in all.
		line, err := br.ReadSlice('\n')
		read = append(read, line...)
		if err == bufio.ErrBufferFull {
			partial = true
			continue
		}
		blank := !partial && isBlank(line)
		partial = false
		if !blank && err == nil {
			continue
		}
		data := eventData(read[evStart:])
		evStart = len(read)
		switch t := eventType(data); {
		case t == "response.failed":
			var f struct {
				Response struct {
					Error json.RawMessage `json:"error"`
				} `json:"response"`
			}
			if json.Unmarshal(data, &f) == nil && len(f.Response.Error) > 0 && string(f.Response.Error) != "null" {
				rest, _ := io.ReadAll(io.LimitReader(br, maxErrorBody))
				body.Close()
				env := append(append([]byte(`{"error":`), f.Response.Error...), '}')
				return io.NopCloser(bytes.NewReader(append(read, rest...))), true, env
			}
		case t == "" && len(data) == 0:
		case t != "response.created" && t != "response.in_progress" && t != "response.queued":
			break hold // the answer has begun: stop holding
		}
		if err != nil {
			break
		}
	}
	return readCloser{io.MultiReader(bytes.NewReader(read), br), body}, false, nil
}

type readCloser struct {
	io.Reader
	io.Closer
}

// selfCompaction recognizes an agent's own compaction request (DESIGN §
// Other APIs): Codex's checkpoint request, Claude Code's and opencode's
// summary prompts, in the newest user message. Such a request is never
// stripped of the history it asks to summarize while it fits the window.
func selfCompaction(view []chat.Message) bool {
	for i := len(view) - 1; i >= 0; i-- {
		m := &view[i]
		if m.Role != "user" {
			continue
		}
		text := chat.Text(*m)
		for _, marker := range selfCompactionMarkers {
			if strings.Contains(text, marker) {
				return true
			}
		}
		return false
	}
	return false
}

// selfCompactionMarkers are sentences of the agents' own compaction
// prompts.
var selfCompactionMarkers = []string{
	"CONTEXT CHECKPOINT COMPACTION",                             // Codex CLI
	"create a detailed summary of the conversation so far",      // Claude Code
	"Provide a detailed prompt for continuing our conversation", // opencode
}

// maxEarlyHold bounds the bytes earlyFailure holds before it lets the
// stream through: far above a real response.created (tens of KB), low
// enough that an endless first line pins little memory.
const maxEarlyHold = 4 << 20
