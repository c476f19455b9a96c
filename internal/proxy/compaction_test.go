package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
)

// countingUpstream answers chat completions and reports prompt_tokens as
// the forwarded body's bytes / 4: a "provider" whose count the proxy can
// only learn from the usage it reports.
func countingUpstream(t *testing.T) *fakeUpstream {
	return newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":1}}`, len(body)/4)
	})
}

// summarizerServer is a separate summarizer endpoint; fail makes it answer
// 400 like a strict provider rejecting the request.
type summarizerServer struct {
	*fakeUpstream
	calls atomic.Int32
	fail  atomic.Bool
	delay time.Duration
}

func newSummarizerServer(t *testing.T) *summarizerServer {
	s := &summarizerServer{}
	s.fakeUpstream = newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		s.calls.Add(1)
		if s.delay > 0 {
			time.Sleep(s.delay)
		}
		w.Header().Set("Content-Type", "application/json")
		if s.fail.Load() {
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"rejected","type":"invalid_request_error"}}`)
			return
		}
		io.WriteString(w, `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Goal: add a retry. Files: store.py. Next: run tests."},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":10}}`)
	})
	return s
}

func compactionConfig(up, sum string) config.Config {
	cfg := testConfig(up)
	cfg.Upstream.ContextWindow = 4000
	cfg.Compaction.ReserveTokens = 500
	cfg.Compaction.Summarizer.URL = sum + "/v1"
	cfg.Compaction.Summarizer.MaxTokens = 200
	return cfg
}

// agent builds a growing tool-using conversation as raw messages.
type agent struct {
	msgs []string
	step int
}

func newAgent() *agent {
	return &agent{msgs: []string{
		`{"role":"system","content":"You are a coding agent."}`,
		`{"role":"user","content":"add a retry to fetch_rows in store.py"}`,
	}}
}

// toolStep appends an assistant tool call and its result of n bytes.
func (a *agent) toolStep(n int) {
	a.step++
	id := fmt.Sprintf("call_%d", a.step)
	out := strings.Repeat(fmt.Sprintf("line %d of output for step %d\n", a.step, a.step), n/10+1)[:n]
	outJSON, _ := json.Marshal(out)
	a.msgs = append(a.msgs,
		fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":%q,"type":"function","function":{"name":"run","arguments":"{\"step\":%d}"}}]}`, id, a.step),
		fmt.Sprintf(`{"role":"tool","tool_call_id":%q,"content":%s}`, id, outJSON))
}

func (a *agent) uiOnly() {
	a.msgs = append(a.msgs, `{"role":"assistant","content":"⏳ compacting context…","ui_only":true}`)
}

func (a *agent) body() string {
	return `{"model":"m","messages":[` + strings.Join(a.msgs, ",") + `]}`
}

