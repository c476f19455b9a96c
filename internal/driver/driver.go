// Package driver runs the compaction planner: it is the "do" half of
// internal/compaction's decisions, the one place where a decision is
// carried out. The loop is written once:
//
//	load the state → select the lineage → plan
//	    when the decision asks for a summary:
//	        one flight per lineage (in this process) and the store's lease
//	        (across replicas) → obtain the summary → plan again with it
//	→ commit (count the events, store the lineage)
//
// and every caller goes through it: the request path of every route, the
// preview, overflow recovery (Pass compaction.PassRecover), background
// summaries after a response (Background) and the planner's tests.
//
// The driver knows no HTTP: what a request is (its conversation key, view,
// chain and estimator, the summarize call it would make) comes in as a
// Request, its dependencies through New as small interfaces.
package driver

import (
	"context"
	"slices"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/summarizer"
)

// Store is the conversation state the driver reads and writes; the
// backends of internal/store satisfy it.
type Store interface {
	Load(ctx context.Context, key string) (store.Conversation, bool, error)
	UpdateLineages(ctx context.Context, key string, fn func([]compaction.Lineage) ([]compaction.Lineage, bool)) error
	Lease(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool, err error)
}

// Summarizer makes one summary; *summarizer.Client satisfies it.
type Summarizer interface {
	Summarize(ctx context.Context, call summarizer.Call) (string, error)
}

// Observer is told what the driver did, for metrics and logs. Its methods
// are called from request goroutines and detached ones alike.
type Observer interface {
	// StoreResult reports one store operation ("load", "save", "lock").
	StoreResult(reqID, op string, err error)
	// Decided reports a decision whose events count (a committed one) for
	// the conversation of that id.
	Decided(reqID, conversation string, out compaction.Output)
	// ChainFailed reports a view whose digest chain could not be computed.
	ChainFailed()
	// Background reports a background summary's summarize call.
	Background(ok bool)
}

// Config is what a Driver is built from.
type Config struct {
	// Planner decides; nil when compaction is off (every decision is an
	// estimate only).
	Planner *compaction.Planner
	// ReserveTokens is compaction.reserve_tokens (an estimate's budget).
	ReserveTokens int
	Store         Store
	// Summarizer is nil when the summarizer is off.
	Summarizer Summarizer
	// MaxConcurrent bounds the summarize calls running in the process
	// (compaction.summarizer.max_concurrent; at least 1).
	MaxConcurrent int
	// Timeout is the summarizer's timeout (0: 60s); the lease lives that
	// long plus a margin.
	Timeout time.Duration
	// PresummarizeRatio is compaction.presummarize_ratio (0: no
	// background summaries); Shadow is compaction.mode shadow.
	PresummarizeRatio float64
	Shadow            bool
	// Now is the clock (nil: time.Now).
	Now func() time.Time
	// Observer is told what happened (nil: nobody).
	Observer Observer
}

// Driver carries out the planner's decisions. Build it with New; it is
// safe for concurrent use.
type Driver struct {
	planner *compaction.Planner
	reserve int
	store   Store
	sum     Summarizer
	sem     chan struct{}
	timeout time.Duration
	ratio   float64
	shadow  bool
	now     func() time.Time
	obs     Observer
	flights flights
}

// New builds a Driver from c.
func New(c Config) *Driver {
	d := &Driver{planner: c.Planner, reserve: c.ReserveTokens, store: c.Store, sum: c.Summarizer,
		sem: make(chan struct{}, max(c.MaxConcurrent, 1)), timeout: c.Timeout, ratio: c.PresummarizeRatio,
		shadow: c.Shadow, now: c.Now, obs: c.Observer}
	if d.timeout <= 0 {
		d.timeout = 60 * time.Second
	}
	if d.now == nil {
		d.now = time.Now
	}
	if d.obs == nil {
		d.obs = nopObserver{}
	}
	return d
}

