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

// pendingPlan is the ready background summary applied to a plan, and the
// estimate of its view (ok false: none applies).
type pendingPlan struct {
	q  plan
	e  int
	ok bool
}

// readyPending is base (the plan without the head; its trims after the
// cut are kept) with the background summary applied, and its estimate
// (from p, the plan now, whose view's estimate is cur), when that
// summary's head still matches the client's chain, it lies within the
// current head and it shrinks the view: no model call on the request that
// crosses the trigger.
//
// A ready background summary applies whatever the guard, which is about
// calls, when it brings the view to the target. One that does not (the
// client's newest turn was large: at 8k a single read can be a third of
// the room) would leave the next request over the trigger again, a
// summary on the next step too: it is kept for when no new summary can be
// made now (latched, throttled, failed), and a new one folds from the cut
// as it is now. A drop is never chosen while a summary fits.
func (r *run) readyPending(p, base plan, headStart, cur int) pendingPlan {
	if !r.pendingMatches(headStart) || r.st.Pending.Cut > max(r.tail, r.floor) {
		return pendingPlan{}
	}
	s := r.joined(*r.st.Pending)
	q := withSummary(base, s)
	e := r.estimate(q, &sized{p, cur})
	if e >= cur {
		return pendingPlan{}
	}
	return pendingPlan{q, e, true}
}

// takePending applies the ready background summary to p: it leaves
// Pending and, a summary that worked, releases the latch (not when it
// stands in for a new summary that just failed). It returns the view's
// estimate.
func (r *run) takePending(p *plan, ready pendingPlan, release bool) (int, bool) {
	r.st.Pending = nil
	r.done.add(stepPendingTaken)
	if release {
		r.st.Latched, r.st.LatchCount = false, 0
	}
	*p = ready.q
	return ready.e, true
}

// fallBack is where a summarize step that makes no summary ends: the ready
// background summary when there is one, else the plan as it is.
func (r *run) fallBack(p *plan, ready pendingPlan, cur int) (int, bool) {
	if !ready.ok {
		return cur, false
	}
	return r.takePending(p, ready, !r.st.Latched)
}

