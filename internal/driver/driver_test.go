package driver

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
)

// The driver's own part: what a request, a preview, a client that leaves,
// concurrent requests, a failing store, a lease held elsewhere and a
// background summary do to the stored state and the summarize calls.

// seen records what the driver reported.
type seen struct {
	mu         sync.Mutex
	ops        map[string][]error
	decided    int
	background []bool
}

func (o *seen) StoreResult(_, op string, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ops == nil {
		o.ops = map[string][]error{}
	}
	o.ops[op] = append(o.ops[op], err)
}

func (o *seen) Decided(string, string, compaction.Output) { o.mu.Lock(); o.decided++; o.mu.Unlock() }
func (o *seen) ChainFailed()                              {}
func (o *seen) Background(ok bool) {
	o.mu.Lock()
	o.background = append(o.background, ok)
	o.mu.Unlock()
}

// gated is a summarizer that tells when a call started and answers once
// released.
func gated() (sum *fakeSummarizer, started chan struct{}, release chan struct{}) {
	started, release = make(chan struct{}, 16), make(chan struct{})
	sum = &fakeSummarizer{fn: func(call int, head []chat.Message, _ string) (string, error) {
		started <- struct{}{}
		<-release
		return "Goal: add a retry. The earlier exploration, summarized.", nil
	}}
	return sum, started, release
}

// newTestDriver is a driver on st (nil: a new memory store) with sum and
// the observer o.
func newTestDriver(st Store, sum *fakeSummarizer, o *seen) (*Driver, Store) {
	if st == nil {
		st = store.NewMemoryBackend(0, 0)
	}
	if o == nil {
		o = &seen{}
	}
	cfg := baseConfig()
	c := Config{Planner: compaction.NewPlanner(cfg), Store: st, Now: newClock().Now, Observer: o, PresummarizeRatio: 0.7}
	if sum != nil {
		c.Summarizer = sum
	}
	return New(c), st
}

// request is a request of the test conversation at window 3500, over its
// trigger with a head to summarize.
func request(t *testing.T, msgs []chat.Message) Request {
	return Request{
		ID: "test", Key: testKey, View: msgs, Window: 3500,
		Chain:    func() ([]anchor.Digest, error) { return chainOf(t, msgs), nil },
		Estimate: func([]anchor.Anchor) compaction.Estimator { return fakeEstimate },
		Detach: func() Detached {
			return Detached{View: msgs, Estimate: func([]anchor.Anchor) compaction.Estimator { return fakeEstimate }}
		},
	}
}

var full = Mode{Enabled: true, Summarize: true, Commit: true}

// stored is the state of the lineage the view's chain selects.
func stored(t *testing.T, st Store, msgs []chat.Message) (compaction.State, bool) {
	t.Helper()
	conv, _, err := st.Load(context.Background(), testKey)
	if err != nil {
		t.Fatal(err)
	}
	li := compaction.SelectLineage(conv.Lineages, chainOf(t, msgs))
	if li < 0 {
		return compaction.State{}, false
	}
	return conv.Lineages[li].State, true
}

// A client that leaves while its summary is made gets no answer, but the
// summary is made and stored all the same: its retry re-applies it
// without a second call.
func TestClientLeaves(t *testing.T) {
	sum, started, release := gated()
	d, st := newTestDriver(nil, sum, nil)
	msgs := parse(t, verbatimTailConv(false))
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-started; cancel() }()
	out, _ := d.Decide(ctx, request(t, msgs), full)
	if out.Action == compaction.ActionSummarized || out.Events.SummarizeCalled {
		t.Fatalf("a client that left got action %q", out.Action)
	}
	close(release)
	retry, _ := d.Decide(context.Background(), request(t, msgs), full)
	if retry.Action != compaction.ActionSummarized && retry.Action != compaction.ActionReused {
		t.Fatalf("retry: action %q, want the summary made for the request that left", retry.Action)
	}
	if sum.Calls() != 1 {
		t.Fatalf("%d summarize calls, want 1", sum.Calls())
	}
	if s, ok := stored(t, st, msgs); !ok || s.Summary == nil {
		t.Fatal("the summary was not stored")
	}
}

// Requests of one lineage that need a summary at once share one call:
// the summary is released only once every request has asked for it, and
// each gets it.
func TestOneSummaryPerLineage(t *testing.T) {
	sum, started, release := gated()
	d, _ := newTestDriver(nil, sum, nil)
	conv := verbatimTailConv(false)
	outs := make([]compaction.Output, 4)
	asked := make(chan struct{}, len(outs))
	var wg sync.WaitGroup
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each request parses its own body (digests are written in place).
			req := request(t, parse(t, conv))
			detach := req.Detach
			req.Detach = func() Detached { asked <- struct{}{}; return detach() }
			outs[i], _ = d.Decide(context.Background(), req, full)
		}()
	}
	<-started
	for range outs {
		<-asked
	}
	close(release)
	wg.Wait()
	if sum.Calls() != 1 {
		t.Fatalf("%d summarize calls for one lineage, want 1", sum.Calls())
	}
	for i, out := range outs {
		if out.Action != compaction.ActionSummarized && out.Action != compaction.ActionReused {
			t.Errorf("request %d: action %q", i, out.Action)
		}
	}
}

// failingStore is a store that cannot be read.
type failingStore struct {
	Store
	updates int
}

var errDown = errors.New("store down")

func (f *failingStore) Load(context.Context, string) (store.Conversation, bool, error) {
	return store.Conversation{}, false, errDown
}

func (f *failingStore) UpdateLineages(context.Context, string, func([]compaction.Lineage) ([]compaction.Lineage, bool)) error {
	f.updates++
	return errDown
}

