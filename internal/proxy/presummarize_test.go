package proxy

import (
	"testing"
	"time"
)

// Background pre-summarization: the request that crosses the trigger
// re-applies the summary made in the background after an earlier response
// and makes no summarize call of its own; without it, the crossing request
// makes (and waits for) the call.
func TestPresummarizeKeepsSummarizeOffTheCriticalPath(t *testing.T) {
	const delay = 150 * time.Millisecond
	// crossing runs the loop to the first request that carries a summary
	// and returns its action, the summarize calls made while it was in
	// flight, its time (logged, not asserted) and presummarize_total.
	crossing := func(t *testing.T, ratio float64) (string, int32, time.Duration, float64) {
		up := countingUpstream(t)
		sum := newSummarizerServer(t)
		sum.delay = delay
		cfg := compactionConfig(up.URL, sum.URL)
		cfg.Compaction.PresummarizeRatio = ratio
		cfg.Compaction.MinInterval = 0
		p := newTestProxy(t, cfg)
		a := newAgent()
		for step := 0; step < 40; step++ {
			a.toolStep(400)
			before := sum.calls.Load()
			start := time.Now()
			resp := p.chatOK(t, a.body())
			took := time.Since(start)
			if got := resp.Header.Get("X-Compactproxy-Compaction"); got == "summarized" || got == "reused" {
				pre := counter(t, p.reg, "compactproxy_presummarize_total", map[string]string{"result": "success"})
				return got, sum.calls.Load() - before, took, pre
			}
			// An agent's own think time: a background summary started
			// after this response finishes before the next step.
			p.srv.flights.waitBackground()
		}
		t.Fatal("the loop never crossed the trigger")
		return "", 0, 0, 0
	}
	action, during, took, pre := crossing(t, 0.7)
	t.Logf("presummarize 0.7: crossing request %s in %v, summarize calls during it %d, presummarize_total{success} %v", action, took, during, pre)
	if action != "reused" || pre != 1 || during != 0 {
		t.Fatalf("crossing request %q (calls during it %d, presummarize %v), want the background summary reused", action, during, pre)
	}
	action, during, took, _ = crossing(t, 0)
	t.Logf("presummarize off: crossing request %s in %v, summarize calls during it %d", action, took, during)
	if action != "summarized" || during != 1 {
		t.Fatalf("without presummarize: %q with %d calls during it, want summarized by its own call", action, during)
	}
}
