package compaction

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// Config configures the engine (DESIGN.md § Compaction; the defaults are
// the configuration's, applied here too when a field is zero where zero
// makes no sense).
type Config struct {
	// TriggerRatio and TargetRatio apply to the room after the fixed part
	// F (leading system messages and the request's overhead): compaction
	// starts at F + TriggerRatio × (budget − F) (0 = 0.80) and aims below
	// F + TargetRatio × (budget − F) (0 = 0.60).
	TriggerRatio, TargetRatio float64
	// ReserveTokens is the output headroom subtracted from the window; the
	// request's max tokens wins when larger, and either is capped at a
	// quarter of the window (an agent that sends max_tokens 32000 to a 32k
	// model still gets compacted). 0 = only the request's.
	ReserveTokens int
	// KeepTail is the floor of verbatim tail messages (0 still keeps the
	// client's final message, and a cut never separates tool results from
	// their call).
	KeepTail int
	// TailRatio extends the verbatim tail backward by whole turns while it
	// stays within this share of the room (budget − F). 0 = no extension
	// (the configuration's default is 0.3).
	TailRatio float64
	// LatchGrowth is how many provider-visible messages a conversation must
	// grow after a failed summarize before the next attempt. 0 disables the
	// latch.
	LatchGrowth int
	// TrimToolResultTokens: tool results longer than this are excerpted
	// (0 = 1024). An excerpt keeps about half of it.
	TrimToolResultTokens int
	// MinInterval allows one summarize attempt per conversation per
	// interval unless the provider-visible message count changed. 0
	// disables the throttle.
	MinInterval time.Duration
	// SummarizerEnabled allows the summarize step (else trim and drop only).
	SummarizerEnabled bool
	// Shadow decides and reports but forwards the client's view unchanged
	// and does not advance the state; the summarizer is never called (the
	// decision is reported as ActionSummarizePending), because a summary
	// that is not stored would be asked for again at every step.
	Shadow bool
	// SummaryTokens caps the tokens a summarize call asks for (the
	// summarizer's max_tokens; 0 = 1024). A call asks for min(SummaryTokens,
	// room), where room is what the target leaves for the summary.
	SummaryTokens int
	// SummaryMinTokens: a summary is attempted only when at least this
	// much room is left for it (0 = 256), or SummaryTokens when that is
	// smaller: a summary asked for at most 64 tokens fits a room of 64, and
	// demanding 256 for it would drop turns where it fits. It is also the
	// least head a new summary folds while the view is within the budget.
	SummaryMinTokens int
}

// Defaults applied by New to zero fields.
const (
	DefaultTriggerRatio         = 0.80
	DefaultTargetRatio          = 0.60
	DefaultTrimToolResultTokens = 1024
	DefaultSummaryTokens        = 1024
	DefaultSummaryMinTokens     = 256
	DefaultTailRatio            = 0.3
)

// Summarizer summarizes the head of a conversation (see SummaryRequest).
type Summarizer interface {
	Summarize(ctx context.Context, req SummaryRequest) (string, error)
}

// SummaryRequest is one summarize call.
type SummaryRequest struct {
	// Head holds only messages no earlier summary covered, as they were
	// forwarded (trims applied, dropped messages left out).
	Head []chat.Message
	// Previous is the summary the head continues ("" when none): the
	// answer must fold it in.
	Previous string
	// MaxTokens is the size the summary may have (the room the view
	// leaves for it); the implementation asks its model for at most that.
	MaxTokens int
	// Prefix is the view as forwarded up to the cut: the leading system
	// messages, the previous summary's block when one applies, then Head.
	// It is what the upstream's prompt cache holds from the previous
	// request; PrefixTokens is its estimate. An implementation that calls
	// the chat upstream itself can extend it instead of sending a
	// transcript.
	Prefix       []chat.Message
	PrefixTokens int
	// Kept is set for a background summary (Input.Presummarize): the rest
	// of the view as it was just forwarded, after Prefix (the verbatim
	// tail and the client's final message); KeptTokens is its estimate.
	// The upstream's cache holds Prefix+Kept, so a request that extends
	// Prefix+Kept (asking for a summary of Prefix only) leaves that cache
	// whole for the client's next request, where one that extends Prefix
	// alone makes a one-slot server such as llama-server evaluate the
	// tail again.
	Kept       []chat.Message
	KeptTokens int
}

// Clock gives the time (the throttle's only use of it).
type Clock interface{ Now() time.Time }

// Estimator estimates the provider input of a view. The proxy's closure
// computes the view's digest chain and uses the conversation's anchors, the
// local estimator and the calibration ratio (anchor.EstimateView).
type Estimator func(view []chat.Message) anchor.Estimate

