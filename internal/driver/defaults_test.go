package driver

import (
	"context"
	"errors"
	"fmt"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// summaryLabel opens the summary message the planner writes (as
// internal/compaction's view.go spells it).
const summaryLabel = "[Summary of the earlier conversation (compactproxy); the latest messages follow verbatim.]\n\n"

// defaultConfig is compactproxy's configuration defaults as the proxy
// hands them to the planner (internal/config), not a tuned profile.
func defaultConfig() compaction.Config {
	return compaction.Config{
		TriggerRatio: 0.8, TargetRatio: 0.6, ReserveTokens: 4096, KeepTail: 3, TailRatio: compaction.DefaultTailRatio,
		LatchGrowth: 20, TrimToolResultTokens: 1024, MinInterval: time.Minute,
		SummarizerEnabled: true, SummaryTokens: 1024, SummaryMinTokens: 256,
	}
}

// pacedLoop runs steps agent steps whose results are size bytes against a
// window at the defaults, with a summarizer that writes to its limit (a
// small local model does), as the upstream's own model, and one minute
// between steps. It returns the steps that made a new summary and the
// forwarded estimate right after each, and fails on a drop or a view over
// the budget.
func pacedLoop(t *testing.T, window, steps, size int) (summarized []int, after []compaction.Output) {
	t.Helper()
	sum := sizedSummarizer(4)
	clock := newClock()
	s := &session{tb: t, e: newDriver(defaultConfig(), sum, clock), win: window, exact: true}
	conv := []msg{sysMsg(blob("system", 2000)), userMsg(ask)}
	for i := 0; i < steps; i++ {
		id := fmt.Sprintf("r%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, size)))
		msgs := parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
			t.Fatalf("step %d: dropped while the summarizer works", i)
		}
		if out.Forwarded > out.Budget {
			t.Fatalf("step %d: forwarded %d over the budget %d", i, out.Forwarded, out.Budget)
		}
		if out.Events.SummarizeCalled {
			summarized = append(summarized, i)
			after = append(after, out)
		}
		clock.Add(time.Minute)
	}
	return summarized, after
}

// Issue 19 goals, at the defaults: a paced loop (a step appends about 4%
// of the room) at 16k–32k makes at most 3 summaries in 40 steps; a loop of
// large steps (a third of the room at 8k) never summarizes on two
// consecutive steps (before the progress guard: on every step from the
// third on); the view right after a new summary is at or under the target,
// so the next steps fit without compacting again.
func TestPacedLoopSummarizesRarely(t *testing.T) {
	for _, tc := range []struct {
		name         string
		window, size int
		most         int
	}{
		{"paced-16k", 16384, 1900, 3},
		{"paced-32k", 32768, 4500, 3},
		{"large-steps-8k", 8192, 5000, 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			steps, after := pacedLoop(t, tc.window, 40, tc.size)
			t.Logf("summaries at steps %v", steps)
			if len(steps) == 0 {
				t.Fatal("no summary in 40 steps: the loop does not reach the trigger")
			}
			if len(steps) > tc.most {
				t.Errorf("%d summaries in 40 steps, want at most %d", len(steps), tc.most)
			}
			for i := 1; i < len(steps); i++ {
				if steps[i] == steps[i-1]+1 {
					t.Errorf("summaries on consecutive steps %d and %d", steps[i-1], steps[i])
					break
				}
			}
			for i, o := range after {
				if o.Forwarded > o.Target {
					t.Errorf("after the summary at step %d the view is %d, over the target %d", steps[i], o.Forwarded, o.Target)
				}
			}
		})
	}
}

