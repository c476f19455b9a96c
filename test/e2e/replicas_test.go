package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/store/storetest"
	"github.com/redis/go-redis/v9"
)

// stateUpstream is a small-window model behind the replicas: prompt =
// len(body)/3 tokens (more tokens per byte than the proxy's own
// estimate), a fixed latency, a tool call for every answer.
type stateUpstream struct {
	latency time.Duration
	mu      sync.Mutex
	bodies  [][]byte
}

const stateWindow = 8000

func (u *stateUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path != "/v1/chat/completions" {
		http.NotFound(w, r)
		return
	}
	time.Sleep(u.latency)
	u.mu.Lock()
	u.bodies = append(u.bodies, body)
	step := len(u.bodies)
	u.mu.Unlock()
	n := len(body) / 3
	w.Header().Set("Content-Type", "application/json")
	if n > stateWindow {
		w.WriteHeader(400)
		fmt.Fprintf(w, `{"error":{"code":400,"message":"request (%d tokens) exceeds the available context size (%d tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`, n, stateWindow, n, stateWindow)
		return
	}
	fmt.Fprintf(w, `{"id":"c%d","object":"chat.completion","model":"loop","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"cat","arguments":"{\"path\":\"f%d.py\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":%d,"completion_tokens":20}}`,
		step, step, step, n)
}

func (u *stateUpstream) last() []byte {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.bodies[len(u.bodies)-1]
}

// countingSummarizer answers every summarize after delay and counts them.
type countingSummarizer struct {
	*httptest.Server
	calls atomic.Int32
	delay atomic.Int64
}

func newCountingSummarizer(t *testing.T) *countingSummarizer {
	s := &countingSummarizer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		s.calls.Add(1)
		time.Sleep(time.Duration(s.delay.Load()))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Goal: review every file. Done: earlier files read, no unsafe retries. Next: the next file."},"finish_reason":"stop"}]}`)
	}))
	t.Cleanup(s.Close)
	return s
}

// loopAgent is a tool loop's history, as raw messages.
type loopAgent struct {
	conv string
	msgs []string
}

func newLoopAgent(conv string) *loopAgent {
	return &loopAgent{conv: conv, msgs: []string{
		`{"role":"system","content":"You are a code reviewer. Read files with the cat tool."}`,
		`{"role":"user","content":"Review every file in the repository for unsafe retries."}`,
	}}
}

func (a *loopAgent) body() []byte {
	return []byte(`{"model":"loop","tools":[{"type":"function","function":{"name":"cat","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}],"messages":[` + strings.Join(a.msgs, ",") + `]}`)
}