// Input is one request's view and everything the decision needs.
type Input struct {
	// Messages is the client's provider-visible view (UI-only removed,
	// pairing-valid unless pairing is off).
	Messages []chat.Message
	// Chain is the digest chain d[0..n] of Messages; stored records match
	// against it. Without it (wrong length) nothing is re-applied, recorded
	// or summarized (a summary that cannot be stored would be asked for
	// again at every step).
	Chain []anchor.Digest
	// State is the conversation's stored state.
	State State
	// Window is the model's context window in tokens (0 = unknown: stored
	// compaction is re-applied, nothing new is done); MaxTokens the
	// request's max_tokens / max_completion_tokens (0 = absent).
	Window, MaxTokens int
	// Estimate measures views.
	Estimate Estimator
	// Summarize false is a dry run (preview): the summarizer is never
	// called; ActionSummarizePending reports where a summary would be made.
	Summarize bool
	// IgnoreThrottle is set by overflow recovery: the throttle is ignored,
	// the latch honoured.
	IgnoreThrottle bool
	// Presummarize is a background run after a response (DESIGN step 2,
	// "Background pre-summarization"): the head is summarized as if the
	// view were over the trigger, under the same latch, throttle and
	// sizing, and a summary is stored in State.Pending, not applied; the
	// client's view is returned unchanged.
	Presummarize bool
	// SummaryInUpstreamTokens: the summarizer is the upstream's model, so
	// its limit (the call's max tokens) counts the same tokens as the
	// window. A summary asked for n tokens then takes at most n in the view,
	// whatever the estimator's ratio (calibrated on the conversation: code
	// and tool output) makes of its prose.
	SummaryInUpstreamTokens bool
	// Measured > 0 is the provider-measured size of this view (from an
	// overflow error); it overrides the estimate of the client's view, and
	// every candidate view's estimate is scaled up by the same ratio.
	Measured int
}

// Action names what a forwarded view carries.
type Action string

// The actions. The values are the X-Compactproxy-Compaction header values
// and the compactions_total label values.
const (
	ActionNone             Action = "none"
	ActionTrimmed          Action = "trimmed"
	ActionReused           Action = "reused"
	ActionSummarized       Action = "summarized"
	ActionDropped          Action = "dropped"
	ActionSummarizePending Action = "summarize_pending"
)

// Suppression reasons (Events.Suppressed), the
// summarize_suppressed_total{reason} label values.
const (
	SuppressedLatch    = "latch"
	SuppressedThrottle = "throttle"
)

// Errors reported in Events.SummaryError besides the summarizer's own.
var (
	// ErrEmptySummary: the summarizer answered no text.
	ErrEmptySummary = errors.New("compaction: empty summary")
	// ErrSummaryNotSmaller: the view with the summary was not smaller than
	// the view without it.
	ErrSummaryNotSmaller = errors.New("compaction: summary does not shrink the view")
)

// Events is what happened during one Compact, for metrics and logs.
type Events struct {
	// SummarizeCalled: the summarizer was called; SummarizeOK: its summary
	// is in the forwarded view (summarize_total{result}).
	SummarizeCalled, SummarizeOK bool
	// Suppressed is SuppressedLatch or SuppressedThrottle when a summarize
	// that was needed was skipped, else "".
	Suppressed string
	// LatchEngaged: a failed summarize engaged the latch.
	LatchEngaged bool
	// InvariantFailure: the produced view failed the pairing check and was
	// discarded (the client's view was forwarded).
	InvariantFailure bool
	// NewActions lists each kind of compaction this request applied
	// (compactions_total{action}): trimmed or dropped when new records were
	// made, summarized for a new summary, reused when a stored summary was
	// re-applied.
	NewActions []Action
	// SummaryError is why the summarize failed (nil when it did not).
	SummaryError error
	// SummaryTokens is the limit the summarize call was given (0 when none
	// was made).
	SummaryTokens int
	// Impossible: the fixed part alone (leading system messages and the
	// request's overhead) is over the budget; nothing new was done
	// (compaction_impossible_total).
	Impossible bool
}

// Output is the decision.
type Output struct {
	// Messages is the view to forward: Input.Messages itself when nothing
	// applies, in Shadow mode and after an invariant failure.
	Messages []chat.Message
	// Action is the strongest thing Messages carries: summarized > reused >
	// dropped > trimmed > none; summarize_pending in a dry run (or shadow)
	// that would have summarized.
	Action Action
	// Context estimates the client's view after stored compaction was
	// re-applied, before new compaction (Tokens = Input.Measured when set).
	Context anchor.Estimate
	// Forwarded estimates Messages.
	Forwarded int
	// Budget, Trigger and Target are the thresholds in tokens (0 when the
	// window is unknown); Fixed is the estimate of the fixed part F.
	Budget, Trigger, Target, Fixed int
	// State is the conversation's state to save when StateChanged.
	State        State
	StateChanged bool
	Events       Events
}