// Issue 19 item 2: a summary is never asked to be larger than half the
// history it folds. The case: a head of a few hundred tokens, a
// tail over the target (so the summary's room is measured against the
// budget and exceeds the head), a summarizer that writes to its limit (a
// small local model does). Asked for min(max_tokens, room) it wrote the
// head's size back, the view was "not smaller", the latch engaged and the
// next steps dropped although the summarizer worked.
func TestSummaryLimitBoundedByWhatItFolds(t *testing.T) {
	cfg := defaultConfig()
	conv := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	for i := 0; i < 5; i++ {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 350)))
	}
	conv = append(conv, callMsg("", `big:read:{}`), toolMsg("big", blob("big", 4000)))
	msgs := parse(t, conv)
	sum := sizedSummarizer(4)
	out := newDriver(cfg, sum, nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
		Window: 2300, Estimate: fakeEstimate})
	if sum.Calls() != 1 {
		t.Fatalf("setup: %d summarize calls (action %q), want 1", sum.Calls(), out.Action)
	}
	req := sum.reqs[0]
	head := fakeEstimate(req.Head).Tokens
	t.Logf("head %d tokens, summary asked for %d", head, req.MaxTokens)
	if req.MaxTokens > head/2+1 {
		t.Errorf("the summary was asked for %d tokens to fold a head of %d", req.MaxTokens, head)
	}
	if out.Action != compaction.ActionSummarized || out.State.Latched {
		t.Fatalf("a summary written to its limit: action %q, latched %v, error %v", out.Action, out.State.Latched, out.Events.SummaryError)
	}

	// With that bound a summary within its limit always shrinks the view
	// (bare + limit < bare + head): one that comes back no smaller ignored
	// its limit, and that is the summarizer's failure (the latch).
	big := &fakeSummarizer{}
	big.fn = func(call int, head []chat.Message, _ string) (string, error) {
		big.mu.Lock()
		limit := big.limits[len(big.limits)-1]
		big.mu.Unlock()
		return blob("s", 40*limit), nil
	}
	out = newDriver(cfg, big, nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
		Window: 2300, Estimate: fakeEstimate})
	if !errors.Is(out.Events.SummaryError, compaction.ErrSummaryNotSmaller) || !out.State.Latched {
		t.Fatalf("a summary ten times over its limit: error %v, latched %v", out.Events.SummaryError, out.State.Latched)
	}
}

// Issue 19 item 1: the last resort. A stored summary is re-applied, the
// tail has grown, the summarizer is latched and the drop cannot get below
// the budget: the proxy shrinks what it owns (its summary), and over the
// window excerpts the final turn, rather than forward a view it estimates
// over the window (a certain 400). Only when even that does not fit is the
// view forwarded and said (Events.Impossible).
func TestLastResortNeverForwardsOverTheWindow(t *testing.T) {
	cfg := defaultConfig()
	cfg.ReserveTokens = 64
	conv := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	for i := 0; i < 10; i++ {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 800)))
	}
	msgs := parse(t, conv)
	const window = 2048
	s := &session{tb: t, e: newDriver(cfg, sizedSummarizer(4), nil), win: window}
	first := s.step(msgs)
	if first.State.Summary == nil {
		t.Fatalf("setup: no summary (action %q)", first.Action)
	}
	// A long summary stored, a latched summarizer, and a final turn of two
	// large reads.
	st := first.State
	big := *st.Summary
	big.Text = blob("earlier summary", 2400)
	big.Tokens = 0
	st.Summary = &big
	st.Latched, st.LatchCount = true, len(msgs)
	s.st = st
	conv = append(conv, callMsg("", `f1:read:{}`, `f2:read:{}`), toolMsg("f1", blob("f1", 3000)), toolMsg("f2", blob("f2", 5800)))
	msgs = parse(t, conv)
	out := s.step(msgs)
	t.Logf("action %q forwarded %d budget %d new %v impossible %v roles %s", out.Action, out.Forwarded, out.Budget, out.Events.NewActions, out.Events.Impossible, roles(out.Messages))
	if v := violations(out.Messages); v != 0 {
		t.Fatalf("pairing violations %d: %s", v, roles(out.Messages))
	}
	if got := fakeEstimate(out.Messages).Tokens; got > window {
		t.Fatalf("forwarded %d tokens over the window %d (budget %d, impossible %v)", got, window, out.Budget, out.Events.Impossible)
	}
	if out.Events.Impossible {
		t.Fatal("reported impossible although a view under the window was forwarded")
	}
	if !strings.Contains(chat.Text(out.Messages[len(out.Messages)-1]), "characters elided by compactproxy") &&
		!strings.Contains(chat.Text(out.Messages[len(out.Messages)-2]), "characters elided by compactproxy") {
		t.Logf("(the final turn fit without an excerpt)")
	}
	var sumText string
	for _, m := range out.Messages {
		if strings.HasPrefix(chat.Text(m), summaryLabel) {
			sumText = chat.Text(m)
		}
	}
	if sumText == "" || len(sumText) >= len(summaryLabel)+len(big.Text) {
		t.Fatalf("the re-applied summary was not shrunk (%d bytes)", len(sumText))
	}
	if out.State.Summary == nil || out.State.Summary.Text == big.Text {
		t.Fatal("the shrunk summary is not stored (later requests would forward another prefix)")
	}

	// A task alone over the window (never dropped, never excerpted): the
	// smallest view is forwarded, and said.
	conv = []msg{sysMsg("You are a coding agent."), userMsg(blob("task", 3000)), callMsg("", `h:read:{}`), toolMsg("h", blob("h", 4000))}
	msgs = parse(t, conv)
	out = newDriver(cfg, sizedSummarizer(4), nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
		Window: 600, Estimate: fakeEstimate})
	if !out.Events.Impossible || out.Forwarded <= 600 {
		t.Fatalf("a task over the window: forwarded %d, impossible %v", out.Forwarded, out.Events.Impossible)
	}
	if !strings.Contains(chat.Text(out.Messages[len(out.Messages)-1]), "characters elided by compactproxy") {
		t.Fatal("the final result was not excerpted before giving up")
	}
}

