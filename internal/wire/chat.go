package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// ChatCompletions is POST /v1/chat/completions.
var ChatCompletions = &API{Dialect: chat.DialectChat, Route: "/v1/chat/completions",
	UpstreamPath: "chat/completions", HistoryKey: "messages", Rules: Chat{}}

// Chat is OpenAI's chat completions (POST /v1/chat/completions), the API
// llama.cpp, vLLM and most gateways speak: OpenAI's error envelope;
// streams of data-only events ending with [DONE] or a chunk with a finish
// reason; usage in a chunk (OpenAI's usage, llama.cpp's timings), asked
// for with stream_options.include_usage.
type Chat struct{ defaults }

// StreamError implements Rules: a data-only chunk carrying OpenAI's error
// object.
func (Chat) StreamError(code, msg string) []byte {
	body, _ := json.Marshal(struct {
		Error openAIError `json:"error"`
	}{openAIError{Message: msg, Type: "upstream_error", Code: &code}})
	return sseEvent("", body)
}

// PairingParam implements Rules: messages[N].
func (Chat) PairingParam(_ *chat.Request, clientIndex int) string {
	return fmt.Sprintf("messages[%d]", clientIndex)
}

// DescribePairing implements Rules: pairing's own words for messages.
func (Chat) DescribePairing(v pairing.Violation, _ string, clientIndex int) string {
	return v.Describe(clientIndex)
}

// UsageOption implements Rules: stream_options.include_usage on a stream
// whose client did not ask for it.
func (Chat) UsageOption(req *chat.Request) (chat.Field, bool) {
	if !req.Stream || req.IncludeUsage {
		return chat.Field{}, false
	}
	return chat.Field{Key: "stream_options", Value: streamOptions(req)}, true
}

// streamOptions returns the client's stream_options with include_usage set.
func streamOptions(req *chat.Request) []byte {
	for _, f := range req.Fields {
		if f.Key != "stream_options" {
			continue
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(f.Value, &m) == nil && m != nil {
			m["include_usage"] = json.RawMessage("true")
			if b, err := json.Marshal(m); err == nil {
				return b
			}
		}
	}
	return []byte(`{"include_usage":true}`)
}

// RefusesUsageOption implements Rules: a 400 or 422 that names
// stream_options.
func (Chat) RefusesUsageOption(status int, body []byte) bool {
	return (status == 400 || status == 422) && bytes.Contains(body, []byte("stream_options"))
}

// SummaryFields implements Rules: max_completion_tokens for dialect openai,
// max_tokens otherwise (the other removed); tool_choice "none" when the
// request has tools.
func (Chat) SummaryFields(req *chat.Request, maxTokens int, dialect string) []chat.Field {
	maxKey, otherKey := "max_tokens", "max_completion_tokens"
	if dialect == "openai" {
		maxKey, otherKey = otherKey, maxKey
	}
	set := []chat.Field{
		{Key: "stream", Value: []byte("false")},
		{Key: maxKey, Value: []byte(strconv.Itoa(maxTokens))},
		{Key: otherKey}, {Key: "stream_options"}, {Key: "n"}, {Key: "response_format"},
		{Key: "stop"}, {Key: "logprobs"}, {Key: "top_logprobs"}, {Key: "prediction"},
		{Key: "parallel_tool_calls"},
		{Key: "tool_choice"},
	}
	for _, f := range req.Fields {
		if f.Key == "tools" { // even "tools": null or []
			set[len(set)-1].Value = []byte(`"none"`)
			break
		}
	}
	return append(set, serverOutputFields...)
}

// SummaryRequest implements Rules: a system and a user message, the limit
// under SummaryFields' name for it; "stream": false.
func (Chat) SummaryRequest(model, system, user string, maxTokens int, dialect string) ([]byte, error) {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content,omitempty"`
	}
	req := struct {
		Model               string    `json:"model"`
		Messages            []message `json:"messages"`
		MaxTokens           int       `json:"max_tokens,omitempty"`
		MaxCompletionTokens int       `json:"max_completion_tokens,omitempty"`
		Stream              bool      `json:"stream"`
	}{Model: model, Messages: []message{{"system", system}, {"user", user}}}
	if dialect == "openai" {
		req.MaxCompletionTokens = maxTokens
	} else {
		req.MaxTokens = maxTokens
	}
	return json.Marshal(req)
}

