// Package wire holds the rules of each API compactproxy serves, as data
// and pure functions: the error envelope, the stream's events (where usage
// and the end of an answer are, the event for a broken stream), an early
// failure inside a 200 stream, tool pairing in the API's words, the shape
// of a summarize request built from the client's own, and the upstreams'
// context-overflow answers. One file per API, declaring its API value (the
// facts as data) and its Rules type (Chat, Responses, Messages); adding an
// API is one more file and its entry in APIs.
//
// No HTTP server code: the proxy reads bytes, asks these rules what they
// mean, and writes. The rules are fuzzed without a server.
package wire

import (
	"encoding/json"
	"io"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// API is one client-facing API: what its rules state as data, and its
// Rules.
type API struct {
	// Dialect is how internal/chat parses and renders the API's bodies;
	// its String is the API's name (route label, ?dialect=).
	Dialect chat.Dialect
	// Route is the proxy's path for the API's compacted requests;
	// UpstreamPath where they go under upstream.url.
	Route, UpstreamPath string
	// HistoryKey is the body's array that holds the conversation.
	HistoryKey string
	Rules
}

// Rules are what an API does differently on the wire. An API's type
// embeds defaults for the rules it shares with most others.
type Rules interface {
	// ErrorBody is an error answer in the API's own envelope. param and
	// code may be "" (left out or null, as the API does).
	ErrorBody(status int, typ, code, param, msg string) []byte
	// StreamError is the SSE event that tells a client the upstream broke
	// off its stream (code: the failure class; msg: a fixed text).
	StreamError(code, msg string) []byte
	// PairingParam names, for an error's param, the client's item at
	// clientIndex (what a chat.Message's Index says).
	PairingParam(req *chat.Request, clientIndex int) string
	// DescribePairing is a pairing violation in the API's words; param
	// names the client's item, clientIndex its index in the client's
	// array.
	DescribePairing(v pairing.Violation, param string, clientIndex int) string
	// HistoryUpstream reports that the upstream holds the request's
	// history (a Responses previous_response_id): the body passes as it
	// came, with no pairing check, compaction or anchor.
	HistoryUpstream(req *chat.Request) bool
	// UsageOption is the field that asks req's stream for its usage
	// (chat completions' stream_options with include_usage, the client's
	// other stream options kept); false when the API reports it unasked
	// or the client asked for it itself.
	UsageOption(req *chat.Request) (chat.Field, bool)
	// RefusesUsageOption recognizes an error answer that may be the
	// upstream refusing UsageOption's field (or the client's own bad
	// value of it: only a resend without it tells which).
	RefusesUsageOption(status int, body []byte) bool
	// NewStream reads one streamed answer. hideUsage: the proxy asked
	// for the usage, so the client must not see it.
	NewStream(hideUsage bool) Stream
	// HoldEarly holds a stream's first events until the answer has begun
	// or failed (Responses: response.failed before any output). It returns
	// the body to relay (replaying what it read), and, when the stream
	// failed at once, the error envelope ({"error":{…}}) overflow recovery
	// reads. An API without early failures returns body as it is.
	HoldEarly(body io.ReadCloser) (replay io.ReadCloser, failure []byte)
	// SummaryFields are the top-level fields a summarize request written
	// as a continuation of req sets (non-nil Value) or removes (nil
	// Value): not streamed, the summary's own limit of maxTokens, no
	// tool call, no option that would shape or cut the summary. dialect
	// is upstream.dialect (its name for the token limit).
	SummaryFields(req *chat.Request, maxTokens int, dialect string) []chat.Field
	// SummaryRequest is a summarize request of the API's own shape (the
	// summarizer's transcript request): system instructions and one user
	// message, at most maxTokens. dialect as for SummaryFields.
	SummaryRequest(model, system, user string, maxTokens int, dialect string) ([]byte, error)
	// SummaryText is the text of a non-streamed answer of the API; when it
	// is empty, why says how the answer ended (its finish or stop reason).
	// err: the body is not such an answer.
	SummaryText(body []byte) (text, why string, err error)
}

// defaults are the rules most APIs share, for an API's type to embed:
// OpenAI's error envelope, internal/chat's name for an item, the history
// in the body, usage reported unasked, failures as an error status
// (nothing held).
type defaults struct{}

// ErrorBody implements Rules: OpenAI's envelope.
func (defaults) ErrorBody(_ int, typ, code, param, msg string) []byte {
	return OpenAIError(typ, code, param, msg)
}

// PairingParam implements Rules: the client's item as internal/chat names
// it (input[N], messages[N], instructions, system).
func (defaults) PairingParam(req *chat.Request, clientIndex int) string {
	return req.Param(clientIndex)
}

// HistoryUpstream implements Rules: the body carries the history.
func (defaults) HistoryUpstream(*chat.Request) bool { return false }

// UsageOption implements Rules: the stream reports its usage unasked.
func (defaults) UsageOption(*chat.Request) (chat.Field, bool) { return chat.Field{}, false }

// RefusesUsageOption implements Rules: there is no option to refuse.
func (defaults) RefusesUsageOption(int, []byte) bool { return false }

// HoldEarly implements Rules: the API fails with an error status.
func (defaults) HoldEarly(body io.ReadCloser) (io.ReadCloser, []byte) { return body, nil }

// Stream reads one upstream event stream of an API, event by event.
type Stream interface {
	// Event reads one SSE event (its lines, the blank line that ends it
	// included) and says what to do with it.
	Event(ev []byte) Step
}

// Step is what one event of a stream means.
type Step struct {
	// Relay is the event as the client gets it (ev, or rewritten); nil:
	// not relayed.
	Relay []byte
	// Usage is the usage the event reports, when HasUsage.
	Usage    anchor.Usage
	HasUsage bool
	// Report: the usage read so far is final; report it before Relay is
	// written, so the client's next request finds its anchor.
	Report bool
	// Complete: the answer is complete; the stream may end cleanly.
	Complete bool
}

// APIs lists every API (each declared in its own file), indexed by its
// chat.Dialect.
var APIs = []*API{ChatCompletions, ResponsesAPI, MessagesAPI}

// For returns the API of dialect d (chat completions for one it does not
// know).
func For(d chat.Dialect) *API {
	if int(d) < len(APIs) {
		return APIs[d]
	}
	return ChatCompletions
}

// Named returns the API called name ("chat", "responses", "messages").
func Named(name string) (*API, bool) {
	for _, a := range APIs {
		if a.Dialect.String() == name {
			return a, true
		}
	}
	return nil, false
}

// openAIError is OpenAI's error envelope body.
type openAIError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// OpenAIError is an error answer in OpenAI's envelope
// ({"error":{"message","type","param","code"}}), the proxy's own paths'
// envelope too. param and code may be "" (encoded as null, as OpenAI
// does).
func OpenAIError(typ, code, param, msg string) []byte {
	e := openAIError{Message: msg, Type: typ}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	body, _ := json.Marshal(struct {
		Error openAIError `json:"error"`
	}{e})
	return body
}

// sseEvent is one SSE event: an optional event: line, the data line and
// the blank line.
func sseEvent(name string, data []byte) []byte {
	var out []byte
	if name != "" {
		out = append(append(append(out, "event: "...), name...), '\n')
	}
	return append(append(append(out, "data: "...), data...), '\n', '\n')
}