// Engine decides compactions. It keeps no per-conversation memory: all of
// it is in State. Safe for concurrent use.
type Engine struct {
	cfg   Config
	sum   Summarizer
	clock Clock
	// corrupt, when set (tests only), alters every view compaction
	// produced before the invariant check.
	corrupt func([]chat.Message) []chat.Message
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// New returns an engine. s may be nil (no summarize step); c nil means the
// system clock.
func New(cfg Config, s Summarizer, c Clock) *Engine {
	if cfg.TriggerRatio <= 0 {
		cfg.TriggerRatio = DefaultTriggerRatio
	}
	if cfg.TargetRatio <= 0 {
		cfg.TargetRatio = DefaultTargetRatio
	}
	if cfg.TargetRatio > cfg.TriggerRatio {
		cfg.TargetRatio = cfg.TriggerRatio
	}
	if cfg.TrimToolResultTokens <= 0 {
		cfg.TrimToolResultTokens = DefaultTrimToolResultTokens
	}
	if cfg.SummaryTokens <= 0 {
		cfg.SummaryTokens = DefaultSummaryTokens
	}
	if cfg.SummaryMinTokens <= 0 {
		cfg.SummaryMinTokens = DefaultSummaryMinTokens
	}
	cfg.TailRatio = min(max(cfg.TailRatio, 0), 1)
	cfg.KeepTail = max(cfg.KeepTail, 0)
	cfg.LatchGrowth = max(cfg.LatchGrowth, 0)
	if c == nil {
		c = systemClock{}
	}
	return &Engine{cfg: cfg, sum: s, clock: c}
}

// plan is a set of compactions applied to the client's messages.
type plan struct {
	sum   *Summary
	trims map[int]int // client position → Trim.Keep
	drops []Drop      // ascending, disjoint
}

func (p plan) empty() bool { return p.sum == nil && len(p.trims) == 0 && len(p.drops) == 0 }

func (p plan) withTrims(idx []int, keep int) plan {
	q := p
	q.trims = make(map[int]int, len(p.trims)+len(idx))
	for k, v := range p.trims {
		q.trims[k] = v
	}
	for _, i := range idx {
		q.trims[i] = keep
	}
	return q
}

// dropped tells whether client position i lies in one of the plan's drops.
func (p plan) dropped(i int) bool {
	for _, d := range p.drops {
		if i >= d.From && i < d.To {
			return true
		}
	}
	return false
}

// run is one Compact call.
type run struct {
	e     *Engine
	ctx   context.Context
	in    Input
	msgs  []chat.Message
	n     int
	chain bool // Input.Chain is usable
	lead  int  // leading system/developer messages
	tail  int  // start of the protected tail
	floor int  // the tail's floor: keep_tail messages, never opening on a tool result
	keep  int  // Trim.Keep for new trims of step 1
	scale float64
	ratio float64 // provider tokens per local token (Estimate.Ratio)
	st    State
	ev    Events

	excerpts map[[2]int]chat.Message
	blocks   map[*Summary][]chat.Message

	// reapplied are the stored trims that matched.
	reapplied map[int]int

	newTrims, newSum, newDrop, pending bool
	usedPending                        bool // a background summary was applied
}

// Compact decides what to forward for one request (DESIGN.md § Compaction).
// It never fails: a problem leaves the client's view forwarded.
func (e *Engine) Compact(ctx context.Context, in Input) Output {
	r := &run{
		e:        e,
		ctx:      ctx,
		in:       in,
		msgs:     in.Messages,
		n:        len(in.Messages),
		chain:    len(in.Chain) == len(in.Messages)+1,
		keep:     e.cfg.TrimToolResultTokens * bytesPerToken / 2,
		scale:    1,
		ratio:    1,
		st:       in.State.clone(),
		excerpts: make(map[[2]int]chat.Message),
		blocks:   make(map[*Summary][]chat.Message),
	}
	if r.in.Estimate == nil {
		r.in.Estimate = byteEstimate
	}
	for r.lead < r.n && isSystemRole(r.msgs[r.lead].Role) {
		r.lead++
	}
	r.tail = tailStart(r.msgs, e.cfg.KeepTail)
	r.floor = r.tail
	return r.compact()
}

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

func (r *run) compact() Output {
	cfg := r.e.cfg
	out := Output{}

	p := r.reapply()
	r.reapplied = p.trims
	view := r.in.Messages
	if !p.empty() {
		view = r.view(p)
	}
	out.Context = r.in.Estimate(view)
	if q := out.Context.Ratio; q > 0 {
		r.ratio = q
	}
	cur := out.Context.Tokens
	if m := r.in.Measured; m > 0 {
		if cur > 0 && m > cur {
			r.scale = float64(m) / float64(cur)
		}
		out.Context.Tokens = m
		cur = m
	}

	out.Budget = Budget(r.in.Window, cfg.ReserveTokens, r.in.MaxTokens)
	if out.Budget <= 0 || r.n == 0 {
		return r.finish(out, p, cur)
	}
	// The fixed part: what no compaction can shrink (the leading system
	// messages and the request's overhead, as estimated).
	out.Fixed = r.est(r.msgs[:r.lead:r.lead])
	room := out.Budget - out.Fixed
	if room <= 0 {
		out.Trigger, out.Target = out.Budget, out.Budget
		if cur >= out.Budget {
			r.ev.Impossible = true
		}
		return r.finish(out, p, cur)
	}
	out.Trigger = out.Fixed + int(float64(room)*cfg.TriggerRatio)
	out.Target = out.Fixed + int(float64(room)*cfg.TargetRatio)
	if r.in.Presummarize {
		return r.presummarize(out, p, cur)
	}
	if cur >= out.Trigger {
		headStart := r.lead
		if p.sum != nil {
			headStart = p.sum.Cut
		}
		r.tail = r.extendTail(r.tail, headStart, out.Fixed, r.tailLimit(out))
		cur = r.decide(&p, cur, out.Budget, out.Target)
	}
	return r.finish(out, p, cur)
}

// tailLimit is how far the verbatim tail may extend beyond its floor:
// tail_ratio of the room, but never so far that a summary of
// summary_min_tokens (with its label) no longer fits under the target. At
// a 2k window the extended tail alone would otherwise leave the summary no
// room, and the view would land over the target, be summarized again at
// the next step, or be dropped instead.
func (r *run) tailLimit(out Output) int {
	cfg := r.e.cfg
	room := out.Budget - out.Fixed
	label := int(float64(len(summaryLabel)+len(ackText))/bytesPerToken*r.ratio) + 2*anchorMessageOverhead
	return min(int(float64(room)*cfg.TailRatio), out.Target-out.Fixed-cfg.minRoom()-label)
}

// anchorMessageOverhead is the template's cost of a message, as the local
// estimator counts it.
const anchorMessageOverhead = anchor.MessageOverheadTokens

// extendTail moves the cut back by whole turns (to earlier messages that
// are not tool results) while the tail, estimated with the leading system
// messages in front of it, stays within limit tokens beyond the fixed part.
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
		v := make([]chat.Message, 0, r.lead+r.n-c)
		v = append(v, r.msgs[:r.lead]...)
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

// reapply returns the stored compactions that still match the client's
// chain: the summary whose head digest matches at its cut, trims whose
// message (and everything before it) is unchanged, the drops likewise.
func (r *run) reapply() plan {
	p := plan{trims: map[int]int{}}
	if !r.chain {
		return p
	}
	ch := r.in.Chain
	if s := r.st.Summary; s != nil && s.Lead == r.lead && s.Cut > s.Lead && s.Cut < r.n &&
		ch[s.Cut] == s.Head && s.Ask < s.Cut {
		p.sum = s
	}
	for _, t := range r.st.Trims {
		if t.Index < 0 || t.Index >= r.n-1 || ch[t.Index+1] != t.Prefix {
			continue // the final message is never trimmed
		}
		if p.sum != nil && t.Index < p.sum.Cut {
			continue
		}
		if _, ok := r.trimmed(t.Index, t.Keep); ok {
			p.trims[t.Index] = t.Keep
		}
	}
	lo := r.lead
	if p.sum != nil {
		lo = p.sum.Cut
	}
	for _, d := range r.st.Drops {
		if d.From < lo || d.From >= d.To || d.To >= r.n || ch[d.To] != d.Prefix {
			continue
		}
		p.drops = append(p.drops, d)
		lo = d.To
	}
	return p
}

// view builds the messages a plan forwards.
func (r *run) view(p plan) []chat.Message {
	out := make([]chat.Message, 0, r.n+3)
	di := 0
	for i := 0; i < r.n; i++ {
		if p.sum != nil && i == p.sum.Lead {
			out = append(out, r.block(p.sum)...)
			i = p.sum.Cut - 1
			continue
		}
		for di < len(p.drops) && p.drops[di].To <= i {
			di++
		}
		if di < len(p.drops) && i == p.drops[di].From {
			i = p.drops[di].To - 1
			continue
		}
		if keep, ok := p.trims[i]; ok {
			m, _ := r.trimmed(i, keep)
			out = append(out, m)
			continue
		}
		out = append(out, r.msgs[i])
	}
	return out
}

func (r *run) block(s *Summary) []chat.Message {
	b, ok := r.blocks[s]
	if !ok {
		b = summaryBlock(s, r.msgs)
		r.blocks[s] = b
	}
	return b
}

// trimmed returns the excerpt of message i (cached for this call).
func (r *run) trimmed(i, keep int) (chat.Message, bool) {
	k := [2]int{i, keep}
	if m, ok := r.excerpts[k]; ok {
		return m, true
	}
	m, ok := trimmed(r.msgs[i], keep)
	if ok {
		r.excerpts[k] = m
	}
	return m, ok
}

// est estimates a view, scaled when a measurement said the estimator
// undercounts.
func (r *run) est(view []chat.Message) int {
	t := r.in.Estimate(view).Tokens
	if r.scale != 1 {
		t = int(float64(t)*r.scale + 0.5)
	}
	return t
}

// decide runs the steps over the trigger and returns the estimate of the
// resulting plan.
func (r *run) decide(p *plan, cur, budget, target int) int {
	cfg := r.e.cfg
	headStart := r.lead
	if p.sum != nil {
		headStart = p.sum.Cut
	}

	// 1. Trim tool results outside the leading system messages and the
	// protected tail, oldest first.
	if cands := r.trimCandidates(*p, headStart, max(r.tail, headStart), r.long()); len(cands) > 0 {
		var reached bool
		cur, reached = r.applyTrims(p, cands, r.keep, target)
		if reached {
			return cur
		}
	}

	// 2. Summarize the head when trim could not reach the target.
	if cfg.SummarizerEnabled && r.e.sum != nil && r.chain && r.tail < r.n && (r.tail > headStart || cur > budget) {
		var summarized bool
		if cur, summarized = r.summarize(p, cur, headStart, budget, target); summarized && cur <= budget {
			return cur // no drop while a summary fits
		}
		// A dry run that would summarize goes on: its view (without the
		// summary) is what a request forwards when the summary cannot be
		// made now (another replica holds it, the store is down), so it
		// must fit too.
	}

	// 4. Still over: excerpt the oldest long tool results after the
	// summary (never the final message), then drop whole turns when over
	// the budget.
	if cur >= target {
		start := r.lead
		if p.sum != nil {
			start = p.sum.Cut
		}
		if cands := r.trimCandidates(*p, start, r.n-1, r.long()); len(cands) > 0 {
			cur, _ = r.applyTrims(p, cands, r.keep, target)
		}
	}
	if cur > budget {
		// Over the budget even so: excerpt any tool result after the
		// summary but the final message to a short excerpt, before
		// dropping turns.
		start := r.lead
		if p.sum != nil {
			start = p.sum.Cut
		}
		if cands := r.trimCandidates(*p, start, r.n-1, 0); len(cands) > 0 {
			cur, _ = r.applyTrims(p, cands, tightKeep, budget+1)
		}
	}
	if cur > budget {
		cur = r.dropTurns(p, cur, budget, target)
	}
	return cur
}

// tightKeep is the excerpt size (text bytes) of the results excerpted when
// the view is over the budget, or leaves a summary no room, with results
// that are not long: a small window (2k–4k tokens with a tools array)
// cannot hold two whole file reads.
const tightKeep = 512

// long is the size, in provider tokens, above which a tool result is long
// (compaction.trim.tool_result_tokens).
func (r *run) long() int { return r.e.cfg.TrimToolResultTokens }

// trimCandidates lists, oldest first, the tool results in [from, to)
// longer than limit provider tokens (measured as the local size of their
// text times the estimate's ratio) that the plan does not trim or drop yet.
func (r *run) trimCandidates(p plan, from, to, limit int) []int {
	var out []int
	for i := max(from, r.lead); i < to && i < r.n; i++ {
		m := &r.msgs[i]
		if !trimmable(m) || float64(textTokens(m))*r.ratio <= float64(limit) {
			continue
		}
		if _, done := p.trims[i]; done {
			continue
		}
		if p.dropped(i) {
			continue
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
	all := p.withTrims(cands, keep)
	estAll := r.est(r.view(all))
	if estAll >= target {
		*p = all
		return estAll, false
	}
	// The estimate falls as more results are excerpted: binary search for
	// the smallest prefix of candidates below the target.
	lo, hi, hiEst := 1, len(cands), estAll
	for lo < hi {
		mid := (lo + hi) / 2
		if e := r.est(r.view(p.withTrims(cands[:mid], keep))); e < target {
			hi, hiEst = mid, e
		} else {
			lo = mid + 1
		}
	}
	*p = p.withTrims(cands[:hi], keep)
	return hiEst, true
}

// askFor returns the client position of the most recent text-only user
// message when it lies in the head [lead, cut) (-1 when the tail carries
// one, or there is none) and whether it must be quoted inside the summary
// because the tail itself starts with a user message.
func (r *run) askFor(cut int) (int, bool) {
	for i := r.n - 1; i >= r.lead; i-- {
		m := &r.msgs[i]
		if m.Role != "user" || m.MediaParts > 0 {
			continue
		}
		if i >= cut {
			return -1, false
		}
		return i, r.msgs[cut].Role == "user"
	}
	return -1, false
}

// headView is the head [from, cut) as it is forwarded under p: trimmed
// results as excerpts, dropped messages left out (a summarize call never
// sends a message again that an earlier compaction removed).
func (r *run) headView(p plan, from, cut int) []chat.Message {
	out := make([]chat.Message, 0, cut-from)
	for i := from; i < cut; i++ {
		if p.dropped(i) {
			continue
		}
		if keep, ok := p.trims[i]; ok {
			m, _ := r.trimmed(i, keep)
			out = append(out, m)
			continue
		}
		out = append(out, r.msgs[i])
	}
	return out
}

// applyPending applies the background summary when its head still matches
// the client's chain, it lies within the current head and it shrinks the
// view: no model call on the request that crosses the trigger. base is the
// plan without the head (its trims after the cut are kept).
func (r *run) applyPending(p *plan, base plan, headStart, cur int) (plan, int, bool) {
	ps := r.st.Pending
	if ps == nil || !r.chain || ps.Lead != r.lead || ps.Cut <= headStart || ps.Cut > max(r.tail, r.floor) ||
		ps.Cut >= r.n || r.in.Chain[ps.Cut] != ps.Head {
		return plan{}, 0, false
	}
	s := *ps
	s.Ask, s.AskInline = r.askFor(s.Cut)
	next := r.msgs[s.Cut].Role
	if s.Ask >= 0 && !s.AskInline {
		next = "user"
	}
	s.Ack = next == "user"
	q := withSummary(base, &s)
	e := r.summaryEst(q)
	if e >= cur {
		return plan{}, 0, false
	}
	r.st.Pending = nil
	r.usedPending = true
	r.st.Latched, r.st.LatchCount = false, 0
	return q, e, true
}

// withSummary replaces the head of base by s under the trims after the
// cut; the drops after the cut are kept, those in the head are covered by
// it.
func withSummary(base plan, s *Summary) plan {
	q := plan{sum: s, trims: map[int]int{}}
	for i, k := range base.trims {
		if i >= s.Cut {
			q.trims[i] = k
		}
	}
	for _, d := range base.drops {
		if d.From >= s.Cut {
			q.drops = append(q.drops, d)
		}
	}
	return q
}

// summarySplit estimates p's view without its summary's text (bare) and
// what the text takes in it: the estimate's share, or Summary.Tokens when
// that bound is known and smaller (a summary asked for n tokens of the
// upstream's own model takes at most n). Without a summary, text is 0.
func (r *run) summarySplit(p plan) (bare, text int) {
	full := r.est(r.view(p))
	s := p.sum
	if s == nil {
		return full, 0
	}
	b := *s
	b.Text = ""
	q := p
	q.sum = &b
	bare = r.est(r.view(q))
	text = max(full-bare, 0)
	if s.Tokens > 0 {
		text = min(text, s.Tokens)
	}
	return bare, text
}

// summaryEst estimates q, a plan whose summary is new, with its text
// counted as summarySplit does. (The first response then measures the
// view exactly: later requests are anchored.)
func (r *run) summaryEst(q plan) int {
	bare, text := r.summarySplit(q)
	return bare + text
}

// minRoom is the least room a summary needs: summary_min_tokens, or the
// summary's own limit when that is smaller.
func (c Config) minRoom() int { return min(c.SummaryMinTokens, c.SummaryTokens) }

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
	cfg := r.e.cfg
	out.Messages, out.Action, out.Forwarded = r.in.Messages, ActionNone, cur
	headStart := r.lead
	if p.sum != nil {
		headStart = p.sum.Cut
	}
	r.tail = r.nextTail(headStart, out)
	if ps := r.st.Pending; ps != nil && r.chain && ps.Lead == r.lead && ps.Cut > headStart && ps.Cut < r.n &&
		r.in.Chain[ps.Cut] == ps.Head {
		// The background summary made at an earlier step still applies:
		// one is enough until the trigger is crossed.
	} else if cfg.SummarizerEnabled && r.e.sum != nil && r.chain && !cfg.Shadow && r.tail > headStart && r.tail < r.n {
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
	return out
}

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
	floor := tailStart(r.msgs, r.e.cfg.KeepTail-1)
	if floor <= now {
		return now
	}
	final := tailStart(r.msgs, 1)
	// The final turn's size, less the request's own cost (tools, template)
	// that an estimate of any view carries.
	turn := r.est(r.msgs[final:]) - r.est(r.msgs[:0])
	return max(now, r.extendTail(floor, headStart, out.Fixed, r.tailLimit(out)-turn))
}

// prefixView is the view p forwards, up to client position cut.
func (r *run) prefixView(p plan, cut int) []chat.Message {
	q := p
	q.trims = map[int]int{}
	for i, k := range p.trims {
		if i < cut {
			q.trims[i] = k
		}
	}
	q.drops = nil
	for _, d := range p.drops {
		if d.To <= cut {
			q.drops = append(q.drops, d)
		}
	}
	v := r.view(q)
	// r.view walks every client message; keep what precedes the cut.
	n := 0
	for i := 0; i < cut; i++ {
		if p.sum != nil && i >= p.sum.Lead && i < p.sum.Cut {
			if i == p.sum.Lead {
				n += len(r.block(p.sum))
			}
			continue
		}
		if q.dropped(i) {
			continue
		}
		n++
	}
	return v[:n:n]
}

// summarize runs step 2 (sizing, latch, throttle, the call) and returns the
// estimate of the resulting plan and whether a summary now applies.
func (r *run) summarize(p *plan, cur, headStart, budget, target int) (int, bool) {
	cfg := r.e.cfg
	// measure sizes a summary with the verbatim tail from cut on: the
	// summary's room is the target minus the view without the head
	// (system messages, the summary's label, acknowledgement, ask, tail).
	measure := func(cut int) (cand *Summary, base plan, withoutHead, room int) {
		ask, inline := r.askFor(cut)
		next := r.msgs[cut].Role
		if ask >= 0 && !inline {
			next = "user"
		}
		cand = &Summary{
			Cut: cut, Head: r.in.Chain[cut], Lead: r.lead,
			Ack: next == "user", Ask: ask, AskInline: inline,
		}
		base = withSummary(*p, cand)
		withoutHead = r.est(r.view(base))
		room = target - withoutHead
		if room < cfg.minRoom() {
			// Excerpt the tail's oldest long tool results (never the final
			// message) and measure again; then accept the budget.
			if cands := r.trimCandidates(base, cut, r.n-1, 0); len(cands) > 0 {
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
	if room < cfg.minRoom() {
		// The tail's floor itself leaves no summary room (a small window
		// with a large fixed part: keep_tail spans two turns). Its older
		// turns go into the summary, never past the final message's turn:
		// otherwise they would be dropped, and their content lost.
		final := r.n - 1
		for final > cut && isToolRole(r.msgs[final].Role) {
			final--
		}
		for c := cut + 1; c <= final && room < cfg.minRoom(); c++ {
			if isToolRole(r.msgs[c].Role) {
				continue
			}
			if cc, cb, cw, cr := measure(c); cr >= cfg.minRoom() {
				cut, cand, base, withoutHead, room = c, cc, cb, cw, cr
			}
		}
		if room < cfg.minRoom() && final > headStart {
			// No cut leaves a summary its least room: the fixed part, the
			// ask and the final message's turn fill the budget (a two-read
			// turn at Qwen2.5 2k). The drop would remove every turn before
			// the final one and leave the view over the budget all the
			// same. A new summary no larger than the one it replaces folds
			// them instead: a view the drop's size, nothing lost.
			_, old := r.summarySplit(*p)
			if old = min(old, cfg.SummaryTokens); old >= cfg.minRoom() {
				if final != cut || cand == nil {
					cand, base, withoutHead, _ = measure(final)
					cut = final
				}
				room = old
			}
		}
		if cand == nil || room < cfg.minRoom() {
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
	fresh := r.est(r.prefixView(*p, cut)) - r.est(r.prefixView(*p, headStart))
	if room < cfg.minRoom() || headTokens < cfg.minRoom() || (fresh < cfg.SummaryMinTokens && cur <= budget) {
		return cur, false // no summary fits: step 4
	}
	limit := min(cfg.SummaryTokens, room, headTokens)

	if q, e, ok := r.applyPending(p, base, headStart, cur); ok {
		*p = q
		return e, true
	}

	n := r.n
	if r.st.Latched {
		if n < r.st.LatchCount+cfg.LatchGrowth {
			r.ev.Suppressed = SuppressedLatch
			return cur, false
		}
		r.st.Latched = false
	}
	now := r.e.clock.Now()
	if cfg.MinInterval > 0 && !r.in.IgnoreThrottle && !r.st.LastAttempt.IsZero() &&
		r.st.LastAttemptCount == n && now.Sub(r.st.LastAttempt) < cfg.MinInterval {
		r.ev.Suppressed = SuppressedThrottle
		return cur, false
	}
	if !r.in.Summarize || cfg.Shadow {
		r.pending = true
		return cur, false
	}

	r.st.LastAttempt, r.st.LastAttemptCount = now, n
	r.ev.SummarizeCalled = true
	r.ev.SummaryTokens = limit
	previous := ""
	if p.sum != nil {
		previous = p.sum.Text
	}
	prefix := r.prefixView(*p, cut)
	req := SummaryRequest{
		Head: r.headView(*p, headStart, cut), Previous: previous, MaxTokens: limit,
		Prefix: prefix, PrefixTokens: r.est(prefix),
	}
	if r.in.Presummarize {
		req.Kept = keptAfter(prefix, r.view(*p))
		if len(req.Kept) > 0 {
			req.KeptTokens = max(cur-req.PrefixTokens, 0)
		}
	}
	text, err := r.e.sum.Summarize(r.ctx, req)
	text = strings.TrimSpace(text)
	if err == nil && text == "" {
		err = ErrEmptySummary
	}
	if err == nil {
		s := *cand
		s.Text = text
		if r.in.SummaryInUpstreamTokens {
			s.Tokens = limit
		}
		q := withSummary(base, &s)
		e := r.summaryEst(q)
		if e < cur {
			*p = q
			r.newSum = true
			r.ev.SummarizeOK = true
			r.st.Latched, r.st.LatchCount = false, 0
			return e, true
		}
		err = fmt.Errorf("%w (%d tokens, %d before)", ErrSummaryNotSmaller, e, cur)
	}
	r.ev.SummaryError = err
	if r.ctx.Err() == nil { // a client that went away is not a summarizer failure
		r.st.Latched, r.st.LatchCount = cfg.LatchGrowth > 0, n
		r.ev.LatchEngaged = cfg.LatchGrowth > 0
	}
	return cur, false
}

// dropUnit is a whole turn: a message that is not a tool result and the
// tool results that directly follow it, client positions [from, to).
type dropUnit struct{ from, to int }

// dropTurns is step 4: it drops the oldest whole turns after the system
// messages (after the summary when one applies), first from the head down
// to the target; when that still leaves the view over the budget, from the
// tail too (never the final message's turn), down to the budget. Never
// dropped: the conversation's first user message (the task) and the most
// recent user message (the instruction being worked on). Every dropped
// range starts and ends at a message that is not a tool result
// (pairing-safe), and the messages it brings together never are two user
// or two assistant messages.
func (r *run) dropTurns(p *plan, cur, budget, target int) int {
	s := r.lead
	if p.sum != nil {
		s = p.sum.Cut
	}
	final := r.n - 1
	for final > 0 && isToolRole(r.msgs[final].Role) {
		final--
	}
	task, last := -1, -1
	for i := r.lead; i < r.n; i++ {
		if r.msgs[i].Role == "user" {
			if task < 0 {
				task = i
			}
			last = i
		}
	}
	var units []dropUnit
	for i := s; i < final; {
		j := i + 1
		for j < final && isToolRole(r.msgs[j].Role) {
			j++
		}
		if i != task && i != last && !isToolRole(r.msgs[i].Role) {
			units = append(units, dropUnit{i, j})
		}
		i = j
	}
	if len(units) == 0 {
		return cur
	}
	// The drop sets, oldest units first: each adds the next unit unless
	// that would bring two user or two assistant messages together (the
	// unit is kept then, and later ones may still go).
	valid := func(q plan) bool {
		for _, d := range q.drops {
			before, after := r.roleBefore(q, d.From), r.msgs[d.To].Role
			if (before == "user" || before == "assistant") && before == after {
				return false
			}
		}
		return true
	}
	var sets []plan // sets[k] drops k+1 units
	headSets := 0
	var chosen []dropUnit
	for _, u := range units {
		try := append(slices.Clone(chosen), u)
		q := *p
		q.drops = nil
		for _, c := range try {
			if m := len(q.drops); m > 0 && q.drops[m-1].To == c.from {
				q.drops[m-1].To = c.to
				continue
			}
			q.drops = append(q.drops, Drop{From: c.from, To: c.to})
		}
		if !valid(q) {
			continue
		}
		if r.chain {
			for i := range q.drops {
				q.drops[i].Prefix = r.in.Chain[q.drops[i].To]
			}
		}
		chosen = try
		sets = append(sets, q)
		if u.to <= r.tail {
			headSets = len(sets)
		}
	}
	// pick returns the first of sets[:limit] whose view is at goal or
	// below, else the last (the estimate falls as more units go).
	pick := func(limit, goal int) (plan, int) {
		lo, hi := 0, limit-1
		for lo < hi {
			mid := (lo + hi) / 2
			if r.est(r.view(sets[mid])) <= goal {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		return sets[lo], r.est(r.view(sets[lo]))
	}
	if headSets > 0 {
		if q, e := pick(headSets, target-1); e < cur {
			*p, cur = q, e
			r.newDrop = true
			if cur <= budget {
				return cur
			}
		}
	}
	if len(sets) > headSets {
		if q, e := pick(len(sets), budget); e < cur {
			*p, cur = q, e
			r.newDrop = true
		}
	}
	return cur
}

// roleBefore is the role of the forwarded message just before client
// position i under q ("" at the start).
func (r *run) roleBefore(q plan, i int) string {
	for j := i - 1; j >= 0; j-- {
		if q.sum != nil && j < q.sum.Cut && j >= q.sum.Lead {
			b := r.block(q.sum)
			return b[len(b)-1].Role
		}
		if q.dropped(j) {
			continue
		}
		return r.msgs[j].Role
	}
	return ""
}

// finish builds the forwarded view, checks it, and fills the output.
func (r *run) finish(out Output, p plan, cur int) Output {
	cfg := r.e.cfg
	in := r.in
	// New trims: in the forwarded plan and not re-applied (trims of step 1
	// that a summary then replaced are not).
	for i := range p.trims {
		if _, ok := r.reapplied[i]; !ok {
			r.newTrims = true
			break
		}
	}
	fresh := r.newTrims || r.newSum || r.newDrop || r.usedPending

	out.Messages = in.Messages
	if !p.empty() {
		out.Messages = r.view(p)
		if r.e.corrupt != nil {
			out.Messages = r.e.corrupt(out.Messages)
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
	if r.newTrims {
		r.ev.NewActions = append(r.ev.NewActions, ActionTrimmed)
	}
	if r.pending {
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
