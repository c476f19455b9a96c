package pairing

import "slices"

// Removal is one thing Repair took out of the conversation.
type Removal struct {
	Index int    // position of the message in Repair's input
	Call  int    // position in that message's Calls, or -1: the whole message
	Kind  Kind   // the rule that made it go
	ID    string // the tool_call_id concerned, "" when none
}

// Repair returns msgs without what breaks pairing, and what it removed,
// ordered by Index, then Call (-1 first). Its output always passes Check; it
// removes nothing (and returns msgs itself) exactly when Check(msgs) is nil.
//
// It removes:
//   - tool messages without a tool_call_id, orphan answers, second answers;
//   - calls without an id, second uses of an id (the first is kept), and calls
//     not answered by the tool messages directly after their assistant
//     message;
//   - interleaving: the break ends the turn, so the calls still waiting then
//     are dropped and their late answers are removed too (both recorded as
//     interleaved_message). The message that interleaves stays: Repair never
//     moves messages and never removes anything but tool, function and
//     assistant messages (user, system, developer and unknown roles stay);
//   - role "function" messages that do not directly follow an assistant
//     message with a function_call;
//   - an assistant message whose calls were all dropped, only when it has no
//     content (HasContent) and no function_call; its entry (Call -1) repeats
//     the Kind and ID of its first removed call, and its calls are listed too.
//
// Unlike Check, Repair judges a call id against what it keeps: an id whose
// earlier call was dropped (never answered in place) may be used again by a
// later call, which is then kept if answered.
//
// The returned messages share Calls slices with msgs except for assistant
// messages that lost calls, which get a new slice; msgs is not modified.
func Repair(msgs []Message) (out []Message, removed []Removal) {
	r := repairer{msgs: msgs, turn: -1}
	if n := countCalls(msgs); n > 0 {
		r.seen = make(map[string]repairState, n)
	}
	for i := range msgs {
		m := &msgs[i]
		switch {
		case m.Role == roleAssistant && len(m.Calls) > 0:
			r.finish()
			r.openTurn(i)
		case m.Role == roleTool:
			r.tool(i)
		case m.Role == roleFunction && !followsFunctionCall(msgs, i):
			// Gone from the output, so it does not end the turn either.
			r.remove(Removal{Index: i, Call: -1, Kind: OrphanFunctionResult})
		default:
			r.finish()
		}
	}
	r.finish()
	if len(r.out) == 0 {
		return msgs, nil
	}
	slices.SortStableFunc(r.out, func(a, b Removal) int {
		if a.Index != b.Index {
			return a.Index - b.Index
		}
		return a.Call - b.Call
	})
	// A whole-assistant entry sorts right before its calls' entries; give it
	// their first reason (late answers may have changed it after the fact).
	for k := range r.out {
		if e := &r.out[k]; e.Call == -1 && msgs[e.Index].Role == roleAssistant && k+1 < len(r.out) && r.out[k+1].Index == e.Index {
			e.Kind, e.ID = r.out[k+1].Kind, r.out[k+1].ID
		}
	}
	return apply(msgs, r.out), r.out
}

// States of a call id in Repair.
const (
	statePending  = iota // call kept so far, waiting for its answer
	stateAnswered        // call and its answer kept
	stateDropped         // call dropped; the id is free again
	stateLate            // call dropped and its late answer removed; the id is free again
)

type repairState struct {
	turn, call int
	state      int
	removal    int // index in repairer.out of the call's removal, when dropped
}

type repairer struct {
	msgs []Message
	seen map[string]repairState // the kept (or last dropped) call of each id
	out  []Removal

	turn     int  // assistant message whose calls are being answered, -1 = none
	kept     int  // calls of turn answered in place
	finished bool // turn ended: its unanswered calls are dropped
}

func (r *repairer) remove(e Removal) { r.out = append(r.out, e) }

func (r *repairer) openTurn(i int) {
	r.turn, r.kept, r.finished = i, 0, false
	for j, call := range r.msgs[i].Calls {
		if !call.HasID || call.ID == "" {
			r.remove(Removal{Index: i, Call: j, Kind: MissingToolCallID})
			continue
		}
		if st, ok := r.seen[call.ID]; ok && (st.state == statePending || st.state == stateAnswered) {
			r.remove(Removal{Index: i, Call: j, Kind: DuplicateToolCallID, ID: call.ID})
			continue
		}
		r.seen[call.ID] = repairState{turn: i, call: j, state: statePending}
	}
}

// finish ends the open turn once: calls not answered yet are dropped, and the
// assistant message goes too when nothing of it is left.
func (r *repairer) finish() {
	if r.turn < 0 || r.finished {
		return
	}
	r.finished = true
	a := &r.msgs[r.turn]
	for j, call := range a.Calls {
		if !call.HasID || call.ID == "" {
			continue
		}
		st := r.seen[call.ID]
		if st.turn == r.turn && st.call == j && st.state == statePending {
			st.state, st.removal = stateDropped, len(r.out)
			r.seen[call.ID] = st
			r.remove(Removal{Index: r.turn, Call: j, Kind: UnansweredToolCall, ID: call.ID})
		}
	}
	if r.kept == 0 && !a.HasContent && !a.FunctionCall {
		r.remove(Removal{Index: r.turn, Call: -1}) // Kind and ID filled in by Repair
	}
}

func (r *repairer) tool(i int) {
	m := &r.msgs[i]
	if !m.HasToolCallID || m.ToolCallID == "" {
		r.remove(Removal{Index: i, Call: -1, Kind: MissingToolCallID})
		return
	}
	id := m.ToolCallID
	st, ok := r.seen[id]
	switch {
	case ok && st.turn == r.turn && st.state == statePending:
		// finish drops every pending call, so pending means "in place".
		st.state = stateAnswered
		r.seen[id] = st
		r.kept++
	case ok && st.turn == r.turn && st.state == stateDropped:
		st.state = stateLate
		r.seen[id] = st
		r.out[st.removal].Kind = InterleavedMessage
		r.remove(Removal{Index: i, Call: -1, Kind: InterleavedMessage, ID: id})
	case ok && (st.state == stateAnswered || st.state == stateLate):
		r.remove(Removal{Index: i, Call: -1, Kind: DuplicateToolCallID, ID: id})
	default:
		r.remove(Removal{Index: i, Call: -1, Kind: OrphanToolResult, ID: id})
	}
}

// apply builds the output from the sorted removals.
func apply(msgs []Message, removed []Removal) []Message {
	whole := 0
	for _, e := range removed {
		if e.Call == -1 {
			whole++
		}
	}
	out := make([]Message, 0, len(msgs)-whole)
	k := 0
	for i := range msgs {
		if k < len(removed) && removed[k].Index == i && removed[k].Call == -1 {
			for k < len(removed) && removed[k].Index == i {
				k++
			}
			continue
		}
		m := msgs[i]
		if k < len(removed) && removed[k].Index == i {
			calls := make([]Call, 0, len(m.Calls))
			for j, c := range m.Calls {
				if k < len(removed) && removed[k].Index == i && removed[k].Call == j {
					k++
					continue
				}
				calls = append(calls, c)
			}
			m.Calls = calls
		}
		out = append(out, m)
	}
	return out
}
