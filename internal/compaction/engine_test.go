package compaction

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/anchor"
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

func baseConfig() Config {
	return Config{
		TriggerRatio: 0.8, TargetRatio: 0.6, KeepTail: 3, LatchGrowth: 20,
		TrimToolResultTokens: 1024, MinInterval: time.Minute, SummarizerEnabled: true,
		SummaryTokens: 200,
	}
}

// checkView asserts what every forwarded view must satisfy.
func checkView(t *testing.T, in []chat.Message, out Output) {
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
			if over != (out.Events.Suppressed == SuppressedLatch) {
				t.Fatalf("step %d: over the trigger %v, suppressed %q", steps, over, out.Events.Suppressed)
			}
			if out.Action == ActionSummarized {
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
			if out.Action != ActionSummarized || sum.Calls() != 1 {
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
	if prev.Action != ActionSummarized {
		t.Fatalf("action %q", prev.Action)
	}
	oldCut := prev.State.Summary.Cut
	for step := 0; step < 3; step++ {
		id := fmt.Sprintf("e%d", step)
		conv = append(conv, callMsg("", id+`:edit:{"file":"store.py"}`), toolMsg(id, "ok"))
		msgs = parse(t, conv)
		out := s.step(msgs)
		checkView(t, msgs, out)
		if sum.Calls() != 1 || out.Action != ActionReused {
			t.Fatalf("step %d: calls %d action %q", step, sum.Calls(), out.Action)
		}
		if len(out.Events.NewActions) != 1 || out.Events.NewActions[0] != ActionReused {
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
		if out.Action != ActionSummarized || sum.prevs[1] != prev.State.Summary.Text {
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
		if out.Action == ActionDropped || slices.Contains(out.Events.NewActions, ActionDropped) {
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
// provider-visible count changed; overflow recovery ignores it but honours
// the latch.
func TestThrottle(t *testing.T) {
	cfg := baseConfig()
	cfg.LatchGrowth = 0 // isolate the throttle
	sum := failingSummarizer()
	clock := newClock()
	e := newDriver(cfg, sum, clock)
	msgs := parse(t, verbatimTailConv(false))
	more := parse(t, append(verbatimTailConv(false), callMsg("", `z:edit:{}`), toolMsg("z", "ok")))
	var st State
	for _, tc := range []struct {
		name      string
		advance   time.Duration
		msgs      []chat.Message
		ignore    bool
		wantCalls int
		wantSupp  string
	}{
		{"first attempt", 0, msgs, false, 1, ""},
		{"same count within the interval", 10 * time.Second, msgs, false, 1, SuppressedThrottle},
		{"interval passed", 51 * time.Second, msgs, false, 2, ""},
		{"count changed", time.Second, more, false, 3, ""},
		{"same count again", time.Second, more, false, 3, SuppressedThrottle},
		{"overflow recovery ignores the throttle", time.Second, more, true, 4, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock.Add(tc.advance)
			out := e.Compact(context.Background(), Input{Messages: tc.msgs, Chain: chainOf(t, tc.msgs), State: st,
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
	t.Run("overflow recovery honours the latch", func(t *testing.T) {
		cfg := baseConfig()
		sum := failingSummarizer()
		e := newDriver(cfg, sum, newClock())
		out := e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
		out = e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), State: out.State, Window: 3500,
			Estimate: fakeEstimate, Pass: PassRecover, Measured: 5000})
		if sum.Calls() != 1 || out.Events.Suppressed != SuppressedLatch {
			t.Fatalf("calls %d, suppressed %q", sum.Calls(), out.Events.Suppressed)
		}
		if out.Context.Tokens != 5000 {
			t.Errorf("measured size not used: %d", out.Context.Tokens)
		}
	})
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
		wantAction Action
		wantNew    []Action
	}{
		{"would summarize", verbatimTailConv(false), 3500, ActionSummarizePending, nil},
		{"would trim", agentSteps(6, 6000), 10000, ActionTrimmed, []Action{ActionTrimmed}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := okSummarizer()
			msgs := parse(t, tc.msgs)
			out := newDriver(cfg, sum, newClock()).Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs),
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

// (g) A produced view that fails the pairing check is discarded: the
// client's view is forwarded, nothing new is stored, the failure reported.
func TestInvariantFailure(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func([]chat.Message) []chat.Message
		msgs    []msg
		win     int
	}{
		{"summary view loses a result", func(v []chat.Message) []chat.Message { // drops the last tool result but one
			for i := len(v) - 2; i >= 0; i-- {
				if v[i].Role == "tool" {
					return append(v[:i:i], v[i+1:]...)
				}
			}
			return v
		}, verbatimTailConv(false), 3500},
		{"trimmed view gets an orphan", func(v []chat.Message) []chat.Message {
			return append([]chat.Message{v[0], chat.WithContentText(v[3], "x")}, v[1:]...)
		}, agentSteps(6, 6000), 10000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := okSummarizer()
			e := newDriver(baseConfig(), sum, newClock())
			e.p.corrupt = tc.corrupt
			msgs := parse(t, tc.msgs)
			out := e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), Window: tc.win,
				Estimate: fakeEstimate})
			if !out.Events.InvariantFailure || &out.Messages[0] != &msgs[0] || len(out.Messages) != len(msgs) {
				t.Fatalf("invariant failure %v, %d messages", out.Events.InvariantFailure, len(out.Messages))
			}
			if out.Action != ActionNone || len(out.Events.NewActions) != 0 {
				t.Errorf("action %q new %v", out.Action, out.Events.NewActions)
			}
			if out.State.Summary != nil || len(out.State.Trims) != 0 || len(out.State.Drops) != 0 {
				t.Errorf("records stored after an invariant failure: %+v", out.State)
			}
			if out.Forwarded != fakeEstimate(msgs).Tokens {
				t.Errorf("forwarded %d", out.Forwarded)
			}
		})
	}
	t.Run("pairing off: an invalid client view is no failure when nothing is added", func(t *testing.T) {
		conv := verbatimTailConv(false)
		conv = append(conv[:3:3], append([]msg{toolMsg("ghost", "orphan")}, conv[3:]...)...)
		msgs := parse(t, conv)
		if violations(msgs) == 0 {
			t.Fatal("test conversation should be invalid")
		}
		out := newDriver(baseConfig(), okSummarizer(), newClock()).Compact(context.Background(), Input{Messages: msgs,
			Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
		if out.Events.InvariantFailure || out.Action != ActionSummarized {
			t.Fatalf("action %q invariant %v", out.Action, out.Events.InvariantFailure)
		}
	})
}

// Trim: long tool results outside the tail become excerpts, oldest first,
// only as many as needed, recorded and re-applied byte-identically.
func TestTrim(t *testing.T) {
	sum := okSummarizer()
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 10000}
	conv := agentSteps(6, 6000) // 6 × 1500 tokens
	msgs := parse(t, conv)
	out := s.step(msgs)
	checkView(t, msgs, out)
	if out.Action != ActionTrimmed || sum.Calls() != 0 || out.Forwarded >= out.Target {
		t.Fatalf("action %q calls %d forwarded %d target %d", out.Action, sum.Calls(), out.Forwarded, out.Target)
	}
	trims := out.State.Trims
	if len(trims) == 0 || trims[0].Index != 3 {
		t.Fatalf("trims %+v", trims)
	}
	for k, tr := range trims {
		if k > 0 && tr.Index <= trims[k-1].Index {
			t.Fatal("trims not oldest first")
		}
	}
	// Only as many as needed: without the last one the view is over the target.
	if len(trims) > 1 {
		var fewer State
		fewer.Trims = trims[:len(trims)-1]
		p := (&run{cfg: &s.e.p.cfg, msgs: msgs, n: len(msgs), chain: true, in: Input{Chain: chainOf(t, msgs)}, st: fewer,
			excerpts: map[[2]int]chat.Message{}, lead: 1}).reapply()
		r := &run{msgs: msgs, n: len(msgs), excerpts: map[[2]int]chat.Message{}, blocks: map[*Summary][]chat.Message{}}
		if fakeEstimate(r.view(p)).Tokens < out.Target {
			t.Error("trimmed more than needed")
		}
	}
	trimmedText := chat.Text(out.Messages[3])
	if !strings.Contains(trimmedText, " characters elided by compactproxy ...]") || len(trimmedText) > 2048+100 {
		t.Fatalf("excerpt %d bytes: %.300q", len(trimmedText), trimmedText)
	}
	if !strings.HasPrefix(trimmedText, "step0 line 0:") || !strings.HasSuffix(trimmedText, chat.Text(msgs[3])[len(chat.Text(msgs[3]))-100:]) {
		t.Error("excerpt does not keep head and tail")
	}
	// The tail is untouched.
	if verbatimTail(msgs, out.Messages) < 3 {
		t.Error("tail changed")
	}
	// Next step: re-applied identically, no new trims.
	conv = append(conv, callMsg("", `n:edit:{}`), toolMsg("n", "ok"))
	msgs2 := parse(t, conv)
	out2 := s.step(msgs2)
	for i := range out.Messages {
		if string(out2.Messages[i].Raw) != string(out.Messages[i].Raw) {
			t.Fatalf("message %d not re-applied identically", i)
		}
	}
	if out2.Action != ActionTrimmed || len(out2.Events.NewActions) != 0 {
		t.Errorf("re-applied: action %q new %v", out2.Action, out2.Events.NewActions)
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
		if out.Forwarded > out.Budget || out.Action != ActionDropped {
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
	if out.Action != ActionSummarizePending || sum.Calls() != 0 || out.Events.SummarizeCalled {
		t.Fatalf("action %q calls %d", out.Action, sum.Calls())
	}
	if !out.State.LastAttempt.IsZero() {
		t.Error("a dry run counted as an attempt")
	}
}

// Failures that are never spliced in: empty text, a summary that does not
// shrink the view, a timeout; a client that went away does not latch.
func TestSummaryFailures(t *testing.T) {
	msgs := parse(t, verbatimTailConv(false))
	for _, tc := range []struct {
		name    string
		fn      func(ctx context.Context) (string, error)
		cancel  bool
		wantErr error
		latch   bool
	}{
		{"empty", func(context.Context) (string, error) { return "  \n", nil }, false, ErrEmptySummary, true},
		{"not smaller", func(context.Context) (string, error) { return strings.Repeat("long ", 4000), nil }, false, ErrSummaryNotSmaller, true},
		{"timeout", func(context.Context) (string, error) { return "", context.DeadlineExceeded }, false, context.DeadlineExceeded, true},
		{"client went away", func(ctx context.Context) (string, error) { return "", ctx.Err() }, true, context.Canceled, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sum := &fakeSummarizer{}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			sum.fn = func(int, []chat.Message, string) (string, error) {
				if tc.cancel {
					cancel()
				}
				return tc.fn(ctx)
			}
			out := newDriver(baseConfig(), sum, newClock()).Compact(ctx, Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: 3500, Estimate: fakeEstimate})
			checkView(t, msgs, out)
			if !errors.Is(out.Events.SummaryError, tc.wantErr) || out.Events.SummarizeOK || out.Action == ActionSummarized {
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

// Below the trigger and with an unknown window nothing is done; stored
// compaction is still re-applied.
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
			out := newDriver(baseConfig(), sum, newClock()).Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs),
				Window: tc.win, MaxTokens: tc.max, Estimate: fakeEstimate})
			if out.Action != ActionNone || &out.Messages[0] != &msgs[0] || out.StateChanged || sum.Calls() != 0 {
				t.Fatalf("action %q changed %v", out.Action, out.StateChanged)
			}
			if out.Context.Tokens != fakeEstimate(msgs).Tokens || out.Forwarded != out.Context.Tokens {
				t.Errorf("context %d forwarded %d", out.Context.Tokens, out.Forwarded)
			}
		})
	}
	t.Run("stored summary re-applied with an unknown window", func(t *testing.T) {
		e := newDriver(baseConfig(), okSummarizer(), newClock())
		first := e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
		out := e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), State: first.State, Estimate: fakeEstimate})
		if out.Action != ActionReused || len(out.Messages) != len(first.Messages) {
			t.Fatalf("action %q", out.Action)
		}
		if out.Context.Tokens != fakeEstimate(first.Messages).Tokens {
			t.Errorf("context %d is not the re-applied view's", out.Context.Tokens)
		}
	})
	t.Run("max_tokens shrinks the budget, capped at a quarter of the window", func(t *testing.T) {
		for _, tc := range []struct{ window, maxTokens, budget int }{
			{20000, 3000, 17000},
			{20000, 15000, 15000},
			{32768, 32000, 24576},
		} {
			out := newDriver(baseConfig(), nil, nil).Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs),
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
	first := e.Compact(context.Background(), Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
	edited := verbatimTailConv(false)
	edited[1] = userMsg("a different ask")
	msgs2 := parse(t, edited)
	out := e.Compact(context.Background(), Input{Messages: msgs2, Chain: chainOf(t, msgs2), State: first.State, Window: 100000, Estimate: fakeEstimate})
	if out.Action != ActionNone || len(out.Messages) != len(msgs2) {
		t.Fatalf("action %q: a summary applied to another head", out.Action)
	}
}

func TestAddAnchor(t *testing.T) {
	var s State
	for i := 1; i <= 6; i++ {
		s.AddAnchor(anchor.Anchor{PrefixLen: i, Input: i * 10})
	}
	s.AddAnchor(anchor.Anchor{PrefixLen: 4, Input: 99}) // same prefix: replaced, moved first
	var got []int
	for _, a := range s.Anchors {
		got = append(got, a.PrefixLen)
	}
	if fmt.Sprint(got) != "[4 6 5 3]" || s.Anchors[0].Input != 99 {
		t.Fatalf("anchors %v", got)
	}
}

func TestExcerpt(t *testing.T) {
	text := strings.Repeat("é", 20000) // 2-byte runes: cuts land on rune boundaries
	out, ok := excerpt(text, 3000)
	if !ok || !strings.Contains(out, "[... 18,500 characters elided by compactproxy ...]") {
		t.Fatalf("%v %q", ok, out[1990:2080])
	}
	if !strings.HasPrefix(out, "éé") || !strings.HasSuffix(out, "éé") || strings.ContainsRune(out, '\uFFFD') {
		t.Fatal("bad cut")
	}
	if _, ok := excerpt("short", 3000); ok {
		t.Fatal("short text excerpted")
	}
	for n, want := range map[int]string{0: "0", 999: "999", 1000: "1,000", 12345: "12,345", 1234567: "1,234,567"} {
		if got := groupThousands(n); got != want {
			t.Errorf("groupThousands(%d) = %q", n, got)
		}
	}
}

// Tool results with image parts are never excerpted; text-part arrays are.
func TestTrimmable(t *testing.T) {
	long := blob("x", 8000)
	msgs := parse(t, []msg{
		{"role": "tool", "tool_call_id": "a", "content": []any{map[string]any{"type": "text", "text": long}}},
		{"role": "tool", "tool_call_id": "b", "content": []any{map[string]any{"type": "text", "text": long},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,AAAA"}}}},
		{"role": "user", "content": long},
	})
	if m, ok := trimmed(msgs[0], 2048); !ok || m.ContentIsString || m.Content[0] != '[' || m.TextBytes > 2200 || m.ToolCallID != "a" ||
		!strings.Contains(chat.Text(m), "characters elided") {
		t.Errorf("text parts not excerpted as a part array: %v string=%v %d", ok, m.ContentIsString, m.TextBytes)
	}
	if _, ok := trimmed(msgs[1], 2048); ok {
		t.Error("a result with an image was excerpted")
	}
	if _, ok := trimmed(msgs[2], 2048); ok {
		t.Error("a user message was excerpted")
	}
}

// excerptJSON works on the JSON literal: its head and tail are the
// decoded text's, and the marker counts exactly the characters in between.
func TestExcerptJSON(t *testing.T) {
	var texts []string
	for i := 0; i < 50; i++ {
		var b strings.Builder
		for j := 0; b.Len() < 3000+i*397; j++ {
			switch (i + j) % 7 {
			case 0:
				b.WriteString("line with \"quotes\" and \\backslashes\\\n")
			case 1:
				b.WriteString("héllo wörld ✓ 😀 ")
			case 2:
				b.WriteString("\t<tag attr='x'>&amp;</tag>\x01\n")
			default:
				fmt.Fprintf(&b, "plain %d ", j)
			}
		}
		texts = append(texts, b.String())
	}
	for k, text := range texts {
		lit, _ := json.Marshal(text)
		if k%2 == 1 { // escape everything non-ASCII as \uXXXX (surrogate pairs for emoji)
			lit = asciiJSON(text)
			var back string
			if err := json.Unmarshal(lit, &back); err != nil || back != text {
				t.Fatalf("bad literal: %v", err)
			}
		}
		out, ok := excerptJSON(lit, 1500)
		if !ok {
			t.Fatalf("text %d not excerpted", k)
		}
		i := strings.Index(out, "\n[... ")
		j := strings.Index(out, " characters elided by compactproxy ...]\n")
		head, tail := out[:i], out[j+len(" characters elided by compactproxy ...]\n"):]
		if !strings.HasPrefix(text, head) || !strings.HasSuffix(text, tail) || !utf8.ValidString(out) {
			t.Fatalf("text %d: head/tail are not the text's", k)
		}
		n, _ := strconv.Atoi(strings.ReplaceAll(out[i+len("\n[... "):j], ",", ""))
		if want := utf8.RuneCountInString(text) - utf8.RuneCountInString(head) - utf8.RuneCountInString(tail); n != want {
			t.Fatalf("text %d: marker says %d characters, %d were elided", k, n, want)
		}
		if len(out) > 1500+200 {
			t.Fatalf("text %d: excerpt %d bytes", k, len(out))
		}
	}
}

// asciiJSON encodes s as a JSON string with every non-ASCII character
// escaped (surrogate pairs beyond the BMP), as some clients send.
func asciiJSON(s string) []byte {
	b := []byte{'"'}
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b = append(b, '\\', byte(r))
		case r == '\n':
			b = append(b, `\n`...)
		case r < 0x20 || r > 0x7e:
			if r > 0xffff {
				r1, r2 := utf16.EncodeRune(r)
				b = fmt.Appendf(b, `\u%04x\u%04x`, r1, r2)
			} else {
				b = fmt.Appendf(b, `\u%04x`, r)
			}
		default:
			b = append(b, byte(r))
		}
	}
	return append(b, '"')
}

func TestUnescape(t *testing.T) {
	for _, lit := range []string{
		`"plain"`, `"a\nb\tc\"d\\e\/f\b\f\r"`, `"\u00e9\u2713\ud83d\ude00"`, `"lone \ud800 high"`, `"lone \ude00 low"`,
		`"\ud800\u0041"`, `"end \ud83d"`, string(asciiJSON("héllo 😀 \x01 \"q\"\n")),
	} {
		var want string
		if err := json.Unmarshal([]byte(lit), &want); err != nil {
			t.Fatalf("%s: %v", lit, err)
		}
		if got := chat.Unescape([]byte(lit[1 : len(lit)-1])); got != want {
			t.Errorf("unescape(%s) = %q, want %q", lit, got, want)
		}
	}
}

// Trims that a summary then replaced are not reported (nor stored).
func TestSummaryReplacesTrims(t *testing.T) {
	sum := okSummarizer()
	s := &session{tb: t, e: newDriver(baseConfig(), sum, newClock()), win: 12000}
	msgs := parse(t, agentSteps(12, 6000))
	out := s.step(msgs)
	checkView(t, msgs, out)
	if out.Action != ActionSummarized || fmt.Sprint(out.Events.NewActions) != "[summarized]" {
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
	if out.Action == ActionNone {
		t.Fatalf("no compaction at %d tokens (target %d, budget %d)", out.Context.Tokens, out.Target, out.Budget)
	}
	if out.Forwarded > out.Budget || slices.Contains(out.Events.NewActions, ActionDropped) {
		t.Fatalf("forwarded %d of budget %d, actions %v", out.Forwarded, out.Budget, out.Events.NewActions)
	}
	if k := verbatimTail(msgs, out.Messages); k < 3 {
		t.Fatalf("the final turn's results are not verbatim (%d trailing messages are): %s", k, roles(out.Messages))
	}
}
