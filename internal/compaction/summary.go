package compaction

import (
	"bytes"
	"fmt"
	"strings"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// askFor returns the client position of the most recent user message
// (the instruction being worked on: text, or text with image or audio
// parts) when it lies in the head [lead, cut); -1 when the tail carries
// it (never twice) or there is none.
func (r *run) askFor(cut int) int {
	for i := r.n - 1; i >= r.lead; i-- {
		if r.msgs[i].Role != "user" {
			continue
		}
		if i >= cut {
			return -1
		}
		return i
	}
	return -1
}

// joined returns s with its ask and acknowledgement decided against the
// client's messages as they are now: the ask re-inserted when the most
// recent user message lies in the summarized head, the acknowledgement
// when the next message would be a user message (roles alternate for
// strict templates). For a summary made now or applied from the
// background.
func (r *run) joined(s Summary) *Summary {
	s.Ask, s.AskInline = r.askFor(s.Cut), false
	s.Ack = s.Ask >= 0 || r.msgs[s.Cut].Role == "user"
	return &s
}

// rejoined is joined for a stored summary re-applied to a later request:
// its ask stays (the prefix it forwards stays byte-stable while the client
// appends), unless the message at the cut is now a user message of its
// own (a client that rewound to the cut and sent a new instruction: the
// tail carries the latest instruction, and two user messages would meet);
// the acknowledgement follows what comes next now.
func (r *run) rejoined(s Summary) *Summary {
	atCut := r.msgs[s.Cut].Role
	if atCut == "user" && s.Ask >= 0 && !s.AskInline {
		s.Ask = -1
	}
	s.Ack = (s.Ask >= 0 && !s.AskInline) || atCut == "user"
	return &s
}

// pendingPlan is base (the plan without the head; its trims after the cut
// are kept) with the background summary applied, and its estimate (from p,
// the plan now, whose view's estimate is cur), when that summary's head
// still matches the client's chain, it lies within the current head and it
// shrinks the view: no model call on the request that crosses the trigger.
func (r *run) pendingPlan(p, base plan, headStart, cur int) (plan, int, bool) {
	ps := r.st.Pending
	if ps == nil || !r.chain || ps.Lead != r.lead || ps.Cut <= headStart || ps.Cut > max(r.tail, r.floor) ||
		ps.Cut >= r.n || r.in.Chain[ps.Cut] != ps.Head {
		return plan{}, 0, false
	}
	s := r.joined(*ps)
	q := withSummary(base, s)
	e := r.freshEst(p, cur, q)
	if e >= cur {
		return plan{}, 0, false
	}
	return q, e, true
}

// takePending records that the background summary is applied: it leaves
// Pending and, a summary that worked, releases the latch (not when it
// stands in for a new summary that just failed).
func (r *run) takePending(release bool) {
	r.st.Pending = nil
	r.usedPending = true
	if release {
		r.st.Latched, r.st.LatchCount = false, 0
	}
}

// keptAfter returns what follows prefix in view when prefix is, byte for
// byte, the start of view (nil otherwise).
func keptAfter(prefix, view []chat.Message) []chat.Message {
	if len(view) <= len(prefix) {
		return nil
	}
	for i := range prefix {
		if !bytes.Equal(prefix[i].Raw, view[i].Raw) {
			return nil
		}
	}
	return view[len(prefix):len(view):len(view)]
}

// presummarize is the background run: step 2 on the client's view as if
// it were over the trigger; a summary goes to State.Pending.
func (r *run) presummarize(out Output, p plan, cur int) Output {
	cfg := r.cfg
	out.Messages, out.Action, out.Forwarded = r.in.Messages, ActionNone, cur
	headStart := p.headStart(r.lead)
	r.tail = r.nextTail(headStart, out)
	if ps := r.st.Pending; ps != nil && r.chain && ps.Lead == r.lead && ps.Cut > headStart && ps.Cut < r.n &&
		r.in.Chain[ps.Cut] == ps.Head {
		// The background summary made at an earlier step still applies:
		// one is enough until the trigger is crossed.
	} else if c := r.st.LastAttemptCount; c > 0 && c <= r.n && assistantTurns(r.msgs[c:]) <= backgroundRest {
		// A summary was attempted within the last backgroundRest steps: a
		// step large enough to reach presummarize_ratio right after it
		// (at 8k one read can be a third of the room) would otherwise put
		// summarize calls on consecutive steps. A background call runs
		// while the client prepares its next request, so it lands on
		// either step; one step of rest is not enough. A later pass, or
		// the request that crosses the trigger, makes it.
	} else if cfg.SummarizerEnabled && r.chain && !cfg.Shadow && r.tail > headStart && r.tail < r.n {
		q := p
		r.st.Pending = nil // a new one supersedes it
		if _, ok := r.summarize(&q, cur, headStart, out.Budget, out.Target); ok && q.sum != nil && r.newSum {
			s := *q.sum
			r.st.Pending = &s
		}
	}
	r.newSum = false
	out.State = r.st
	out.StateChanged = !stateEqual(r.in.State, r.st)
	out.Events = r.ev
	out.Need = r.need
	return out
}

// backgroundRest is how many steps (assistant turns) after a summarize
// attempt no background summary starts.
const backgroundRest = 2

// assistantTurns counts the assistant messages in msgs: the turns a
// conversation took since a point.
func assistantTurns(msgs []chat.Message) int {
	n := 0
	for i := range msgs {
		if msgs[i].Role == "assistant" {
			n++
		}
	}
	return n
}

// summarize runs step 2 (sizing, latch, throttle, the call) and returns the
// estimate of the resulting plan and whether a summary now applies.
func (r *run) summarize(p *plan, cur, headStart, budget, target int) (int, bool) {
	cfg := r.cfg
	// measure sizes a summary with the verbatim tail from cut on: the
	// summary's room is the target minus the view without the head
	// (system messages, the summary's label, acknowledgement, ask, tail).
	measure := func(cut int) (cand *Summary, base plan, withoutHead, room int) {
		cand = r.joined(Summary{Cut: cut, Head: r.in.Chain[cut], Lead: r.lead})
		base = withSummary(*p, cand)
		withoutHead = r.est(r.view(base))
		room = target - withoutHead
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
		return cand, base, withoutHead, room
	}
	cut := r.tail
	var cand *Summary
	var base plan
	withoutHead, room := 0, -1
	if cut > headStart {
		cand, base, withoutHead, room = measure(cut)
	} else {
		// The tail's floor covers everything since the previous cut and
		// the view is over the budget: only a later cut can help.
		cut = headStart
	}
	// short: a cut whose summary has less than its least room, or folds
	// less than that (a head that holds only the ask it re-inserts).
	short := func(room, withoutHead int) bool { return room < cfg.minRoom() || cur-withoutHead < cfg.minRoom() }
	// refold: no cut leaves a summary its least room, and the one in
	// place is folded again with what follows it, no larger than it is.
	refold := false
	if short(room, withoutHead) {
		// The tail's floor itself leaves no summary room, or nothing to
		// fold (a small window with a large fixed part: keep_tail spans
		// two turns; an agent whose only instruction is its first
		// message). Its older turns go into the summary, never past the
		// final message's turn: otherwise they would be dropped, and their
		// content lost.
		final := r.n - 1
		for final > cut && isToolRole(r.msgs[final].Role) {
			final--
		}
		for c := cut + 1; c <= final && short(room, withoutHead); c++ {
			if isToolRole(r.msgs[c].Role) {
				continue
			}
			if cc, cb, cw, cr := measure(c); !short(cr, cw) {
				cut, cand, base, withoutHead, room = c, cc, cb, cw, cr
			}
		}
		if room < cfg.minRoom() && final > headStart {
			// No cut leaves a summary its least room: the fixed part, the
			// ask and the final message's turn fill the budget (a two-read
			// turn at Qwen2.5 2k). The drop would remove every turn before
			// the final one, keep the summary in place, and leave the view
			// as large. A new summary folds them instead, into the room
			// there is, and never larger than the one it replaces: a view
			// at most the drop's size, nothing lost. The summary in place
			// may itself be under summary_min_tokens (asked for half of a
			// small head): that least room is for a summary that opens a
			// history, not for one that takes the place of another.
			_, old := r.summarySplit(*p)
			if old = min(old, cfg.SummaryTokens); old > 0 {
				if final != cut || cand == nil {
					cand, base, withoutHead, room = measure(final)
					cut = final
				}
				room, refold = min(old, max(room, summaryFloorBytes/bytesPerToken)), true
			}
		}
		if cand == nil || (room < cfg.minRoom() && !refold) {
			return cur, false
		}
		r.tail = cut
	}
	// A summary can only pay for itself when it is smaller than what it
	// replaces: the head as forwarded now.
	headTokens := cur - withoutHead
	// What a new summary would take in beyond the previous one: the head
	// messages after the previous cut, as forwarded. Folding less than
	// summary_min_tokens of them is not worth a model call (a view that
	// stays over the trigger after a summary would otherwise be summarized
	// again at every step), unless the view is over the budget: then the
	// alternative is a drop, and a summary that fits comes first.
	//
	// The progress guard: a compaction aims at the target so that the
	// next steps fit without compacting again; a new summary is made only
	// once it folds at least max(summary_min_tokens, a quarter of the room)
	// of history not yet summarized. Until then the cheaper steps (trim,
	// excerpts, re-applying what is stored) keep the view under the
	// budget; the guard yields when they cannot.
	fresh := r.est(r.prefixView(*p, cut)) - r.est(r.prefixView(*p, headStart))
	if !refold && (room < cfg.minRoom() || headTokens < cfg.minRoom()) {
		return cur, false // no summary fits: step 4
	}
	// A background summary that is ready costs no model call: it applies
	// whatever the guard, which is about calls, when it brings the view
	// to the target. One that does not (the client's newest turn was
	// large: at 8k a single read can be a third of the room) would leave
	// the next request over the trigger again, a summary on the next step
	// too: it is kept for when no new summary can be made now (latched,
	// throttled, failed), and a new one folds from the cut as it is now. A
	// drop is never chosen while a summary fits.
	failed := func() (int, bool) { return cur, false }
	pending := false
	if q, e, ok := r.pendingPlan(*p, base, headStart, cur); ok {
		take := func(release bool) (int, bool) {
			r.takePending(release)
			*p = q
			return e, true
		}
		if e <= target {
			return take(true)
		}
		failed = func() (int, bool) { return take(!r.st.Latched) }
		pending = e <= budget
	}
	if fresh < r.progress() && cur <= budget && !r.progressed {
		if pending {
			return failed() // the guard withholds a call, not a summary made
		}
		r.guarded = true
		return cur, false
	}
	// Ask for no more than can be used: the room, and half of what the
	// summary folds (small local models write to their limit; a summary
	// is never asked to be as large as the history it replaces); and no
	// more than 1/summaryShare of the room, never under its least room,
	// from a room of summaryShareFrom times that on (under ~4k windows a
	// summary is sized by the room alone).
	limit := min(cfg.SummaryTokens, room, max(headTokens/2, 1))
	if r.room/summaryShareFrom >= cfg.minRoom() {
		limit = min(limit, max(r.room/summaryShare, cfg.minRoom()))
	}

	n := r.n
	if r.st.Latched {
		if n < r.st.LatchCount+cfg.LatchGrowth {
			r.ev.Suppressed = SuppressedLatch
			return failed()
		}
		r.st.Latched = false
	}
	now := r.in.Now
	if cfg.MinInterval > 0 && r.in.Pass != PassRecover && !r.st.LastAttempt.IsZero() &&
		r.st.LastAttemptCount == n && now.Sub(r.st.LastAttempt) < cfg.MinInterval {
		r.ev.Suppressed = SuppressedThrottle
		return failed()
	}
	if cfg.Shadow {
		r.due = true // shadow decides and reports, never asks
		return cur, false
	}
	at := r.in.Chain[cut]
	res := r.in.Summary
	if !res.answers(cut, at) {
		// Decide, then do: ask for the summary; the caller obtains it and
		// plans again with the answer.
		previous := ""
		if p.sum != nil {
			previous = p.sum.Text
		}
		prefix := r.prefixView(*p, cut)
		req := &SummaryRequest{
			Cut: cut, At: at,
			Head: r.headView(*p, headStart, cut), Previous: previous, MaxTokens: limit,
			Prefix: prefix, PrefixTokens: r.est(prefix),
		}
		req.HeadTokens = max(req.PrefixTokens-r.est(r.prefixView(*p, headStart)), 0)
		if r.in.Pass == PassBackground {
			req.Kept = keptAfter(prefix, r.view(*p))
			if len(req.Kept) > 0 {
				req.KeptTokens = max(cur-req.PrefixTokens, 0)
			}
		}
		r.need, r.due = req, true
		return cur, false
	}

	r.st.LastAttempt, r.st.LastAttemptCount = now, n
	r.ev.SummarizeCalled = true
	r.ev.SummaryTokens = limit
	text, err := res.Text, res.Err
	text = strings.TrimSpace(text)
	if err == nil && text == "" {
		err = ErrEmptySummary
	}
	if err == nil {
		s := *cand
		s.Text = text
		if r.in.SummaryInUpstreamTokens {
			s.Tokens = limit
			if res.Tokens > 0 {
				s.Tokens = res.Tokens
			}
		}
		q := withSummary(base, &s)
		e := r.freshEst(*p, cur, q)
		if e < cur {
			*p = q
			r.newSum = true
			r.ev.SummarizeOK = true
			r.st.Latched, r.st.LatchCount = false, 0
			return e, true
		}
		// Asked for at most half of what it folds, a summary within its
		// limit always shrinks the view: one that does not ignored it.
		err = fmt.Errorf("%w (%d tokens, %d before)", ErrSummaryNotSmaller, e, cur)
	}
	r.ev.SummaryError = err
	if !res.Canceled { // a client that went away is not a summarizer failure
		r.st.Latched, r.st.LatchCount = cfg.LatchGrowth > 0, n
		r.ev.LatchEngaged = cfg.LatchGrowth > 0
	}
	return failed()
}

// summaryWithheld tells whether the progress guard withholds a summary of
// p's head up to the tail with the view at cur: the summarizer could make
// one (on, not latched), the view is within the budget, and the history
// not yet summarized before the tail is under the guard's amount.
func (r *run) summaryWithheld(p plan, cur, headStart, budget int) bool {
	cfg := r.cfg
	if !cfg.SummarizerEnabled || !r.chain || cur > budget || r.tail <= headStart ||
		(r.st.Latched && r.n < r.st.LatchCount+cfg.LatchGrowth) {
		return false
	}
	if ps := r.st.Pending; ps != nil && ps.Lead == r.lead && ps.Cut > headStart && ps.Cut < r.n && r.in.Chain[ps.Cut] == ps.Head {
		return false // a background summary is ready: no call to withhold
	}
	fresh := r.est(r.prefixView(p, r.tail)) - r.est(r.prefixView(p, headStart))
	return fresh < r.progress()
}

// summaryShare: a new summary is asked for at most room/summaryShare
// tokens, never under summary_min_tokens, where the room is at least
// summaryShareFrom × summary_min_tokens (from about a 4k window on).
// Every compaction evaluates the summary again, and every step after it
// carries it: at an 8k window summarizer.max_tokens (1,024) is 18% of the
// room; the next compaction comes sooner and costs more of the prompt
// cache (8k, real Qwen2.5 tokenizer: an eighth, 713 tokens, gave 4
// summaries and cache reuse 0.843 on the paced loop, 13 and 0.602 on
// large steps; a twelfth, 475, gave 4, 0.859 and 11, 0.626; a sixteenth
// cost the 16k large-step loop two summaries on consecutive steps). From
// 16k on the limit is about summarizer.max_tokens. Under a room of
// summaryShareFrom × summary_min_tokens (a 2k window) a summary is sized
// by the room alone: it must hold what the drop would otherwise take.
const (
	summaryShare     = 12
	summaryShareFrom = 8
)

// progress is the least history not yet summarized that a new summary
// must fold (the progress guard): summary_min_tokens, or a quarter of the
// room when that is more.
func (r *run) progress() int { return max(r.cfg.SummaryMinTokens, r.room/4) }

// summaryFloorBytes is the least of its text an excerpted summary keeps.
const summaryFloorBytes = 256

// shrinkSummary is the last resort's first step: the re-applied summary is
// what the proxy owns, so when the view is still over the budget after the
// drop it is excerpted (head and tail kept, a marker saying how much was
// elided) to what the budget leaves it, and stored so that later requests
// forward the same prefix. It returns the view's new estimate.
func (r *run) shrinkSummary(p *plan, cur, budget int) int {
	s := p.sum
	_, text := r.summarySplit(*p)
	if s == nil || text <= 0 || len(s.Text) <= summaryFloorBytes {
		return cur
	}
	want := text - (cur - budget) - 8 // the marker's tokens
	keep := max(int(float64(len(s.Text))*float64(max(want, 0))/float64(text)), summaryFloorBytes)
	short, ok := excerpt(s.Text, keep)
	if !ok {
		return cur
	}
	ns := *s
	ns.Text = short
	if s.Tokens > 0 {
		ns.Tokens = s.Tokens*len(short)/len(s.Text) + 16
	}
	q := *p
	q.sum = &ns
	e := r.summaryEst(q)
	if e >= cur {
		return cur
	}
	*p = q
	r.shrunk = true
	return e
}