// A fixed part over the budget but under the window (an agent's system
// prompt and tools at 12k with max_tokens reserving a quarter of it): no
// summary has room and the request is reported impossible, yet the view is
// brought under the window rather than forwarded to a certain refusal
// (DESIGN: never forward what you estimate over the window while something
// smaller and valid exists). It used to be forwarded as it was.
func TestFixedPartOverBudgetStillFitsTheWindow(t *testing.T) {
	cfg := defaultConfig()
	conv := []msg{sysMsg(blob("system prompt and tools", 38000)), userMsg(ask)} // ~9,500 tokens
	for i := 0; i < 12; i++ {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 1600)))
	}
	msgs := parse(t, conv)
	const window = 12288 // budget 9,216: under the fixed part
	out := newDriver(cfg, sizedSummarizer(4), nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
		Window: window, Estimate: fakeEstimate})
	checkView(t, msgs, out)
	if out.Fixed < out.Budget || fakeEstimate(msgs).Tokens <= window {
		t.Fatalf("setup: fixed %d, budget %d, client view %d, window %d", out.Fixed, out.Budget, fakeEstimate(msgs).Tokens, window)
	}
	if !out.Events.Impossible {
		t.Error("a fixed part over the budget is not reported")
	}
	if got := fakeEstimate(out.Messages).Tokens; got > window {
		t.Fatalf("forwarded %d tokens over the window %d while a smaller view exists (%s)", got, window, roles(out.Messages))
	}
}

// TestSummaryLimitShareOfTheRoom: a new summary is asked for at most a
// twelfth of the room, never under summary_min_tokens (from a room of
// eight times that on), so that at small windows the summary every later
// step carries, and every compaction evaluates again, stays small; from
// 16k on the limit is about summarizer.max_tokens.
func TestSummaryLimitShareOfTheRoom(t *testing.T) {
	for _, window := range []int{4096, 8192, 16384, 32768} {
		cfg := defaultConfig()
		conv := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
		// Reads under the trim threshold, 3.4 window's worth of bytes: a
		// view over the trigger that only a summary brings down.
		for i := 0; i < window*34/10/3600; i++ {
			id := fmt.Sprintf("s%d", i)
			conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 3600)))
		}
		msgs := parse(t, conv)
		sum := sizedSummarizer(4)
		c := struct{ window int }{window}
		out := newDriver(cfg, sum, nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
			Window: c.window, Estimate: fakeEstimate, SummaryInUpstreamTokens: true})
		if sum.Calls() != 1 || out.Action != compaction.ActionSummarized {
			t.Fatalf("window %d, setup: %d summarize calls, action %q", c.window, sum.Calls(), out.Action)
		}
		room := out.Budget - out.Fixed
		want := min(cfg.SummaryTokens, max(room/12, cfg.SummaryMinTokens))
		if got := sum.reqs[0].MaxTokens; got != want {
			t.Errorf("window %d (room %d): summary asked for %d tokens, want %d", c.window, room, got, want)
		}
	}
}

