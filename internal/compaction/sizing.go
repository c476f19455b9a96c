package compaction

import (
	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// tailStart is the cut: len − keepTail (the final message always stays),
// walked backward while the message at the cut is a tool result, so the
// tail starts with the assistant call its results answer.
func tailStart(msgs []chat.Message, keepTail int) int {
	c := max(len(msgs)-max(keepTail, 1), 0)
	for c > 0 && isToolRole(msgs[c].Role) {
		c--
	}
	return c
}

// byteEstimate is the fallback estimator: 4 bytes per token.
func byteEstimate(view []chat.Message) anchor.Estimate {
	t := 0
	for i := range view {
		t += len(view[i].Raw)
	}
	return anchor.Estimate{Tokens: t / bytesPerToken, Source: anchor.SourceLocal, Local: t / bytesPerToken}
}

// Budget is DESIGN.md § Budget: the window less the reserved output, where
// the reserved output is the larger of reserveTokens and the request's max
// tokens, capped at a quarter of the window.
func Budget(window, reserveTokens, maxTokens int) int {
	if window <= 0 {
		return 0
	}
	return window - min(max(reserveTokens, maxTokens), window/4)
}

// tailLimit is how far the verbatim tail may extend beyond its floor:
// tail_ratio of the room, but never so far that a summary of
// summary_min_tokens (with its label) no longer fits under the target. At
// a 2k window the extended tail alone would otherwise leave the summary no
// room, and the view would land over the target, be summarized again at
// the next step, or be dropped instead.
func (r *run) tailLimit(out Output) int {
	cfg := r.cfg
	room := out.Budget - out.Fixed
	label := int(float64(len(summaryLabel)+len(ackText))/bytesPerToken*r.ratio) + 2*anchorMessageOverhead
	return min(int(float64(room)*cfg.TailRatio), out.Target-out.Fixed-cfg.minRoom()-label)
}

// anchorMessageOverhead is the template's cost of a message, as the local
// estimator counts it.
const anchorMessageOverhead = anchor.MessageOverheadTokens

// extendTail moves the cut back by whole turns (to earlier messages that
// are not tool results) while the tail, estimated with the leading system
// messages and the ask it would re-insert in front of it, stays within
// limit tokens beyond the fixed part.
// The head keeps at least one message.
func (r *run) extendTail(cut, headStart, fixed, limit int) int {
	if limit <= 0 {
		return cut
	}
	var cands []int // candidate cuts, nearest first
	for c := cut - 1; c > headStart; c-- {
		if !isToolRole(r.msgs[c].Role) {
			cands = append(cands, c)
		}
	}
	fits := func(c int) bool {
		v := make([]chat.Message, 0, r.lead+1+r.n-c)
		v = append(v, r.msgs[:r.lead]...)
		if a := r.askFor(c); a >= 0 {
			// The ask is re-inserted after the summary when the cut
			// leaves it in the head: it shares the tail's room (an
			// agent's first message with its environment can be a
			// third of a small room).
			v = append(v, r.msgs[a])
		}
		v = append(v, r.msgs[c:]...)
		return r.est(v)-fixed <= limit
	}
	// The tail's size grows as the cut moves back: binary search for the
	// farthest candidate that still fits.
	lo, hi := 0, len(cands) // cands[:lo] fit
	for lo < hi {
		mid := (lo + hi) / 2
		if fits(cands[mid]) {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == 0 {
		return cut
	}
	return cands[lo-1]
}

// Estimates. est is the one call of the Estimator: a list of messages,
// scaled when a measurement said the estimator undercounts. estimate is
// the one for a plan whose summary may be new (its text counted by the
// bound the summarizer gave, anchored on the view it replaces when it
// can); summarySplit is the summary's share of a view.

// est estimates a view, scaled when a measurement said the estimator
// undercounts.
func (r *run) est(view []chat.Message) int {
	t := r.in.Estimate(view).Tokens
	if r.scale != 1 {
		t = int(float64(t)*r.scale + 0.5)
	}
	return t
}

// sized is a plan and the estimate of its view.
type sized struct {
	p      plan
	tokens int
}

// estimate sizes q's view with its summary's text counted as summarySplit
// does. Alone (from nil) that estimate is not anchored: the calibration's
// overhead plus its ratio times the local count, and the overhead of a fit
// across views of mixed content (system prompt, a prose summary, code) can
// be hundreds of tokens where the request has none (stories260K with
// ChatML, no tools array rendered: 120–470 tokens, and views right after a
// summary 13% over llama-server's count). The first response then measures
// the view exactly: later requests are anchored.
//
// from is the plan q replaces (part of) the head of, with its view's
// estimate (anchored: measured up to the client's newest messages). The
// estimate from it is from.tokens, less from's summary text, plus q's,
// plus the difference of the rest at the conversation's rate for the
// messages it appends (anchor.AppendRate, over every measured step); the
// system messages and the tail, common to both views, cancel out. Each
// errs high in its own case: the one alone by that overhead, this one
// where the messages it drops cost more than the appended ones' rate (a
// prose task folded at a 4k window: 12–15% over). The estimate is the
// smaller of the two; without a rate yet it is the one alone. (A summary
// is then a failure only when neither finds the view smaller.)
func (r *run) estimate(q plan, from *sized) int {
	bare, text := r.summarySplit(q)
	alone := bare + text
	if from == nil || q.sum == nil {
		return alone
	}
	var rate float64
	ok := len(r.in.State.Anchors) > 0
	if ok {
		rate, ok = r.in.State.Anchors[0].AppendRate()
	}
	if !ok {
		return alone
	}
	rate *= r.scale
	local := func(v []chat.Message) int { return r.in.Estimate(v).Local }
	pBare, pFull := r.split(from.p, local)
	qBare, qFull := r.split(q, local)
	textOf := func(s *Summary, bare, full int) float64 {
		switch {
		case s == nil:
			return 0
		case s.Tokens > 0:
			return float64(s.Tokens) // the upstream's count, as summarySplit
		default:
			return rate * float64(full-bare)
		}
	}
	e := int(float64(from.tokens) - textOf(from.p.sum, pBare, pFull) + textOf(q.sum, qBare, qFull) + rate*float64(qBare-pBare) + 0.5)
	if e <= 0 {
		return alone
	}
	return min(e, alone)
}

// summarySplit estimates p's view without its summary's text (bare) and
// what the text takes in it: the estimate's share, or Summary.Tokens when
// that bound is known and smaller (a summary asked for n tokens of the
// upstream's own model takes at most n). Without a summary, text is 0.
func (r *run) summarySplit(p plan) (bare, text int) {
	bare, full := r.split(p, r.est)
	text = max(full-bare, 0)
	if p.sum != nil && p.sum.Tokens > 0 {
		// The upstream's own count of the text (its completion tokens,
		// or the limit it was given): the estimator's ratio is calibrated
		// on code and tool output, not on a model's prose.
		text = p.sum.Tokens
	}
	return bare, text
}

// split counts p's view without its summary's text (bare) and with it
// (full) by count.
func (r *run) split(p plan, count func([]chat.Message) int) (bare, full int) {
	full = count(r.view(p))
	if p.sum == nil {
		return full, full
	}
	b := *p.sum
	b.Text = ""
	q := p
	q.sum = &b
	return count(r.view(q)), full
}

// minRoom is the least room a summary needs: summary_min_tokens, or the
// summary's own limit when that is smaller.
func (c Config) minRoom() int { return min(c.SummaryMinTokens, c.SummaryTokens) }

// nextTail is where a background summary cuts: at the verbatim tail of
// the request it is made for, the client's next one, which appends a turn
// to this view. That request's floor counts keep_tail messages back from
// its end, the newest at least its own; its extension has the new turn to
// pay for too (taken the size of this view's final turn). Cut at this
// view's tail instead, the next request would carry that whole tail plus
// the new turn: a turn more than its own tail, re-evaluated with the
// summary at each compaction and bringing the next one nearer.
func (r *run) nextTail(headStart int, out Output) int {
	now := r.extendTail(r.tail, headStart, out.Fixed, r.tailLimit(out))
	floor := tailStart(r.msgs, r.cfg.KeepTail-1)
	if floor <= now {
		return now
	}
	final := tailStart(r.msgs, 1)
	// The final turn's size, less the request's own cost (tools, template)
	// that an estimate of any view carries.
	turn := r.est(r.msgs[final:]) - r.est(r.msgs[:0])
	return max(now, r.extendTail(floor, headStart, out.Fixed, r.tailLimit(out)-turn))
}
