package compaction

import (
	"slices"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// finish builds the forwarded view, checks it, and fills the output from
// the steps taken.
func (r *run) finish(out Output, p plan, cur int) Output {
	in := r.in
	// New trims: in the forwarded plan and not re-applied (trims of step 1
	// that a summary then replaced are not).
	for i := range p.trims {
		if _, ok := r.reapplied[i]; !ok {
			r.done.add(stepTrimmed)
			break
		}
	}
	out.Messages = in.Messages
	if !p.empty() {
		out.Messages, p, cur = r.check(p, cur)
	}
	out.Forwarded = cur
	out.Action = r.actions(p)
	if r.changed() && r.chain {
		r.store(p)
	}
	out.State = r.st
	out.StateChanged = !stateEqual(in.State, r.st)
	out.Events = r.ev
	out.Need = r.need

	if r.cfg.Shadow {
		// Decide and report, forward the client's view, store nothing.
		if !p.empty() {
			out.Forwarded = r.est(in.Messages)
		}
		out.Messages = in.Messages
		out.State, out.StateChanged = in.State, false
	}
	return out
}

// changed tells whether this run made compaction records to store.
func (r *run) changed() bool {
	return !r.done.has(stepDiscarded) && r.done.has(stepTrimmed|stepSummarized|stepDropped|stepPendingTaken|stepShrunk)
}

// check renders p and asserts the invariant: every produced view must pass
// the strict pairing check (or, when the client's own view does not —
// pairing off — add nothing). It returns the view to forward, the plan it
// renders and its estimate: the client's view, no plan and its estimate
// when p's view fails.
func (r *run) check(p plan, cur int) ([]chat.Message, plan, int) {
	view := r.view(p)
	if r.corrupt != nil {
		view = r.corrupt(view)
	}
	if v := violations(view); v == 0 || v <= violations(r.in.Messages) {
		return view, p, cur
	}
	r.ev.InvariantFailure = true
	// Keep the summarize bookkeeping (latch, throttle) so a broken view
	// does not cause a summarize per step; forget the stored records if
	// they alone already produce a broken view.
	if !r.changed() || violations(r.view(r.reapply())) > 0 {
		r.st.Summary, r.st.Trims, r.st.Drops = nil, nil, nil
	}
	r.done.forget(stepTrimmed | stepSummarized | stepDropped)
	r.done.add(stepDiscarded)
	return r.in.Messages, plan{}, r.est(r.in.Messages)
}

// actions is the action the forwarded view (plan p) carries, and notes the
// new ones in the events.
func (r *run) actions(p plan) Action {
	action := ActionNone
	switch {
	case p.sum != nil && r.done.has(stepSummarized) && !r.done.has(stepPendingTaken):
		action = ActionSummarized
		r.ev.NewActions = append(r.ev.NewActions, ActionSummarized)
	case p.sum != nil:
		action = ActionReused
		r.ev.NewActions = append(r.ev.NewActions, ActionReused)
	case len(p.drops) > 0:
		action = ActionDropped
	case len(p.trims) > 0:
		action = ActionTrimmed
	}
	if r.done.has(stepDropped) {
		r.ev.NewActions = append(r.ev.NewActions, ActionDropped)
	}
	if r.done.has(stepTrimmed | stepShrunk) {
		r.ev.NewActions = append(r.ev.NewActions, ActionTrimmed)
	}
	if r.done.has(stepDue) {
		action = ActionSummarizePending
	}
	return action
}

// store replaces the state's compaction records with p's.
func (r *run) store(p plan) {
	r.st.Summary = p.sum
	r.st.Drops = slices.Clone(p.drops)
	r.st.Trims = r.st.Trims[:0:0]
	for i, k := range p.trims {
		r.st.Trims = append(r.st.Trims, Trim{Index: i, Prefix: r.in.Chain[i+1], Keep: k})
	}
	slices.SortFunc(r.st.Trims, func(a, b Trim) int { return a.Index - b.Index })
}

// stateEqual compares two states (anchors included).
func stateEqual(a, b State) bool {
	if a.Latched != b.Latched || a.LatchCount != b.LatchCount ||
		!a.LastAttempt.Equal(b.LastAttempt) || a.LastAttemptCount != b.LastAttemptCount ||
		!slices.Equal(a.Anchors, b.Anchors) || !slices.Equal(a.Trims, b.Trims) ||
		!slices.Equal(a.Drops, b.Drops) {
		return false
	}
	if (a.Summary == nil) != (b.Summary == nil) || (a.Summary != nil && *a.Summary != *b.Summary) {
		return false
	}
	if (a.Pending == nil) != (b.Pending == nil) || (a.Pending != nil && *a.Pending != *b.Pending) {
		return false
	}
	return true
}
