package driver

import (
	"context"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// workCall is what the edit–test generator knows of a call: the oracle
// of the working set and of duplicates.
type workCall struct {
	tool, path, args string
	body             string // the result without its envelope
}

// genWorkLoop builds an edit–test session like a real agent's: it re-reads
// a working set of files, edits them (a read after an edit sees the new
// content), re-runs the same commands (Codex's envelope around mostly
// identical output), sometimes in parallel, with new user asks between.
func genWorkLoop(r *rand.Rand) ([]msg, map[string]workCall) {
	files := []string{"a.go", "b.go", "c.go", "d.go"}
	cmds := []string{"go test ./...", "go vet ./...", "grep -rn retry ."}
	version := map[string]int{}
	calls := map[string]workCall{}
	out := []msg{sysMsg("You are a coding agent."), userMsg("make the store retry")}
	n, users := 0, 1
	for s := 1 + r.Intn(45); s > 0; s-- {
		if r.Intn(12) == 0 && out[len(out)-1]["role"] != "user" {
			users++
			out = append(out, asstMsg("done: "+blob("reply", r.Intn(300))), userMsg(fmt.Sprintf("ask %d: go on", users)))
			continue
		}
		k := 1 + r.Intn(2)
		var specs []string
		var results []msg
		for range k {
			n++
			id := fmt.Sprintf("call_%d", n)
			var c workCall
			var text string
			switch x := r.Intn(10); {
			case x < 5:
				f := files[r.Intn(len(files))]
				c = workCall{tool: "read_file", path: f, args: fmt.Sprintf(`{"path":%q}`, f)}
				c.body = blob(fmt.Sprintf("%s@%d", f, version[f]), 600+len(f)*300*(1+version[f]%3))
				text = c.body
			case x < 8:
				cmd := cmds[r.Intn(len(cmds))]
				c = workCall{tool: "exec_command", args: fmt.Sprintf(`{"cmd":%q}`, cmd)}
				c.body = "Process exited with code 1\nOutput:\n" + blob(fmt.Sprintf("%s#%d", cmd, r.Intn(2)), 300+r.Intn(3)*900)
				text = fmt.Sprintf("Chunk ID: %04x\nWall time: 0.%03d seconds\n", r.Intn(1<<16), r.Intn(1000)) + c.body
			default:
				f := files[r.Intn(len(files))]
				version[f]++
				c = workCall{tool: "edit_file", path: f, args: fmt.Sprintf(`{"file_path":%q,"old_string":"x","new_string":"y"}`, f)}
				text = "ok"
			}
			calls[id] = c
			specs = append(specs, id+":"+c.tool+":"+c.args)
			results = append(results, toolMsg(id, text))
		}
		out = append(append(out, callMsg("", specs...)), results...)
	}
	return out, calls
}

// workingSetOf is the oracle of the working set: per file the latest read
// when it was read again or edited; per command the latest run when it
// ran again.
func workingSetOf(msgs []chat.Message, calls map[string]workCall) map[int]bool {
	type g struct{ last, count int }
	reads, runs := map[string]*g{}, map[string]*g{}
	edited := map[string]bool{}
	for i := range msgs {
		c, ok := calls[msgs[i].ToolCallID]
		if msgs[i].Role != "tool" || !ok {
			continue
		}
		m := reads
		key := c.path
		switch {
		case c.tool == "edit_file":
			edited[c.path] = true
			continue
		case c.path == "":
			m, key = runs, c.args
		}
		if x := m[key]; x != nil {
			x.last, x.count = i, x.count+1
		} else {
			m[key] = &g{i, 1}
		}
	}
	ws := map[int]bool{}
	for p, x := range reads {
		if x.count > 1 || edited[p] {
			ws[x.last] = true
		}
	}
	for _, x := range runs {
		if x.count > 1 {
			ws[x.last] = true
		}
	}
	return ws
}

// checkStepZero runs one edit–test session step by step with dedupe and
// mask on and checks every decision: pairing holds, the final message and
// the verbatim tail are never replaced by a placeholder or pointer, the
// working set is never newly masked or deduplicated (nor excerpted short
// of a view over the budget), and a decision over the trigger forwards no
// duplicate tool result outside the tail.
func checkStepZero(t *testing.T, seed int64, keepTail int, summarize bool) {
	r := rand.New(rand.NewSource(seed))
	conv, calls := genWorkLoop(r)
	cfg := baseConfig()
	cfg.KeepTail, cfg.Dedupe, cfg.Mask, cfg.MinInterval = keepTail, true, true, 0
	var s *fakeSummarizer
	if summarize {
		s = okSummarizer()
	}
	clock := newClock()
	e := newDriver(cfg, s, clock)
	all := parse(t, conv)
	allChain := chainOf(t, all)
	window := max(fakeEstimate(all).Tokens*(25+r.Intn(80))/100, 800)
	var st compaction.State
	var prev []chat.Message
	prevN, prevFwd := 0, 0
	for _, n := range requestPoints(conv) {
		clock.Add(5 * time.Second)
		msgs := all[:n:n]
		out := e.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: allChain[:n+1], State: st,
			Window: window, Estimate: fakeEstimate})
		where := fmt.Sprintf("seed %d K %d summarize %v n %d window %d", seed, keepTail, summarize, n, window)
		v := out.Messages
		// Decisions are re-applied byte for byte: a decision that changed
		// nothing (ResetAt −1) extends the previous forwarded view.
		if out.ResetAt < 0 && prev != nil {
			for i := range prev {
				if i >= len(v) || string(v[i].Raw) != string(prev[i].Raw) {
					t.Fatalf("%s: forwarded prefix changed at %d without a reset (%s)", where, i, out.Action)
				}
			}
		}
		prev = v
		// What was stored is re-applied: the next view starts from what
		// was forwarded, plus what the client appended.
		if prevN > 0 {
			if grown := prevFwd + fakeEstimate(msgs[prevN:]).Tokens + 64; out.Context.Tokens > grown {
				t.Fatalf("%s: context %d, more than the %d forwarded before and the %d messages appended", where, out.Context.Tokens, prevFwd, n-prevN)
			}
		}
		prevN, prevFwd = n, out.Forwarded
		if out.Events.InvariantFailure || violations(v) != 0 {
			t.Fatalf("%s: pairing violation in %s", where, roles(v))
		}
		pos := map[string]int{}
		for i := range msgs {
			if msgs[i].Role == "tool" {
				pos[msgs[i].ToolCallID] = i
			}
		}
		tail := tailStart(msgs, keepTail)
		ws := workingSetOf(msgs, calls)
		for i := range v {
			if v[i].Role != "tool" {
				continue
			}
			ci := pos[v[i].ToolCallID]
			if !strings.HasPrefix(chat.Text(v[i]), "[compactproxy: ") {
				continue
			}
			if ci >= tail || ci == n-1 {
				t.Fatalf("%s: message %d of the verbatim tail (from %d) replaced: %s", where, ci, tail, chat.Text(v[i]))
			}
		}
		old := map[int]int{}
		for _, tr := range st.Trims {
			old[tr.Index] = tr.Keep
		}
		for _, tr := range out.State.Trims {
			if k, ok := old[tr.Index]; (ok && k == tr.Keep) || !ws[tr.Index] {
				continue
			}
			if _, pointer := tr.PointsTo(); tr.Masked() || pointer || out.Context.Tokens <= out.Budget {
				t.Fatalf("%s: working-set result %d newly reduced (keep %d; context %d, budget %d)", where, tr.Index, tr.Keep, out.Context.Tokens, out.Budget)
			}
		}
		if out.Context.Tokens >= out.Trigger && out.Trigger > 0 && !out.Events.Impossible {
			// No duplicate bytes outside the tail: every forwarded result
			// there that a later one repeats is a pointer (or smaller than one).
			type fwd struct {
				ci   int
				text string
			}
			var seen []fwd
			for i := range v {
				if v[i].Role == "tool" {
					seen = append(seen, fwd{pos[v[i].ToolCallID], chat.Text(v[i])})
				}
			}
			for a := range seen {
				ca, ok := calls[v2id(msgs, seen[a].ci)]
				if !ok || seen[a].ci >= tail || len(seen[a].text) < 200 || strings.HasPrefix(seen[a].text, "[compactproxy: ") ||
					strings.Contains(seen[a].text, " characters elided by compactproxy ...]") {
					continue
				}
				for b := a + 1; b < len(seen); b++ {
					cb := calls[v2id(msgs, seen[b].ci)]
					same := ca.body != "" && ca.body == cb.body
					reread := ca.path != "" && ca.tool == "read_file" && cb.tool == "read_file" && ca.path == cb.path
					if same || reread {
						t.Fatalf("%s: result %d forwarded although %d repeats it (%s %s)", where, seen[a].ci, seen[b].ci, ca.tool, ca.args)
					}
				}
			}
		}
		if out.StateChanged {
			st = out.State
		}
	}
}

