package llama

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
)

// The late-compaction reference is the cache figure of a proxy that
// compacts as seldom as the rules every compaction keeps allow, computed on
// the same client steps with llama-server's own tokens:
//
//   - it compacts only when the client's view, appended to what it forwarded
//     last, would be over the budget (window − a quarter of it: the reserve
//     at these windows), never at a trigger below it;
//   - a compaction keeps DESIGN's floor and nothing more: the last keep_tail
//     (3) messages, walked back while the message at the cut is a tool
//     result, with no tail extension (and only the final turn when the
//     floor does not fit, as compactproxy folds rather than drops); before
//     it the system prompt, a summary of the run's summary length opened by
//     compactproxy's label, the acknowledgement when the next message is a
//     user message, and the latest text-only user instruction when it lies
//     in the folded head;
//   - llama-server serves from its cache the longest common token prefix of
//     a prompt and the one before it.
//
// It is a reference, not a proof: compacting at a trigger below the budget
// gives a smaller view now and then, which can serve a slightly larger share
// (at Qwen2.5 2k compactproxy passes it by 0.01). Where the reference itself
// is under the 0.8 goal, that is the price of keeping the floor, folding
// what leaves the view into a summary and never dropping, at this window.

// floorKeep is DESIGN's compaction.keep_tail default.
const floorKeep = 3

// floorStart is where the floor of msgs begins.
func floorStart(msgs []message) int {
	c := max(len(msgs)-floorKeep, 1)
	for c > 1 && msgs[c].Role == "tool" {
		c--
	}
	return c
}

// finalTurn is where the final turn of msgs begins: its last assistant
// message with tool calls, when only tool results follow it.
func finalTurn(msgs []message) int {
	i := len(msgs) - 1
	for i > 1 && msgs[i].Role == "tool" {
		i--
	}
	return i
}

// latestText is the index of the newest text-only user message (-1: none).
func latestText(msgs []message) int {
	for i := len(msgs) - 1; i >= 1; i-- {
		if msgs[i].Role == "user" {
			if _, ok := msgs[i].Content.(string); ok {
				return i
			}
		}
	}
	return -1
}

// referenceView is the reference's view after folding msgs[1:cut) into a summary,
// with msgs[pin] after it when pin > 0 (the latest instruction, when the
// compaction found it in the folded head; re-applied as it was until the
// next compaction, as compactproxy re-applies its records).
func referenceView(msgs []message, cut, pin int, summary string) []message {
	view := []message{msgs[0], {Role: "user", Content: summary}}
	next := msgs[cut]
	if pin > 0 {
		next = msgs[pin]
	}
	if next.Role == "user" {
		view = append(view, message{Role: "assistant", Content: "Understood."})
	}
	if pin > 0 {
		view = append(view, msgs[pin])
	}
	return append(view, msgs[cut:]...)
}

// lateReference computes f.cacheLateReference over the steps that ran.
// (The previous answer's own tokens are not part of a common prefix: the
// client sends back its own assistant message.)
func (f *figures) lateReference(t *testing.T, ls *llamaServer, cs []clientStep, tools []json.RawMessage, final []message) {
	t.Helper()
	tokens := func(msgs []message) ([]json.RawMessage, bool) {
		toks, err := ls.promptTokens(requestBody(f.cfg.model(), msgs, tools, requestShape{}))
		if err != nil {
			t.Logf("late-compaction reference: counting a view of %d messages: %v", len(msgs), err)
			return nil, false
		}
		return toks, true
	}
	// A summary text of the run's summary length in this tokenizer's
	// tokens, after compactproxy's label (the same at every compaction, so
	// the cache serves it), opened by a number so that each compaction's
	// text differs from the one before from there on.
	const word = "story "
	n100, err := ls.countText(strings.Repeat(word, 100))
	if err != nil || n100 == 0 {
		t.Logf("late-compaction reference: counting a summary text: %v", err)
		return
	}
	reps := max(int(float64(summaryTokens(f.cfg.ctx))*100/float64(n100)+0.5), 1)
	summary := func(k int) string { return summaryLabel + strconv.Itoa(k) + " " + strings.Repeat(word, reps) }
	budget := f.cfg.budget()

	cut, pin, k := 0, 0, 0 // cut 0: nothing folded yet; k: compactions so far
	var prev []json.RawMessage
	prompts, cached := 0, 0
	for i, st := range cs {
		if i >= len(f.rows) {
			break
		}
		msgs := final[:st.clientMsgs]
		view := msgs
		if cut > 0 {
			view = referenceView(msgs, cut, pin, summary(k))
		}
		toks, ok := tokens(view)
		if !ok {
			return
		}
		if len(toks) > budget && len(msgs) > floorKeep+1 {
			cut, pin, k = floorStart(msgs), 0, k+1
			if l := latestText(msgs); l >= 1 && l < cut {
				pin = l
			}
			if toks, ok = tokens(referenceView(msgs, cut, pin, summary(k))); !ok {
				return
			}
			if ft := finalTurn(msgs); len(toks) > budget && ft > cut {
				// The floor does not fit: fold all but the final turn, as
				// compactproxy does rather than drop (docs/design-notes.md,
				// "Departures from DESIGN").
				cut, pin = ft, 0
				if l := latestText(msgs); l >= 1 && l < cut {
					pin = l
				}
				if toks, ok = tokens(referenceView(msgs, cut, pin, summary(k))); !ok {
					return
				}
			}
		}
		if i > 0 {
			prompts += len(toks)
			cached += commonPrefix(toks, prev)
		}
		prev = toks
	}
	if prompts > 0 {
		f.cacheLateReference = float64(cached) / float64(prompts)
	}
}

func commonPrefix(a, b []json.RawMessage) int {
	n := 0
	for n < len(a) && n < len(b) && string(a[n]) == string(b[n]) {
		n++
	}
	return n
}
