package compaction

import (
	"slices"
)

// finish builds the forwarded view, checks it, and fills the output.
func (r *run) finish(out Output, p plan, cur int) Output {
	cfg := r.cfg
	in := r.in
	// New trims: in the forwarded plan and not re-applied (trims of step 1
	// that a summary then replaced are not).
	for i := range p.trims {
		if _, ok := r.reapplied[i]; !ok {
			r.newTrims = true
			break
		}
	}
	fresh := r.newTrims || r.newSum || r.newDrop || r.usedPending || r.shrunk

	out.Messages = in.Messages
	if !p.empty() {
		out.Messages = r.view(p)
		if r.corrupt != nil {
			out.Messages = r.corrupt(out.Messages)
		}
		// Every produced view must pass the strict pairing check (or, when
		// the client's own view does not — pairing off — add nothing).
		if v := violations(out.Messages); v > 0 && v > violations(in.Messages) {
			r.ev.InvariantFailure = true
			out.Messages = in.Messages
			cur = r.est(in.Messages)
			// Keep the summarize bookkeeping (latch, throttle) so a broken
			// view does not cause a summarize per step; forget the stored
			// records if they alone already produce a broken view.
			if !fresh || violations(r.view(r.reapply())) > 0 {
				r.st.Summary, r.st.Trims, r.st.Drops = nil, nil, nil
			}
			p, fresh, r.newTrims, r.newSum, r.newDrop = plan{}, false, false, false, false
		}
	}
	out.Forwarded = cur

	// The action the forwarded view carries and the new ones.
	out.Action = ActionNone
	switch {
	case p.sum != nil && r.newSum && !r.usedPending:
		out.Action = ActionSummarized
		r.ev.NewActions = append(r.ev.NewActions, ActionSummarized)
	case p.sum != nil:
		out.Action = ActionReused
		r.ev.NewActions = append(r.ev.NewActions, ActionReused)
	case len(p.drops) > 0:
		out.Action = ActionDropped
	case len(p.trims) > 0:
		out.Action = ActionTrimmed
	}
	if r.newDrop {
		r.ev.NewActions = append(r.ev.NewActions, ActionDropped)
	}
	if r.newTrims || r.shrunk {
		r.ev.NewActions = append(r.ev.NewActions, ActionTrimmed)
	}
	if r.due {
		out.Action = ActionSummarizePending
	}

	if fresh && r.chain {
		r.st.Summary = p.sum
		r.st.Drops = slices.Clone(p.drops)
		r.st.Trims = r.st.Trims[:0:0]
		for i, k := range p.trims {
			r.st.Trims = append(r.st.Trims, Trim{Index: i, Prefix: in.Chain[i+1], Keep: k})
		}
		slices.SortFunc(r.st.Trims, func(a, b Trim) int { return a.Index - b.Index })
	}
	out.State = r.st
	out.StateChanged = !stateEqual(in.State, r.st)
	out.Events = r.ev
	out.Need = r.need

	if cfg.Shadow {
		// Decide and report, forward the client's view, store nothing.
		if !p.empty() {
			out.Forwarded = r.est(in.Messages)
		}
		out.Messages = in.Messages
		out.State, out.StateChanged = in.State, false
	}
	return out
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
