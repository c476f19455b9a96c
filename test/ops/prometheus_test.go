package ops

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Markers in the first user message (or the last, for one-shot requests)
// pick the mock's behaviour.
const (
	markFailSummary = "[fail-summary]" // the summarizer answers 400 for this conversation
	markFlaky       = "[flaky]"        // the upstream answers 503 once, then 200
	markBroken      = "[broken]"       // the upstream answers 500 (not retried)
	markCut         = "[cut]"          // the upstream breaks the stream off
)

// loopWindow is the model's window: small, so conversations outgrow it.
const loopWindow = 6000

// opsUpstream is the chat upstream: it counts a prompt as len(body)/3
// tokens (more per byte than the proxy's local estimate, as real tokenizers
// do), reports half of it as cached, and records what it reported.
type opsUpstream struct {
	mu             sync.Mutex
	prompt, cached int // summed over the usage it reported
	flakySeen      map[string]bool
	flaky503       map[string]int // by route: chat, messages
}

func (u *opsUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	// Claude Code's route too: its failures must reach the same alerts.
	messages := r.URL.Path == "/v1/messages"
	if r.URL.Path != "/v1/chat/completions" && !messages {
		http.NotFound(w, r) // discovery finds no window: "mystery" stays unknown
		return
	}
	route := "chat"
	if messages {
		route = "messages"
	}
	var req struct {
		Model    string `json:"model"`
		Stream   bool   `json:"stream"`
		Messages []struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil || len(req.Messages) == 0 {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	last := req.Messages[len(req.Messages)-1].Content
	switch {
	case strings.Contains(last, markBroken):
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		if messages {
			io.WriteString(w, `{"type":"error","error":{"type":"api_error","message":"mock: internal error"}}`)
			return
		}
		io.WriteString(w, `{"error":{"message":"mock: internal error","type":"server_error"}}`)
		return
	case strings.Contains(last, markFlaky):
		u.mu.Lock()
		first := !u.flakySeen[last]
		u.flakySeen[last] = true
		if first {
			u.flaky503[route]++
		}
		u.mu.Unlock()
		if first {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			if messages {
				io.WriteString(w, `{"type":"error","error":{"type":"overloaded_error","message":"mock: overloaded"}}`)
				return
			}
			io.WriteString(w, `{"error":{"message":"mock: loading","type":"unavailable"}}`)
			return
		}
	case strings.Contains(last, markCut) && req.Stream:
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","model":"loop","choices":[{"index":0,"delta":{"role":"assistant","content":"par"},"finish_reason":null}]}`+"\n\n")
		w.(http.Flusher).Flush()
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
		return
	}
	n := len(body)/3 + 1
	u.mu.Lock()
	u.prompt += n
	u.cached += n / 2
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if messages {
		fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":%q,"content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":5}}`,
			req.Model, n-n/2, n/2)
		return
	}
	fmt.Fprintf(w, `{"id":"c","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":5,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}`,
		req.Model, n, n+5, n/2)
}

// opsSummarizer answers summaries, or 400 for conversations marked to fail.
type opsSummarizer struct {
	mu               sync.Mutex
	success, failure int
}

func (s *opsSummarizer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	s.mu.Lock()
	defer s.mu.Unlock()
	if bytes.Contains(body, []byte(markFailSummary)) {
		s.failure++
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"error":{"message":"mock: summarizer refuses","type":"invalid_request_error"}}`)
		return
	}
	s.success++
	io.WriteString(w, `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Goal: review the files. Done: files read so far, no findings yet. Next: the next file."},"finish_reason":"stop"}],"usage":{"prompt_tokens":900,"completion_tokens":30}}`)
}

// loopTally is what the scripted clients saw.
type loopTally struct {
	codes               map[int]int    // chat status codes
	msgCodes            map[int]int    // Anthropic Messages status codes
	actions             map[string]int // X-Compactproxy-Compaction
	contextSum, fwdSum  float64        // header sums
	withHeaders         int
	streamErrors, cuts  int
	flaky, broken, pair int
	mystery, impossible int
}

type chatClient struct {
	t    *testing.T
	base string
	hc   *http.Client
	tl   *loopTally
}

type msg map[string]any

// send posts one chat request and tallies the answer.
func (c *chatClient) send(model string, msgs []msg, stream bool) int {
	c.t.Helper()
	return c.post("/v1/chat/completions", map[string]any{"model": model, "messages": msgs, "stream": stream}, c.tl.codes)
}

// sendMessages posts one Anthropic Messages request (Claude Code's route)
// and tallies the answer.
func (c *chatClient) sendMessages(model, text string) int {
	c.t.Helper()
	body := map[string]any{"model": model, "max_tokens": 64, "messages": []msg{{"role": "user", "content": text}}}
	return c.post("/v1/messages", body, c.tl.msgCodes)
}

func (c *chatClient) post(path string, v any, codes map[int]int) int {
	c.t.Helper()
	body, _ := json.Marshal(v)
	req, _ := http.NewRequest(http.MethodPost, c.base+path, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk-ops-test")
	req.Header.Set("Anthropic-Version", "2023-06-01")
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("chat: %v", err)
	}
	_, rerr := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if rerr != nil {
		c.tl.streamErrors++
	}
	codes[resp.StatusCode]++
	if a := resp.Header.Get("X-Compactproxy-Compaction"); a != "" {
		c.tl.actions[a]++
		ctx, err1 := strconv.Atoi(resp.Header.Get("X-Compactproxy-Context-Tokens"))
		fwd, err2 := strconv.Atoi(resp.Header.Get("X-Compactproxy-Forwarded-Tokens"))
		if err1 != nil || err2 != nil {
			c.t.Fatalf("compaction header without token headers: %v", resp.Header)
		}
		c.tl.contextSum += float64(ctx)
		c.tl.fwdSum += float64(fwd)
		c.tl.withHeaders++
	}
	return resp.StatusCode
}

// agentLoop runs one tool-calling conversation of steps steps: each step
// reads a file of about 600 tokens (under the trim threshold, so only a
// summary or a drop can make room).
func (c *chatClient) agentLoop(task string, steps int) {
	msgs := []msg{
		{"role": "system", "content": "You review code. Read files with the cat tool."},
		{"role": "user", "content": task},
	}
	for i := 1; i <= steps; i++ {
		if code := c.send("loop", msgs, false); code != http.StatusOK {
			c.t.Fatalf("%s step %d: status %d", task, i, code)
		}
		id := fmt.Sprintf("call_%d", i)
		msgs = append(msgs,
			msg{"role": "assistant", "content": nil, "tool_calls": []any{msg{"id": id, "type": "function", "function": msg{"name": "cat", "arguments": fmt.Sprintf(`{"path":"f%d.go"}`, i)}}}},
			msg{"role": "tool", "tool_call_id": id, "content": strings.Repeat(fmt.Sprintf("func f%d() error { return retry(%d) }\n", i, i), 50)},
		)
	}
}

// promAPI queries Prometheus' HTTP API.
type promAPI struct {
	t    *testing.T
	base string
}

type promResult struct {
	Status    string `json:"status"`
	ErrorType string `json:"errorType"`
	Error     string `json:"error"`
	Data      struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		} `json:"result"`
	} `json:"data"`
}

