package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/identity"
)

// workerStep appends a tool call and a result that names the worker, so
// two workers started from one template diverge after their opening
// messages (the derived conversation id cannot tell them apart).
func (a *agent) workerStep(worker string, n int) {
	a.step++
	id := fmt.Sprintf("call_%s_%d", worker, a.step)
	out := strings.Repeat(fmt.Sprintf("%s: line of output for step %d\n", worker, a.step), n/20+1)[:n]
	outJSON, _ := json.Marshal(out)
	a.msgs = append(a.msgs,
		fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":%q,"type":"function","function":{"name":"run","arguments":"{\"w\":\"%s\"}"}}]}`, id, worker),
		fmt.Sprintf(`{"role":"tool","tool_call_id":%q,"content":%s}`, id, outJSON))
}

// Issue 10 item 1: two swarm workers that share a conversation id (no
// header; same system prompt and first user message) alternate, 12
// requests over the trigger. Each keeps its own summary: one summarize
// per worker, and every later request of a worker re-applies its own
// summary with a byte-stable prefix. Before lineages, each worker's save
// overwrote the other's summary and throttle: 12 requests, 6 summarize
// calls, one worker dropped on every step.
func TestSwarmWorkersKeepOwnLineages(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20 // summaries only: the action says which
	p := newTestProxy(t, cfg)
	workers := map[string]*agent{"A": newAgent(), "B": newAgent()}
	for name, a := range workers {
		for a.step < 16 {
			a.workerStep(name, 800)
		}
	}
	firstView := map[string][]json.RawMessage{}
	ids := map[string]string{}
	for i := 0; i < 12; i++ {
		name := "A"
		if i%2 == 1 {
			name = "B"
		}
		a := workers[name]
		if i >= 2 {
			a.workerStep(name, 120)
		}
		resp := p.post(t, "/v1/chat/completions", a.body(), "Authorization", "Bearer k")
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		ids[name] = resp.Header.Get("X-Compactproxy-Conversation-Id")
		action := resp.Header.Get("X-Compactproxy-Compaction")
		fwd := forwardedMessages(t, up.last(t).Body)
		if i < 2 {
			if action != "summarized" {
				t.Fatalf("worker %s first request: compaction %q, want summarized", name, action)
			}
			firstView[name] = fwd
			continue
		}
		if action != "reused" {
			t.Fatalf("request %d (worker %s): compaction %q, want reused (its own summary)", i, name, action)
		}
		first := firstView[name]
		if len(fwd) < len(first) {
			t.Fatalf("request %d: forwarded view shorter than the worker's first", i)
		}
		// The summary and what follows it up to the first request's tail
		// are the worker's own, byte for byte.
		for j := range first {
			if !bytes.Equal(first[j], fwd[j]) {
				t.Fatalf("request %d (worker %s): forwarded prefix changed at message %d", i, name, j)
			}
		}
		if !bytes.Contains(fwd[len(fwd)-1], []byte(name+": line")) {
			t.Fatalf("request %d: last forwarded message is not worker %s's", i, name)
		}
	}
	if ids["A"] != ids["B"] {
		t.Fatalf("the workers got different conversation ids (%s, %s): the test needs them shared", ids["A"], ids["B"])
	}
	if n := sum.calls.Load(); n != 2 {
		t.Fatalf("summarize calls %d for two workers, want 2 (one each)", n)
	}
}

// Issue 10 item 2: an anchor recorded by a response while a summarize of
// the same conversation is running survives the summarize's save.
func TestAnchorRecordedDuringSummarizeKept(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.delay = 400 * time.Millisecond
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	long := a.body()
	short := newAgent()
	short.toolStep(100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp := p.post(t, "/v1/chat/completions", long, "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv")
		readAll(t, resp)
		if resp.Header.Get("X-Compactproxy-Compaction") != "summarized" {
			t.Errorf("long request: compaction %q, want summarized", resp.Header.Get("X-Compactproxy-Compaction"))
		}
	}()
	// Once the summarize is running, another request of the same
	// conversation (bypassing compaction: it never waits for the
	// summarize) is answered and records its anchor.
	deadline := time.Now().Add(5 * time.Second)
	for sum.calls.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	resp := p.post(t, "/v1/chat/completions", short.body(), "Authorization", "Bearer k", "X-Compactproxy-Conversation", "conv", "X-Compactproxy-Bypass", "true")
	readAll(t, resp)
	if resp.Header.Get("X-Compactproxy-Compaction") != "none" {
		t.Fatalf("short request compacted: %q", resp.Header.Get("X-Compactproxy-Compaction"))
	}
	<-done
	cv := resp.Header.Get("X-Compactproxy-Conversation-Id")
	key := identity.Key(identity.Tenant(p.srv.tenantSecret, http.Header{"Authorization": {"Bearer k"}}), cv)
	conv, ok, err := p.srv.store.Load(context.Background(), key)
	if err != nil || !ok {
		t.Fatalf("state not found: %v", err)
	}
	shortLen := len(short.msgs)
	var anchored bool
	for _, an := range conv.Anchors {
		anchored = anchored || an.PrefixLen == shortLen
	}
	if !anchored {
		t.Fatalf("the short request's anchor (prefix %d) was lost; anchors %+v", shortLen, conv.Anchors)
	}
	var summarized bool
	for _, l := range conv.Lineages {
		summarized = summarized || l.State.Summary != nil
	}
	if !summarized {
		t.Fatalf("the summary was not stored")
	}
}

// Issue 9 item 9: the summarize is not tied to the client that triggered
// it. A client that gives up while it runs does not cancel it; the SDK's
// retry of the same request finds it in progress and reuses it: one
// summarize call. A waiting request whose client leaves returns at once.
func TestSummarizeDetachedFromClient(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.delay = 600 * time.Millisecond
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	body := a.body()
	send := func(timeout time.Duration) (*http.Response, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer k")
		req.Header.Set("X-Compactproxy-Conversation", "conv")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			readAll(t, resp)
		}
		return resp, err
	}
	if _, err := send(100 * time.Millisecond); err == nil {
		t.Fatal("the first client should have timed out while the summarize ran")
	}
	// A second impatient client: it waits for the running summarize and
	// gives up with its own context, well before the summarize ends.
	start := time.Now()
	if _, err := send(100 * time.Millisecond); err == nil {
		t.Fatal("the second client should have timed out too")
	}
	if d := time.Since(start); d > 400*time.Millisecond {
		t.Fatalf("a waiting request outlived its client by %v", d)
	}
	resp, err := send(10 * time.Second)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("retry: %v", err)
	}
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "reused" {
		t.Fatalf("retry: compaction %q, want reused (the summary the first client started)", got)
	}
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("summarize calls %d, want 1 (the retry must not restart it)", n)
	}
}

// compaction.conversation_headers: the first is the proxy's own (stripped
// before forwarding), X-Session-Id (agents' own) names a conversation too
// and is forwarded unchanged.
func TestConversationHeaders(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	idOf := func(hdr ...string) string {
		resp := p.post(t, "/v1/chat/completions", body, hdr...)
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		return resp.Header.Get("X-Compactproxy-Conversation-Id")
	}
	derived := idOf()
	s1 := idOf("X-Session-Id", "s1")
	if s1 == derived {
		t.Fatal("X-Session-Id did not name the conversation")
	}
	if got := up.last(t).Header.Get("X-Session-Id"); got != "s1" {
		t.Fatalf("X-Session-Id forwarded as %q, want s1", got)
	}
	if idOf("X-Session-Id", "s2") == s1 {
		t.Fatal("two sessions share an id")
	}
	own := idOf("X-Compactproxy-Conversation", "c1", "X-Session-Id", "s1")
	if own == s1 {
		t.Fatal("X-Compactproxy-Conversation does not win over X-Session-Id")
	}
	if got := up.last(t).Header.Get("X-Compactproxy-Conversation"); got != "" {
		t.Fatalf("X-Compactproxy-Conversation forwarded: %q", got)
	}

	cfg := testConfig(up.URL)
	cfg.Compaction.ConversationHeaders = []string{"X-My-Conv"}
	p2 := newTestProxy(t, cfg)
	resp := p2.post(t, "/v1/chat/completions", body, "X-My-Conv", "z", "X-Session-Id", "s1")
	readAll(t, resp)
	if got := up.last(t).Header.Get("X-My-Conv"); got != "" {
		t.Fatalf("the configured first header was forwarded: %q", got)
	}
	var _ sync.Mutex
}

// The latch is per lineage too: worker A's failed summarize latches A
// only; worker B (same conversation id) still gets its summary (before
// lineages, A's latch suppressed B: B was dropped instead), and A never
// gets B's summary.
func TestSwarmWorkersKeepOwnLatch(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.fail.Store(true)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Retry.Attempts = 1
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20
	p := newTestProxy(t, cfg)
	wa, wb := newAgent(), newAgent()
	for wa.step < 16 {
		wa.workerStep("A", 800)
		wb.workerStep("B", 800)
	}
	p.chatOK(t, wa.body()) // A: the summarize fails, A latches
	if sum.calls.Load() != 1 {
		t.Fatalf("summarize calls %d after A's first request", sum.calls.Load())
	}
	sum.fail.Store(false)
	if got := p.chatOK(t, wb.body()).Header.Get("X-Compactproxy-Compaction"); got != "summarized" {
		t.Fatalf("worker B: compaction %q, want summarized (A's latch is not B's)", got)
	}
	// A again: its own records (the drop made after the failure) apply;
	// no new summarize call.
	wa.workerStep("A", 100)
	if got := p.chatOK(t, wa.body()).Header.Get("X-Compactproxy-Compaction"); got == "summarized" || got == "reused" {
		t.Fatalf("worker A: compaction %q: it got B's summary", got)
	}
	if n := sum.calls.Load(); n != 2 {
		t.Fatalf("summarize calls %d, want 2 (A once, B once)", n)
	}
}

// Issue 19 review item 1: an agent whose system prompt changes on every
// request (a clock, a git status), no conversation header, a summarizer
// that always fails. The records, latch and throttle are keyed after the
// system messages, and the derived conversation id ignores the system
// prompt: one summarize call, then the latch holds for latch_growth
// messages. Keyed on the system prompt, every step was a new lineage (and
// a new conversation): a summarize call per step.
func TestChangingSystemPromptKeepsLatch(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	sum.fail.Store(true)
	p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	ids := map[string]bool{}
	for i := 0; i < 8; i++ {
		a.msgs[0] = fmt.Sprintf(`{"role":"system","content":"You are a coding agent. Time: 09:%02d:%02d. git status: %d files changed."}`, 10+i, 7*i%60, i)
		a.toolStep(120)
		resp := p.post(t, "/v1/chat/completions", a.body(), "Authorization", "Bearer k")
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		ids[resp.Header.Get("X-Compactproxy-Conversation-Id")] = true
	}
	if len(ids) != 1 {
		t.Errorf("%d conversation ids for one agent whose system prompt changes, want 1", len(ids))
	}
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("summarize calls %d in 8 steps with a failing summarizer, want 1 (then the latch)", n)
	}
}

// Each recorded anchor carries the conversation's running totals of what
// its appended messages cost (anchor.Extend): steps that extend the last
// measured view add theirs (countingUpstream reports a token per 4 bytes
// of body, so the appended messages' bytes / 4).
func TestAnchorsCarryTheAppendedMessagesCost(t *testing.T) {
	up := countingUpstream(t)
	p := newTestProxy(t, compactionConfig(up.URL, newSummarizerServer(t).URL))
	a := newAgent()
	var sizes []int
	var cv string
	for a.step < 4 {
		a.toolStep(400)
		cv = p.chatOK(t, a.body()).Header.Get("X-Compactproxy-Conversation-Id")
		sizes = append(sizes, len(a.body())/4)
	}
	key := identity.Key(identity.Tenant(p.srv.tenantSecret, http.Header{"Authorization": {"Bearer k"}}), cv)
	conv, ok, err := p.srv.store.Load(context.Background(), key)
	if err != nil || !ok || len(conv.Anchors) == 0 {
		t.Fatalf("state not found: %v", err)
	}
	newest := conv.Anchors[0]
	if want := sizes[3] - sizes[0]; newest.SumInput != want || newest.SumLocal <= 0 {
		t.Fatalf("newest anchor's totals %d / %d, want the cost of three appended steps, %d, and their local count", newest.SumInput, newest.SumLocal, want)
	}
}
