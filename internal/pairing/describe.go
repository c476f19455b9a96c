package pairing

import "fmt"

// Message explains v for an agent developer, with v.Index as the message
// position. See Describe.
func (v Violation) Message() string { return v.Describe(v.Index) }

// Describe explains v, naming the message as messages[clientIndex], the rule
// (its Kind) and the tool_call_id concerned. The proxy passes the index in
// the client's own array (UI-only messages counted), which can differ from
// v.Index.
func (v Violation) Describe(clientIndex int) string {
	switch v.Kind {
	case OrphanToolResult:
		return fmt.Sprintf(`messages[%d]: role "tool" message with tool_call_id %q does not answer a tool call of the preceding assistant message (%s); every tool message must directly follow the assistant message whose tool_calls contains its id`,
			clientIndex, v.ID, v.Kind)
	case UnansweredToolCall:
		return fmt.Sprintf(`messages[%d]: tool call %q (tool_calls[%d]) of this assistant message is not answered (%s); every id in an assistant message's tool_calls must be answered by a role "tool" message directly following it, before any other message`,
			clientIndex, v.ID, v.Call, v.Kind)
	case DuplicateToolCallID:
		if v.Call >= 0 {
			return fmt.Sprintf(`messages[%d]: tool call id %q (tool_calls[%d]) is already used by an earlier tool call (%s); tool call ids must be unique in the conversation`,
				clientIndex, v.ID, v.Call, v.Kind)
		}
		return fmt.Sprintf(`messages[%d]: role "tool" message with tool_call_id %q answers a tool call that an earlier tool message already answered (%s); each tool call is answered exactly once`,
			clientIndex, v.ID, v.Kind)
	case InterleavedMessage:
		return fmt.Sprintf(`messages[%d]: role %q message comes between an assistant message's tool calls and the role "tool" message answering tool_call_id %q (%s); tool messages must directly follow the assistant message whose tool_calls they answer, with no other message in between`,
			clientIndex, v.Role, v.ID, v.Kind)
	case MissingToolCallID:
		if v.Call >= 0 {
			return fmt.Sprintf(`messages[%d]: tool_calls[%d] of this assistant message has no id (%s); every tool call needs an id for its tool message to answer`,
				clientIndex, v.Call, v.Kind)
		}
		return fmt.Sprintf(`messages[%d]: role "tool" message has no tool_call_id (%s); every tool message must name the id of the tool call it answers`,
			clientIndex, v.Kind)
	case OrphanFunctionResult:
		return fmt.Sprintf(`messages[%d]: role "function" message does not directly follow an assistant message with a function_call (%s); a legacy function result must come right after the assistant message that made the function_call`,
			clientIndex, v.Kind)
	}
	return fmt.Sprintf(`messages[%d]: tool pairing rule broken (%s), tool_call_id %q`, clientIndex, v.Kind, v.ID)
}