func (p *testProxy) chatOK(t *testing.T, body string) *http.Response {
	t.Helper()
	resp := p.post(t, "/v1/chat/completions", body, "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
	b := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	return resp
}

// The failed-summarizer repro (DESIGN failure 1): a summarizer that always
// rejects, agent tool steps over the trigger, a UI-only status message each
// step. The summarizer is called once; every request succeeds; the UI-only
// messages never release the latch; provider-visible growth does.
func TestFailedSummarizerLatches(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.fail.Store(true)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Retry.Attempts = 1
	cfg.Compaction.MinInterval = 0 // isolate the latch from the throttle
	// Trigger 2,800, target 2,625 of a 3,500 budget, no trimming: every
	// tool step (≈ 230 tokens) takes the conversation over the trigger
	// again even after a drop down to the target.
	cfg.Compaction.TargetRatio = 0.75
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20
	p := newTestProxy(t, cfg)
	a := newAgent()
	for {
		a.toolStep(800)
		resp := p.post(t, "/v1/compactproxy/preview", a.body(), "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
		var pr previewResponse
		if err := json.Unmarshal(readAll(t, resp), &pr); err != nil {
			t.Fatal(err)
		}
		if pr.ContextTokens >= 2800-300 {
			break
		}
	}
	latchedAt := 0
	for i := 0; i < 5; i++ {
		a.toolStep(800)
		a.uiOnly()
		resp := p.chatOK(t, a.body())
		// A summary due after this response runs in the background
		// (presummarize); let it finish before counting calls.
		p.srv.driver.WaitBackground()
		if latchedAt == 0 && sum.calls.Load() == 1 {
			latchedAt = 2 + 2*a.step
		}
		t.Logf("step %d: context %s (%s) forwarded %s action %s", i, resp.Header.Get("X-Compactproxy-Context-Tokens"),
			resp.Header.Get("X-Compactproxy-Context-Source"), resp.Header.Get("X-Compactproxy-Forwarded-Tokens"), resp.Header.Get("X-Compactproxy-Compaction"))
	}
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("summarizer called %d times over 5 steps, want 1", n)
	}
	if v := counter(t, p.reg, "compactproxy_summarize_suppressed_total", map[string]string{"reason": "latch"}); v != 4 {
		t.Errorf("summarize_suppressed_total{latch} = %v, want 4 (steps 1-4)", v)
	}
	if v := counter(t, p.reg, "compactproxy_latch_engaged_total", nil); v != 1 {
		t.Errorf("latch_engaged_total = %v", v)
	}
	if v := counter(t, p.reg, "compactproxy_summarize_total", map[string]string{"result": "failure"}); v != 1 {
		t.Errorf("summarize_total{failure} = %v", v)
	}
	// 20 UI-only messages later: still latched.
	for i := 0; i < 20; i++ {
		a.uiOnly()
	}
	a.toolStep(800)
	p.chatOK(t, a.body())
	p.srv.driver.WaitBackground()
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("UI-only messages released the latch: %d calls", n)
	}
	// The next attempt may come only at ≥ C + 20 provider-visible
	// messages, and must come then (every step is over the trigger).
	retriedAt := 0
	for i := 0; i < 20 && retriedAt == 0; i++ {
		a.toolStep(800)
		p.chatOK(t, a.body())
		p.srv.driver.WaitBackground()
		if sum.calls.Load() > 1 {
			retriedAt = 2 + 2*a.step
		}
	}
	if retriedAt != latchedAt+20 {
		t.Fatalf("summarize retried at %d provider-visible messages, want %d (latched at %d)", retriedAt, latchedAt+20, latchedAt)
	}
	for _, r := range up.requests() {
		if bytes.Contains(r.Body, []byte("compacting context")) {
			t.Fatal("a UI-only message reached the upstream")
		}
	}
}

// A successful summary is stored and re-applied: the next step forwards the
// same prefix (canonically and byte-for-byte) without a new summarize.
func TestSummaryReusedWithStablePrefix(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	if got := p.sixteenSteps(t, a); got != "summarized" {
		t.Fatalf("compaction %q, want summarized", got)
	}
	first := forwardedMessages(t, up.last(t).Body)
	a.toolStep(200)
	resp := p.chatOK(t, a.body())
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "reused" {
		t.Fatalf("second step compaction %q, want reused", got)
	}
	if sum.calls.Load() != 1 {
		t.Fatalf("summarizer calls %d, want 1", sum.calls.Load())
	}
	second := forwardedMessages(t, up.last(t).Body)
	if len(second) < len(first) {
		t.Fatalf("second view shorter than the first")
	}
	for i := range first {
		if !bytes.Equal(first[i], second[i]) {
			t.Fatalf("forwarded prefix changed at message %d:\n%s\n%s", i, first[i], second[i])
		}
	}
	// The client's last message stays last, verbatim.
	if !bytes.Equal(second[len(second)-1], []byte(a.msgs[len(a.msgs)-1])) {
		t.Errorf("last forwarded message is not the client's")
	}
	if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "reused"}); v != 1 {
		t.Errorf("compactions_total{reused} = %v", v)
	}
}

