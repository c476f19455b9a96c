package driver

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
)

// flights are the summaries being made in this process, by lease name: a
// request of the same lineage (a concurrent one, or an SDK's retry of a
// request whose client timed out) waits for the running one instead of
// starting its own.
type flights struct {
	mu sync.Mutex
	m  map[string]*flight
	// bg counts background summaries not finished yet.
	bg sync.WaitGroup
}

// flight is one detached summary; done closes when its state is saved.
type flight struct {
	done chan struct{}
	out  compaction.Output
	ok   bool // out is a summary run's result (not: lease held elsewhere)
}

// join returns the running flight of name, or starts one (leader true).
func (f *flights) join(name string) (fl *flight, leader bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fl := f.m[name]; fl != nil {
		return fl, false
	}
	if f.m == nil {
		f.m = map[string]*flight{}
	}
	fl = &flight{done: make(chan struct{})}
	f.m[name] = fl
	return fl, true
}

func (f *flights) finish(name string, fl *flight) {
	f.mu.Lock()
	delete(f.m, name)
	f.mu.Unlock()
	close(fl.done)
}

// leaseMargin is added to the summarizer's timeout for the lease's life: a
// holder that dies frees the lineage after that much time at most.
const leaseMargin = 10 * time.Second

// leaseName names the summary of lineage li of the conversation (key is
// tenant-bound and opaque). A lineage not stored yet has no id, and two
// requests of it may differ in length: new lineages of a conversation
// share one name, so at worst one of them waits a step for its own.
func leaseName(key string, ls []compaction.Lineage, li int) string {
	if li < 0 {
		return key + "|new"
	}
	return key + "|" + strconv.FormatUint(ls[li].ID, 16)
}

// shared makes the summary that is due for r's lineage (li of conv), once:
// in this process by a flight per lease name, across replicas by the
// store's lease. The summary is made detached from the request (make), so
// a client that leaves or times out does not cancel it, and its retry
// finds it in progress or made. The request waits, giving up when its own
// client leaves. ok false: no summary for this request (held elsewhere,
// the store failed, the client left, or the wait found nothing new); the
// caller forwards the view without it.
func (d *Driver) shared(ctx context.Context, r *run, conv store.Conversation, li int, commit bool) (compaction.Output, bool) {
	// A request that waited on another request's (or a background)
	// summary of its lineage and still needs one (that summary covered an
	// older head) leads a summary of its own once: falling back to the
	// view without it would drop while the summarizer works.
	for attempt := 0; ; attempt++ {
		name := leaseName(r.req.Key, conv.Lineages, li)
		fl, leader := d.flights.join(name)
		if leader {
			go d.make(context.WithoutCancel(ctx), name, fl, r)
		}
		select {
		case <-fl.done:
		case <-ctx.Done():
			return compaction.Output{}, false
		}
		if leader {
			return fl.out, fl.ok
		}
		if !fl.ok {
			return compaction.Output{}, false
		}
		// Another request's summary of this lineage: re-read the state and
		// re-apply it to this request's own view (no summarize call).
		var loaded bool
		conv, loaded = d.load(ctx, r.req.ID, r.req.Key)
		if !loaded {
			return compaction.Output{}, false
		}
		li = compaction.SelectLineage(conv.Lineages, r.chain)
		out := d.plan(r, conv, li, nil)
		if out.Need != nil {
			if attempt == 0 {
				continue
			}
			return compaction.Output{}, false
		}
		if commit {
			d.commit(ctx, r, conv, li, out, false)
		}
		return out, true
	}
}