// TestReadyBackgroundSummaryBeforeTrim: the request that crosses the
// trigger re-applies the background summary made for it, before any trim
// of the head that summary replaces. A trim first changed the forwarded
// prefix (the upstream re-evaluated everything after the first excerpt)
// and the stored summary came one crossing later, a second re-evaluation
// (32k real-tokenizer loop: "trimmed" at step 18, "reused" at 23).
func TestReadyBackgroundSummaryBeforeTrim(t *testing.T) {
	cfg := defaultConfig()
	conv := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	add := func(i, size int) {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, size)))
	}
	// Long reads first (trimmable), then short ones.
	for i := 0; i < 4; i++ {
		add(i, 12000)
	}
	for i := 4; i < 12; i++ {
		add(i, 1400)
	}
	d := newDriver(cfg, sizedSummarizer(4), nil)
	var st compaction.State
	for i := 12; ; i++ {
		msgs := parse(t, conv)
		out := d.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 32768, State: st,
			Estimate: fakeEstimate, SummaryInUpstreamTokens: true})
		if out.StateChanged {
			st = out.State
		}
		if out.Action != compaction.ActionNone {
			if st.Pending != nil || out.Action != compaction.ActionReused {
				t.Fatalf("step %d crossed the trigger (%d of %d) with a background summary ready: action %q, want reused", i, out.Context.Tokens, out.Trigger, out.Action)
			}
			return
		}
		bg := d.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 32768, State: st,
			Estimate: fakeEstimate, SummaryInUpstreamTokens: true, Pass: compaction.PassBackground})
		if bg.StateChanged {
			st = bg.State
		}
		if i > 40 {
			t.Fatal("setup: never crossed the trigger")
		}
		add(i, 1400)
	}
}

// TestOversizedNewSummaryGivesWayBeforeTurns: a summary made now that
// leaves the view over the budget (it came back longer than it was sized
// for) is shortened before any of the client's turns is dropped (issue 19:
// no drop while the summarizer answers; seen once at Qwen2.5 2k under
// -race).
func TestOversizedNewSummaryGivesWayBeforeTurns(t *testing.T) {
	cfg := defaultConfig()
	cfg.ReserveTokens = 64
	long := &fakeSummarizer{}
	long.fn = func(call int, head []chat.Message, _ string) (string, error) {
		long.mu.Lock()
		limit := long.limits[len(long.limits)-1]
		long.mu.Unlock()
		return blob("summary", 4*limit*15/10), nil // half again its limit
	}
	conv := []msg{sysMsg(blob("system prompt and tools", 3600)), userMsg(ask)}
	for i := 0; i < 12; i++ {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 600)))
	}
	msgs := parse(t, conv)
	out := newDriver(cfg, long, nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
		Window: 2048, Estimate: fakeEstimate})
	checkView(t, msgs, out)
	if !out.Events.SummarizeOK {
		t.Fatalf("setup: the summary was not taken (%v): action %q", out.Events.SummaryError, out.Action)
	}
	if slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
		t.Fatalf("dropped the client's turns (%s) while the new summary could give way", roles(out.Messages))
	}
	if got := fakeEstimate(out.Messages).Tokens; got > out.Budget {
		t.Fatalf("forwarded %d over the budget %d", got, out.Budget)
	}
}