// grow appends the answer's tool call and the file it read.
func (a *loopAgent) grow(t *testing.T, answer []byte, i int) {
	t.Helper()
	var resp struct {
		Choices []struct {
			Message json.RawMessage `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(answer, &resp); err != nil || len(resp.Choices) == 0 {
		t.Fatalf("answer %q: %v", answer, err)
	}
	var call struct {
		ToolCalls []struct {
			ID string `json:"id"`
		} `json:"tool_calls"`
	}
	json.Unmarshal(resp.Choices[0].Message, &call)
	content, _ := json.Marshal(strings.Repeat(fmt.Sprintf("def handler_%d(x):\n    return retry(x, attempts=%d)\n", i, i), 22))
	a.msgs = append(a.msgs, string(resp.Choices[0].Message),
		fmt.Sprintf(`{"role":"tool","tool_call_id":%q,"content":%s}`, call.ToolCalls[0].ID, content))
}

type stepResult struct {
	status          int
	action, source  string
	took            time.Duration
	answer          []byte
	forwardedPrefix []json.RawMessage
}

func send(t *testing.T, base string, a *loopAgent) stepResult {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(a.body()))
	req.Header.Set("Authorization", "Bearer sk-replica-key")
	req.Header.Set("Content-Type", "application/json")
	if a.conv != "" {
		req.Header.Set("X-Compactproxy-Conversation", a.conv)
	}
	start := time.Now()
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("request: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return stepResult{status: resp.StatusCode, action: resp.Header.Get("X-Compactproxy-Compaction"),
		source: resp.Header.Get("X-Compactproxy-Context-Source"), took: time.Since(start), answer: b}
}

func forwarded(t *testing.T, body []byte) []json.RawMessage {
	var b struct {
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	return b.Messages
}

// isPrefix reports whether a's messages open b, byte for byte.
func isPrefix(a, b []json.RawMessage) bool {
	if len(b) < len(a) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

func stateEnv(sumURL string, extra ...string) []string {
	return append([]string{
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=" + strconv.Itoa(stateWindow),
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=1000",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_URL=" + sumURL + "/v1",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS=300",
		"COMPACTPROXY_STORE_TENANT_SECRET=shared-by-the-replicas",
		// Summaries made on the request path, so each one is a step the
		// test can see (background summaries are tested in internal/proxy).
		"COMPACTPROXY_COMPACTION_PRESUMMARIZE_RATIO=0",
	}, extra...)
}

// Issue 10: two compactproxy processes sharing one Redis behind an agent
// loop that alternates between them.
func TestReplicasShareRedis(t *testing.T) {
	rd := storetest.StartRedis(t)
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &stateUpstream{latency: 30 * time.Millisecond}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	sum := newCountingSummarizer(t)
	env := stateEnv(sum.URL, "COMPACTPROXY_STORE_BACKEND=redis", "COMPACTPROXY_STORE_REDIS_URL="+rd.URL())
	replicas := []*proxyProc{startProxy(t, bin, upSrv.URL+"/v1", env...), startProxy(t, bin, upSrv.URL+"/v1", env...)}

	// 1. The loop alternates: one summary serves both, anchors recorded by
	// one replica are seen by the other, the forwarded prefix is stable.
	a := newLoopAgent("")
	alternateShares(t, replicas, up, sum, a)

	// 2. Concurrent over-trigger requests of one conversation spread over
	// both replicas: exactly one summarize call.
	concurrentSummarizeOnce(t, replicas, sum)

	// Keys: every one with a TTL, naming the tenant by its HMAC and the
	// conversation by a digest (no key, no content).
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr})
	keys, err := rc.Keys(context.Background(), "*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("keys: %v %v", keys, err)
	}
	for _, k := range keys {
		ttl, err := rc.PTTL(context.Background(), k).Result()
		if err != nil || ttl <= 0 {
			t.Errorf("key %q has no TTL (%v %v)", k, ttl, err)
		}
		if strings.Contains(k, "sk-replica-key") || strings.Contains(k, "concurrent") || strings.Contains(k, "review") {
			t.Errorf("key %q names a credential or content", k)
		}
	}
	t.Logf("redis keys after the loop: %d, e.g. %q", len(keys), keys[0])
	rc.Close()

	// 3. Redis dies mid-loop: every request is still answered 200 within
	// the upstream's own time + 1 s; once it is back, compaction resumes.
	rd.Stop()
	for i := 25; i <= 30; i++ {
		r := send(t, replicas[i%2].URL, a)
		if r.status != 200 {
			t.Fatalf("Redis down, step %d: status %d", i, r.status)
		}
		if r.took > up.latency+time.Second {
			t.Fatalf("Redis down, step %d took %v (upstream %v)", i, r.took, up.latency)
		}
		t.Logf("Redis down, step %d: %v, compaction %s", i, r.took.Round(time.Millisecond), r.action)
		a.grow(t, r.answer, i)
	}
	rd.Start()
	time.Sleep(1200 * time.Millisecond) // past the fail-fast pause
	resumed := false
	for i := 31; i <= 36 && !resumed; i++ {
		r := send(t, replicas[i%2].URL, a)
		if r.status != 200 {
			t.Fatalf("after restart, step %d: status %d", i, r.status)
		}
		resumed = r.action == "summarized" || r.action == "reused"
		a.grow(t, r.answer, i)
	}
	if !resumed {
		t.Fatalf("compaction did not resume after Redis came back\n%s", replicas[0].LogTail())
	}
	for _, p := range replicas {
		if n := strings.Count(p.Log(), "state store failing"); n > 1 {
			t.Errorf("the outage was logged %d times by one replica, want once", n)
		}
		if strings.Contains(p.Log(), "sk-replica-key") {
			t.Error("a log carries the client's key")
		}
	}
	n, err := rd.Do("DBSIZE")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("keys in Redis after the restart: %s", strings.TrimSpace(n))
}

// bolt: SIGTERM mid-loop, start again with the same file: the next step
// makes no summarize call and forwards the same prefix.
func TestBoltSurvivesRestart(t *testing.T) {
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &stateUpstream{}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	sum := newCountingSummarizer(t)
	env := stateEnv(sum.URL, "COMPACTPROXY_STORE_BACKEND=bolt", "COMPACTPROXY_STORE_BOLT_PATH="+filepath.Join(t.TempDir(), "state.db"))
	p := startProxy(t, bin, upSrv.URL+"/v1", env...)
	a := newLoopAgent("")
	var last stepResult
	seenSummary := false
	i := 1
	for ; i <= 30; i++ {
		last = send(t, p.URL, a)
		if last.status != 200 {
			t.Fatalf("step %d: %d", i, last.status)
		}
		last.forwardedPrefix = forwarded(t, up.last())
		a.grow(t, last.answer, i)
		if last.action == "summarized" {
			seenSummary = true
		}
		if seenSummary && last.action == "reused" {
			break
		}
	}
	if !seenSummary {
		t.Fatal("no summary in 30 steps")
	}
	if err := p.Stop(10 * time.Second); err != nil {
		t.Fatalf("SIGTERM: %v\n%s", err, p.LogTail())
	}
	calls := sum.calls.Load()
	p2 := startProxy(t, bin, upSrv.URL+"/v1", env...)
	r := send(t, p2.URL, a)
	if r.status != 200 {
		t.Fatalf("after restart: %d", r.status)
	}
	if r.action != "reused" || sum.calls.Load() != calls {
		t.Fatalf("after restart: compaction %q, summarize calls %d → %d; want reused and none", r.action, calls, sum.calls.Load())
	}
	if !isPrefix(last.forwardedPrefix, forwarded(t, up.last())) {
		t.Fatal("the forwarded prefix changed across the restart")
	}
}

// alternateShares runs 24 steps of a's loop alternating between two
// replicas: one summary serves both, anchors recorded by one replica are
// seen by the other, the forwarded prefix is stable across them.
func alternateShares(t *testing.T, replicas []*proxyProc, up *stateUpstream, sum *countingSummarizer, a *loopAgent) {
	t.Helper()
	before := int(sum.calls.Load())
	var steps []stepResult
	for i := 1; i <= 24; i++ {
		r := send(t, replicas[i%2].URL, a)
		if r.status != 200 {
			t.Fatalf("step %d: status %d %s\n%s", i, r.status, r.answer, replicas[i%2].LogTail())
		}
		r.forwardedPrefix = forwarded(t, up.last())
		steps = append(steps, r)
		a.grow(t, r.answer, i)
	}
	summarized, anchored, stable, pairs := 0, 0, 0, 0
	for i, s := range steps {
		t.Logf("step %2d replica %d: %-10s source %s", i+1, (i+1)%2, s.action, s.source)
		if s.action == "summarized" {
			summarized++
		}
		if i > 0 && s.source == "anchor" {
			anchored++
		}
		if i > 0 && s.action == "reused" && (steps[i-1].action == "reused" || steps[i-1].action == "summarized") {
			pairs++
			if isPrefix(steps[i-1].forwardedPrefix, s.forwardedPrefix) {
				stable++
			}
		}
	}
	calls := int(sum.calls.Load()) - before
	t.Logf("summarize calls %d, summarized steps %d; anchored estimates %d of %d; prefix stable across replicas %d of %d", calls, summarized, anchored, len(steps)-1, stable, pairs)
	if calls == 0 || calls != summarized {
		t.Fatalf("summarize calls %d, summarized steps %d: want at least one, each made once", calls, summarized)
	}
	if calls > 4 {
		t.Errorf("summarize calls %d for 24 steps: the replicas do not share the summary", calls)
	}
	if pairs == 0 || stable != pairs {
		t.Errorf("forwarded prefix stable across replicas in %d of %d consecutive reused steps", stable, pairs)
	}
	if anchored < len(steps)-2 {
		t.Errorf("only %d of %d steps estimated from an anchor: anchors not shared", anchored, len(steps)-1)
	}
}

// concurrentSummarizeOnce sends 8 concurrent over-trigger requests of one
// conversation spread over both replicas: exactly one summarize call (the
// lease).
func concurrentSummarizeOnce(t *testing.T, replicas []*proxyProc, sum *countingSummarizer) {
	t.Helper()
	b := newLoopAgent("concurrent")
	for i := 1; i <= 16; i++ {
		content, _ := json.Marshal(strings.Repeat(fmt.Sprintf("class Worker%d: retry = %d\n", i, i), 40))
		b.msgs = append(b.msgs,
			fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":"k%d","type":"function","function":{"name":"cat","arguments":"{}"}}]}`, i),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"k%d","content":%s}`, i, content))
	}
	sum.delay.Store(int64(600 * time.Millisecond))
	before := sum.calls.Load()
	var wg sync.WaitGroup
	results := make([]stepResult, 8)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = send(t, replicas[i%2].URL, b)
		}()
	}
	wg.Wait()
	sum.delay.Store(0)
	for i, r := range results {
		if r.status != 200 {
			t.Fatalf("concurrent request %d: status %d", i, r.status)
		}
	}
	if n := sum.calls.Load() - before; n != 1 {
		t.Fatalf("8 concurrent over-trigger requests on 2 replicas: %d summarize calls, want 1", n)
	}
}