// Request is one decision's input: a request's view of its conversation,
// as the proxy's identify stage knows it.
type Request struct {
	// ID is the proxy's request id, Conversation the conversation's id as
	// its client sees it (both for logs only).
	ID, Conversation string
	// Key is the conversation's tenant-bound state key.
	Key string
	// View is the client's provider-visible view.
	View []chat.Message
	// Chain computes View's record chain (compaction.RecordChain).
	Chain func() ([]anchor.Digest, error)
	// Estimate returns the estimator of views of this conversation given
	// its stored anchors.
	Estimate func(anchors []anchor.Anchor) compaction.Estimator
	// Window is the model's context window (0: unknown, nothing is
	// compacted); MaxTokens the request's output limit.
	Window, MaxTokens int
	// Pass is why the planner runs.
	Pass compaction.Pass
	// SummaryInUpstreamTokens: summaries are made by the upstream's own
	// model (compaction.Input.SummaryInUpstreamTokens).
	SummaryInUpstreamTokens bool
	// SelfCompaction: the agent's own compaction request, forwarded whole
	// while the whole request fits the window.
	SelfCompaction bool
	// Detach returns what a summary made for this request keeps: it runs
	// detached from the request and may outlive it, so its view, estimator
	// and call own every byte they read. Called once, only when a summary
	// is about to be made.
	Detach func() Detached
}

// Detached is a request's part in a summary that outlives it.
type Detached struct {
	View     []chat.Message
	Estimate func(anchors []anchor.Anchor) compaction.Estimator
	// Call is the summarize call the summary is made with (its Request is
	// set by the driver).
	Call summarizer.Call
}

// Mode selects what one decision may do.
type Mode struct {
	// Enabled: compaction applies to the request at all (else an estimate).
	Enabled bool
	// Summarize: obtain a summary the decision asks for (false: a
	// preview's dry run reports it only).
	Summarize bool
	// Commit: store the new state and count the events.
	Commit bool
}

// Decide decides for req's view: load → select the lineage → plan →
// (obtain the summary the plan asks for) → commit. Without a known window,
// or when compaction does not apply, it only estimates; when the state
// could not be read (the store is down: fail open) it neither summarizes
// nor saves. It returns the decision and the time spent making or waiting
// for a summary.
func (d *Driver) Decide(ctx context.Context, req Request, m Mode) (compaction.Output, time.Duration) {
	conv, loaded := d.load(ctx, req.ID, req.Key)
	estimateOnly := func() compaction.Output {
		e := req.Estimate(conv.Anchors)(req.View)
		out := compaction.Output{Messages: req.View, Action: compaction.ActionNone, Context: e, Forwarded: e.Tokens}
		out.Budget = compaction.Budget(req.Window, d.reserve, req.MaxTokens)
		return out
	}
	if !m.Enabled || d.planner == nil || req.Window == 0 {
		return estimateOnly(), 0
	}
	if req.SelfCompaction && req.Pass == compaction.PassForward {
		// The agent asks to summarize its history itself: it gets all of
		// it while the whole request fits the window (DESIGN § Other
		// APIs), else the compacted view like any request.
		if out := estimateOnly(); out.Forwarded <= out.Budget {
			return out, 0
		}
	}
	chain, err := req.Chain()
	if err != nil {
		d.obs.ChainFailed()
		return estimateOnly(), 0
	}
	r := &run{req: req, chain: chain, estimate: req.Estimate}
	if !loaded {
		// The state could not be read: no summary (it could be neither
		// coordinated nor kept) and nothing stored, but the steps without
		// a model call (trim, and drop past the budget) still apply, so a
		// conversation that outgrew the window is still answered instead
		// of overflowing upstream.
		out := d.plan(r, store.Conversation{}, -1, nil)
		if m.Commit {
			d.obs.Decided(req.ID, req.Conversation, out)
		}
		return out, 0
	}
	li := compaction.SelectLineage(conv.Lineages, chain)
	out := d.plan(r, conv, li, nil)
	if !m.Summarize || out.Need == nil {
		if m.Commit {
			d.commit(ctx, r, conv, li, out, false)
		}
		return out, 0
	}
	// A summary is due: made once per lineage (in this process and, with a
	// shared store, across replicas), not under this client's context.
	start := d.now()
	made, ok := d.shared(ctx, r.detach(), conv, li, m.Commit)
	if !ok {
		// Another request or replica holds the lineage's summarize, the
		// store could not lease it, or this client left: forward the view
		// without the summary now, and store nothing (the summary's save
		// supersedes it).
		if m.Commit {
			d.obs.Decided(req.ID, req.Conversation, out)
		}
		return out, d.now().Sub(start)
	}
	return made, d.now().Sub(start)
}