// sixteenSteps sends a's conversation after sixteen tool steps of 800
// bytes (over compactionConfig's trigger) and returns the compaction it got.
func (p *testProxy) sixteenSteps(t *testing.T, a *agent) string {
	t.Helper()
	for a.step < 16 {
		a.toolStep(800)
	}
	return p.chatOK(t, a.body()).Header.Get("X-Compactproxy-Compaction")
}

func forwardedMessages(t *testing.T, body []byte) []json.RawMessage {
	t.Helper()
	var b struct {
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	return b.Messages
}

// Concurrent requests of one conversation cause one summarize.
func TestConcurrentRequestsOneSummarize(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.delay = 200 * time.Millisecond
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	body := a.body()
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp := p.post(t, "/v1/chat/completions", body, "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
			readAll(t, resp)
			if resp.StatusCode != 200 {
				t.Errorf("status %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("summarizer called %d times for 4 concurrent requests, want 1", n)
	}
}

// Shadow mode decides and counts but forwards the client's bytes.
func TestShadowModeForwardsUnchanged(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Compaction.Mode = "shadow"
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 14 {
		a.toolStep(5000) // long results: trim would apply
	}
	body := a.body()
	resp := p.chatOK(t, body)
	if got := string(up.last(t).Body); got != body {
		t.Fatal("shadow mode changed the forwarded body")
	}
	if resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Errorf("shadow header %q", resp.Header.Get("X-Compactproxy-Compaction"))
	}
	if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": "trimmed"}); v < 1 {
		t.Errorf("shadow mode did not count its decision: trimmed = %v", v)
	}
}

// Bypass forwards without compaction.
func TestBypassHeader(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	for a.step < 14 {
		a.toolStep(5000)
	}
	body := a.body()
	resp := p.post(t, "/v1/chat/completions", body, "X-Compactproxy-Bypass", "true")
	readAll(t, resp)
	if string(up.last(t).Body) != body || resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Fatal("bypass request was compacted")
	}
	if up.last(t).Header.Get("X-Compactproxy-Bypass") != "" {
		t.Error("bypass header forwarded upstream")
	}
}

// Overflow recovery: the upstream's window is smaller than configured; its
// llama.cpp overflow answer teaches n_ctx, the proxy compacts and retries
// once, and the client gets a normal answer.
func TestOverflowRecovery(t *testing.T) {
	const nCtx = 3000
	var calls atomic.Int32
	var plain atomic.Bool
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if plain.Load() {
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"bad temperature","type":"invalid_request_error"}}`)
			return
		}
		if n := len(body) / 4; n > nCtx {
			w.WriteHeader(400)
			fmt.Fprintf(w, `{"error":{"code":400,"message":"request (%d tokens) exceeds the available context size (%d tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`, n, nCtx, n, nCtx)
			return
		}
		fmt.Fprintf(w, `{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":1}}`, len(body)/4)
	})
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Upstream.ContextWindow = 0
	cfg.Models = []config.Model{{Name: "other", ContextWindow: 1}}
	cfg.Compaction.ReserveTokens = 200
	p := newTestProxy(t, cfg)
	// No window known: the first over-long request overflows, and the
	// window is learned from the answer.
	a := newAgent()
	for a.step < 8 {
		a.toolStep(2500)
	}
	resp := p.post(t, "/v1/chat/completions", a.body())
	b := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("overflow not recovered: %d %s", resp.StatusCode, b)
	}
	if calls.Load() != 2 {
		t.Errorf("upstream calls %d, want 2 (overflow + one retry)", calls.Load())
	}
	if v := counter(t, p.reg, "compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "context_overflow"}); v != 1 {
		t.Errorf("retries{context_overflow} = %v", v)
	}
	// A 400 that is not an overflow passes through untouched, once.
	plain.Store(true)
	before := calls.Load()
	resp = p.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	b = readAll(t, resp)
	if resp.StatusCode != 400 || !bytes.Contains(b, []byte("bad temperature")) || calls.Load()-before != 1 {
		t.Errorf("plain 400: status %d calls %d body %s", resp.StatusCode, calls.Load()-before, b)
	}
}