// SummaryText implements Rules: the first choice's message content (a
// string; content parts are no summary).
func (Chat) SummaryText(body []byte) (string, string, error) {
	var out struct {
		Choices []struct {
			Message struct {
				Content json.RawMessage `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		return "", "", err
	}
	if len(out.Choices) == 0 {
		return "", "", errors.New("no choices")
	}
	var text string
	if c := bytes.TrimSpace(out.Choices[0].Message.Content); len(c) > 0 && c[0] != '[' && !bytes.Equal(c, []byte("null")) {
		if err := json.Unmarshal(c, &text); err != nil {
			return "", "", err // neither text nor content parts
		}
	}
	return strings.TrimSpace(text), fmt.Sprintf("finish_reason %q", out.Choices[0].FinishReason), nil
}

// serverOutputFields are servers' own length and format options, removed
// from every summarize request: they win over its token limit
// (llama-server reads n_predict first: a client's n_predict 16 for its
// answers cut the summary to 16 tokens), and a grammar would force its
// format on the summary.
var serverOutputFields = []chat.Field{{Key: "n_predict"}, {Key: "ignore_eos"}, {Key: "min_tokens"},
	{Key: "grammar"}, {Key: "json_schema"}, {Key: "guided_json"}, {Key: "guided_regex"},
	{Key: "guided_choice"}, {Key: "guided_grammar"}}

// NewStream implements Rules.
func (Chat) NewStream(hideUsage bool) Stream { return &chatStream{hideUsage: hideUsage} }

// chatStream reads a chat completions stream.
type chatStream struct{ hideUsage bool }

var (
	doneData         = []byte("[DONE]")
	timingsKey       = []byte(`"timings"`)
	finishReasonKey  = []byte(`"finish_reason"`)
	finishReasonNull = []byte(`"finish_reason":null`)
)

// Event implements Stream: usage from a chunk's usage or timings; [DONE]
// ends the stream (the usage is reported before it), a finish reason
// completes the answer (llama.cpp and some gateways end there). With
// hideUsage, the usage-only chunk is dropped and a usage member on a
// content chunk cut.
func (s *chatStream) Event(ev []byte) Step {
	st := Step{Relay: ev}
	data := EventData(ev)
	switch {
	case bytes.Equal(data, doneData):
		st.Complete, st.Report = true, true
	case len(data) > 0 && (bytes.Contains(data, usageKey) || bytes.Contains(data, timingsKey)):
		st.Usage, st.HasUsage = anchor.UsageFromJSON(data)
		if s.hideUsage && usageOnly(data) {
			st.Relay, st.Report = nil, true
		} else if s.hideUsage && bytes.Contains(data, usageKey) {
			// Some upstreams put the usage the proxy asked for on a
			// content chunk (or "usage":null on every chunk): the client
			// did not ask for it, so the field is cut and the rest of the
			// chunk relayed.
			if cut, ok := CutTopLevelKey(data, "usage"); ok {
				st.Relay = rebuildEvent(ev, cut)
			}
		}
	}
	if !st.Complete && bytes.Contains(data, finishReasonKey) && finished(data) {
		st.Complete = true
	}
	return st
}

// usageOnly reports whether a chunk is the usage-only chunk that
// include_usage adds: usage with no choices (an empty array, as OpenAI
// sends it; null or no choices key at all, as some gateways do). Cut of
// its usage, such a chunk would reach the client as an empty chunk.
func usageOnly(data []byte) bool {
	var c struct {
		Choices json.RawMessage `json:"choices"`
		Usage   json.RawMessage `json:"usage"`
	}
	if json.Unmarshal(data, &c) != nil {
		return false
	}
	if len(c.Usage) == 0 || bytes.Equal(c.Usage, []byte("null")) {
		return false
	}
	choices := bytes.ReplaceAll(bytes.TrimSpace(c.Choices), []byte(" "), nil)
	return len(choices) == 0 || bytes.Equal(choices, []byte("null")) || bytes.Equal(choices, []byte("[]"))
}

// finished reports whether a chunk carries a finish reason (a choice with a
// non-null finish_reason): the answer is complete even if no [DONE] follows.
func finished(data []byte) bool {
	// Most chunks carry "finish_reason":null: no decode for those (one
	// per streamed token).
	if bytes.Count(data, finishReasonKey) == bytes.Count(data, finishReasonNull) {
		return false
	}
	var c struct {
		Choices []struct {
			FinishReason json.RawMessage `json:"finish_reason"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &c) != nil {
		return false
	}
	for _, ch := range c.Choices {
		if len(ch.FinishReason) > 0 && !bytes.Equal(ch.FinishReason, []byte("null")) {
			return true
		}
	}
	return false
}