func (p promAPI) query(q string, at float64) (promResult, error) {
	v := url.Values{"query": {q}}
	if at > 0 {
		v.Set("time", strconv.FormatFloat(at, 'f', 3, 64))
	}
	resp, err := http.Get(p.base + "/api/v1/query?" + v.Encode())
	if err != nil {
		return promResult{}, err
	}
	defer resp.Body.Close()
	var r promResult
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return r, err
	}
	if r.Status != "success" {
		return r, fmt.Errorf("%s: %s", r.ErrorType, r.Error)
	}
	return r, nil
}

// values returns the samples of q keyed by the label set (rendered by keys).
func (p promAPI) values(q string, at float64, keys ...string) map[string]float64 {
	p.t.Helper()
	r, err := p.query(q, at)
	if err != nil {
		p.t.Fatalf("query %s: %v", q, err)
	}
	out := map[string]float64{}
	for _, s := range r.Data.Result {
		var k []string
		for _, key := range keys {
			k = append(k, s.Metric[key])
		}
		f, _ := strconv.ParseFloat(s.Value[1].(string), 64)
		out[strings.Join(k, ",")] = f
	}
	return out
}

func (p promAPI) scalar(q string, at float64) float64 {
	p.t.Helper()
	v := p.values(q, at)
	if len(v) != 1 {
		p.t.Fatalf("query %s: %d series, want 1", q, len(v))
	}
	return v[""]
}