// run is what one decision is made on, besides the state: the request,
// its chain, and the estimator in use (the detached one in a summary).
type run struct {
	req      Request
	chain    []anchor.Digest
	estimate func(anchors []anchor.Anchor) compaction.Estimator
	call     summarizer.Call
}

// detach returns r's copy for a summary: everything it reads is its own.
func (r *run) detach() *run {
	own := &run{req: r.req, chain: slices.Clone(r.chain), estimate: r.estimate}
	if r.req.Detach != nil {
		det := r.req.Detach()
		own.req.View, own.estimate, own.call = det.View, det.Estimate, det.Call
	}
	own.req.Detach = nil
	return own
}

// plan is the planner's decision for r on lineage li of conv (-1: a new
// lineage), with the summary res when one was obtained.
func (d *Driver) plan(r *run, conv store.Conversation, li int, res *compaction.SummaryResult) compaction.Output {
	var l compaction.Lineage
	if li >= 0 {
		l = conv.Lineages[li]
	}
	return d.planner.Plan(compaction.Input{
		Messages:  r.req.View,
		Chain:     r.chain,
		State:     l.WithAnchors(conv.Anchors),
		Window:    r.req.Window,
		MaxTokens: r.req.MaxTokens,
		Estimate:  r.estimate(conv.Anchors),
		Now:       d.now(),
		Pass:      r.req.Pass,
		Summary:   res,
		// The lineage's tip is how far its previous request reached: a
		// change before it resets the provider's cache.
		PreviousLen: l.TipLen,

		SummaryInUpstreamTokens: r.req.SummaryInUpstreamTokens,
	})
}

// commit counts the decision's events and, when its state changed, stores
// it as lineage li of conv (a new lineage when li is -1) through the
// store's update: the lineage replaces the stored one only while that is
// still the generation this decision started from, unless force (a
// summarize result); other lineages and the anchors are untouched.
func (d *Driver) commit(ctx context.Context, r *run, conv store.Conversation, li int, out compaction.Output, force bool) {
	d.obs.Decided(r.req.ID, r.req.Conversation, out)
	if !out.StateChanged {
		return
	}
	n := len(r.chain) - 1
	l := compaction.Lineage{ID: compaction.LineageID(r.chain), TipLen: n, Tip: r.chain[n], Used: d.now().Unix(), State: out.State}
	var base uint32
	if li >= 0 {
		l.ID, base = conv.Lineages[li].ID, conv.Lineages[li].Gen
	}
	err := d.store.UpdateLineages(ctx, r.req.Key, func(ls []compaction.Lineage) ([]compaction.Lineage, bool) {
		if r.req.Pass == compaction.PassBackground {
			// A background summary merges into what requests saved
			// meanwhile (it took seconds; the conversation went on).
			return compaction.MergeBackground(ls, l), true
		}
		return compaction.SaveLineage(ls, l, base, force)
	})
	d.obs.StoreResult(r.req.ID, "save", err)
}

// load reads the conversation's state; ok false when the store failed
// (the request goes on without new compaction: fail open).
func (d *Driver) load(ctx context.Context, reqID, key string) (store.Conversation, bool) {
	conv, _, err := d.store.Load(ctx, key)
	d.obs.StoreResult(reqID, "load", err)
	return conv, err == nil
}

type nopObserver struct{}

func (nopObserver) StoreResult(string, string, error)         {}
func (nopObserver) Decided(string, string, compaction.Output) {}
func (nopObserver) ChainFailed()                              {}
func (nopObserver) Background(bool)                           {}
