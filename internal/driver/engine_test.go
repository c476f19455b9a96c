package driver

import (
	"context"
	"errors"
	"fmt"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat"
)

const ask = "add a retry to fetch_rows in store.py"

// agentSteps is an agent conversation: system, the ask, then steps
// assistant call + result, each result size bytes.
func agentSteps(steps, size int) []msg {
	out := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	for i := 0; i < steps; i++ {
		id := fmt.Sprintf("call_%d", i)
		out = append(out,
			callMsg("", fmt.Sprintf(`%s:run:{"cmd":"step %d"}`, id, i)),
			toolMsg(id, blob(fmt.Sprintf("step%d", i), size)))
	}
	return out
}

func baseConfig() compaction.Config {
	return compaction.Config{
		TriggerRatio: 0.8, TargetRatio: 0.6, KeepTail: 3, LatchGrowth: 20,
		TrimToolResultTokens: 1024, MinInterval: time.Minute, SummarizerEnabled: true,
		SummaryTokens: 200,
	}
}

// checkView asserts what every forwarded view must satisfy.
func checkView(t *testing.T, in []chat.Message, out compaction.Output) {
	t.Helper()
	if len(out.Messages) == 0 {
		t.Fatal("empty view")
	}
	if v := violations(out.Messages); v != 0 {
		t.Fatalf("view fails pairing (%d violations): %s", v, roles(out.Messages))
	}
	if got, want := out.Messages[len(out.Messages)-1].Raw, in[len(in)-1].Raw; string(got) != string(want) {
		t.Fatalf("last message is not the client's: %.80s", got)
	}
	if out.Events.InvariantFailure {
		t.Fatal("invariant failure")
	}
}

// (a) The failed-summarizer repro: a summarizer that always fails is
// called once at the first step over the trigger, the next steps are
// suppressed by the latch (each still forwards a view that fits), and it is
// attempted again once the conversation grew by latch_growth
// provider-visible messages. (UI-only messages never reach the engine: the
// proxy removes them before, so they cannot move the count.)
func TestFailedSummarizerLatch(t *testing.T) {
	sum := failingSummarizer()
	cfg := baseConfig()
	s := &session{tb: t, e: newDriver(cfg, sum, newClock()), win: 10000}
	first, C, overSteps := -1, 0, 0
	for steps := 1; steps <= 60; steps++ {
		msgs := parse(t, agentSteps(steps, 2000))
		out := s.step(msgs)
		checkView(t, msgs, out)
		if out.Forwarded > out.Budget {
			t.Fatalf("step %d: forwarded %d > budget %d", steps, out.Forwarded, out.Budget)
		}
		if first < 0 {
			if out.Context.Tokens >= out.Trigger {
				first, C = steps, len(msgs)
				if !out.Events.SummarizeCalled || !out.Events.LatchEngaged || !errors.Is(out.Events.SummaryError, errRejected) {
					t.Fatalf("first step over the trigger: events %+v", out.Events)
				}
				if sum.Calls() != 1 {
					t.Fatalf("calls = %d at the first step over the trigger", sum.Calls())
				}
			} else if sum.Calls() != 0 {
				t.Fatalf("step %d below the trigger called the summarizer", steps)
			}
			continue
		}
		over := out.Context.Tokens >= out.Trigger
		if over {
			overSteps++
		}
		if len(msgs) < C+cfg.LatchGrowth || !over {
			if sum.Calls() != 1 || out.Events.SummarizeCalled {
				t.Fatalf("step %d (count %d, C %d): calls %d", steps, len(msgs), C, sum.Calls())
			}
			if over != (out.Events.Suppressed == compaction.SuppressedLatch) {
				t.Fatalf("step %d: over the trigger %v, suppressed %q", steps, over, out.Events.Suppressed)
			}
			if out.Action == compaction.ActionSummarized {
				t.Fatalf("step %d: latched step summarized", steps)
			}
			continue
		}
		// count ≥ C + latch_growth: attempted again, exactly once.
		if sum.Calls() != 2 || !out.Events.SummarizeCalled {
			t.Fatalf("step %d (count %d ≥ %d): calls %d, events %+v", steps, len(msgs), C+cfg.LatchGrowth, sum.Calls(), out.Events)
		}
		t.Logf("first attempt at step %d (count %d), %d suppressed steps over the trigger, re-attempt at step %d (count %d)", first, C, overSteps, steps, len(msgs))
		if overSteps < 5 {
			t.Fatalf("only %d suppressed steps over the trigger before the re-attempt", overSteps)
		}
		return
	}
	t.Fatalf("never re-attempted (first=%d calls=%d)", first, sum.Calls())
}

