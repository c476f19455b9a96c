package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
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

// The conversation read lists step 0's records apart from excerpts: masks
// by position, dedupe pointers with the later result they point to.
func TestConversationStateListsMasksAndDedupes(t *testing.T) {
	up := countingUpstream(t)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 6000
	cfg.Compaction.ReserveTokens = 500
	cfg.Compaction.Summarizer.Enabled = false
	cfg.Compaction.Dedupe, cfg.Compaction.Mask = true, true
	p := newTestProxy(t, cfg)
	msgs := []string{`{"role":"user","content":"review every file"}`}
	call := func(i int, file string) {
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"%s\"}"}}]}`, i, file),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"call_%d","content":%q}`, i, strings.Repeat(fmt.Sprintf("%s line %d; ", file, i), 180)))
	}
	call(0, "a.go") // position 2: read again at position 14
	for i := 1; i < 6; i++ {
		call(i, fmt.Sprintf("f%d.go", i))
	}
	call(6, "a.go")
	for i := 7; i < 10; i++ {
		call(i, fmt.Sprintf("f%d.go", i))
	}
	msgs = append(msgs, `{"role":"user","content":"continue"}`)
	body := `{"model":"m","messages":[` + strings.Join(msgs, ",") + `]}`
	resp, out := p.send(t, "POST", "/v1/chat/completions", body, "Authorization", "Bearer k", "X-Session-Id", "s")
	if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Compaction") != "masked" {
		t.Fatalf("not masked: %d %q %s", resp.StatusCode, resp.Header.Get("X-Compactproxy-Compaction"), out)
	}
	resp, out = p.send(t, "GET", "/v1/compactproxy/conversations/s", "", "Authorization", "Bearer k")
	var st conversationState
	if resp.StatusCode != 200 || json.Unmarshal(out, &st) != nil || len(st.Lineages) != 1 {
		t.Fatalf("GET: %d %s", resp.StatusCode, out)
	}
	l := st.Lineages[0]
	if len(l.Trims) != 0 || len(l.Masks) == 0 || len(l.Dedupes) != 1 || l.Dedupes[0] != (dedupeState{Index: 2, PointsTo: 14}) {
		t.Errorf("lineage %s: want no excerpts, masks, and one pointer from 2 to 14", out)
	}
	if !bytes.Contains(out, []byte(`"masks":[`)) || !bytes.Contains(out, []byte(`"dedupes":[{"index":2,"points_to":14}]`)) {
		t.Errorf("body %s: want masks and dedupes", out)
	}
}

// A view forwarded without the summary that is due names what it carries:
// masked when every changed message is a stored placeholder or pointer,
// trimmed when one is an excerpt (or any change without a record).
func TestViewActionMasked(t *testing.T) {
	msg := func(i int, raw string) chat.Message { return chat.Message{Raw: []byte(raw), Index: i} }
	client := []chat.Message{msg(0, "u"), msg(1, "call"), msg(2, "result one"), msg(3, "call"), msg(4, "result two"), msg(5, "u2")}
	changed := func(at ...int) []chat.Message {
		out := slices.Clone(client)
		for _, i := range at {
			out[i] = msg(i, "reduced")
		}
		return out
	}
	cases := []struct {
		fwd   []chat.Message
		trims []compaction.Trim
		want  string
	}{
		{changed(2, 4), []compaction.Trim{{Index: 2, Keep: 0}, {Index: 4, Keep: -2}}, "masked"},
		{changed(2, 4), []compaction.Trim{{Index: 2, Keep: 0}, {Index: 4, Keep: 100}}, "trimmed"},
		{changed(2, 4), []compaction.Trim{{Index: 2, Keep: 0}}, "trimmed"},
		{client, []compaction.Trim{{Index: 2, Keep: 0}}, "none"},
	}
	for i, c := range cases {
		if got := viewAction(client, c.fwd, c.trims); got != c.want {
			t.Errorf("case %d: %q, want %q", i, got, c.want)
		}
	}
}