func v2id(msgs []chat.Message, i int) string { return msgs[i].ToolCallID }

// TestStepZeroProperties runs edit–test sessions with dedupe and mask on
// over a fixed set of seeds and keep_tail values, with and without a
// summarizer.
func TestStepZeroProperties(t *testing.T) {
	seeds := 16
	if testing.Short() {
		seeds = 4
	}
	for _, summarize := range []bool{true, false} {
		for k := 0; k <= 6; k += 2 {
			t.Run(fmt.Sprintf("summarize=%v/K%d", summarize, k), func(t *testing.T) {
				t.Parallel()
				for seed := int64(0); seed < int64(seeds); seed++ {
					checkStepZero(t, seed*100+int64(k), k, summarize)
				}
			})
		}
	}
}

// FuzzStepZero: go test -fuzz FuzzStepZero -fuzztime 1m ./internal/driver
func FuzzStepZero(f *testing.F) {
	f.Add(int64(1), uint8(3), true)
	f.Add(int64(2), uint8(0), false)
	f.Fuzz(func(t *testing.T, seed int64, k uint8, summarize bool) {
		checkStepZero(t, seed, int(k%9), summarize)
	})
}

// TestPreviousLenFromLineage: a mask made in messages the lineage's
// previous request never held resets no cache; the same mask in messages
// it held does. The driver tells the planner how long that request was
// (the selected lineage's tip).
func TestPreviousLenFromLineage(t *testing.T) {
	conv := []msg{sysMsg("You are a coding agent."), userMsg("make the store retry")}
	for i := range 8 {
		id := fmt.Sprintf("call_%d", i)
		conv = append(conv, callMsg("", id+`:read_file:{"path":"f`+fmt.Sprint(i)+`.go"}`), toolMsg(id, blob(id, 3000)))
	}
	conv = append(conv, asstMsg("done"), userMsg("go on"))
	all := parse(t, conv)
	chain := chainOf(t, all)
	cfg := baseConfig()
	cfg.Mask, cfg.SummarizerEnabled = true, false
	window := fakeEstimate(all).Tokens * 100 / 90
	for _, tip := range []int{2, len(all) - 1} {
		e := newDriver(cfg, nil, nil)
		l := compaction.Lineage{ID: compaction.LineageID(chain[:tip+1]), TipLen: tip, Tip: chain[tip]}
		_ = e.store.UpdateLineages(context.Background(), testKey, func(ls []compaction.Lineage) ([]compaction.Lineage, bool) {
			return compaction.SaveLineage(ls, l, 0, true)
		})
		req := Request{ID: "test", Key: testKey, View: all, Window: window,
			Chain:    func() ([]anchor.Digest, error) { return chain, nil },
			Estimate: func([]anchor.Anchor) compaction.Estimator { return fakeEstimate }}
		out, _ := e.d.Decide(context.Background(), req, Mode{Enabled: true, Summarize: true, Commit: true})
		if out.Action != compaction.ActionMasked || out.Reduced.Mask == 0 || out.ResetAt < 0 {
			t.Fatalf("tip %d: want a new mask, got %s reduced %+v reset at %d", tip, out.Action, out.Reduced, out.ResetAt)
		}
		if want := out.ResetAt < tip; out.CacheReset != want {
			t.Errorf("tip %d: mask from %d: cache reset %v, want %v", tip, out.ResetAt, out.CacheReset, want)
		}
	}
}