// verbatimTailConv is the case: the ask, exploration (ls, grep,
// git log), then cat store.py and a failing pytest. With askInTail the ask
// comes after the exploration, right before cat.
func verbatimTailConv(askInTail bool) []msg {
	out := []msg{sysMsg("You are a coding agent. Work in /repo.")}
	if askInTail {
		out = append(out, userMsg("look around the repository first"))
	} else {
		out = append(out, userMsg(ask))
	}
	for i, c := range []struct{ name, args string }{
		{"ls", `{"cmd":"ls -la"}`}, {"grep", `{"cmd":"grep -rn fetch_rows ."}`}, {"git_log", `{"cmd":"git log --oneline -20"}`},
	} {
		id := fmt.Sprintf("x%d", i)
		out = append(out, callMsg("", id+":"+c.name+":"+c.args), toolMsg(id, blob(c.name, 3000)))
	}
	if askInTail {
		out = append(out, userMsg(ask))
	}
	out = append(out,
		callMsg("I should read the file before changing it.", `c1:bash:{"cmd":"cat store.py"}`),
		toolMsg("c1", "def fetch_rows(conn, q):\n    return conn.execute(q).fetchall()\n"+blob("store.py", 1500)),
		callMsg("Now run the tests.", `c2:bash:{"cmd":"pytest -q"}`),
		toolMsg("c2", "F.\nFAILED test_store.py::test_fetch_rows_retries - AssertionError\n"+blob("pytest", 800)),
	)
	return out
}

// (b) The verbatim tail.
func TestVerbatimTail(t *testing.T) {
	for _, tc := range []struct {
		name      string
		askInTail bool
		keepTail  int
		wantTail  int // trailing client messages kept verbatim
		wantRoles string
	}{
		// keep_tail 3: the cut (at cat's result) walks back to its call.
		{"ask in head", false, 3, 4, "system,user,assistant,user,assistant,tool,assistant,tool"},
		// keep_tail 5 starts the tail at the ask: it is not re-inserted,
		// and an acknowledgement separates it from the summary.
		{"ask in tail", true, 5, 5, "system,user,assistant,user,assistant,tool,assistant,tool"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := baseConfig()
			cfg.KeepTail = tc.keepTail
			sum := okSummarizer()
			s := &session{tb: t, e: newDriver(cfg, sum, newClock()), win: 3500}
			msgs := parse(t, verbatimTailConv(tc.askInTail))
			out := s.step(msgs)
			checkView(t, msgs, out)
			if out.Action != compaction.ActionSummarized || sum.Calls() != 1 {
				t.Fatalf("action %q, calls %d, context %d trigger %d", out.Action, sum.Calls(), out.Context.Tokens, out.Trigger)
			}
			if got := verbatimTail(msgs, out.Messages); got != tc.wantTail {
				t.Errorf("verbatim tail = %d messages, want %d", got, tc.wantTail)
			}
			if got := roles(out.Messages); got != tc.wantRoles {
				t.Errorf("roles = %s, want %s", got, tc.wantRoles)
			}
			var askRaw []byte
			for i := range msgs {
				if msgs[i].Role == "user" && chat.Text(msgs[i]) == ask {
					askRaw = msgs[i].Raw
				}
			}
			if n := count(out.Messages, askRaw); n != 1 {
				t.Errorf("ask appears %d times", n)
			}
			sm := out.Messages[1]
			if sm.Role != "user" || !strings.HasPrefix(chat.Text(sm), summaryLabel) || !strings.Contains(chat.Text(sm), "Summary #1") {
				t.Errorf("summary message = %.200s", sm.Raw)
			}
			// The summarizer saw the head: after the system message, up to the cut.
			head := sum.heads[0]
			if len(head) != len(msgs)-1-tc.wantTail || string(head[0].Raw) != string(msgs[1].Raw) {
				t.Errorf("head has %d messages", len(head))
			}
			// reasoning_content kept on the tail's assistant turns.
			if !strings.Contains(string(out.Messages[len(out.Messages)-2].Raw), "reasoning_content") {
				t.Error("reasoning_content lost")
			}
			if out.State.Summary == nil || out.State.Summary.Head != chainOf(t, msgs)[out.State.Summary.Cut] {
				t.Errorf("summary not stored under the head digest: %+v", out.State.Summary)
			}
		})
	}
}