// TestRefoldsASmallSummaryRatherThanDrop: at a small window with a large
// fixed part, the summary in place can be under summary_min_tokens (asked
// for half of a small head). When the next request's final turn leaves
// no cut a summary's least room, the turn between that summary and the
// final turn was dropped (Qwen2.5 2k, window discovered: two
// compactions_total{dropped} in 40 steps, answered "reused"). A new
// summary no larger than the one in place folds it instead: a view the
// drop's size, nothing lost.
func TestRefoldsASmallSummaryRatherThanDrop(t *testing.T) {
	cfg := defaultConfig()
	small := &fakeSummarizer{}
	small.fn = func(call int, head []chat.Message, _ string) (string, error) {
		small.mu.Lock()
		limit := small.limits[len(small.limits)-1]
		small.mu.Unlock()
		return blob(fmt.Sprintf("summary %d", call), 4*min(limit, 180)), nil // ~180 tokens
	}
	s := &session{tb: t, e: newDriver(cfg, small, nil), win: 2048}
	conv := []msg{sysMsg(blob("system prompt and tools", 3600)), userMsg(ask)}
	add := func(i, size int) {
		id := fmt.Sprintf("s%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, size)))
	}
	for i := 0; i < 4; i++ {
		add(i, 600)
	}
	first := s.step(parse(t, conv))
	if !first.Events.SummarizeOK || s.st.Summary == nil {
		t.Fatalf("setup: no summary in place (action %q)", first.Action)
	}
	// One more turn, then a final turn of two reads that fills what the
	// fixed part, the ask and the summary's label leave.
	add(4, 600)
	conv = append(conv, callMsg("", `p1:read:{}`, `p2:read:{}`), toolMsg("p1", blob("p1", 1000)), toolMsg("p2", blob("p2", 1000)))
	msgs := parse(t, conv)
	out := s.step(msgs)
	checkView(t, msgs, out)
	if slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
		t.Fatalf("dropped the client's turns (%s) while a summary no larger than the one in place could fold them", roles(out.Messages))
	}
	if !out.Events.SummarizeOK {
		t.Fatalf("no new summary (action %q, %v)", out.Action, out.Events.SummaryError)
	}
	if got := fakeEstimate(out.Messages).Tokens; got > out.Budget {
		t.Fatalf("forwarded %d over the budget %d (action %q %v, fixed %d, %s)", got, out.Budget, out.Action, out.Events.NewActions, out.Fixed, roles(out.Messages)+fmt.Sprint(" fwd ", out.Forwarded))
	}
}

// readLoop is an agent conversation of reads planned at a window with the
// defaults, a summarizer that writes to its limit (as the upstream's own
// model), the state carried from step to step, a minute between steps.
type readLoop struct {
	t     *testing.T
	conv  []msg
	sum   *fakeSummarizer
	d     *rig
	clock *fakeClock
	st    compaction.State
	win   int
}

func newReadLoop(t *testing.T, window int) *readLoop {
	sum, clock := sizedSummarizer(4), newClock()
	return &readLoop{t: t, conv: []msg{sysMsg("You are a coding agent."), userMsg(ask)}, sum: sum,
		d: newDriver(defaultConfig(), sum, clock), clock: clock, win: window}
}

// read appends a turn of one read of size bytes, a minute later.
func (l *readLoop) read(i, size int) {
	id := fmt.Sprintf("s%d", i)
	l.conv = append(l.conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, size)))
	l.clock.Add(time.Minute)
}

// step plans the conversation as it stands.
func (l *readLoop) step(pass compaction.Pass) compaction.Output {
	msgs := parse(l.t, l.conv)
	out := l.d.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(l.t, msgs), Window: l.win, State: l.st,
		Estimate: fakeEstimate, SummaryInUpstreamTokens: true, Pass: pass, Now: l.clock.Now()})
	if out.StateChanged {
		l.st = out.State
	}
	return out
}

