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
	for i, k := range p.trims {
		if old, ok := r.reapplied[i]; !ok || old != k {
			switch {
			case k > 0:
				r.done.add(stepTrimmed)
			case k == keepMask:
				r.done.add(stepMasked)
			default:
				r.done.add(stepDeduped)
			}
		}
	}
	out.Messages = in.Messages
	if !p.empty() {
		out.Messages, p, cur = r.check(p, cur)
	}
	out.Forwarded = cur
	out.Action = r.actions(p)
	out.Reduced, out.ResetAt = r.accounting(p)
	// Shadow reports what the decision would remove; it forwards the
	// client's view, which resets nothing.
	out.CacheReset = !r.cfg.Shadow && out.ResetAt >= 0 && out.ResetAt < r.previousLen()
	if out.CacheReset {
		out.ResetTokens = max(cur-r.est(r.prefixView(p, out.ResetAt)), 0)
	}
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
	return !r.done.has(stepDiscarded) && r.done.has(stepTrimmed|stepSummarized|stepDropped|stepPendingTaken|stepShrunk|stepDeduped|stepMasked)
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
	r.done.forget(stepTrimmed | stepSummarized | stepDropped | stepDeduped | stepMasked)
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
		action = ActionMasked
		for _, k := range p.trims {
			if k > 0 {
				action = ActionTrimmed
				break
			}
		}
	}
	if r.done.has(stepDropped) {
		r.ev.NewActions = append(r.ev.NewActions, ActionDropped)
	}
	if r.done.has(stepTrimmed | stepShrunk) {
		r.ev.NewActions = append(r.ev.NewActions, ActionTrimmed)
	}
	if r.done.has(stepDeduped | stepMasked) {
		r.ev.NewActions = append(r.ev.NewActions, ActionMasked)
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
		t := Trim{Index: i, Keep: k}
		t.Prefix = r.in.Chain[t.covers()+1]
		r.st.Trims = append(r.st.Trims, t)
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

// accounting splits what this decision removed among the ladder's steps
// (the estimate of the re-applied view less the forwarded one, each new
// kind of record added in the ladder's order) and returns the first client
// position whose forwarded bytes it changed (−1 when it changed none). It
// estimates only when something new was made.
func (r *run) accounting(p plan) (Reduction, int) {
	var red Reduction
	if !r.changed() {
		return red, -1
	}
	base := r.base
	reset := -1
	at := func(i int) {
		if reset < 0 || i < reset {
			reset = i
		}
	}
	newSum := p.sum != nil && (base.sum == nil || *p.sum != *base.sum)
	if newSum || (p.sum == nil) != (base.sum == nil) {
		at(r.lead)
	}
	for _, d := range p.drops {
		if !slices.Contains(base.drops, d) {
			at(d.From)
		}
	}
	// Add the new records of each kind in turn to the re-applied plan.
	step := base.withTrims(nil, 0)
	prev := r.est(r.view(step))
	add := func(kind func(int) bool) int {
		changed := false
		for i, k := range p.trims {
			if old, ok := base.trims[i]; (!ok || old != k) && kind(k) {
				if newSum && i < p.sum.Cut {
					continue
				}
				step.trims[i] = k
				changed = true
				at(i)
			}
		}
		if !changed {
			return 0
		}
		e := r.est(r.view(step))
		d := prev - e
		prev = e
		return max(d, 0)
	}
	red.Dedupe = add(func(k int) bool { return k < keepMask })
	red.Mask = add(func(k int) bool { return k == keepMask })
	red.Trim = add(func(k int) bool { return k > 0 })
	final := r.est(r.view(p))
	if newSum || len(p.drops) != len(base.drops) {
		q := p
		q.drops = base.drops
		if newSum {
			q.drops = nil
			for _, d := range p.drops {
				if slices.Contains(base.drops, d) || d.From >= p.sum.Cut {
					q.drops = append(q.drops, d)
				}
			}
		}
		mid := r.est(r.view(q))
		if newSum {
			red.Summarize = max(prev-mid, 0)
		}
		red.Drop = max(mid-final, 0)
	}
	return red, reset
}

// previousLen is how many client messages the previous forwarded view of
// the lineage held (Input.PreviousLen), else every message but the final
// one.
func (r *run) previousLen() int {
	if n := r.in.PreviousLen; n > 0 {
		return n
	}
	return r.n - 1
}
