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
//
// Roles are compared exactly ("assistant", "tool", "function"); every other
// role, unknown ones included, is an ordinary message that ends a block of
// tool results. Calls and FunctionCall are only read on assistant messages.
// A Call or a tool message whose id is present but empty counts as missing.
type Message struct {
	Role          string
	Calls         []Call // assistant tool_calls; empty = none
	ToolCallID    string
	HasToolCallID bool
	FunctionCall  bool   // assistant carries a legacy function_call
	Name          string // name (legacy function results)
	// HasContent reports that an assistant message carries something besides
	// its calls that must reach the model: non-empty text, content parts, a
	// refusal. Repair removes an assistant message whose tool calls it all
	// dropped only when HasContent and FunctionCall are both false; with
	// content it keeps the message without its tool_calls. Check ignores it.
	HasContent bool
}

// Violation is one broken rule. Index is the position in the slice given to
// Check where the rule breaks (see DESIGN.md for which message that is).
type Violation struct {
	Index int
	Kind  Kind
	ID    string // the tool_call_id concerned, "" when none
	// Call is the position in Messages[Index].Calls of the call concerned
	// (unanswered, duplicate or id-less call), or -1 when the violation is
	// about the whole message.
	Call int
	// Role is the role of Messages[Index], so that Describe can name the
	// message that interleaves.
	Role string
}
