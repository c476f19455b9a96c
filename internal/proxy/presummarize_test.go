package proxy

import (
	"bytes"
	"strconv"
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
			p.srv.driver.WaitBackground()
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

// A request that arrives while a background summary of its lineage is
// still running waits for it and re-applies it (or, when that summary
// covered an older head, leads one of its own): it never falls back to
// the trim-only view, which excerpts or drops while the summarizer works.
func TestRequestJoiningBackgroundSummaryUsesIt(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.delay = 300 * time.Millisecond
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Compaction.PresummarizeRatio = 0.5
	cfg.Compaction.MinInterval = 0
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20 // no trimming: only a summary or a drop helps
	// A trigger close to the budget and a one-turn tail: a request in the
	// presummarize band (≥ 1,755 tokens) is followed by one over the
	// budget (3,500), sent at once while the background summary runs.
	cfg.Compaction.TriggerRatio = 0.95
	cfg.Compaction.KeepTail = 1
	p := newTestProxy(t, cfg)
	a := newAgent()
	summarized := 0
	for step := 0; step < 12; step++ {
		a.toolStep(4800) // ~1,200 tokens a step
		resp := p.chatOK(t, a.body())
		t.Logf("step %d: context %s forwarded %s %s", step, resp.Header.Get("X-Compactproxy-Context-Tokens"), resp.Header.Get("X-Compactproxy-Forwarded-Tokens"), resp.Header.Get("X-Compactproxy-Compaction"))
		got := resp.Header.Get("X-Compactproxy-Compaction")
		ctx, _ := strconv.Atoi(resp.Header.Get("X-Compactproxy-Context-Tokens"))
		if ctx >= 3325 && got != "summarized" && got != "reused" {
			// Trim-only (tight excerpts) or a drop while the summarizer
			// works: the request did not use the background summary.
			t.Fatalf("step %d: context %d over the trigger forwarded %q, want the background summary", step, ctx, got)
		}
		if got == "summarized" || got == "reused" {
			summarized++
		}
	}
	p.srv.driver.WaitBackground()
	if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "dropped"}); v != 0 {
		t.Errorf("compactions_total{dropped} = %v, want 0 (summarize_total{failure} = %v)", v,
			counter(t, p.reg, "compactproxy_summarize_total", map[string]string{"result": "failure"}))
	}
	if summarized == 0 {
		t.Fatal("no step carried a summary")
	}
	if v := counter(t, p.reg, "compactproxy_presummarize_total", map[string]string{"result": "success"}); v == 0 {
		t.Error("no background summary ran: the test did not exercise a joined flight")
	}
}

// With the chat upstream as the summarizer, a background summary extends
// the whole view the proxy has just forwarded (system, head, kept tail,
// the client's final message), byte for byte, and only then asks for the
// summary: llama-server's one slot keeps the view's KV for the next step.
func TestBackgroundSummaryExtendsForwardedView(t *testing.T) {
	up := countingUpstream(t)
	cfg := compactionConfig(up.URL, up.URL)
	cfg.Compaction.Summarizer.URL = ""
	cfg.Upstream.ContextWindow = 6000
	cfg.Compaction.MinInterval = 0
	p := newTestProxy(t, cfg)
	a := newAgent()
	for step := 0; step < 40; step++ {
		a.toolStep(400)
		n := len(up.requests())
		p.chatOK(t, a.body())
		p.srv.driver.WaitBackground()
		reqs := up.requests()
		if len(reqs) < n+2 {
			continue // no background summary after this response
		}
		forwarded := forwardedMessages(t, reqs[n].Body)
		summarize := forwardedMessages(t, reqs[n+1].Body)
		if len(summarize) != len(forwarded)+1 {
			t.Fatalf("background summarize request has %d messages for a %d-message forwarded view, want the view plus one instruction", len(summarize), len(forwarded))
		}
		for i := range forwarded {
			if !bytes.Equal(forwarded[i], summarize[i]) {
				t.Fatalf("background summarize request differs from the forwarded view at message %d:\n%s\n%s", i, forwarded[i], summarize[i])
			}
		}
		if !bytes.Contains(summarize[len(summarize)-1], []byte("stay in the context verbatim")) {
			t.Fatalf("last message is not the kept-tail instruction: %s", summarize[len(summarize)-1])
		}
		return
	}
	t.Fatal("no background summary in 40 steps")
}