// (c) Reuse: the next steps send the full history plus new messages; the
// stored summary is re-applied without a call and the forwarded prefix is
// byte-identical; when the conversation grows over the trigger again, the
// next summarize folds the previous summary and the newer head messages.
func TestReuseAndFold(t *testing.T) {
	sum := okSummarizer()
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 3500}
	conv := verbatimTailConv(false)
	msgs := parse(t, conv)
	prev := s.step(msgs)
	if prev.Action != compaction.ActionSummarized {
		t.Fatalf("action %q", prev.Action)
	}
	oldCut := prev.State.Summary.Cut
	for step := 0; step < 3; step++ {
		id := fmt.Sprintf("e%d", step)
		conv = append(conv, callMsg("", id+`:edit:{"file":"store.py"}`), toolMsg(id, "ok"))
		msgs = parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if sum.Calls() != 1 || out.Action != compaction.ActionReused {
			t.Fatalf("step %d: calls %d action %q", step, sum.Calls(), out.Action)
		}
		if len(out.Events.NewActions) != 1 || out.Events.NewActions[0] != compaction.ActionReused {
			t.Errorf("new actions %v", out.Events.NewActions)
		}
		for i := range prev.Messages {
			if string(out.Messages[i].Raw) != string(prev.Messages[i].Raw) {
				t.Fatalf("step %d: forwarded message %d differs from the previous request's", step, i)
			}
		}
		prev = out
	}
	// Grow over the trigger again.
	for i := 0; ; i++ {
		id := fmt.Sprintf("g%d", i)
		conv = append(conv, callMsg("", id+`:bash:{"cmd":"cat more.py"}`), toolMsg(id, blob(id, 3000)))
		msgs = parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if sum.Calls() == 1 {
			continue
		}
		if out.Action != compaction.ActionSummarized || sum.prevs[1] != prev.State.Summary.Text {
			t.Fatalf("fold: action %q, previous %q", out.Action, sum.prevs[1])
		}
		if head := sum.heads[1]; string(head[0].Raw) != string(msgs[oldCut].Raw) || len(head) != out.State.Summary.Cut-oldCut {
			t.Fatalf("fold head: %d messages from the old cut %d to %d", len(head), oldCut, out.State.Summary.Cut)
		}
		if n := count(out.Messages, msgs[1].Raw); n != 1 {
			t.Fatalf("ask appears %d times after the fold", n)
		}
		break
	}
}

// (d) A tail larger than the target: a huge file read in the verbatim
// tail (keep_tail) stays verbatim while the view is within the budget —
// it is what the model holds, and the progress guard withholds a summary
// of the small head (issue 19: a summary per step is the defect) — the
// final message is never touched, nothing is dropped, and once the read
// leaves the tail it is excerpted and the view falls under the target.
func TestHugeTail(t *testing.T) {
	t.Run("summarizer fails", func(t *testing.T) { hugeTail(t, failingSummarizer()) })
	t.Run("summarizer works", func(t *testing.T) { hugeTail(t, okSummarizer()) })
}

func hugeTail(t *testing.T, sum *fakeSummarizer) {
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 10000}
	conv := agentSteps(3, 1000)
	huge := blob("store.py", 28000) // ≈ 7000 tokens: over the target, under the budget
	conv = append(conv, callMsg("", `cat:bash:{"cmd":"cat store.py"}`), toolMsg("cat", huge))
	for step := 0; step < 4; step++ {
		msgs := parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if out.Action == compaction.ActionDropped || slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
			t.Fatalf("step %d: dropped", step)
		}
		if out.Forwarded > out.Budget {
			t.Fatalf("step %d: forwarded %d > budget %d", step, out.Forwarded, out.Budget)
		}
		hugeKept := count(out.Messages, msgs[len(agentSteps(3, 1000))+1].Raw) == 1
		inTail := tailStart(msgs, baseConfig().KeepTail) <= len(agentSteps(3, 1000))+1
		switch {
		case inTail && !hugeKept:
			t.Fatalf("step %d: the huge read is in the verbatim tail and the view within the budget, yet it was excerpted", step)
		case !inTail && (hugeKept || out.Forwarded >= out.Target):
			t.Fatalf("step %d: the huge read left the tail but was not excerpted (forwarded %d, target %d)", step, out.Forwarded, out.Target)
		}
		id := fmt.Sprintf("e%d", step)
		conv = append(conv, callMsg("", id+`:edit:{}`), toolMsg(id, "ok"))
	}
	if sum.Calls() != 0 {
		t.Errorf("%d summarize calls for a head of three small steps (the progress guard)", sum.Calls())
	}
	marked := false
	for _, m := range s.last.Messages {
		marked = marked || strings.Contains(chat.Text(m), "characters elided by compactproxy")
	}
	if !marked {
		t.Errorf("no marker in %s", roles(s.last.Messages))
	}
}

