package compaction

import (
	"errors"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// Config configures the planner (DESIGN.md § Compaction; the defaults are
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
	// stays within this share of the room (budget − F). 0 = no extension:
	// NewPlanner does not apply DefaultTailRatio, the configuration's
	// default.
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
	// Dedupe enables step 0's lossless reduction over the trigger: a tool
	// result that a later one repeats (the same text without the tool's own
	// envelope, or an older read of a file read again by the same tool)
	// becomes a pointer to the later call. Mask enables the placeholder
	// step after it: old tool results outside the tail and the working set
	// become a placeholder naming their call, as few as reach the target,
	// before any trim or summary. With either on, the working set (the
	// latest read of a file re-read or edited, the latest output of a
	// command re-run) is never excerpted short of the last resort. Both off
	// at zero: the proxy sets them from its configuration.
	Dedupe, Mask bool
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

// Defaults applied by NewPlanner to zero fields.
const (
	DefaultTriggerRatio         = 0.80
	DefaultTargetRatio          = 0.60
	DefaultTrimToolResultTokens = 1024
	DefaultSummaryTokens        = 1024
	DefaultSummaryMinTokens     = 256
)

// DefaultTailRatio is the configuration's default for Config.TailRatio
// (compaction.tail_ratio). NewPlanner does not apply it: a zero TailRatio
// means no extension of the verbatim tail.
const DefaultTailRatio = 0.1

// SummaryRequest is the summary a decision asks for (Output.Need): what to
// fold, how large it may be, and the request shape. The proxy obtains it
// and plans again with the answer in Input.Summary.
type SummaryRequest struct {
	// Cut and At identify the summary: it replaces the client's messages
	// up to position Cut, whose chain digest d[Cut] is At. An answer
	// (SummaryResult) applies only to a plan that asks for the same.
	Cut int
	At  anchor.Digest
	// Head holds only messages no earlier summary covered, as they were
	// forwarded (trims applied, dropped messages left out).
	Head []chat.Message
	// Previous is the summary the head continues ("" when none): the
	// answer must fold it in.
	Previous string
	// MaxTokens is the size the summary may have: the room the view leaves
	// for it, never more than the history it folds; ask the model for at
	// most that.
	MaxTokens int
	// Prefix is the view as forwarded up to the cut: the leading system
	// messages, the previous summary's block when one applies, then Head.
	// It is what the upstream's prompt cache holds from the previous
	// request; PrefixTokens is its estimate. A summarizer that calls the
	// chat upstream itself can extend it instead of sending a transcript.
	Prefix       []chat.Message
	PrefixTokens int
	// HeadTokens is the estimate of Head's share of Prefix (PrefixTokens
	// less the prefix before the head): what the head costs in the
	// upstream's tokens, by which a summarizer that sends it as a
	// transcript calibrates its own count of that text.
	HeadTokens int
	// Kept is set for a background summary (PassBackground): the rest of
	// the view as it was just forwarded, after Prefix (the verbatim tail
	// and the client's final message); KeptTokens is its estimate. The
	// upstream's cache holds Prefix+Kept, so a request that extends
	// Prefix+Kept (asking for a summary of Prefix only) leaves that cache
	// whole for the client's next request, where one that extends Prefix
	// alone makes a one-slot server such as llama-server evaluate the
	// tail again.
	Kept       []chat.Message
	KeptTokens int
}

// SummaryResult is the answer to a SummaryRequest, handed back in
// Input.Summary with the same Input the request came from.
type SummaryResult struct {
	// Cut and At are the request's (what the answer is a summary of).
	Cut int
	At  anchor.Digest
	// Text is the summarizer's answer; Err why there is none.
	Text string
	Err  error
	// Tokens is the answer's size as the summarizer reported it (its
	// completion tokens; 0 = not reported). When the summarizer is the
	// upstream's model (Input.SummaryInUpstreamTokens) it is the summary's
	// exact size in the window's tokens.
	Tokens int
	// Canceled: the call was given up because its requester went away,
	// which says nothing about the summarizer (no latch).
	Canceled bool
}

// ResultFor returns the answer to req: text of tokens reported tokens (0 =
// not reported), or err; canceled when the call was given up for a reason
// of the requester's.
func ResultFor(req *SummaryRequest, text string, tokens int, err error, canceled bool) *SummaryResult {
	return &SummaryResult{Cut: req.Cut, At: req.At, Text: text, Tokens: tokens, Err: err, Canceled: canceled}
}

// answers reports whether res answers a summary of the client's messages
// up to cut, whose chain digest is at.
func (res *SummaryResult) answers(cut int, at anchor.Digest) bool {
	return res != nil && res.Cut == cut && res.At == at
}

// Pass names why the planner runs: a small set of passes, each with its own
// rules, instead of flags.
type Pass int

const (
	// PassForward is a request on its way upstream (and a preview of one):
	// the full decision.
	PassForward Pass = iota
	// PassRecover is overflow recovery (DESIGN step 5): the upstream
	// refused the view as too long; the throttle is ignored, the latch
	// honoured.
	PassRecover
	// PassBackground is background pre-summarization after a response
	// (DESIGN step 2): the head is summarized as if the view were over the
	// trigger, under the same latch, throttle and sizing; the summary is
	// stored in State.Pending, not applied, and the client's view is
	// returned unchanged.
	PassBackground
)

// Estimator estimates the provider input of a view. The proxy's closure
// computes the view's digest chain and uses the conversation's anchors, the
// local estimator and the calibration ratio (anchor.EstimateView).
type Estimator func(view []chat.Message) anchor.Estimate

// Input is one request's view and everything the decision needs.
type Input struct {
	// Messages is the client's provider-visible view (UI-only removed,
	// pairing-valid unless pairing is off).
	Messages []chat.Message
	// Chain is the record chain of Messages (RecordChain: keyed after the
	// leading system messages), d[0..n]; stored records match against it.
	// Without it (wrong length) nothing is re-applied, stored or
	// summarized (a summary that cannot be stored would be asked for again
	// at every step).
	Chain []anchor.Digest
	// State is the conversation's stored state.
	State State
	// Window is the model's context window in tokens (0 = unknown: stored
	// compaction is re-applied, nothing new is done); MaxTokens the
	// request's max_tokens / max_completion_tokens (0 = absent).
	Window, MaxTokens int
	// Estimate measures views.
	Estimate Estimator
	// Now is the time of the decision (the throttle reads it).
	Now time.Time
	// Pass is why the planner runs (PassForward when zero).
	Pass Pass
	// Summary is the answer to the SummaryRequest an earlier Plan of this
	// same Input returned in Output.Need; nil before one was obtained.
	Summary *SummaryResult
	// SummaryInUpstreamTokens: the summarizer is the upstream's model, so
	// its reported completion tokens (else its limit, the call's max
	// tokens) count the same tokens as the window: a new summary is
	// counted at that size in the view, whatever the estimator's ratio
	// (calibrated on the conversation: code and tool output) makes of its
	// prose.
	SummaryInUpstreamTokens bool
	// PreviousLen is how many client messages the lineage's previous
	// request held (the selected Lineage's TipLen; 0 = unknown: every
	// message but the final one counts as forwarded before). It tells a
	// change that resets the provider's cache (Output.CacheReset) from one
	// in messages it never saw.
	PreviousLen int
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
	ActionNone       Action = "none"
	ActionTrimmed    Action = "trimmed"
	ActionReused     Action = "reused"
	ActionSummarized Action = "summarized"
	ActionDropped    Action = "dropped"
	// ActionMasked: the view carries step 0's pointers or placeholders
	// and no excerpt, summary or drop.
	ActionMasked           Action = "masked"
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

// Events is what happened during one Plan, for metrics and logs.
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
	// dropped > trimmed > masked > none; summarize_pending when a summary is due
	// and not in Messages (Need asks for it; in shadow mode Need is nil).
	Action Action
	// Need, when set, is the summary this decision asks for. Messages is
	// then the view without it: what to forward when the summary cannot be
	// had now. To use it, obtain the summary and Plan the same Input again
	// with its answer in Input.Summary.
	Need *SummaryRequest
	// Context estimates the client's view after stored compaction was
	// re-applied, before new compaction (Tokens = Input.Measured when set).
	Context anchor.Estimate
	// Forwarded estimates Messages.
	Forwarded int
	// Budget, Trigger and Target are the thresholds in tokens (0 when the
	// window is unknown); Fixed is the estimate of the fixed part F.
	Budget, Trigger, Target, Fixed int
	// Reduced is what this decision removed, in estimated tokens, by the
	// ladder's step (new records only; re-applied ones removed nothing
	// new; in Shadow mode what the decision would remove): the proxy adds
	// each to reduced_tokens_total{step}.
	Reduced Reduction
	// ResetAt is the first client position whose forwarded bytes this
	// decision changed (a new record, summary or drop), −1 when none.
	// CacheReset: ResetAt lies in what the previous forwarded view of the
	// lineage held (Input.PreviousLen), so the provider re-reads the view
	// from there uncached once (cache_resets_total; never in Shadow mode,
	// which forwards the client's view).
	ResetAt    int
	CacheReset bool
	// ResetTokens estimates what a cache reset makes the provider read
	// uncached once: Messages from ResetAt on (0 without a reset). Set
	// against Reduced, which every later step saves, it is what the
	// decision must pay back.
	ResetTokens int
	// State is the conversation's state to save when StateChanged.
	State        State
	StateChanged bool
	Events       Events
}

// Reduction is the estimated tokens each step of the ladder removed in
// one decision (Output.Reduced), the reduced_tokens_total{step} label
// values in its field names' lower case.
type Reduction struct {
	Dedupe, Mask, Trim, Summarize, Drop int
}

// workingSet tells whether step 0 runs, which keeps the working set
// verbatim.
func (c *Config) workingSet() bool { return c.Dedupe || c.Mask }

// Planner decides compactions. It keeps no per-conversation memory: all of
// it is in State; it reads no clock and calls nothing. Safe for concurrent
// use.
type Planner struct {
	cfg Config
	// corrupt, when set (tests only), alters every view compaction
	// produced before the invariant check.
	corrupt func([]chat.Message) []chat.Message
}

// NewPlanner returns a planner; zero fields of cfg take their defaults.
func NewPlanner(cfg Config) *Planner {
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
	return &Planner{cfg: cfg}
}

// run is one Plan call.
type run struct {
	cfg   *Config
	in    Input
	msgs  []chat.Message
	n     int
	chain bool // Input.Chain is usable
	lead  int  // leading system/developer messages
	tail  int  // start of the protected tail
	floor int  // the tail's floor: keep_tail messages, never opening on a tool result
	keep  int  // Trim.Keep for new trims of step 1
	scale float64
	// base is the plan of the re-applied records.
	base plan
	// callOf and red are step 0's view of the calls and the duplicates
	// (computed once, when needed).
	callOf    []call
	callCache map[int]call
	red       *reductions
	// lastResort is set while overBudget runs: the working set may be
	// excerpted then (a view over the budget is a certain refusal).
	lastResort bool
	// room is the budget less the fixed part (0 until known).
	room  int
	ratio float64 // provider tokens per local token (Estimate.Ratio)
	st    State
	ev    Events

	excerpts map[[2]int]chat.Message
	blocks   map[*Summary][]chat.Message

	// reapplied are the stored trims that matched.
	reapplied map[int]int

	// done is the log of the steps taken (finish reads it).
	done steps
	// need is the summary this decision asks for (Output.Need).
	need *SummaryRequest
	// corrupt is Planner.corrupt.
	corrupt func([]chat.Message) []chat.Message
}

// Plan decides what to forward for one view (DESIGN.md § Compaction): the
// one entry point for requests, overflow recovery, previews and background
// summaries. It never fails: a problem leaves the client's view forwarded.
// When a summary is due it says so in Output.Need; plan the same Input
// again with the answer in Input.Summary to use it.
func (pl *Planner) Plan(in Input) Output {
	cfg := pl.cfg
	r := &run{
		cfg:      &cfg,
		corrupt:  pl.corrupt,
		in:       in,
		msgs:     in.Messages,
		n:        len(in.Messages),
		chain:    len(in.Chain) == len(in.Messages)+1,
		keep:     cfg.TrimToolResultTokens * bytesPerToken / 2,
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
	r.tail = tailStart(r.msgs, cfg.KeepTail)
	r.floor = r.tail
	return r.decision()
}

// decision is one Plan: re-apply what is stored, size the view and its
// thresholds, then run the pass's steps.
func (r *run) decision() Output {
	cfg := r.cfg
	out := Output{}

	p := r.reapply()
	r.base = p
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
	r.room = room
	if room <= 0 {
		// The fixed part alone fills the budget: no summary has room, and
		// that is said (Events.Impossible). The window may still hold the
		// request (the budget keeps room for the answer): a view over it is
		// brought under it, as the last resort does, rather than forwarded
		// to a certain refusal.
		out.Trigger, out.Target = out.Budget, out.Budget
		if cur >= out.Budget {
			r.ev.Impossible = true
		}
		if w := r.in.Window; cur > w && out.Fixed < w {
			cur = r.overBudget(&p, cur, w, w)
		}
		return r.finish(out, p, cur)
	}
	out.Trigger = out.Fixed + int(float64(room)*cfg.TriggerRatio)
	out.Target = out.Fixed + int(float64(room)*cfg.TargetRatio)
	if r.in.Pass == PassBackground {
		return r.presummarize(out, p, cur)
	}
	if cur >= out.Trigger {
		headStart := p.headStart(r.lead)
		r.tail = r.extendTail(r.tail, headStart, out.Fixed, r.tailLimit(out))
		cur = r.decide(&p, cur, out.Budget, out.Target)
	}
	return r.finish(out, p, cur)
}

// decide runs the steps over the trigger and returns the estimate of the
// resulting plan.
func (r *run) decide(p *plan, cur, budget, target int) int {
	cfg := r.cfg
	headStart := p.headStart(r.lead)

	// 0. Dedupe (lossless, every repeated result outside the tail: once a
	// view is over the trigger no duplicate bytes go out), then mask; not
	// in the head a ready background summary replaces (see step 1).
	if cfg.Dedupe {
		if cur = r.dedupe(p, r.pendingFrom(*p, headStart, cur), r.tail, cur); cur < target {
			return cur
		}
	}

	// The progress guard, before anything changes the forwarded prefix: a
	// view within the budget whose history not yet summarized is under
	// the guard's amount goes as it is. Trimming it would change the
	// prefix (the upstream's cache re-evaluates from there) for a step
	// the next summary folds anyway.
	if r.summaryWithheld(*p, cur, headStart, budget) {
		r.done.add(stepGuarded)
		return cur
	}
	// The guard let this compaction through on the history as it stands:
	// trims below do not take it back (a trimmed head that then looked too
	// small to fold would leave a changed prefix and no summary).
	r.done.add(stepPassedGuard)

	// 1. Trim tool results outside the leading system messages and the
	// protected tail, oldest first; not in the head a ready background
	// summary replaces: the request crossing the trigger re-applies that
	// summary (step 2, no model call), and a trim there would change the
	// forwarded prefix (the upstream re-evaluates everything after it)
	// only to keep that summary stored until a later crossing, older.
	trimFrom := r.pendingFrom(*p, headStart, cur)
	// 0. Mask old results (no model call, the model can call again) before
	// any excerpt or summary.
	if cfg.Mask {
		var reached bool
		if cur, reached = r.mask(p, trimFrom, max(r.tail, headStart), cur, target); reached {
			return cur
		}
	}
	if cands := r.trimCandidates(*p, trimFrom, max(r.tail, headStart), r.long()); len(cands) > 0 {
		var reached bool
		cur, reached = r.applyTrims(p, cands, r.keep, target)
		if reached {
			return cur
		}
	}

	// 2. Summarize the head when trim could not reach the target.
	if cfg.SummarizerEnabled && r.chain && r.tail < r.n && (r.tail > headStart || cur > budget) {
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
	// summary (never the final turn's results: the files the model is
	// holding; not while the progress guard holds a view within the
	// budget), then drop whole turns when over the budget.
	if cur >= target && !r.done.has(stepGuarded) {
		start := p.headStart(r.lead)
		if cands := r.trimCandidates(*p, start, r.finalResults(), r.long()); len(cands) > 0 {
			cur, _ = r.applyTrims(p, cands, r.keep, target)
		}
	}
	return r.overBudget(p, cur, budget, target)
}

// pendingFrom is where the cheap steps may start: headStart, or the cut
// of a ready background summary (its head is replaced whole).
func (r *run) pendingFrom(p plan, headStart, cur int) int {
	if r.readyPending(p, p, headStart, cur).ok {
		return r.st.Pending.Cut
	}
	return headStart
}

// overBudget is what runs when nothing before it brought the view under
// the budget: excerpts of the tool results after the summary (never the
// final message), the drop, then the last resort — never forward a view
// estimated over the window while a smaller valid one exists: shrink what
// the proxy owns (the re-applied summary) down to the budget; then, over
// the window (a certain refusal), excerpt the final turn's tool results,
// the final message last. What is still over the window is forwarded, and
// said (Events.Impossible). It returns the view's estimate.
func (r *run) overBudget(p *plan, cur, budget, target int) int {
	r.lastResort = true
	defer func() { r.lastResort = false }()
	if cur > budget {
		start := p.headStart(r.lead)
		if cands := r.trimCandidates(*p, start, r.n-1, 0); len(cands) > 0 {
			cur, _ = r.applyTrims(p, cands, tightKeep, budget+1)
		}
	}
	if cur > budget && p.sum != nil && r.done.has(stepSummarized|stepPendingTaken) {
		// A summary applied now (made, or ready from the background) that
		// leaves the view over the budget was sized on an estimate the
		// answer or the client's newest turn proved short (the proxy's
		// sizing): it is what gives way, before the client's turns.
		cur = r.shrinkSummary(p, cur, budget)
	}
	if cur > budget {
		cur = r.dropTurns(p, cur, budget, target)
	}
	if cur > budget && p.sum != nil {
		cur = r.shrinkSummary(p, cur, budget)
	}
	if window := r.in.Window; cur > window {
		if cands := r.trimCandidates(*p, p.headStart(r.lead), r.n, 0); len(cands) > 0 {
			cur, _ = r.applyTrims(p, cands, tightKeep, window+1)
		}
		r.ev.Impossible = r.ev.Impossible || cur > window
	}
	return cur
}