// TestReadyBackgroundSummaryOverTheTargetGivesWay: a background summary
// is made for the next request from the view as it is; when that request
// brings a large turn (at 8k a read can be a third of the room), the
// stored summary leaves the view over the target, the next request
// crosses the trigger again, and a summary follows on consecutive steps
// (8k real-tokenizer loop of large steps, steps 21 and 22). A new summary
// folds from the cut as it is now instead, and the view lands at the
// target.
func TestReadyBackgroundSummaryOverTheTargetGivesWay(t *testing.T) {
	l := newReadLoop(t, 8192)
	// Small reads to under half the room, then a read of about a third
	// of the room: the response to it starts a background summary
	// (presummarize_ratio), which keeps that read in its tail.
	for i := 0; ; i++ {
		l.read(i, 1200)
		out := l.step(compaction.PassForward)
		if out.Context.Tokens >= out.Fixed+(out.Budget-out.Fixed)*45/100 {
			break
		}
	}
	l.read(50, 7200)
	if out := l.step(compaction.PassForward); out.Action != compaction.ActionNone || out.Context.Tokens < out.Fixed+(out.Budget-out.Fixed)*7/10 {
		t.Fatalf("setup: the large read gave action %q at %d (trigger %d)", out.Action, out.Context.Tokens, out.Trigger)
	}
	l.step(compaction.PassBackground)
	if l.st.Pending == nil {
		t.Fatal("setup: no background summary")
	}
	// The next request: a turn of two such reads.
	calls := l.sum.Calls()
	l.conv = append(l.conv, callMsg("", `p1:read:{}`, `p2:read:{}`), toolMsg("p1", blob("p1", 3600)), toolMsg("p2", blob("p2", 3600)))
	out := l.step(compaction.PassForward)
	checkView(t, parse(t, l.conv), out)
	if out.Forwarded > out.Target {
		t.Fatalf("action %q: the view landed at %d, over the target %d (trigger %d): the next request summarizes again",
			out.Action, out.Forwarded, out.Target, out.Trigger)
	}
	if out.Action != compaction.ActionSummarized || l.sum.Calls() != calls+1 {
		t.Fatalf("action %q after %d calls, want one new summary (view %d, target %d)", out.Action, l.sum.Calls()-calls, out.Forwarded, out.Target)
	}
}

// TestNoBackgroundSummaryRightAfterASummary: a step large enough to reach
// presummarize_ratio right after a summary (at 8k a read can be a third of
// the room) started a background summary at once: summarize calls on two
// consecutive steps (8k real-tokenizer loop of large steps, steps 9 and
// 10). The background pass rests two steps; the crossing request makes
// the summary when it comes first.
func TestNoBackgroundSummaryRightAfterASummary(t *testing.T) {
	l := newReadLoop(t, 8192)
	// Request-path summaries only (no background pass) until one is made.
	var last compaction.Output
	for i := 0; ; i++ {
		if i > 60 {
			t.Fatal("setup: no summary")
		}
		l.read(i, 4000)
		if last = l.step(compaction.PassForward); last.Action == compaction.ActionSummarized {
			if last.Forwarded > last.Target {
				t.Fatalf("setup: the summary landed at %d, over the target %d", last.Forwarded, last.Target)
			}
			break
		}
	}
	// A large read: the view reaches presummarize_ratio, under the trigger.
	pre := last.Fixed + (last.Budget-last.Fixed)*7/10
	l.read(100, 4*((pre+last.Trigger)/2-last.Forwarded))
	out := l.step(compaction.PassForward)
	if out.Events.SummarizeCalled || out.Forwarded < pre || out.Forwarded >= out.Trigger {
		t.Fatalf("setup: the large read gave action %q at %d (presummarize from %d, trigger %d)", out.Action, out.Forwarded, pre, out.Trigger)
	}
	calls := l.sum.Calls()
	l.step(compaction.PassBackground)
	if l.sum.Calls() != calls || l.st.Pending != nil {
		t.Fatalf("a background summary on the step right after a summary (%d calls)", l.sum.Calls()-calls)
	}
	// Nor on the step after (a background call runs while the client
	// prepares its next request: it lands on either step); two steps
	// later the background pass makes it.
	for i, want := range []int{0, 1} {
		l.read(101+i, 200)
		if out := l.step(compaction.PassForward); out.Events.SummarizeCalled || out.Forwarded >= out.Trigger {
			t.Fatalf("setup: step %d after gave action %q at %d (trigger %d)", i+2, out.Action, out.Forwarded, out.Trigger)
		}
		l.step(compaction.PassBackground)
		if l.sum.Calls() != calls+want || (l.st.Pending != nil) != (want == 1) {
			t.Fatalf("step %d after the summary: %d background calls, want %d", i+2, l.sum.Calls()-calls, want)
		}
	}
}