// (e) The throttle: one attempt per min_interval unless the
// provider-visible count changed; overflow recovery ignores it (that it
// honours the latch is internal/compaction's TestRecoverHonoursTheLatch).
func TestThrottle(t *testing.T) {
	cfg := baseConfig()
	cfg.LatchGrowth = 0 // isolate the throttle
	sum := failingSummarizer()
	clock := newClock()
	e := newDriver(cfg, sum, clock)
	msgs := parse(t, verbatimTailConv(false))
	more := parse(t, append(verbatimTailConv(false), callMsg("", `z:edit:{}`), toolMsg("z", "ok")))
	var st compaction.State
	for _, tc := range []struct {
		name      string
		advance   time.Duration
		msgs      []chat.Message
		ignore    bool
		wantCalls int
		wantSupp  string
	}{
		{"first attempt", 0, msgs, false, 1, ""},
		{"same count within the interval", 10 * time.Second, msgs, false, 1, compaction.SuppressedThrottle},
		{"interval passed", 51 * time.Second, msgs, false, 2, ""},
		{"count changed", time.Second, more, false, 3, ""},
		{"same count again", time.Second, more, false, 3, compaction.SuppressedThrottle},
		{"overflow recovery ignores the throttle", time.Second, more, true, 4, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock.Add(tc.advance)
			out := e.Compact(context.Background(), compaction.Input{Messages: tc.msgs, Chain: chainOf(t, tc.msgs), State: st,
				Window: 3500, Estimate: fakeEstimate, Pass: recoverIf(tc.ignore)})
			checkView(t, tc.msgs, out)
			if out.StateChanged {
				st = out.State
			}
			if sum.Calls() != tc.wantCalls || out.Events.Suppressed != tc.wantSupp {
				t.Fatalf("calls %d (want %d), suppressed %q (want %q)", sum.Calls(), tc.wantCalls, out.Events.Suppressed, tc.wantSupp)
			}
		})
	}
}

// (f) Shadow mode decides and reports but forwards the client's view and
// stores nothing; it never calls the summarizer.
func TestShadow(t *testing.T) {
	cfg := baseConfig()
	cfg.Shadow = true
	for _, tc := range []struct {
		name       string
		msgs       []msg
		win        int
		wantAction compaction.Action
		wantNew    []compaction.Action
	}{
		{"would summarize", verbatimTailConv(false), 3500, compaction.ActionSummarizePending, nil},
		{"would trim", agentSteps(6, 6000), 10000, compaction.ActionTrimmed, []compaction.Action{compaction.ActionTrimmed}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := okSummarizer()
			msgs := parse(t, tc.msgs)
			out := newDriver(cfg, sum, newClock()).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: tc.win, Estimate: fakeEstimate})
			if len(out.Messages) != len(msgs) || &out.Messages[0] != &msgs[0] {
				t.Fatal("shadow mode changed the forwarded view")
			}
			if out.StateChanged || out.State.Summary != nil || len(out.State.Trims) != 0 {
				t.Fatal("shadow mode advanced the state")
			}
			if sum.Calls() != 0 {
				t.Fatal("shadow mode called the summarizer")
			}
			if out.Action != tc.wantAction || fmt.Sprint(out.Events.NewActions) != fmt.Sprint(tc.wantNew) {
				t.Fatalf("action %q, new %v", out.Action, out.Events.NewActions)
			}
			if out.Forwarded != fakeEstimate(msgs).Tokens {
				t.Errorf("forwarded %d, want the client's view's %d", out.Forwarded, fakeEstimate(msgs).Tokens)
			}
		})
	}
}

