package wire

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// ResponsesAPI is POST /v1/responses.
var ResponsesAPI = &API{Dialect: chat.DialectResponses, Route: "/v1/responses",
	UpstreamPath: "responses", HistoryKey: "input", Rules: Responses{}}

// Responses is OpenAI's Responses API (POST /v1/responses; Codex CLI, the
// Agents SDK): OpenAI's error envelope; typed events, the stream complete
// at response.completed or response.incomplete, whose response object
// carries the usage, or at a terminal error event; an overflow may come as response.failed before any
// output inside a 200; previous_response_id leaves the history upstream.
type Responses struct{ defaults }

// StreamError implements Rules: the Responses stream's own error event.
func (Responses) StreamError(code, msg string) []byte {
	body, _ := json.Marshal(struct {
		Type    string `json:"type"`
		Code    string `json:"code"`
		Message string `json:"message"`
	}{"error", code, msg})
	return sseEvent("error", body)
}

// DescribePairing implements Rules: input items paired by call_id.
func (Responses) DescribePairing(v pairing.Violation, param string, _ int) string {
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
}

// HistoryUpstream implements Rules: previous_response_id.
func (Responses) HistoryUpstream(req *chat.Request) bool {
	return req.HasField("previous_response_id")
}

// SummaryFields implements Rules: max_output_tokens, tool_choice "none"
// when the request has tools (Codex's own compaction request sends
// "tools": [] — no tool_choice for an empty list), no text format,
// background or previous_response_id.
func (Responses) SummaryFields(req *chat.Request, maxTokens int, _ string) []chat.Field {
	set := append([]chat.Field{{Key: "response_format"}}, serverOutputFields...)
	set = append(set, chat.Field{Key: "stream", Value: []byte("false")}, chat.Field{Key: "max_output_tokens", Value: []byte(strconv.Itoa(maxTokens))},
		chat.Field{Key: "stream_options"}, chat.Field{Key: "text"}, chat.Field{Key: "parallel_tool_calls"},
		chat.Field{Key: "max_tool_calls"}, chat.Field{Key: "background"}, chat.Field{Key: "previous_response_id"},
		chat.Field{Key: "tool_choice"})
	if hasTools(req) {
		set[len(set)-1].Value = []byte(`"none"`)
	}
	return set
}

// SummaryRequest implements Rules: instructions and one user message
// item, not stored.
func (Responses) SummaryRequest(model, system, user string, maxTokens int, _ string) ([]byte, error) {
	return json.Marshal(map[string]any{"model": model, "instructions": system, "store": false,
		"input":             []map[string]any{{"type": "message", "role": "user", "content": user}},
		"max_output_tokens": maxTokens})
}

// SummaryText implements Rules: the output_text parts of the message
// items.
func (Responses) SummaryText(body []byte) (string, string, error) { return typedText(body, true) }