// TestFreshViewEstimatedFromTheAnchoredView: the view right after a new
// summary is new from the summary on, so its estimate is not anchored.
// Counted on the local path, at the calibration's overhead plus its ratio,
// it ran 13% over llama-server's count on average at ChatML 2k
// (stories260K), 31% at one step: the fit's overhead (120–470 tokens) was
// an artifact of views whose content packs differently (a system prompt, a
// prose summary, code), not a cost of the request (no tools array
// rendered). Here the upstream counts that way (the system prompt at three
// tokens per four bytes, a summary at one, the rest at one and a half; no
// request overhead) and the calibration has such an overhead: the view
// right after each new summary is estimated within 10% of its cost, from
// the anchored view it replaces and the rate the conversation's appended
// messages measured.
func TestFreshViewEstimatedFromTheAnchoredView(t *testing.T) {
	cost := func(view []chat.Message) int {
		c := 0.0
		for i := range view {
			n := float64(len(view[i].Raw)) / 4
			switch {
			case view[i].Role == "system":
				c += 3 * n
			case strings.Contains(string(view[i].Raw), "Summary of the earlier conversation"):
				c += n
			default:
				c += 1.5 * n
			}
		}
		return int(c)
	}
	local := anchor.NewLocalEstimator()
	locals := func(view []chat.Message) (l []int, sum int) {
		for i := range view {
			l = append(l, local.Tokens(&view[i]))
			sum += l[i]
		}
		return l, sum
	}
	fit := anchor.Fit{Overhead: 400, Ratio: 1.2, Pairs: 10}
	var anchors []anchor.Anchor
	estimate := func(view []chat.Message) anchor.Estimate {
		l, _ := locals(view)
		return anchor.EstimateView(chainOf(t, view), l, anchors, fit)
	}
	sum, clock := sizedSummarizer(4), newClock()
	d := newDriver(defaultConfig(), sum, clock)
	conv := []msg{sysMsg(blob("system", 300)), userMsg(ask)}
	var st compaction.State
	var errs []float64
	for i := 0; i < 40; i++ {
		id := fmt.Sprintf("r%d", i)
		conv = append(conv, callMsg("", id+`:read:{}`), toolMsg(id, blob(id, 80+(i*77)%160)))
		msgs := parse(t, conv)
		st.Anchors = anchors // the proxy hands the conversation's anchors with the state
		out := d.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 2048, State: st,
			Estimate: estimate, SummaryInUpstreamTokens: true, Now: clock.Now()})
		if out.StateChanged {
			st = out.State
		}
		measured := cost(out.Messages)
		if out.Events.SummarizeOK {
			errs = append(errs, math.Abs(float64(out.Forwarded-measured))/float64(measured))
			t.Logf("step %d: new summary, view estimated %d, costs %d", i, out.Forwarded, measured)
		}
		// The response measures the forwarded view (the proxy's
		// recordAnchor).
		chain := chainOf(t, out.Messages)
		_, n := locals(out.Messages)
		if a, ok := anchor.NewAnchor(chain, anchor.Usage{Input: measured, HasInput: true}, clock.Now().Unix(), n); ok {
			if len(anchors) > 0 {
				a = anchor.Extend(anchors[0], a, chain)
			}
			anchors = compaction.MergeAnchor(anchors, a)
		}
		clock.Add(time.Minute)
	}
	if len(errs) < 4 {
		t.Fatalf("%d new summaries in 40 steps: the loop does not exercise the estimate", len(errs))
	}
	mean := 0.0
	for _, e := range errs {
		mean += e / float64(len(errs))
	}
	if mean > 0.10 {
		t.Fatalf("views right after a new summary estimated %.1f%% off on average (%v), want within 10%%", 100*mean, errs)
	}
}