// Drop: with the summarizer off, a conversation over the budget whose
// results are short loses its oldest turns, pairing-safe, keeping the ask.
func TestDrop(t *testing.T) {
	cfg := baseConfig()
	cfg.SummarizerEnabled = false
	s := &session{tb: t, e: newDriver(cfg, nil, newClock()), win: 10000}
	conv := agentSteps(100, 400) // results too short to excerpt: only a drop helps
	for step := 0; step < 5; step++ {
		msgs := parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if out.Forwarded > out.Budget || out.Action != compaction.ActionDropped {
			t.Fatalf("step %d: action %q forwarded %d budget %d", step, out.Action, out.Forwarded, out.Budget)
		}
		if out.Messages[1].Role != "user" || chat.Text(out.Messages[1]) != ask || out.Messages[2].Role != "assistant" {
			t.Fatalf("step %d: ask not kept first: %s", step, roles(out.Messages[:4]))
		}
		if verbatimTail(msgs, out.Messages) < 3 {
			t.Fatalf("step %d: tail not verbatim", step)
		}
		if d := out.State.Drops; len(d) != 1 || d[0].From != 2 {
			t.Fatalf("step %d: drops %+v", step, d)
		}
		id := fmt.Sprintf("n%d", step)
		conv = append(conv, callMsg("", id+`:edit:{}`), toolMsg(id, blob(id, 400)))
	}
}

// A dry run reports summarize_pending and never calls the summarizer.
func TestDryRun(t *testing.T) {
	sum := okSummarizer()
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 3500, dry: true}
	msgs := parse(t, verbatimTailConv(false))
	out := s.step(msgs)
	checkView(t, msgs, out)
	if out.Action != compaction.ActionSummarizePending || sum.Calls() != 0 || out.Events.SummarizeCalled {
		t.Fatalf("action %q calls %d", out.Action, sum.Calls())
	}
	if !out.State.LastAttempt.IsZero() {
		t.Error("a dry run counted as an attempt")
	}
}

// Failures that are never spliced in: empty text, a summary that does not
// shrink the view, a timeout. (A client that went away: TestClientLeaves;
// that it does not latch is the planner's, internal/compaction.)
func TestSummaryFailures(t *testing.T) {
	msgs := parse(t, verbatimTailConv(false))
	for _, tc := range []struct {
		name    string
		text    string
		err     error
		wantErr error
		latch   bool
	}{
		{"empty", "  \n", nil, compaction.ErrEmptySummary, true},
		{"not smaller", strings.Repeat("long ", 4000), nil, compaction.ErrSummaryNotSmaller, true},
		{"timeout", "", context.DeadlineExceeded, context.DeadlineExceeded, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := &fakeSummarizer{fn: func(int, []chat.Message, string) (string, error) { return tc.text, tc.err }}
			out := newDriver(baseConfig(), sum, newClock()).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: 3500, Estimate: fakeEstimate})
			checkView(t, msgs, out)
			if !errors.Is(out.Events.SummaryError, tc.wantErr) || out.Events.SummarizeOK || out.Action == compaction.ActionSummarized {
				t.Fatalf("error %v ok %v action %q", out.Events.SummaryError, out.Events.SummarizeOK, out.Action)
			}
			if out.State.Latched != tc.latch || out.Events.LatchEngaged != tc.latch {
				t.Errorf("latched %v", out.State.Latched)
			}
			for _, m := range out.Messages {
				if strings.Contains(string(m.Raw), "elided by compactproxy") || strings.Contains(string(m.Raw), "Summary of the earlier") {
					t.Fatal("failed summary spliced in")
				}
			}
		})
	}
}

