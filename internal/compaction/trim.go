package compaction

// tightKeep is the excerpt size (text bytes) of the results excerpted when
// the view is over the budget, or leaves a summary no room, with results
// that are not long: a small window (2k–4k tokens with a tools array)
// cannot hold two whole file reads.
const tightKeep = 512

// long is the size, in provider tokens, above which a tool result is long
// (compaction.trim.tool_result_tokens).
func (r *run) long() int { return r.cfg.TrimToolResultTokens }

// trimCandidates lists, oldest first, the tool results in [from, to)
// longer than limit provider tokens (measured as the local size of their
// text times the estimate's ratio) that the plan does not trim or drop yet;
// with step 0 on, not the working set's short of the last resort
// (overBudget).
func (r *run) trimCandidates(p plan, from, to, limit int) []int {
	var out []int
	for i := max(from, r.lead); i < to && i < r.n; i++ {
		m := &r.msgs[i]
		if !trimmable(m) || float64(localTextTokens(m))*r.ratio <= float64(limit) {
			continue
		}
		if _, done := p.trims[i]; done {
			continue
		}
		if p.dropped(i) {
			continue
		}
		if !r.lastResort && r.cfg.workingSet() && r.reductions().working[i] {
			continue // the working set stays verbatim short of the last resort
		}
		if _, ok := r.trimmed(i, min(r.keep, max(limit*bytesPerToken/2, tightKeep))); ok {
			out = append(out, i)
		}
	}
	return out
}

// applyTrims adds the fewest leading candidates, excerpted to keep bytes,
// that bring the view below target (all of them when none does) and
// returns the new estimate and whether the target was reached.
func (r *run) applyTrims(p *plan, cands []int, keep, target int) (int, bool) {
	n, est, ok := r.fewestBelow(*p, cands, keep, target)
	*p = p.withTrims(cands[:n], keep)
	return est, ok
}

// fewestBelow is the shortest prefix cands[:n] whose reductions (keep)
// bring p's view below target, with that view's estimate; when even all of
// them do not, n is len(cands) and ok is false. The estimate falls as more
// results are reduced: a binary search, O(log n) estimates.
func (r *run) fewestBelow(p plan, cands []int, keep, target int) (n, est int, ok bool) {
	estAll := r.est(r.view(p.withTrims(cands, keep)))
	if estAll >= target {
		return len(cands), estAll, false
	}
	lo, hi, hiEst := 1, len(cands), estAll
	for lo < hi {
		mid := (lo + hi) / 2
		if e := r.est(r.view(p.withTrims(cands[:mid], keep))); e < target {
			hi, hiEst = mid, e
		} else {
			lo = mid + 1
		}
	}
	return hi, hiEst, true
}

// finalResults is where the final turn's tool results begin: the first of
// the tool messages that end the view (a parallel read answers with
// several), else the final message. Excerpting to reach the target, or to
// make a summary room, stops before them: they are what the model is
// working on. Only a view over the budget excerpts them, before a drop
// (overBudget).
func (r *run) finalResults() int {
	i := r.n - 1
	for i > r.lead && i > 0 && r.msgs[i-1].Role == "tool" && r.msgs[i].Role == "tool" {
		i--
	}
	return max(i, 0)
}
