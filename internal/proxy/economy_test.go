package proxy

import (
	"testing"
)

// maskingProxy is a proxy with dedupe and mask on (mode: enforce or
// shadow) and an agent whose short tool results take it over the trigger:
// mask, not trim (each result is under trim.tool_result_tokens), brings it
// below the target.
func maskingProxy(t *testing.T, mode string) (*testProxy, *fakeUpstream, *agent) {
	t.Helper()
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Compaction.Dedupe, cfg.Compaction.Mask, cfg.Compaction.Mode = true, true, mode
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	return p, up, a
}

// A view that carries only placeholders reports masked, and the decision
// is counted: compactions_total{masked}, the tokens mask removed and the
// cache reset it caused (the previous request held the masked results).
func TestMaskedHeaderAndMetrics(t *testing.T) {
	p, _, a := maskingProxy(t, "enforce")
	resp := p.chatOK(t, a.body())
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "masked" {
		t.Fatalf("X-Compactproxy-Compaction = %q, want masked", got)
	}
	if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "masked"}); v != 1 {
		t.Errorf("compactions_total{masked} = %v, want 1", v)
	}
	if v := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": "mask"}); v <= 0 {
		t.Errorf("reduced_tokens_total{mask} = %v, want > 0", v)
	}
	for _, step := range []string{"trim", "summarize", "drop"} {
		if v := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": step}); v != 0 {
			t.Errorf("reduced_tokens_total{%s} = %v, want 0", step, v)
		}
	}
	if v := counter(t, p.reg, "compactproxy_cache_resets_total", nil); v != 1 {
		t.Errorf("cache_resets_total = %v, want 1", v)
	}
	lines := p.logs.FilterMessage("compaction").All()
	if len(lines) != 1 {
		t.Fatalf("%d compaction log lines, want 1", len(lines))
	}
	f := lines[0].ContextMap()
	if f["action"] != "masked" || f["cache_reset"] != true {
		t.Errorf("log line %v: want action masked, cache_reset true", f)
	}
	if red, _ := f["reduced_tokens"].(map[string]any); red == nil || red["mask"] == nil {
		t.Errorf("log line %v: want reduced_tokens by step with mask", f)
	}
	// The next step re-applies the placeholders: nothing new removed, no
	// reset, still masked.
	before := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": "mask"})
	a.toolStep(40)
	resp = p.chatOK(t, a.body())
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "masked" {
		t.Errorf("re-applied: X-Compactproxy-Compaction = %q, want masked", got)
	}
	if v := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": "mask"}); v != before {
		t.Errorf("re-applied: reduced_tokens_total{mask} went from %v to %v", before, v)
	}
	if v := counter(t, p.reg, "compactproxy_cache_resets_total", nil); v != 1 {
		t.Errorf("re-applied: cache_resets_total = %v, want 1", v)
	}
}

// A preview's dry run counts nothing, ?summarize=true included (it is not
// forwarded).
func TestPreviewCountsNoReduction(t *testing.T) {
	p, _, a := maskingProxy(t, "enforce")
	for _, q := range []string{"", "?summarize=true"} {
		resp := p.post(t, "/v1/compactproxy/preview"+q, a.body(), "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
		if b := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("preview%s: %d %s", q, resp.StatusCode, b)
		}
	}
	if v := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": "mask"}); v != 0 {
		t.Errorf("preview counted reduced_tokens_total{mask} = %v", v)
	}
	if v := counter(t, p.reg, "compactproxy_cache_resets_total", nil); v != 0 {
		t.Errorf("preview counted cache_resets_total = %v", v)
	}
}

// Shadow mode decides and counts what it would remove, and forwards the
// client's bytes.
func TestShadowCountsReduction(t *testing.T) {
	p, up, a := maskingProxy(t, "shadow")
	body := a.body()
	resp := p.chatOK(t, body)
	if string(up.last(t).Body) != body || resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Fatal("shadow mode changed the forwarded request")
	}
	if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "masked"}); v != 1 {
		t.Errorf("compactions_total{masked} = %v, want 1", v)
	}
	if v := counter(t, p.reg, "compactproxy_reduced_tokens_total", map[string]string{"step": "mask"}); v <= 0 {
		t.Errorf("shadow: reduced_tokens_total{mask} = %v, want > 0", v)
	}
}