// pendingMatches tells whether the background summary in State.Pending
// still applies to the client's messages: its head matches their chain
// and it lies within the head after headStart.
func (r *run) pendingMatches(headStart int) bool {
	ps := r.st.Pending
	return ps != nil && r.chain && ps.Lead == r.lead && ps.Cut > headStart && ps.Cut < r.n && r.in.Chain[ps.Cut] == ps.Head
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
	if r.pendingMatches(headStart) {
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
		if _, ok := r.summarize(&q, cur, headStart, out.Budget, out.Target); ok && q.sum != nil && r.done.has(stepSummarized) {
			s := *q.sum
			r.st.Pending = &s
		}
	}
	r.done.forget(stepSummarized)
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

// summarize runs step 2 and returns the estimate of the resulting plan and
// whether a summary now applies. Its steps, each on its own: size the
// summary (the cut and its room), fall back on a ready background summary,
// the gates (progress guard, latch, throttle), then shadow's report, the
// ask, or the acceptance of the answer.
func (r *run) summarize(p *plan, cur, headStart, budget, target int) (int, bool) {
	cfg := r.cfg
	sz, ok := r.sizeSummary(*p, cur, headStart, budget, target)
	if !ok {
		return cur, false
	}
	// A summary can only pay for itself when it is smaller than what it
	// replaces: the head as forwarded now.
	headTokens := cur - sz.withoutHead
	if !sz.refold && (sz.room < cfg.minRoom() || headTokens < cfg.minRoom()) {
		return cur, false // no summary fits: step 4
	}
	ready := r.readyPending(*p, sz.base, headStart, cur)
	if ready.ok && ready.e <= target {
		return r.takePending(p, ready, true)
	}
	if r.guardHolds(*p, sz.cut, headStart, cur, budget) {
		if ready.ok && ready.e <= budget {
			// The guard withholds a call, not a summary made.
			return r.takePending(p, ready, !r.st.Latched)
		}
		r.done.add(stepGuarded)
		return cur, false
	}
	limit := r.summaryLimit(sz.room, headTokens)
	if reason := r.gate(); reason != "" {
		r.ev.Suppressed = reason
		return r.fallBack(p, ready, cur)
	}
	if cfg.Shadow {
		r.done.add(stepDue) // shadow decides and reports, never asks
		return cur, false
	}
	if !r.in.Summary.answers(sz.cut, r.in.Chain[sz.cut]) {
		// Decide, then do: ask for the summary; the caller obtains it and
		// plans again with the answer.
		r.need = r.request(*p, sz.cut, headStart, cur, limit)
		r.done.add(stepDue)
		return cur, false
	}
	return r.accept(p, sz, cur, limit, ready)
}

// summaryLimit is what a summary is asked for at most: the room, and half
// of what the summary folds (small local models write to their limit; a
// summary is never asked to be as large as the history it replaces); and
// no more than 1/summaryShare of the room, never under its least room,
// from a room of summaryShareFrom times that on (under ~4k windows a
// summary is sized by the room alone).
func (r *run) summaryLimit(room, headTokens int) int {
	cfg := r.cfg
	limit := min(cfg.SummaryTokens, room, max(headTokens/2, 1))
	if r.room/summaryShareFrom >= cfg.minRoom() {
		limit = min(limit, max(r.room/summaryShare, cfg.minRoom()))
	}
	return limit
}

// request is the SummaryRequest for a summary of p's head [headStart, cut)
// of at most limit tokens, the view at cur.
func (r *run) request(p plan, cut, headStart, cur, limit int) *SummaryRequest {
	previous := ""
	if p.sum != nil {
		previous = p.sum.Text
	}
	prefix := r.prefixView(p, cut)
	req := &SummaryRequest{
		Cut: cut, At: r.in.Chain[cut],
		Head: r.headView(p, headStart, cut), Previous: previous, MaxTokens: limit,
		Prefix: prefix, PrefixTokens: r.est(prefix),
	}
	req.HeadTokens = max(req.PrefixTokens-r.est(r.prefixView(p, headStart)), 0)
	if r.in.Pass == PassBackground {
		req.Kept = keptAfter(prefix, r.view(p))
		if len(req.Kept) > 0 {
			req.KeptTokens = max(cur-req.PrefixTokens, 0)
		}
	}
	return req
}

// accept takes the answer in Input.Summary for the summary sized sz (asked
// for at most limit tokens): the attempt is noted in the state for the throttle; a
// summary that makes the view smaller applies and releases the latch;
// anything else is a failure that engages it (unless the call was given
// up for its requester's sake) and falls back on ready.
func (r *run) accept(p *plan, sz cutSize, cur, limit int, ready pendingPlan) (int, bool) {
	cfg := r.cfg
	res := r.in.Summary
	r.st.LastAttempt, r.st.LastAttemptCount = r.in.Now, r.n
	r.ev.SummarizeCalled = true
	r.ev.SummaryTokens = limit
	text, err := strings.TrimSpace(res.Text), res.Err
	if err == nil && text == "" {
		err = ErrEmptySummary
	}
	if err == nil {
		s := *sz.cand
		s.Text = text
		if r.in.SummaryInUpstreamTokens {
			s.Tokens = limit
			if res.Tokens > 0 {
				s.Tokens = res.Tokens
			}
		}
		q := withSummary(sz.base, &s)
		e := r.estimate(q, &sized{*p, cur})
		if e < cur {
			*p = q
			r.done.add(stepSummarized)
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
		r.st.Latched, r.st.LatchCount = cfg.LatchGrowth > 0, r.n
		r.ev.LatchEngaged = cfg.LatchGrowth > 0
	}
	return r.fallBack(p, ready, cur)
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
	e := r.estimate(q, nil)
	if e >= cur {
		return cur
	}
	*p = q
	r.done.add(stepShrunk)
	return e
}