// make is the detached summary of one lineage, for the request path and
// background summaries alike: lease, re-read the state (another replica
// may have just saved it), plan, obtain the summary the plan asks for,
// plan again with it, save (a request's summary supersedes what others
// recorded meanwhile: it cost a model call), release. fl reports the
// decision to the requests waiting on it.
func (d *Driver) make(ctx context.Context, name string, fl *flight, r *run) {
	defer d.flights.finish(name, fl)
	release, ok, err := d.store.Lease(ctx, name, d.timeout+leaseMargin)
	d.obs.StoreResult(r.req.ID, "lock", err)
	if err != nil || !ok {
		return
	}
	defer release()
	conv, loaded := d.load(ctx, r.req.ID, r.req.Key)
	if !loaded {
		return
	}
	li := compaction.SelectLineage(conv.Lineages, r.chain)
	ctx, cancel := context.WithTimeout(ctx, d.timeout+leaseMargin/2)
	defer cancel()
	out := d.plan(r, conv, li, nil)
	if need := out.Need; need != nil {
		text, tokens, err := d.summarize(ctx, r, need)
		out = d.plan(r, conv, li, compaction.ResultFor(need, text, tokens, err, ctx.Err() != nil))
	}
	background := r.req.Pass == compaction.PassBackground
	if background && out.Events.SummarizeCalled {
		d.obs.Background(out.Events.SummarizeOK)
	}
	d.commit(ctx, r, conv, li, out, out.Events.SummarizeCalled && !background)
	fl.out, fl.ok = out, true
}

// summarize obtains the summary need asks for, at most MaxConcurrent at a
// time in the process, with the completion tokens the summarizer reported
// for it (0 = not reported).
func (d *Driver) summarize(ctx context.Context, r *run, need *compaction.SummaryRequest) (string, int, error) {
	select {
	case d.sem <- struct{}{}:
	case <-ctx.Done():
		return "", 0, ctx.Err()
	}
	defer func() { <-d.sem }()
	call := r.call
	call.Request = *need
	tokens := 0
	count := call.OnUsage
	call.OnUsage = func(u anchor.Usage) {
		if count != nil {
			count(u)
		}
		// The last answer is the summary (a chunked transcript folds).
		tokens = 0
		if u.HasOutput {
			tokens = u.Output
		}
	}
	if d.sum == nil {
		return "", 0, ErrNoSummarizer
	}
	text, err := d.sum.Summarize(ctx, call)
	return text, tokens, err
}

// ErrNoSummarizer is the summary error of a decision that asked for a
// summary from a driver built without a summarizer (its planner should
// have compaction.Config.SummarizerEnabled off).
var ErrNoSummarizer = errors.New("driver: no summarizer")

// Background summarizes the conversation's head after a response (DESIGN
// step 2, "Background pre-summarization") when the next request would pass
// compaction.presummarize_ratio of the room but still be under the
// trigger: out is the decision the response was forwarded with, u the
// usage it reported. The summary is stored without being applied: the
// request that crosses the trigger re-applies it instead of waiting for a
// model call. It is made like a summary due on a request (one flight per
// lineage, the store's lease, max_concurrent, latch and throttle),
// detached from the client, on its own copy of the messages; when a
// summary of the lineage is being made already, nothing more is done.
// req.Pass is ignored (compaction.PassBackground).
func (d *Driver) Background(ctx context.Context, req Request, out compaction.Output, u anchor.Usage) {
	if !d.nearTrigger(out, u) || req.Window == 0 || d.planner == nil {
		return
	}
	chain, err := req.Chain()
	if err != nil {
		return
	}
	req.Pass = compaction.PassBackground
	r := (&run{req: req, chain: chain, estimate: req.Estimate}).detach()
	d.flights.bg.Add(1)
	go func() {
		defer d.flights.bg.Done()
		ctx := context.WithoutCancel(ctx)
		conv, loaded := d.load(ctx, r.req.ID, r.req.Key)
		if !loaded {
			return
		}
		name := leaseName(r.req.Key, conv.Lineages, compaction.SelectLineage(conv.Lineages, r.chain))
		fl, leader := d.flights.join(name)
		if !leader {
			return // a summary of this lineage is being made already
		}
		d.make(ctx, name, fl, r)
	}()
}

// nearTrigger tells whether the request after this response would be over
// compaction.presummarize_ratio of the room but still under the trigger:
// its input will be at least this one's plus this answer.
func (d *Driver) nearTrigger(out compaction.Output, u anchor.Usage) bool {
	if d.ratio <= 0 || d.planner == nil || out.Budget <= 0 || out.Fixed >= out.Budget || !u.HasInput ||
		out.Action == compaction.ActionSummarized || d.shadow {
		return false
	}
	next := u.Input + u.Output
	return next >= out.Fixed+int(d.ratio*float64(out.Budget-out.Fixed)) && next < out.Trigger
}

// WaitBackground waits until no background summary is being made (tests; a
// drain).
func (d *Driver) WaitBackground() { d.flights.bg.Wait() }
