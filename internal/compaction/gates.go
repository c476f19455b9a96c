package compaction

// The gates a summarize call passes: the progress guard (is there enough
// new history to fold?), the latch (did the summarizer fail lately?) and
// the throttle (was the same request attempted moments ago?).

// unsummarized is the history a summary of p's head up to cut would fold
// that no earlier summary covered: the estimate of the prefix up to cut
// less the prefix up to headStart.
func (r *run) unsummarized(p plan, cut, headStart int) int {
	return r.est(r.prefixView(p, cut)) - r.est(r.prefixView(p, headStart))
}

// progress is the least history not yet summarized that a new summary
// must fold (the progress guard): summary_min_tokens, or a quarter of the
// room when that is more.
func (r *run) progress() int { return max(r.cfg.SummaryMinTokens, r.room/4) }

// summaryWithheld tells, before any step changes the forwarded prefix,
// whether the progress guard withholds a summary of p's head up to the
// tail with the view at cur: the summarizer could make one (on, not
// latched), the view is within the budget, no background summary is ready,
// and the history not yet summarized before the tail is under the guard's
// amount.
func (r *run) summaryWithheld(p plan, cur, headStart, budget int) bool {
	cfg := r.cfg
	if !cfg.SummarizerEnabled || !r.chain || cur > budget || r.tail <= headStart || r.latched() {
		return false
	}
	if r.pendingMatches(headStart) {
		return false // a background summary is ready: no call to withhold
	}
	return r.unsummarized(p, r.tail, headStart) < r.progress()
}

// guardHolds is the progress guard at the summarize step, for a summary
// cut at cut: a compaction aims at the target so that the next steps fit
// without compacting again; a new summary is made only once it folds at
// least progress() of history not yet summarized (folding less is not
// worth a model call: a view that stays over the trigger after a summary
// would otherwise be summarized again at every step). Until then the
// cheaper steps (trim, excerpts, re-applying what is stored) keep the view
// under the budget; the guard yields when they cannot (the alternative is
// a drop, and a summary that fits comes first), and when it already let
// this compaction through before the trims.
func (r *run) guardHolds(p plan, cut, headStart, cur, budget int) bool {
	return r.unsummarized(p, cut, headStart) < r.progress() && cur <= budget && !r.done.has(stepPassedGuard)
}

// latched tells whether the latch holds: a summarize failed and the
// conversation has not grown by latch_growth messages since.
func (r *run) latched() bool {
	return r.st.Latched && r.n < r.st.LatchCount+r.cfg.LatchGrowth
}

// gate is the latch, then the throttle: the suppression reason when a
// summarize call may not be made now, else "" (a latch the conversation
// has outgrown is released).
func (r *run) gate() string {
	cfg := r.cfg
	if r.st.Latched {
		if r.latched() {
			return SuppressedLatch
		}
		r.st.Latched = false
	}
	if cfg.MinInterval > 0 && r.in.Pass != PassRecover && !r.st.LastAttempt.IsZero() &&
		r.st.LastAttemptCount == r.n && r.in.Now.Sub(r.st.LastAttempt) < cfg.MinInterval {
		return SuppressedThrottle
	}
	return ""
}
