package wire

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// ResponsesAPI is POST /v1/responses.
var ResponsesAPI = &API{Dialect: chat.DialectResponses, Route: "/v1/responses",
	UpstreamPath: "responses", HistoryKey: "input", Rules: Responses{}}

// Responses is OpenAI's Responses API (POST /v1/responses; Codex CLI, the
// Agents SDK): OpenAI's error envelope; typed events, the answer complete
// at response.completed or response.incomplete, whose response object
// carries the usage; an overflow may come as response.failed before any
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

// hasTools: a tools list that is not empty.
func hasTools(req *chat.Request) bool {
	return req.HasField("tools") && !bytes.Equal(bytes.TrimSpace(req.FieldValue("tools")), []byte("[]"))
}

// NewStream implements Rules.
func (Responses) NewStream(bool) Stream { return &responsesStream{} }

type responsesStream struct{ done bool }

// Event implements Stream: response.completed, response.incomplete and
// response.failed carry the response object, its usage inside; the
// answer is complete at response.completed or response.incomplete. Only
// an event that names one of those is decoded (never a text delta).
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
	if !s.done && (bytes.Contains(data, []byte(`response.completed"`)) || bytes.Contains(data, []byte(`response.incomplete"`))) {
		if t := eventType(data); t == "response.completed" || t == "response.incomplete" {
			s.done, st.Complete, st.Report = true, true, true
		}
	}
	return st
}

// maxEarly bounds what HoldEarly reads before it lets the answer through.
const maxEarly = 1 << 20

// HoldEarly implements Rules: it reads the first events, up to the first
// output (the upstream has started answering) or a response.failed event.
// A response.failed before any output is returned as failure, its error
// envelope ({"error":{…}}, what overflow recovery reads), with the bytes
// read and the rest of the body (up to maxEarly) as replay; otherwise
// replay gives the events read, then the rest. A Responses upstream
// reports a context overflow either as a 400 or this way (DESIGN § Other
// APIs): holding these first events lets recovery retry before the client
// has seen a byte.
func (Responses) HoldEarly(body io.ReadCloser) (io.ReadCloser, []byte) {
	br := bufio.NewReaderSize(body, 4096)
	var read []byte
	var ev []byte
	for len(read) < maxEarly {
		line, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// A long line: the answer has begun (no failure event is this
			// long).
			read = append(read, line...)
			break
		}
		read = append(read, line...)
		ev = append(ev, line...)
		if IsBlank(line) || err != nil {
			data := EventData(ev)
			ev = ev[:0]
			switch t := eventType(data); {
			case t == "response.failed":
				var f struct {
					Response struct {
						Error json.RawMessage `json:"error"`
					} `json:"response"`
				}
				if json.Unmarshal(data, &f) == nil && len(f.Response.Error) > 0 && string(f.Response.Error) != "null" {
					rest, _ := io.ReadAll(io.LimitReader(br, maxEarly))
					body.Close()
					env := append(append([]byte(`{"error":`), f.Response.Error...), '}')
					return io.NopCloser(bytes.NewReader(append(read, rest...))), env
				}
			case t == "" && len(data) == 0:
			case t != "response.created" && t != "response.in_progress" && t != "response.queued":
				err = io.EOF // the answer has begun: stop holding
			}
			if err != nil {
				break
			}
		}
	}
	return readCloser{io.MultiReader(bytes.NewReader(read), br), body}, nil
}

type readCloser struct {
	io.Reader
	io.Closer
}