// metricNames are the compactproxy_ metric names an expression uses.
var metricNameRE = regexp.MustCompile(`\bcompactproxy_[a-z0-9_]+`)

// exported lists the metric families the binary exports now (histograms as
// their _bucket/_sum/_count series too).
func exported(t *testing.T, base string) map[string]bool {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			out[f[2]] = true
			if f[3] == "histogram" {
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					out[f[2]+s] = true
				}
			}
		}
	}
	return out
}

// designMetrics are DESIGN.md's metric names (and the two this package's
// dashboard added); a name in a rule or panel that is neither exported nor
// here is a typo, not a metric still to come.
var designMetrics = strings.Fields(`http_requests_total upstream_retries_total compactions_total
	summarize_total summarize_suppressed_total latch_engaged_total pairing_violations_total
	ui_only_removed_total anchor_lookups_total context_tokens usage_input_tokens_total
	overhead_seconds upstream_duration_seconds compaction_invariant_failures_total
	unknown_window_total compaction_impossible_total store_errors_total
	summarize_input_tokens_total presummarize_total stream_aborts_total compaction_errors_total
	forwarded_tokens summarize_duration_seconds reduced_tokens_total cache_resets_total`)

func knownMetric(name string) bool {
	for _, m := range designMetrics {
		for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
			if name == "compactproxy_"+m+suffix {
				return true
			}
		}
	}
	return false
}

// missing lists the metrics expr uses that the binary does not export.
func missing(t *testing.T, expr string, have map[string]bool) []string {
	t.Helper()
	var out []string
	for _, n := range metricNameRE.FindAllString(expr, -1) {
		if !knownMetric(n) {
			t.Errorf("%s is not a DESIGN.md metric name (in %s)", n, strings.TrimSpace(expr))
		}
		if !have[n] && !strings.Contains(strings.Join(out, " "), n) {
			out = append(out, n)
		}
	}
	return out
}

