package pairing

import "slices"

// Roles pairing treats specially. Every other role is an ordinary message.
const (
	roleAssistant = "assistant"
	roleTool      = "tool"
	roleFunction  = "function"
)

// Check returns every pairing violation in msgs, ordered by Index, then Call
// (-1, the whole message, first), then kind (see kindRank). The first one is
// what a strict proxy reports. A valid conversation returns nil.
//
// The rules, as one walk over the messages:
//
//   - An assistant message with a non-empty Calls opens a turn. Each call
//     needs an id (else missing_tool_call_id at the assistant) that no
//     earlier call used (else duplicate_tool_call_id at the second use; the
//     duplicate call expects no answer of its own).
//   - A tool message needs a tool_call_id (else missing_tool_call_id). It
//     answers a call of the open turn, i.e. of the closest preceding
//     assistant message with calls; an id already answered is
//     duplicate_tool_call_id at the second answer; anything else (no turn, an
//     unknown id, the id of an older turn) is orphan_tool_result.
//   - The answers must come directly after the turn's assistant message. The
//     first other message (user, system, developer, an assistant without
//     calls, function, unknown roles) that arrives while calls are still
//     unanswered breaks the turn. If a call is answered after the break, that
//     message is reported once as interleaved_message (ID = the first late
//     answer); the late answers themselves are not reported again, since
//     "move this message" is the one fix. Calls never answered at all are
//     unanswered_tool_call at the assistant message (this includes a request
//     that ends on unanswered calls).
//   - A role "function" message must directly follow an assistant message
//     with a function_call, else orphan_function_result. It is an ordinary
//     message for the tool-call rules.
//
// Check runs in O(len(msgs) + calls) time with one map sized to the number
// of calls; a conversation without calls allocates nothing.
func Check(msgs []Message) []Violation {
	c := checker{msgs: msgs, turn: -1, brokenAt: -1}
	if n := countCalls(msgs); n > 0 {
		c.seen = make(map[string]int32, n)
		c.calls = make([]callState, 0, n)
	}
	for i := range msgs {
		m := &msgs[i]
		switch {
		case m.Role == roleAssistant && len(m.Calls) > 0:
			c.closeTurn()
			c.openTurn(i)
		case m.Role == roleTool:
			c.tool(i)
		default:
			if m.Role == roleFunction && !followsFunctionCall(msgs, i) {
				c.add(Violation{Index: i, Kind: OrphanFunctionResult, Call: -1, Role: m.Role})
			}
			if c.pending > 0 && c.brokenAt < 0 {
				c.brokenAt = i
			}
		}
	}
	c.closeTurn()
	if !slices.IsSortedFunc(c.out, compareViolations) {
		// Only unanswered (found when a turn closes) and interleaved (found
		// at the late answer) violations can arrive out of order.
		slices.SortStableFunc(c.out, compareViolations)
	}
	return c.out
}

// callState is what Check remembers about the first call that used an id.
// The map holds an index into checker.calls rather than the state itself:
// smaller map slots, and answering a call updates the slice in place instead
// of writing the map again.
// int32 is ample: a body within limits.max_body_bytes holds far fewer than
// 2^31 messages.
type callState struct {
	turn     int32 // index of the assistant message holding the call
	call     int32 // position in its Calls
	answered bool
}

type checker struct {
	msgs  []Message
	seen  map[string]int32 // first use of each call id -> index in calls
	calls []callState
	out   []Violation

	turn         int // assistant message whose calls are being answered, -1 = none
	pending      int // calls of turn not answered yet
	brokenAt     int // first ordinary message after turn while calls were pending, -1 = none
	lateReported bool
}

func (c *checker) add(v Violation) { c.out = append(c.out, v) }

func (c *checker) openTurn(i int) {
	c.turn, c.pending, c.brokenAt, c.lateReported = i, 0, -1, false
	for j, call := range c.msgs[i].Calls {
		switch {
		case !call.HasID || call.ID == "":
			c.add(Violation{Index: i, Kind: MissingToolCallID, Call: j, Role: roleAssistant})
		case c.known(call.ID):
			c.add(Violation{Index: i, Kind: DuplicateToolCallID, ID: call.ID, Call: j, Role: roleAssistant})
		default:
			c.seen[call.ID] = int32(len(c.calls))
			c.calls = append(c.calls, callState{turn: int32(i), call: int32(j)})
			c.pending++
		}
	}
}

func (c *checker) known(id string) bool {
	_, ok := c.seen[id]
	return ok
}

// closeTurn reports the calls of the open turn that nothing answered.
func (c *checker) closeTurn() {
	if c.turn < 0 || c.pending == 0 {
		return
	}
	for j, call := range c.msgs[c.turn].Calls {
		if !call.HasID || call.ID == "" {
			continue
		}
		st := c.calls[c.seen[call.ID]]
		if int(st.turn) == c.turn && int(st.call) == j && !st.answered {
			c.add(Violation{Index: c.turn, Kind: UnansweredToolCall, ID: call.ID, Call: j, Role: roleAssistant})
		}
	}
	c.pending = 0
}

func (c *checker) tool(i int) {
	m := &c.msgs[i]
	if !m.HasToolCallID || m.ToolCallID == "" {
		c.add(Violation{Index: i, Kind: MissingToolCallID, Call: -1, Role: roleTool})
		return
	}
	id := m.ToolCallID
	k, ok := c.seen[id]
	var st *callState
	if ok {
		st = &c.calls[k]
	}
	switch {
	case ok && st.answered:
		c.add(Violation{Index: i, Kind: DuplicateToolCallID, ID: id, Call: -1, Role: roleTool})
	case ok && int(st.turn) == c.turn:
		st.answered = true
		c.pending--
		if c.brokenAt >= 0 && !c.lateReported {
			c.lateReported = true
			c.add(Violation{Index: c.brokenAt, Kind: InterleavedMessage, ID: id, Call: -1, Role: c.msgs[c.brokenAt].Role})
		}
	default:
		c.add(Violation{Index: i, Kind: OrphanToolResult, ID: id, Call: -1, Role: roleTool})
	}
}

// followsFunctionCall reports whether msgs[i] directly follows an assistant
// message carrying a legacy function_call.
func followsFunctionCall(msgs []Message, i int) bool {
	return i > 0 && msgs[i-1].Role == roleAssistant && msgs[i-1].FunctionCall
}

func countCalls(msgs []Message) int {
	n := 0
	for i := range msgs {
		if msgs[i].Role == roleAssistant {
			n += len(msgs[i].Calls)
		}
	}
	return n
}

// compareViolations orders violations by message, then call (-1 first), then
// kind, so that Check's order is fully defined whatever the walk found first.
func compareViolations(a, b Violation) int {
	if a.Index != b.Index {
		return a.Index - b.Index
	}
	if a.Call != b.Call {
		return a.Call - b.Call
	}
	return kindRank(a.Kind) - kindRank(b.Kind)
}

// kindRank breaks the one tie that can occur (a role "function" message that
// is both an orphan and the message interleaving a turn): the message's own
// fault comes first.
func kindRank(k Kind) int {
	if k == InterleavedMessage {
		return 1
	}
	return 0
}