// The preview is a dry run: over the trigger it reports summarize_pending
// without calling anyone; ?summarize=true makes and stores the summary,
// which the next chat request then reuses.
func TestPreviewSummarizePendingThenSummarize(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	a.toolStep(6000) // long enough to be trimmed: a dry run must not count that
	for a.step < 16 {
		a.toolStep(800)
	}
	preview := func(query string) previewResponse {
		resp := p.post(t, "/v1/compactproxy/preview"+query, a.body(), "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
		b := readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("preview status %d: %s", resp.StatusCode, b)
		}
		var pr previewResponse
		if err := json.Unmarshal(b, &pr); err != nil {
			t.Fatal(err)
		}
		return pr
	}
	pr := preview("")
	if pr.Action != "summarize_pending" || sum.calls.Load() != 0 || len(up.requests()) != 0 {
		t.Fatalf("dry run: action %q, summarizer calls %d, upstream calls %d", pr.Action, sum.calls.Load(), len(up.requests()))
	}
	for _, action := range []string{"trimmed", "summarized", "dropped", "reused"} {
		if v := counter(t, p.reg, "compactproxy_compactions_total", map[string]string{"action": action}); v != 0 {
			t.Errorf("dry run counted compactions_total{%s} = %v", action, v)
		}
	}
	if pr.ContextTokens < int(0.8*float64(pr.Budget)) || pr.Window != 4000 || pr.Budget != 3500 {
		t.Errorf("dry run figures %+v", pr)
	}
	pr = preview("?summarize=true")
	if pr.Action != "summarized" || sum.calls.Load() != 1 || pr.ForwardedTokens >= pr.ContextTokens {
		t.Fatalf("summarize=true: action %q, calls %d, forwarded %d of %d", pr.Action, sum.calls.Load(), pr.ForwardedTokens, pr.ContextTokens)
	}
	if len(up.requests()) != 0 {
		t.Fatal("preview called the chat upstream")
	}
	if v := counter(t, p.reg, "compactproxy_summarize_total", map[string]string{"result": "success"}); v != 1 {
		t.Errorf("summarize_total{success} = %v after ?summarize=true", v)
	}
	resp := p.chatOK(t, a.body())
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "reused" || sum.calls.Load() != 1 {
		t.Fatalf("chat after preview: %q, summarizer calls %d", got, sum.calls.Load())
	}
}

// A summarizer's error body can echo the conversation; the compaction log
// names the failure without quoting it.
func TestSummarizeErrorNotLogged(t *testing.T) {
	up := countingUpstream(t)
	const marker = "MARKER-ECHOED-PROMPT-41c9"
	sum := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.WriteHeader(400)
		io.WriteString(w, `{"error":{"message":"cannot summarize: `+marker+`","type":"invalid_request_error"}}`)
	})
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Retry.Attempts = 1
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	p.chatOK(t, a.body())
	if len(sum.requests()) != 1 {
		t.Fatalf("summarizer calls %d, want 1", len(sum.requests()))
	}
	found := false
	for _, e := range p.logs.All() {
		for k, v := range e.ContextMap() {
			if strings.Contains(fmt.Sprint(v), marker) {
				t.Errorf("log %q field %s quotes the summarizer's error body", e.Message, k)
			}
			if k == "summarize_error" && v == "status 400" {
				found = true
			}
		}
	}
	if !found {
		t.Error("no compaction log line with summarize_error=\"status 400\"")
	}
}