// dashboardQueries returns every panel target's expression by panel title,
// after checking what Grafana needs of the panels: unique ids and titles,
// the datasource variable on every panel and target, a grid 24 wide.
func dashboardQueries(t *testing.T, root string) (map[string][]string, []string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "deploy", "grafana", "compactproxy.json"))
	if err != nil {
		t.Fatal(err)
	}
	type ds struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	}
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			ID         int    `json:"id"`
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource *ds    `json:"datasource"`
			GridPos    struct {
				X, W int
			} `json:"gridPos"`
			Targets []struct {
				Expr       string `json:"expr"`
				RefID      string `json:"refId"`
				Datasource *ds    `json:"datasource"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("deploy/grafana/compactproxy.json: %v", err)
	}
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Type
	}
	if d.UID == "" || vars["datasource"] != "datasource" || vars["job"] != "query" {
		t.Errorf("dashboard: uid %q, variables %v: want a uid, a datasource and a job variable", d.UID, vars)
	}
	out := map[string][]string{}
	var order []string
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("panel %q: id %d missing or not unique", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos x %d w %d outside the 24-column grid", p.Title, p.GridPos.X, p.GridPos.W)
		}
		if p.Type == "row" {
			continue
		}
		if _, dup := out[p.Title]; dup {
			t.Errorf("panel title %q is used twice", p.Title)
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if refs[tg.RefID] || tg.RefID == "" || tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: target %q needs a unique refId and the ${datasource} variable", p.Title, tg.RefID)
			}
			refs[tg.RefID] = true
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if _, ok := out[p.Title]; !ok {
				order = append(order, p.Title)
			}
			out[p.Title] = append(out[p.Title], tg.Expr)
		}
	}
	return out, order
}

// thresholdRE cuts an alert expression's final "> N" comparison.
var thresholdRE = regexp.MustCompile(`(?s)^(.*\S)\s*>\s*[0-9.]+\s*$`)

// TestPrometheusScrapesTheLoop starts a real Prometheus scraping the real
// binary under a scripted agent loop and evaluates every dashboard query
// and every rule expression through Prometheus' HTTP API.
func TestPrometheusScrapesTheLoop(t *testing.T) {
	promBin := needTool(t, "prometheus")
	root := repoRoot(t)
	bin, _ := dockerBuild(t)

	up := &opsUpstream{flakySeen: map[string]bool{}, flaky503: map[string]int{}}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	sum := &opsSummarizer{}
	sumSrv := httptest.NewServer(sum)
	defer sumSrv.Close()

	proxyAddr := freeAddr(t)
	proxy := start(t, "compactproxy", t.TempDir(), []string{
		"COMPACTPROXY_LISTEN=" + proxyAddr,
		"COMPACTPROXY_UPSTREAM_URL=" + upSrv.URL + "/v1",
		"COMPACTPROXY_UPSTREAM_DIALECT=openai",
		fmt.Sprintf(`COMPACTPROXY_MODELS=[{"name":"loop","context_window":%d}]`, loopWindow),
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=1000",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_URL=" + sumSrv.URL + "/v1",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS=300",
		// Background pre-summaries (DESIGN, not in every build yet: an
		// unknown env name is ignored) would call the summarizer outside
		// the requests this test counts.
		"COMPACTPROXY_COMPACTION_PRESUMMARIZE_RATIO=0",
		"COMPACTPROXY_RETRY_BACKOFF=5ms",
		"COMPACTPROXY_RETRY_MAX_BACKOFF=10ms",
		"COMPACTPROXY_SHUTDOWN_TIMEOUT=2s",
		"COMPACTPROXY_LOG_LEVEL=warn",
	}, bin)
	proxyURL := "http://" + proxyAddr
	proxy.WaitHTTP(t, proxyURL+"/healthz", 15*time.Second)

	// Prometheus: loopback only, 1 s scrape and rule evaluation, the rules
	// as shipped.
	promDir := t.TempDir()
	promAddr := freeAddr(t)
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - %s
scrape_configs:
  - job_name: compactproxy
    static_configs:
      - targets: ["%s"]
`, rulesPath(root), proxyAddr)
	if err := os.WriteFile(filepath.Join(promDir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	prom := start(t, "prometheus", promDir, nil, promBin,
		"--config.file="+filepath.Join(promDir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(promDir, "data"),
		"--web.listen-address="+promAddr,
		"--log.level=warn")
	api := promAPI{t: t, base: "http://" + promAddr}
	prom.WaitHTTP(t, api.base+"/-/ready", 30*time.Second)
	waitFor(t, "the first scrape of compactproxy", func() bool {
		v := api.values(`up{job="compactproxy"} == 1`, 0)
		return len(v) == 1
	})
	firstScrape := api.scalar(`timestamp(up{job="compactproxy"})`, 0)

	// The scripted loop.
	tl := &loopTally{codes: map[int]int{}, msgCodes: map[int]int{}, actions: map[string]int{}}
	c := &chatClient{t: t, base: proxyURL, hc: &http.Client{Timeout: 30 * time.Second}, tl: tl}
	loopStart := time.Now()
	// Warm-up: a series born at its first increment (status codes, and
	// any counter not pre-created) has no earlier sample, so rate() cannot
	// see that increment. One of each kind of event first, then a scrape,
	// as a long-running proxy would have had.
	c.agentLoop("Review package 0 for unsafe retries.", 16)
	c.send("loop", []msg{{"role": "user", "content": "warm-up " + markBroken}}, false)
	tl.broken++
	c.sendMessages("loop", "warm-up "+markBroken)
	c.sendMessages("loop", "warm-up "+markFlaky)
	c.send("loop", []msg{{"role": "user", "content": "warm-up"}, {"role": "tool", "tool_call_id": "call_nowhere", "content": "{}"}}, false)
	tl.pair++
	c.send("loop", []msg{{"role": "user", "content": "warm-up " + markCut}}, true)
	tl.cuts++
	c.send("loop", oversized(0), false)
	tl.impossible++
	warm := 0
	for _, n := range tl.codes {
		warm += n
	}
	waitFor(t, "a scrape of the warm-up", func() bool {
		return api.values(`sum(compactproxy_http_requests_total{route="chat"})`, 0)[""] == float64(warm)
	})
	c.agentLoop("Review package 1 for unsafe retries.", 16)
	const failing = 12 // LatchEngagingOften fires above 10 an hour
	for i := range failing {
		c.agentLoop(fmt.Sprintf("Review module %d. %s", i, markFailSummary), 9)
	}
	for i := range 40 {
		if code := c.send("loop", []msg{{"role": "user", "content": fmt.Sprintf("ping %d %s", i, markFlaky)}}, false); code != 200 {
			t.Fatalf("flaky request %d: status %d", i, code)
		}
		tl.flaky++
	}
	for i := range 25 {
		c.send("loop", []msg{{"role": "user", "content": fmt.Sprintf("ping %d %s", i, markBroken)}}, false)
		tl.broken++
	}
	for i := range 10 {
		c.send("loop", []msg{{"role": "user", "content": fmt.Sprintf("stream %d %s", i, markCut)}}, true)
		tl.cuts++
	}
	// Claude Code's route in trouble while chat is busy: half its
	// requests answered 500, the other half retried after a 503.
	for i := range 10 {
		c.sendMessages("loop", fmt.Sprintf("claude %d %s", i, markBroken))
		if code := c.sendMessages("loop", fmt.Sprintf("claude %d %s", i, markFlaky)); code != 200 {
			t.Fatalf("flaky Messages request %d: status %d", i, code)
		}
	}
	for i := range 2 {
		c.send("loop", []msg{
			{"role": "user", "content": fmt.Sprintf("orphan %d", i)},
			{"role": "tool", "tool_call_id": "call_nowhere", "content": "{}"},
		}, false)
		tl.pair++
	}
	// A system prompt larger than the whole budget: compaction cannot help
	// (compaction_impossible_total), the request goes out as it is.
	for i := 1; i <= 2; i++ {
		c.send("loop", oversized(i), false)
		tl.impossible++
	}
	for i := range 3 {
		c.send("mystery", []msg{{"role": "user", "content": fmt.Sprintf("hello %d", i)}}, false)
		tl.mystery++
	}
	chats := 0
	for _, n := range tl.codes {
		chats += n
	}
	t.Logf("loop: %d chat requests in %v; codes %v (Messages %v); actions %v; stream read errors %d; summarizer %d ok / %d failed",
		chats, time.Since(loopStart).Round(time.Millisecond), tl.codes, tl.msgCodes, tl.actions, tl.streamErrors, sum.success, sum.failure)

	// Wait until Prometheus has scraped the final counts, then evaluate
	// everything at that scrape's timestamp T over a window reaching back
	// before the first scrape: rate()×window is then exactly the increase
	// for series that start at zero.
	waitFor(t, "a scrape after the loop", func() bool {
		v := api.values(`sum(compactproxy_http_requests_total{route="chat"})`, 0)
		return v[""] == float64(chats)
	})
	time.Sleep(1500 * time.Millisecond) // a few rule evaluations on the final data
	at := api.scalar(`timestamp(up{job="compactproxy"})`, 0)
	window := math.Ceil(at-firstScrape) + 2
	win := strconv.Itoa(int(window)) + "s"
	have := exported(t, proxyURL)

	// Figures: Prometheus' view of the counters against what the loop did.
	raw := func(q string, keys ...string) map[string]float64 { return api.values(q, at, keys...) }
	codes := raw(`compactproxy_http_requests_total{route="chat"}`, "code")
	for code, n := range tl.codes {
		if codes[strconv.Itoa(code)] != float64(n) {
			t.Errorf("http_requests_total{chat,%d} = %v in Prometheus, the clients saw %d", code, codes[strconv.Itoa(code)], n)
		}
	}
	comp := raw(`compactproxy_compactions_total`, "action")
	for _, a := range []string{"summarized", "reused"} {
		if comp[a] != float64(tl.actions[a]) {
			t.Errorf("compactions_total{%s} = %v, the response headers say %d", a, comp[a], tl.actions[a])
		}
	}
	if tl.actions["summarized"] == 0 || tl.actions["reused"] == 0 {
		t.Errorf("the loop made no summary or never reused one (actions %v): the window is not small enough", tl.actions)
	}
	summ := raw(`compactproxy_summarize_total`, "result")
	if summ["failure"] != float64(sum.failure) || sum.failure < failing {
		t.Errorf("summarize_total{failure} = %v, the summarizer refused %d times (want ≥ %d)", summ["failure"], sum.failure, failing)
	}
	if summ["success"] < 1 || summ["success"] > float64(sum.success) {
		t.Errorf("summarize_total{success} = %v, the summarizer answered %d calls", summ["success"], sum.success)
	}
	if v := raw(`compactproxy_latch_engaged_total`)[""]; v != summ["failure"] {
		t.Errorf("latch_engaged_total = %v, want one per failed summarize (%v)", v, summ["failure"])
	}
	if v := raw(`sum(compactproxy_summarize_duration_seconds_count)`)[""]; v != summ["success"]+summ["failure"] {
		t.Errorf("summarize_duration_seconds_count = %v, summarize_total = %v", v, summ["success"]+summ["failure"])
	}
	if v := raw(`compactproxy_context_tokens_sum`)[""]; v != tl.contextSum {
		t.Errorf("context_tokens_sum = %v, X-Compactproxy-Context-Tokens headers sum to %v", v, tl.contextSum)
	}
	if v := raw(`compactproxy_forwarded_tokens_sum`)[""]; v != tl.fwdSum {
		t.Errorf("forwarded_tokens_sum = %v, X-Compactproxy-Forwarded-Tokens headers sum to %v", v, tl.fwdSum)
	}
	if tl.fwdSum >= tl.contextSum {
		t.Errorf("forwarded %v ≥ context %v tokens: compaction saved nothing", tl.fwdSum, tl.contextSum)
	}
	up.mu.Lock()
	prompt, cached, flaky503, msgFlaky503 := up.prompt, up.cached, up.flaky503["chat"], up.flaky503["messages"]
	up.mu.Unlock()
	usage := raw(`compactproxy_usage_input_tokens_total`, "kind")
	if usage["cache_read"] != float64(cached) || usage["uncached"] != float64(prompt-cached) || usage["cache_write"] != 0 {
		t.Errorf("usage_input_tokens_total %v; the upstream reported %d prompt tokens, %d cached", usage, prompt, cached)
	}
	if v := raw(`compactproxy_upstream_retries_total{op="chat",reason="status_5xx"}`)[""]; v != float64(flaky503) {
		t.Errorf("upstream_retries_total{chat,status_5xx} = %v, the upstream answered 503 %d times", v, flaky503)
	}
	if v := raw(`compactproxy_upstream_retries_total{op="messages",reason="status_5xx"}`)[""]; v != float64(msgFlaky503) || msgFlaky503 == 0 {
		t.Errorf("upstream_retries_total{messages,status_5xx} = %v, the upstream answered Messages 503 %d times", v, msgFlaky503)
	}
	msgCodes := raw(`compactproxy_http_requests_total{route="messages"}`, "code")
	for code, n := range tl.msgCodes {
		if msgCodes[strconv.Itoa(code)] != float64(n) {
			t.Errorf("http_requests_total{messages,%d} = %v in Prometheus, the clients saw %d", code, msgCodes[strconv.Itoa(code)], n)
		}
	}
	if v := raw(`sum(compactproxy_pairing_violations_total)`)[""]; v != float64(tl.pair) {
		t.Errorf("pairing_violations_total = %v, the loop sent %d broken histories", v, tl.pair)
	}
	if v := raw(`compactproxy_unknown_window_total`)[""]; v != float64(tl.mystery) {
		t.Errorf("unknown_window_total = %v, the loop sent %d requests for the unknown model", v, tl.mystery)
	}

	if v := raw(`compactproxy_compaction_impossible_total`); have["compactproxy_compaction_impossible_total"] && v[""] != float64(tl.impossible) {
		t.Errorf("compaction_impossible_total = %v, the loop sent %d requests whose system prompt exceeds the budget", v[""], tl.impossible)
	}
	if v := raw(`compactproxy_stream_aborts_total`); have["compactproxy_stream_aborts_total"] && v[""] != float64(tl.cuts) {
		t.Errorf("stream_aborts_total = %v, the upstream cut %d streams", v[""], tl.cuts)
	}

	// Every dashboard query parses and returns data where its metrics exist.
	queries, order := dashboardQueries(t, root)
	subst := strings.NewReplacer("$__rate_interval", win, "$__interval", win, "$__range", win, `"$job"`, `"compactproxy"`)
	noData := map[string]bool{}
	panelValues := map[string][]map[string]float64{}
	nq := 0
	for _, title := range order {
		for _, q := range queries[title] {
			nq++
			expr := subst.Replace(q)
			if strings.Contains(expr, "$") {
				t.Errorf("panel %q: unknown variable in %s", title, q)
				continue
			}
			r, err := api.query(expr, at)
			if err != nil {
				t.Errorf("panel %q: %s: %v", title, q, err)
				continue
			}
			if m := missing(t, q, have); len(m) > 0 {
				for _, n := range m {
					noData[n] = true
				}
				continue
			}
			if len(r.Data.Result) == 0 {
				t.Errorf("panel %q: no data for %s", title, expr)
			}
			seen := map[string]bool{}
			var keys []string
			for _, s := range r.Data.Result {
				for k := range s.Metric {
					if !seen[k] {
						seen[k] = true
						keys = append(keys, k)
					}
				}
			}
			sort.Strings(keys)
			panelValues[title] = append(panelValues[title], api.values(expr, at, keys...))
		}
	}
	// Panel figures agree with the loop.
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }
	if pv := panelValues["Compactions by action"]; len(pv) == 1 {
		for _, a := range []string{"summarized", "reused"} {
			if got := pv[0][a] * window; !near(got, float64(tl.actions[a])) {
				t.Errorf("panel Compactions by action: %s × window = %v, headers say %d", a, got, tl.actions[a])
			}
		}
	} else {
		t.Errorf("panel Compactions by action: %d results", len(pv))
	}
	if pv := panelValues["Tokens: client view vs forwarded"]; len(pv) == 3 {
		if got := pv[0][""] * window; !near(got, tl.contextSum) {
			t.Errorf("panel tokens: client view × window = %v, headers %v", got, tl.contextSum)
		}
		if got := pv[1][""] * window; !near(got, tl.fwdSum) {
			t.Errorf("panel tokens: forwarded × window = %v, headers %v", got, tl.fwdSum)
		}
		if got := pv[2][""] * window; !near(got, tl.contextSum-tl.fwdSum) {
			t.Errorf("panel tokens: saved × window = %v, headers %v", got, tl.contextSum-tl.fwdSum)
		}
	} else {
		t.Errorf("panel Tokens: %d results", len(pv))
	}
	if pv := panelValues["Tokens saved"]; len(pv) != 1 || !near(pv[0][""], 1-tl.fwdSum/tl.contextSum) {
		t.Errorf("panel Tokens saved %v, headers say %v", pv, 1-tl.fwdSum/tl.contextSum)
	}
	if pv := panelValues["Cache share of provider input"]; len(pv) != 1 || !near(pv[0][""], float64(cached)/float64(prompt)) {
		t.Errorf("panel Cache share %v, the upstream reported %v", pv, float64(cached)/float64(prompt))
	}
	if pv := panelValues["Summarize calls"]; len(pv) >= 3 { // the 4th, presummarize_total, once exported
		if got := pv[0]["failure"] * window; !near(got, float64(sum.failure)) {
			t.Errorf("panel Summarize calls: failure × window = %v, the summarizer refused %d", got, sum.failure)
		}
		if got := pv[2][""] * window; !near(got, summ["failure"]) {
			t.Errorf("panel Summarize calls: latch engaged × window = %v, want %v", got, summ["failure"])
		}
	} else {
		t.Errorf("panel Summarize calls: %d results", len(pv))
	}
	t.Logf("%d dashboard queries over %d panels evaluated at T over %s", nq, len(order), win)

	// Every rule expression parses and returns data where its metrics exist.
	// The loop makes the alerts fire whose metrics the binary exports,
	// except those it cannot cause honestly (a proxy bug, a slow proxy, the
	// memory store failing): for those the expression without its threshold
	// must return data.
	cannotFire := map[string]bool{"CompactproxyCompactionInvariantFailure": true, "CompactproxyOverheadHigh": true,
		"CompactproxyStoreErrors": true}
	expectFiring := map[string]bool{}
	for _, r := range loadRules(t, root) {
		name := r.Record + r.Alert
		if _, err := api.query(r.Expr, at); err != nil {
			t.Errorf("rule %s: %v", name, err)
			continue
		}
		if m := missing(t, r.Expr, have); len(m) > 0 {
			for _, n := range m {
				noData[n] = true
			}
			t.Logf("rule %s: not evaluated for data: the binary does not export %s", name, strings.Join(m, ", "))
			continue
		}
		expr := r.Expr
		if cannotFire[r.Alert] {
			m := thresholdRE.FindStringSubmatch(r.Expr)
			if m == nil {
				t.Errorf("alert %s: no final threshold to cut", r.Alert)
				continue
			}
			expr = m[1]
		} else if r.Alert != "" {
			expectFiring[r.Alert] = true
		}
		res, _ := api.query(expr, at)
		if len(res.Data.Result) == 0 {
			t.Errorf("rule %s: no data at T for %s", name, strings.TrimSpace(expr))
		}
	}
	// Prometheus' own rule evaluation agrees: the alerts the loop causes
	// are pending or firing, the others are not.
	resp, err := http.Get(api.base + "/api/v1/alerts")
	if err != nil {
		t.Fatal(err)
	}
	var alerts struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
				State  string            `json:"state"`
			} `json:"alerts"`
		} `json:"data"`
	}
	json.NewDecoder(resp.Body).Decode(&alerts)
	resp.Body.Close()
	active := map[string]string{}
	byRoute := map[string]string{} // alertname/route -> state
	for _, a := range alerts.Data.Alerts {
		active[a.Labels["alertname"]] = a.State
		if r := a.Labels["route"]; r != "" {
			byRoute[a.Labels["alertname"]+"/"+r] = a.State
		}
	}
	// The Messages route's own trouble pages, though chat traffic is larger.
	for _, name := range []string{"CompactproxyChat5xx/messages", "CompactproxyUpstreamRetriesHigh/messages"} {
		if byRoute[name] == "" {
			t.Errorf("alert %s is not pending or firing after the Messages route's 5xx and retries (active: %v)", name, byRoute)
		}
	}
	for name := range expectFiring {
		if active[name] == "" {
			t.Errorf("alert %s is not pending or firing in Prometheus after the loop", name)
		}
	}
	for name, state := range active {
		if name == "CompactproxyOverheadHigh" {
			// Real time on a loaded machine (2 cores under -race): logged,
			// never asserted.
			t.Logf("alert %s is %s: the proxy's p99 overhead was above 100ms on this machine", name, state)
			continue
		}
		if !expectFiring[name] {
			t.Errorf("alert %s is %s, but the loop did nothing to cause it", name, state)
		}
	}
	names := make([]string, 0, len(noData))
	for n := range noData {
		names = append(names, n)
	}
	sort.Strings(names)
	t.Logf("alerts active: %v", active)
	t.Logf("metrics in rules or panels that this binary does not export yet (no data required): %s", strings.Join(names, ", "))
}

// oversized is a request whose system prompt alone is larger than the
// budget: compaction cannot help (compaction_impossible_total).
func oversized(i int) []msg {
	return []msg{
		{"role": "system", "content": strings.Repeat(fmt.Sprintf("Rule %d: never retry a POST. ", i), 1500)},
		{"role": "user", "content": "go"},
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
