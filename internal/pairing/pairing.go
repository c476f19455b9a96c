// Package pairing validates and repairs tool-call pairing in a chat
// conversation, in OpenAI's terms (see DESIGN.md § Pairing). It is pure logic:
// standard library only.
package pairing

// Kind names a pairing rule that was broken. The values are part of the
// external contract (metric label and error text).
type Kind string

// The violation kinds.
const (
	OrphanToolResult     Kind = "orphan_tool_result"
	UnansweredToolCall   Kind = "unanswered_tool_call"
	DuplicateToolCallID  Kind = "duplicate_tool_call_id"
	InterleavedMessage   Kind = "interleaved_message"
	MissingToolCallID    Kind = "missing_tool_call_id"
	OrphanFunctionResult Kind = "orphan_function_result"
)

// Kinds lists every kind, for pre-registering metric labels.
var Kinds = []Kind{OrphanToolResult, UnansweredToolCall, DuplicateToolCallID, InterleavedMessage, MissingToolCallID, OrphanFunctionResult}

// Call is one entry of an assistant message's tool_calls.
type Call struct {
	ID    string
	HasID bool
	Name  string
}

// Message is the minimal view pairing needs of one provider-visible message.
type Message struct {
	Role          string
	Calls         []Call // assistant tool_calls; empty = none
	ToolCallID    string
	HasToolCallID bool
	FunctionCall  bool   // assistant carries a legacy function_call
	Name          string // name (legacy function results)
}

// Violation is one broken rule. Index is the position in the slice given to
// Check where the rule breaks (see DESIGN.md for which message that is).
type Violation struct {
	Index int
	Kind  Kind
	ID    string // the tool_call_id concerned, "" when none
}