// typedText is the text of a Responses answer (responses: its message
// items' output_text parts) or a Messages answer (its text blocks).
func typedText(body []byte, responses bool) (string, string, error) {
	var out struct {
		Output []struct {
			Type    string `json:"type"`
			Content []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			} `json:"content"`
		} `json:"output"`
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
		Status     string `json:"status"`
		StopReason string `json:"stop_reason"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		return "", "", err
	}
	var sb strings.Builder
	if responses {
		for _, it := range out.Output {
			if it.Type != "message" {
				continue
			}
			for _, p := range it.Content {
				if p.Type == "output_text" {
					sb.WriteString(p.Text)
				}
			}
		}
	} else {
		for _, b := range out.Content {
			if b.Type == "text" {
				sb.WriteString(b.Text)
			}
		}
	}
	return strings.TrimSpace(sb.String()), fmt.Sprintf("status %q%s", out.Status, out.StopReason), nil
}

// hasTools: a tools list that is not empty.
func hasTools(req *chat.Request) bool {
	return req.HasField("tools") && !bytes.Equal(bytes.TrimSpace(req.FieldValue("tools")), []byte("[]"))
}

// NewStream implements Rules.
func (Responses) NewStream(bool) Stream { return &responsesStream{} }

type responsesStream struct{ done bool }

// Event implements Stream: response.completed, response.incomplete and
// response.failed carry the response object, its usage inside; the
// stream ends cleanly at response.completed or response.incomplete, or at
// the upstream's own terminal error event (response.failed, error), which
// the client gets as it came: the stream was not broken off, it ended in
// an error the upstream reported. Only an event that names one of those is
// decoded (never a text delta).
func (s *responsesStream) Event(ev []byte) Step {
	st := Step{Relay: ev}
	data := EventData(ev)
	if len(data) > 0 && bytes.Contains(data, usageKey) && bytes.Contains(data, []byte(`"response.`)) {
		var e struct {
			Response json.RawMessage `json:"response"`
		}
		if json.Unmarshal(data, &e) == nil && len(e.Response) > 0 {
			st.Usage, st.HasUsage = anchor.UsageFromJSON(e.Response)
		}
	}
	if !s.done && (bytes.Contains(data, []byte(`response.completed"`)) || bytes.Contains(data, []byte(`response.incomplete"`)) ||
		bytes.Contains(data, []byte(`response.failed"`)) || bytes.Contains(data, []byte(`"error"`))) {
		switch eventType(data) {
		case "response.completed", "response.incomplete", "response.failed", "error":
			s.done, st.Complete, st.Report = true, true, true
		}
	}
	return st
}

// MaxEarlyHold bounds the bytes HoldEarly holds before it lets the stream
// through: far above a real response.created (tens of KB), low enough
// that an endless first line pins little memory.
const MaxEarlyHold = 4 << 20

// maxFailure bounds what is read of a stream after its early failure.
const maxFailure = 1 << 20

// earlyReaderSize is the reader's buffer; a longer line is held in parts.
const earlyReaderSize = 16 << 10

// HoldEarly implements Rules: it reads the first events, up to the first
// output (the upstream has started answering) or a response.failed event.
// A response.failed before any output is returned as failure, its error
// envelope ({"error":{…}}, what overflow recovery reads), with the bytes
// read and the rest of the body (up to maxFailure) as replay; otherwise
// replay gives the events read, then the rest. A Responses upstream
// reports a context overflow either as a 400 or this way (DESIGN § Other
// APIs): holding these first events lets recovery retry before the client
// has seen a byte.
func (Responses) HoldEarly(body io.ReadCloser) (io.ReadCloser, []byte) {
	br := bufio.NewReaderSize(body, earlyReaderSize)
	var read []byte
	evStart := 0     // where the event being read starts in read
	partial := false // the last ReadSlice ended mid-line
hold:
	for len(read) < MaxEarlyHold {
		// response.created and response.in_progress carry the whole
		// response object (Codex's instructions and tools: ~20 KB), so
		// a line is held whatever its length, up to MaxEarlyHold in all.
		line, err := br.ReadSlice('\n')
		read = append(read, line...)
		if err == bufio.ErrBufferFull {
			partial = true
			continue
		}
		blank := !partial && IsBlank(line)
		partial = false
		if !blank && err == nil {
			continue
		}
		data := EventData(read[evStart:])
		evStart = len(read)
		switch t := eventType(data); {
		case t == "response.failed":
			var f struct {
				Response struct {
					Error json.RawMessage `json:"error"`
				} `json:"response"`
			}
			if json.Unmarshal(data, &f) == nil && len(f.Response.Error) > 0 && string(f.Response.Error) != "null" {
				rest, _ := io.ReadAll(io.LimitReader(br, maxFailure))
				body.Close()
				env := append(append([]byte(`{"error":`), f.Response.Error...), '}')
				return io.NopCloser(bytes.NewReader(append(read, rest...))), env
			}
		case t == "" && len(data) == 0:
		case t != "response.created" && t != "response.in_progress" && t != "response.queued":
			break hold // the answer has begun: stop holding
		}
		if err != nil {
			break
		}
	}
	return readCloser{io.MultiReader(bytes.NewReader(read), br), body}, nil
}

type readCloser struct {
	io.Reader
	io.Closer
}