// Below the trigger and with an unknown window nothing is done (the
// planner's re-applying stored compaction at an unknown window is
// internal/compaction's; the driver does not plan without a window).
func TestNoCompaction(t *testing.T) {
	msgs := parse(t, verbatimTailConv(false))
	for _, tc := range []struct {
		name string
		win  int
		max  int
	}{
		{"unknown window", 0, 0},
		{"below the trigger", 100000, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := okSummarizer()
			out := newDriver(baseConfig(), sum, newClock()).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: tc.win, MaxTokens: tc.max, Estimate: fakeEstimate})
			if out.Action != compaction.ActionNone || &out.Messages[0] != &msgs[0] || out.StateChanged || sum.Calls() != 0 {
				t.Fatalf("action %q changed %v", out.Action, out.StateChanged)
			}
			if out.Context.Tokens != fakeEstimate(msgs).Tokens || out.Forwarded != out.Context.Tokens {
				t.Errorf("context %d forwarded %d", out.Context.Tokens, out.Forwarded)
			}
		})
	}
	t.Run("max_tokens shrinks the budget, capped at a quarter of the window", func(t *testing.T) {
		for _, tc := range []struct{ window, maxTokens, budget int }{
			{20000, 3000, 17000},
			{20000, 15000, 15000},
			{32768, 32000, 24576},
		} {
			out := newDriver(baseConfig(), nil, nil).Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: tc.window, MaxTokens: tc.maxTokens, Estimate: fakeEstimate})
			room := float64(tc.budget - out.Fixed)
			if out.Fixed <= 0 || out.Budget != tc.budget || out.Trigger != out.Fixed+int(room*0.8) || out.Target != out.Fixed+int(room*0.6) {
				t.Fatalf("%+v: budget %d fixed %d trigger %d target %d", tc, out.Budget, out.Fixed, out.Trigger, out.Target)
			}
		}
	})
}

// A stored summary does not apply to a conversation whose head differs.
func TestSummaryKeyedByHead(t *testing.T) {
	e := newDriver(baseConfig(), okSummarizer(), newClock())
	msgs := parse(t, verbatimTailConv(false))
	first := e.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
	edited := verbatimTailConv(false)
	edited[1] = userMsg("a different ask")
	msgs2 := parse(t, edited)
	out := e.Compact(context.Background(), compaction.Input{Messages: msgs2, Chain: chainOf(t, msgs2), State: first.State, Window: 100000, Estimate: fakeEstimate})
	if out.Action != compaction.ActionNone || len(out.Messages) != len(msgs2) {
		t.Fatalf("action %q: a summary applied to another head", out.Action)
	}
}

// Trims that a summary then replaced are not reported (nor stored).
func TestSummaryReplacesTrims(t *testing.T) {
	sum := okSummarizer()
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 12000}
	msgs := parse(t, agentSteps(12, 6000))
	out := s.step(msgs)
	checkView(t, msgs, out)
	if out.Action != compaction.ActionSummarized || fmt.Sprint(out.Events.NewActions) != "[summarized]" {
		t.Fatalf("action %q new %v", out.Action, out.Events.NewActions)
	}
	if len(out.State.Trims) != 0 || out.Forwarded >= out.Target {
		t.Fatalf("trims %v forwarded %d", out.State.Trims, out.Forwarded)
	}
}

// (d2) A final turn of parallel reads larger than the target: its results
// are the files the model is working on. While the view is within the
// budget none of them is excerpted — not to reach the target, not to make
// the summary room (Claude Code's parallel Read pair lost its first file
// to an excerpt, issue 21) — and nothing is dropped.
func TestParallelFinalResultsStayVerbatim(t *testing.T) {
	s := &session{tb: t, e: newDriver(baseConfig(), okSummarizer(), newClock()), win: 10000}
	conv := agentSteps(12, 1000)
	a, b := blob("a.go", 11500), blob("b.go", 11500) // ≈ 2900 tokens each
	conv = append(conv, callMsg("", `ra:read:{"path":"a.go"}`, `rb:read:{"path":"b.go"}`), toolMsg("ra", a), toolMsg("rb", b))
	msgs := parse(t, conv)
	out := s.step(msgs)
	checkView(t, msgs, out)
	if out.Action == compaction.ActionNone {
		t.Fatalf("no compaction at %d tokens (target %d, budget %d)", out.Context.Tokens, out.Target, out.Budget)
	}
	if out.Forwarded > out.Budget || slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
		t.Fatalf("forwarded %d of budget %d, actions %v", out.Forwarded, out.Budget, out.Events.NewActions)
	}
	if k := verbatimTail(msgs, out.Messages); k < 3 {
		t.Fatalf("the final turn's results are not verbatim (%d trailing messages are): %s", k, roles(out.Messages))
	}
}