// A store that cannot be read: no summary (it could be neither
// coordinated nor kept) and nothing stored, but the steps without a model
// call still apply, and the decision is counted.
func TestStoreDownFailsOpen(t *testing.T) {
	sum := okSummarizer()
	o := &seen{}
	fs := &failingStore{Store: store.NewMemoryBackend(0, 0)}
	d, _ := newTestDriver(fs, sum, o)
	msgs := parse(t, agentSteps(6, 6000))
	req := request(t, msgs)
	req.Window = 10000
	out, _ := d.Decide(context.Background(), req, full)
	checkView(t, msgs, out)
	if out.Action != compaction.ActionTrimmed {
		t.Errorf("action %q, want trimmed without the store", out.Action)
	}
	if sum.Calls() != 0 || fs.updates != 0 {
		t.Fatalf("store down: %d summarize calls, %d saves", sum.Calls(), fs.updates)
	}
	if len(o.ops["load"]) != 1 || !errors.Is(o.ops["load"][0], errDown) || o.decided != 1 {
		t.Fatalf("observed loads %v, decided %d", o.ops["load"], o.decided)
	}
}

// A summary whose lease another replica holds is not made here: the view
// goes without it and nothing is stored (the holder's save supersedes it).
func TestLeaseHeldElsewhere(t *testing.T) {
	sum := okSummarizer()
	d, st := newTestDriver(nil, sum, nil)
	release, ok, err := st.Lease(context.Background(), leaseName(testKey, nil, -1), time.Hour)
	if err != nil || !ok {
		t.Fatalf("setup: lease %v %v", ok, err)
	}
	defer release()
	msgs := parse(t, verbatimTailConv(false))
	out, _ := d.Decide(context.Background(), request(t, msgs), full)
	checkView(t, msgs, out)
	if out.Action != compaction.ActionSummarizePending || sum.Calls() != 0 {
		t.Fatalf("action %q, %d calls", out.Action, sum.Calls())
	}
	if _, ok := stored(t, st, msgs); ok {
		t.Fatal("stored a state while another holds the summary's lease")
	}
}

// A preview's dry run reports the summary that is due, makes no call and
// stores nothing.
func TestPreviewStoresNothing(t *testing.T) {
	sum := okSummarizer()
	o := &seen{}
	d, st := newTestDriver(nil, sum, o)
	msgs := parse(t, verbatimTailConv(false))
	out, _ := d.Decide(context.Background(), request(t, msgs), Mode{Enabled: true})
	if out.Action != compaction.ActionSummarizePending || sum.Calls() != 0 || o.decided != 0 {
		t.Fatalf("action %q, %d calls, %d counted", out.Action, sum.Calls(), o.decided)
	}
	if _, ok := stored(t, st, msgs); ok {
		t.Fatal("a dry run stored a state")
	}
}

// After a response whose next request would pass presummarize_ratio, the
// head is summarized in the background and stored as pending, not applied;
// the request that crosses the trigger re-applies it without a call.
func TestBackgroundSummaryStoredPending(t *testing.T) {
	sum := okSummarizer()
	o := &seen{}
	d, st := newTestDriver(nil, sum, o)
	msgs := parse(t, verbatimTailConv(false))
	// The forwarded decision: room 2500 over a fixed part of 500; the next
	// request (2,300 in + 50 out) is past 70% of the room, under the
	// trigger.
	fwd := compaction.Output{Budget: 3000, Fixed: 500, Trigger: 2500, Action: compaction.ActionNone}
	d.Background(context.Background(), request(t, msgs), fwd, anchor.Usage{Input: 2300, Output: 50, HasInput: true})
	d.WaitBackground()
	s, ok := stored(t, st, msgs)
	if !ok || s.Pending == nil || s.Summary != nil {
		t.Fatalf("stored %v: pending %v, applied %v", ok, s.Pending != nil, s.Summary != nil)
	}
	if sum.Calls() != 1 || len(o.background) != 1 || !o.background[0] {
		t.Fatalf("%d calls, background results %v", sum.Calls(), o.background)
	}
	next := parse(t, append(verbatimTailConv(false), callMsg("", `c3:bash:{"cmd":"pytest -q"}`), toolMsg("c3", "ok")))
	out, _ := d.Decide(context.Background(), request(t, next), full)
	if sum.Calls() != 1 || out.Action != compaction.ActionSummarized && out.Action != compaction.ActionReused {
		t.Fatalf("crossing request: action %q, %d calls (%+v)", out.Action, sum.Calls(), out.Events)
	}
	t.Run("not near the trigger", func(t *testing.T) {
		sum := okSummarizer()
		d, st := newTestDriver(nil, sum, nil)
		d.Background(context.Background(), request(t, msgs), fwd, anchor.Usage{Input: 1000, Output: 50, HasInput: true})
		d.WaitBackground()
		if _, ok := stored(t, st, msgs); ok || sum.Calls() != 0 {
			t.Fatalf("a response far from the trigger started a background summary (%d calls)", sum.Calls())
		}
	})
}

// A planner that asks for a summary from a driver built without a
// summarizer gets a failed summary, not a crash.
func TestNoSummarizer(t *testing.T) {
	d := New(Config{Planner: compaction.NewPlanner(baseConfig()), Store: store.NewMemoryBackend(0, 0)})
	msgs := parse(t, verbatimTailConv(false))
	out, _ := d.Decide(context.Background(), request(t, msgs), full)
	checkView(t, msgs, out)
	if !errors.Is(out.Events.SummaryError, ErrNoSummarizer) || out.Action == compaction.ActionSummarized {
		t.Fatalf("action %q, summary error %v", out.Action, out.Events.SummaryError)
	}
}
