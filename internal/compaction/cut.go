package compaction

// cutSize is a new summary sized at one cut.
type cutSize struct {
	cut int
	// cand is the summary without its text; base the plan with it in
	// place of the head (the tail's long results excerpted when that made
	// the summary room).
	cand *Summary
	base plan
	// withoutHead is the estimate of base's view (the view without the
	// head); room what the target (else the budget) leaves the summary.
	withoutHead, room int
	// refold: no cut leaves a summary its least room, and the one in
	// place is folded again with what follows it, no larger than it is.
	refold bool
}

// short tells whether sz leaves its summary less than its least room, or
// folds less than that (a head that holds only the ask it re-inserts),
// with the view at cur.
func (sz cutSize) short(cur, minRoom int) bool {
	return sz.room < minRoom || cur-sz.withoutHead < minRoom
}

// measureCut sizes a summary of p's head with the verbatim tail from cut
// on: the summary's room is the target minus the view without the head
// (system messages, the summary's label, acknowledgement, ask, tail).
func (r *run) measureCut(p plan, cut, budget, target int) cutSize {
	cfg := r.cfg
	cand := r.joined(Summary{Cut: cut, Head: r.in.Chain[cut], Lead: r.lead})
	base := withSummary(p, cand)
	withoutHead := r.est(r.view(base))
	room := target - withoutHead
	if room < cfg.minRoom() {
		// Excerpt the tail's oldest long tool results (never the final
		// message) and measure again; then accept the budget.
		if cands := r.trimCandidates(base, cut, r.finalResults(), 0); len(cands) > 0 {
			r.applyTrims(&base, cands, tightKeep, target-cfg.minRoom())
			room = target - r.est(r.view(base))
		}
		if room < cfg.minRoom() {
			room = budget - r.est(r.view(base))
		}
	}
	return cutSize{cut: cut, cand: cand, base: base, withoutHead: withoutHead, room: room}
}

// sizeSummary chooses the cut of a new summary of p's head (the view at
// cur) and sizes it: at the verbatim tail; when that leaves no room, or
// nothing to fold, at a later cut; when none does, a refold of the summary
// in place. ok is false when no summary can be made; when the cut moved,
// the run's tail moves with it.
func (r *run) sizeSummary(p plan, cur, headStart, budget, target int) (cutSize, bool) {
	minRoom := r.cfg.minRoom()
	sz := cutSize{cut: headStart, room: -1}
	if r.tail > headStart {
		sz = r.measureCut(p, r.tail, budget, target)
	}
	// Else the tail's floor covers everything since the previous cut and
	// the view is over the budget: only a later cut can help.
	if !sz.short(cur, minRoom) {
		return sz, true
	}
	// The tail's floor itself leaves no summary room, or nothing to fold
	// (a small window with a large fixed part: keep_tail spans two turns;
	// an agent whose only instruction is its first message). Its older
	// turns go into the summary, never past the final message's turn:
	// otherwise they would be dropped, and their content lost.
	final := r.n - 1
	for final > sz.cut && isToolRole(r.msgs[final].Role) {
		final--
	}
	for c := sz.cut + 1; c <= final; c++ {
		if isToolRole(r.msgs[c].Role) {
			continue
		}
		if later := r.measureCut(p, c, budget, target); !later.short(cur, minRoom) {
			sz = later
			break
		}
	}
	if sz.room < minRoom && final > headStart {
		sz = r.refoldCut(p, sz, final, budget, target)
	}
	if sz.cand == nil || (sz.room < minRoom && !sz.refold) {
		return sz, false
	}
	r.tail = sz.cut
	return sz, true
}

// refoldCut is the last way to a summary when no cut leaves one its least
// room: the fixed part, the ask and the final message's turn fill the
// budget (a two-read turn at Qwen2.5 2k). The drop would remove every turn
// before the final one, keep the summary in place, and leave the view as
// large. A new summary cut at final folds them instead, into the room
// there is, and never larger than the one it replaces: a view at most the
// drop's size, nothing lost. The summary in place may itself be under
// summary_min_tokens (asked for half of a small head): that least room is
// for a summary that opens a history, not for one that takes the place of
// another. Without a summary in place sz is returned as it is.
func (r *run) refoldCut(p plan, sz cutSize, final, budget, target int) cutSize {
	_, old := r.summarySplit(p)
	if old = min(old, r.cfg.SummaryTokens); old <= 0 {
		return sz
	}
	if final != sz.cut || sz.cand == nil {
		sz = r.measureCut(p, final, budget, target)
	}
	sz.room, sz.refold = min(old, max(sz.room, summaryFloorBytes/bytesPerToken)), true
	return sz
}