// A summarize call that continues the client's request (the summarizer is
// the chat upstream) keeps the client's model, tools and sampling fields
// but none of the output options that would shape the summary: llama-server
// reads n_predict before max_tokens, so a client's n_predict: 16 for its
// own answers would cut every summary to 16 tokens.
func TestSummarizeRequestDropsClientOutputOptions(t *testing.T) {
	up := countingUpstream(t)
	cfg := compactionConfig(up.URL, up.URL)
	cfg.Compaction.Summarizer.URL = ""
	cfg.Upstream.ContextWindow = 6000
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 20 {
		a.toolStep(800)
	}
	extra := `,"tools":[{"type":"function","function":{"name":"run","parameters":{"type":"object"}}}],"temperature":0.2,"n_predict":16,"ignore_eos":true,"grammar":"root ::= \"x\"","json_schema":{"type":"object"},"guided_regex":"x+","min_tokens":9,"max_tokens":300}`
	body := strings.TrimSuffix(a.body(), "}") + extra
	resp := p.chatOK(t, body)
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "summarized" {
		t.Fatalf("compaction %q, want summarized", got)
	}
	var sum map[string]json.RawMessage
	for _, r := range up.requests() {
		var b map[string]json.RawMessage
		if err := json.Unmarshal(r.Body, &b); err != nil {
			t.Fatal(err)
		}
		if string(b["tool_choice"]) == `"none"` {
			sum = b
		}
	}
	if sum == nil {
		for _, r := range up.requests() {
			t.Logf("%s %.300s", r.Path, r.Body)
		}
		t.Fatalf("no summarize request reached the upstream (%d requests)", len(up.requests()))
	}
	for _, k := range []string{"n_predict", "ignore_eos", "grammar", "json_schema", "guided_regex", "min_tokens"} {
		if v, ok := sum[k]; ok {
			t.Errorf("summarize request carries the client's %s: %s", k, v)
		}
	}
	if string(sum["temperature"]) != "0.2" || len(sum["tools"]) == 0 || string(sum["model"]) != `"m"` {
		t.Errorf("summarize request lost the client's fields: temperature %s, model %s, tools %d bytes", sum["temperature"], sum["model"], len(sum["tools"]))
	}
	if mt := string(sum["max_tokens"]); mt == "" || mt == "300" {
		t.Errorf("summarize max_tokens = %q, want the summary's own limit", mt)
	}
}

// A summarize request its endpoint refuses as over its window (llama.cpp's
// exceed_context_size_error, which names the window) is sent again in
// chunks that fit it: the summary is made, nothing latches, nothing is
// dropped. (A summarizer of its own whose window the proxy does not know:
// the first request carries the whole head.)
func TestSummarizerOverflowResentInChunks(t *testing.T) {
	up := countingUpstream(t)
	const nCtx = 1600 // the summarizer's window: a token per 3 bytes of body
	var refused, answered atomic.Int32
	sum := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		if n := len(body) / 3; n >= nCtx {
			refused.Add(1)
			w.WriteHeader(400)
			fmt.Fprintf(w, `{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`, n, nCtx)
			return
		}
		answered.Add(1)
		io.WriteString(w, `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Goal: add a retry. Files: store.py. Next: run tests."},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":10}}`)
	})
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	if got := p.sixteenSteps(t, newAgent()); got != "summarized" {
		t.Fatalf("compaction %q, want summarized (%d refused, %d answered)", got, refused.Load(), answered.Load())
	}
	if refused.Load() != 1 || answered.Load() < 2 {
		t.Fatalf("%d summarize requests refused, %d answered: want one refused, then the head in chunks", refused.Load(), answered.Load())
	}
	for i, r := range sum.requests()[1:] {
		if n := len(r.Body) / 3; n >= nCtx {
			t.Errorf("request %d, after the refusal, is over the window: %d tokens", i+2, n)
		}
	}
	if v := counter(t, p.reg, "compactproxy_summarize_total", map[string]string{"result": "failure"}); v != 0 {
		t.Errorf("summarize_total{failure} = %v", v)
	}
	if v := counter(t, p.reg, "compactproxy_latch_engaged_total", nil); v != 0 {
		t.Errorf("latch_engaged_total = %v", v)
	}
}
