package compaction

import (
	"fmt"
	"runtime"
	"testing"
)

// tinyTurns is a conversation of n agent turns whose results are a few
// bytes: the most turns a body of a given size can hold.
func tinyTurns(tb testing.TB, n int) Input {
	conv := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("c%d", i)
		conv = append(conv, callMsg("", id+`:ls:{}`), toolMsg(id, "ok"))
	}
	msgs := parse(tb, conv)
	return Input{Messages: msgs, Chain: chainOf(tb, msgs), Window: 2000, Estimate: fakeEstimate}
}

// allocated is the heap bytes one Plan of in allocates.
func allocated(p *Planner, in Input) (uint64, Output) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	out := p.Plan(in)
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc, out
}

// Issue 19 review item 4: the drop step is linear in the number of turns.
// It used to clone the chosen turns for every turn it considered
// (quadratic: 32,000 tiny turns took 2.2 s, and the body limit allows five
// times that). Measured by what it allocates, not by time: twice the turns
// may cost at most three times the bytes (quadratic is four).
func TestDropIsLinear(t *testing.T) {
	cfg := baseConfig()
	cfg.SummarizerEnabled = false
	p := NewPlanner(cfg)
	small, large := tinyTurns(t, 3000), tinyTurns(t, 6000)
	a, outS := allocated(p, small)
	b, outL := allocated(p, large)
	for _, o := range []Output{outS, outL} {
		if o.Action != ActionDropped || o.Forwarded > o.Budget {
			t.Fatalf("setup: action %q, forwarded %d of a %d budget: want a drop to the budget", o.Action, o.Forwarded, o.Budget)
		}
	}
	t.Logf("Plan allocated %d bytes for 3,000 turns, %d for 6,000 (ratio %.2f)", a, b, float64(b)/float64(a))
	if float64(b) > 3*float64(a) {
		t.Fatalf("twice the turns allocated %.2f times the bytes (%d → %d): not linear", float64(b)/float64(a), a, b)
	}
}

// BenchmarkDropManyTurns is the case: 32,000 tiny turns.
func BenchmarkDropManyTurns(b *testing.B) {
	cfg := baseConfig()
	cfg.SummarizerEnabled = false
	p := NewPlanner(cfg)
	in := tinyTurns(b, 32000)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p.Plan(in)
	}
}
