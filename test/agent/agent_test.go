// Package agent runs a real agent CLI from npm, the pi coding agent
// (@mariozechner/pi-coding-agent, pinned by package-lock.json), through the
// real compactproxy binary against a scripted mock model, over a temporary
// project of real Go files. The agent lists the project and reads every file
// with its own tools until the conversation outgrows the model's small
// window, so compactproxy must compact a real agent's traffic: its real
// system prompt, its real tool schemas, its streaming and its max tokens.
// It runs two workloads (see workloads): large_reads, where every read is
// over a third of the room, and paced_reads, where a read is ~6% of it and
// the cache reuse is asserted.
//
// Topology, all on 127.0.0.1:
//
//	pi ──► recorder ──► compactproxy ──► mock model (chat + summarize calls)
//
// The recorder keeps what the agent sent and compactproxy's response
// headers; the mock keeps what compactproxy forwarded. The agent runs with
// a temporary HOME, PI_OFFLINE=1 and telemetry off, and with
// loopback-guard.cjs preloaded, which refuses (and reports) any connection
// or DNS lookup that is not loopback.
//
// It needs node >= 20.6 and, on a fresh machine, npm
// (scripts/agent-deps.sh installs the agent from the lockfile). Without
// them it skips, except under CI=true, where it fails.
package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// agentCLI is the agent's entry point, relative to the repo root.
const agentCLI = "test/agent/node_modules/@mariozechner/pi-coding-agent/dist/cli.js"

const (
	// window is the mock model's context window, the one compactproxy is
	// told (upstream.context_window). pi's fixed part (system prompt +
	// four tool schemas, ~5.5 KB) counts ~3,700 tokens at the mock's rate,
	// under a quarter of it; the workloads' files add the rest.
	window    = 16384
	apiKey    = "sk-agent-e2e-0123456789-not-a-real-key"
	task      = "Review every Go file in this project for unsafe retries: list the files, read each one, then report."
	finalText = "REVIEW-COMPLETE: every file was read; no unsafe retries found."
)

// workload is the agent's task over a generated project: fileCount Go files
// of at least fileBytes each, which the mock's script has the agent list
// and then read one per step, except files pairAt and pairAt+1 (0-based),
// read in one parallel turn.
type workload struct {
	name      string
	fileCount int
	fileBytes int
	pairAt    int
	// minCacheReuse is a regression bound on the cache reuse of a run
	// through compactproxy (Σcached ÷ Σprompt after the first request);
	// 0 = logged, not asserted.
	minCacheReuse float64
}

// scriptSteps is how many distinct steps the mock answers when the agent
// gets through the task: ls, one per file but the pair, the final answer.
func (wl workload) scriptSteps() int {
	reads := wl.fileCount
	if wl.pairAt >= 0 && wl.pairAt+1 < wl.fileCount {
		reads--
	}
	return 1 + reads + 1
}

// workloads are the projects the agent works through.
var workloads = []workload{
	// Ten files of ~4 KB: a read step appends ~3,250 tokens at the mock's
	// rate (the call, the result's JSON-escaped text), 37% of the room
	// compactproxy leaves the conversation (window − reserved output − the
	// fixed part, ~8,700), so nearly every step needs a new summary. Its
	// cache reuse is logged, not asserted: what the agent appends caps it
	// at 0.56 however well a proxy compacts (the ceiling), under the
	// issue's 0.8; compactproxy reaches 0.54.
	{name: "large_reads", fileCount: 10, fileBytes: 4000, pairAt: 2},
	// Forty files of ~600 bytes: a read step appends ~520 tokens (the
	// call, the result's JSON-escaped text), 6% of the room, closer to
	// real agents at real windows (1–3% per step). Uncompacted the
	// conversation reaches ~1.6 windows, so compaction comes back every
	// ~7 steps (five times) and summaries are made and reused.
	// Issue 8's goal, cache reuse >= 0.8 with max tokens >= a quarter of
	// the window, is asserted here (measured 0.89, ceiling 0.93).
	{name: "paced_reads", fileCount: 40, fileBytes: 500, pairAt: 2, minCacheReuse: 0.8},
}

// turn is one chat request of the agent as the recorder saw it.
type turn struct {
	N      int
	Body   []byte // what the agent sent to compactproxy
	Status int
	Header http.Header // compactproxy's response headers
}

// recorder sits between the agent and compactproxy: it numbers the agent's
// chat requests (turnHeader, which compactproxy forwards like any client
// header), keeps their bodies and the response status and headers, and
// streams the answers through.
type recorder struct {
	srv *httptest.Server
	rp  *httputil.ReverseProxy

	mu     sync.Mutex
	turns  []turn
	others []string
}

func newRecorder(t *testing.T, target string) *recorder {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	rec.rp = &httputil.ReverseProxy{
		Rewrite:       func(pr *httputil.ProxyRequest) { pr.SetURL(u); pr.Out.Host = u.Host },
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			n, err := strconv.Atoi(resp.Request.Header.Get(turnHeader))
			if err != nil {
				return nil
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			rec.turns[n].Status = resp.StatusCode
			rec.turns[n].Header = resp.Header.Clone()
			return nil
		},
	}
	rec.srv = httptest.NewServer(rec)
	t.Cleanup(rec.srv.Close)
	return rec
}

func (rec *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	rec.mu.Lock()
	if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/chat/completions") {
		n := len(rec.turns)
		rec.turns = append(rec.turns, turn{N: n, Body: body})
		r.Header.Set(turnHeader, strconv.Itoa(n))
	} else {
		rec.others = append(rec.others, r.Method+" "+r.URL.Path)
	}
	rec.mu.Unlock()
	rec.rp.ServeHTTP(w, r)
}

func (rec *recorder) snapshot() ([]turn, []string) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]turn(nil), rec.turns...), append([]string(nil), rec.others...)
}

// writeProject creates the workload's fileCount Go files of at least
// fileBytes each; every file carries a marker line of its own.
func writeProject(t *testing.T, wl workload) (string, []projectFile) {
	t.Helper()
	dir := t.TempDir()
	var files []projectFile
	for i := 1; i <= wl.fileCount; i++ {
		f := projectFile{Name: fmt.Sprintf("retry%02d.go", i), Marker: fmt.Sprintf("agent-e2e-marker-%02d-%08x", i, uint32(i)*2654435761)}
		var b strings.Builder
		fmt.Fprintf(&b, "// Package review is a test project for compactproxy's real-agent test.\npackage review\n\n// %s\n\nimport (\n\t\"errors\"\n\t\"time\"\n)\n\n", f.Marker)
		for k := 0; b.Len() < wl.fileBytes; k++ {
			fmt.Fprintf(&b, `// Retry%[1]d_%[2]d calls op until it succeeds, at most %[3]d times,
// sleeping a little longer after each failure.
func Retry%[1]d_%[2]d(op func() error) error {
	var err error
	for attempt := 0; attempt < %[3]d; attempt++ {
		if err = op(); err == nil {
			return nil
		}
		time.Sleep(time.Duration(attempt+1) * %[4]d * time.Millisecond)
	}
	return errors.Join(errors.New("retry%[1]d_%[2]d: giving up"), err)
}

`, i, k, 3+(i+k)%5, 10*(k+1))
		}
		if err := os.WriteFile(filepath.Join(dir, f.Name), []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	return dir, files
}

// agentRun is the outcome of one run of the agent.
type agentRun struct {
	err            error
	stdout, stderr string
	elapsed        time.Duration
	guard          []string // non-loopback connects and lookups the guard refused
}

// runAgent runs pi in print mode in project, with its provider pointed at
// baseURL: an "openai-completions" provider whose one model has a large
// contextWindow for pi itself (pi's own compaction is also switched off, so
// compacting is left to compactproxy) and maxTokens as given, sent in the
// request field maxField (pi's compat.maxTokensField: "max_completion_tokens",
// its default, or "max_tokens").
func runAgent(t *testing.T, root, project, baseURL string, maxTokens int, maxField string) agentRun {
	t.Helper()
	home := t.TempDir()
	agentDir := filepath.Join(home, ".pi", "agent")
	if err := os.MkdirAll(agentDir, 0o755); err != nil {
		t.Fatal(err)
	}
	models := map[string]any{"providers": map[string]any{"mock": map[string]any{
		"baseUrl": baseURL,
		"api":     "openai-completions",
		"apiKey":  apiKey,
		"compat": map[string]any{
			"supportsDeveloperRole":   false, // a plain "system" message, as local servers want
			"supportsReasoningEffort": false,
			"supportsStore":           false,
			"maxTokensField":          maxField,
		},
		"models": []any{map[string]any{
			"id": "mock-model", "name": "mock-model", "reasoning": false, "input": []string{"text"},
			"contextWindow": 131072, "maxTokens": maxTokens,
		}},
	}}}
	settings := map[string]any{
		"compaction":             map[string]any{"enabled": false},
		"retry":                  map[string]any{"enabled": false}, // an error must surface, not be retried away
		"enableInstallTelemetry": false,
		"quietStartup":           true,
	}
	for name, v := range map[string]any{"models.json": models, "settings.json": settings} {
		b, _ := json.MarshalIndent(v, "", "  ")
		if err := os.WriteFile(filepath.Join(agentDir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	guardLog := filepath.Join(home, "guard.log")

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node",
		"--require", filepath.Join(root, "test", "agent", "loopback-guard.cjs"),
		filepath.Join(root, agentCLI),
		"--provider", "mock", "--model", "mock-model",
		"--print", "--no-session", "--offline",
		"--no-extensions", "--no-skills", "--no-prompt-templates", "--no-themes", "--no-context-files",
		task)
	cmd.Dir = project
	// A clean environment: no proxy variables, no provider keys, no
	// COMPACTPROXY_ settings; only what node and the agent's bash tool need.
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + home,
		"TMPDIR=" + home,
		"LANG=C.UTF-8",
		"TERM=dumb",
		"NO_COLOR=1",
		"PI_CODING_AGENT_DIR=" + agentDir,
		"PI_OFFLINE=1",
		"PI_SKIP_VERSION_CHECK=1",
		"PI_TELEMETRY=0",
		"AGENT_GUARD_LOG=" + guardLog,
	}
	var stdout, stderr lockedBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	start := time.Now()
	err := cmd.Run()
	run := agentRun{err: err, stdout: stdout.String(), stderr: stderr.String(), elapsed: time.Since(start)}
	if b, rerr := os.ReadFile(guardLog); rerr == nil {
		run.guard = strings.Fields(strings.ReplaceAll(string(b), " ", "_"))
	}
	return run
}

// field returns a top-level field's raw JSON, nil when absent.
func field(cr *chat.Request, key string) []byte {
	var v []byte
	for _, f := range cr.Fields {
		if f.Key == key {
			v = f.Value // the last occurrence wins, as in encoding/json
		}
	}
	return v
}

func headerInt(h http.Header, name string) int {
	n, err := strconv.Atoi(h.Get(name))
	if err != nil {
		return -1
	}
	return n
}

// TestRealAgentThroughCompactproxy is issue 8's real-agent test: the agent
// finishes, every request the upstream received passes the strict pairing
// check, the agent's system prompt and tools reach the upstream unchanged,
// and compaction happened with the newest tool result verbatim. The agent
// sends max_tokens of at least a quarter of the window (real agents send
// their model's full output limit), which must not switch compaction off.
// Where a workload sets minCacheReuse, the prompt tokens the mock reports
// cached must reach it.
func TestRealAgentThroughCompactproxy(t *testing.T) {
	if testing.Short() {
		t.Skip("real-agent end-to-end test: skipped with -short")
	}
	root := repoRoot(t)
	ensureAgentDeps(t, root)
	bin := buildBinary(t, root)

	for _, wl := range workloads {
		t.Run(wl.name, func(t *testing.T) { testWorkload(t, root, bin, wl) })
	}
}

// testWorkload runs the agent over wl's project without compactproxy, then
// through it with each of the two max-tokens settings.
func testWorkload(t *testing.T, root, bin string, wl workload) {
	// The agent straight at the mock (through the recorder, which numbers
	// its requests), with a window nothing overflows: the reference that
	// the agent, its config and the script work without compactproxy.
	ok := t.Run("reference_without_proxy", func(t *testing.T) {
		project, files := writeProject(t, wl)
		mock := newMockModel(t, 1<<20, task, finalText, wl.pairAt, files)
		rec := newRecorder(t, mock.srv.URL)
		run := runAgent(t, root, project, rec.srv.URL+"/v1", window/2, "max_completion_tokens")
		turns, _ := rec.snapshot()
		ups := mock.requests()
		t.Logf("agent ran %v, exit: %v; %d requests; without compaction the conversation reaches %d tokens at the mock's rate (the cases' window: %d)",
			run.elapsed.Round(time.Millisecond), run.err, len(turns), maxPrompt(ups), window)
		if run.err != nil || !strings.Contains(run.stdout, finalText) {
			t.Errorf("agent exited %v without the final answer\nstdout: %s\nstderr: %s", run.err, tail(run.stdout, 2000), tail(run.stderr, 2000))
		}
		if len(run.guard) > 0 {
			t.Errorf("the agent tried to reach past loopback (refused): %v", run.guard)
		}
		for i, u := range ups {
			if u.Summarize {
				t.Errorf("upstream request %d taken for a summarize call", i)
			}
			for _, p := range u.Problems {
				t.Errorf("upstream request %d: %s", i, p)
			}
			for _, v := range u.Pairing {
				t.Errorf("upstream request %d: %s", i, v.Message())
			}
		}
		if maxPrompt(ups) <= window {
			t.Errorf("the conversation reaches only %d tokens: it would fit the %d window uncompacted", maxPrompt(ups), window)
		}
		// The mock's cache model (renderPrompt) checked on the reference:
		// every request of a conversation nothing compacts extends the
		// previous one, so all of it but what was appended is cached.
		byTurn := map[int][]upstreamReq{}
		for _, u := range ups {
			byTurn[u.Turn] = append(byTurn[u.Turn], u)
		}
		if f := logTable(t, turns, byTurn, nil); !(f.efficiency() >= 0.95) {
			t.Errorf("without compaction the mock reports %.2f of the cacheable prefix cached (Σcached %d ÷ Σ(prompt − appended) %d), want >= 0.95: its cache model is broken",
				f.efficiency(), f.Cached, f.Prompt-f.Appended)
		}
	})
	if !ok {
		t.Fatal("the agent fails against the mock without compactproxy: fix the agent's setup or the mock before blaming the proxy")
	}

	for _, tc := range []struct {
		name      string
		maxTokens int
		maxField  string
	}{
		// Half the window: a quarter is reserved for output (DESIGN §
		// Budget), the rest is the conversation's.
		{"max_tokens_half_window", window / 2, "max_completion_tokens"},
		// The whole window, as the agent in issue 8 sent max_tokens 32000
		// to a 32k model: reserved output is still capped at a quarter.
		{"max_tokens_whole_window", window, "max_tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) { testAgent(t, root, bin, wl, tc.maxTokens, tc.maxField) })
	}
}

func testAgent(t *testing.T, root, bin string, wl workload, maxTokens int, maxField string) {
	project, files := writeProject(t, wl)
	mock := newMockModel(t, window, task, finalText, wl.pairAt, files)
	proxy := startProxy(t, bin, mock.baseURL(),
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW="+strconv.Itoa(window),
	)
	rec := newRecorder(t, proxy.URL)

	run := runAgent(t, root, project, rec.srv.URL+"/v1", maxTokens, maxField)
	turns, recOthers := rec.snapshot()
	ups := mock.requests()
	t.Logf("agent ran %v, exit: %v; %d agent requests, %d upstream requests", run.elapsed.Round(time.Millisecond), run.err, len(turns), len(ups))

	// The per-request table first, so a failure below has its context.
	byTurn := map[int][]upstreamReq{}
	var summarizes []upstreamReq
	for _, u := range ups {
		if u.Summarize {
			summarizes = append(summarizes, u)
		} else {
			byTurn[u.Turn] = append(byTurn[u.Turn], u)
		}
	}
	figures := logTable(t, turns, byTurn, summarizes)
	dumpOnFailure := func() {
		if t.Failed() {
			t.Logf("agent stdout:\n%s\nagent stderr:\n%s", tail(run.stdout, 4000), tail(run.stderr, 4000))
			t.Logf("compactproxy log (tail):\n%s", proxy.LogTail())
		}
	}
	defer dumpOnFailure()

	t.Run("loopback_only", func(t *testing.T) {
		if len(run.guard) > 0 {
			t.Errorf("the agent tried to reach past loopback (refused): %v", run.guard)
		}
		for _, o := range append(recOthers, mock.others()...) {
			t.Logf("non-chat request: %s", o)
		}
	})

	t.Run("agent_finishes", func(t *testing.T) {
		if run.err != nil {
			t.Errorf("agent exited with %v", run.err)
		}
		if !strings.Contains(run.stdout, finalText) {
			t.Errorf("agent's output lacks the mock's final answer %q", finalText)
		}
		for _, tr := range turns {
			if tr.Status != http.StatusOK {
				t.Errorf("agent request %d: answered %d", tr.N, tr.Status)
			}
		}
		steps := map[int]bool{}
		for _, u := range ups {
			if !u.Summarize && u.Status == http.StatusOK {
				steps[u.Step] = true
			}
		}
		// ls + one read step per file (two files in one) + the final answer.
		if want := wl.scriptSteps(); len(steps) < want {
			t.Errorf("the mock answered %d distinct script steps, want %d: the agent did not get through its task", len(steps), want)
		}
	})

	t.Run("agent_sends_large_max_tokens", func(t *testing.T) {
		for _, tr := range turns {
			cr, err := chat.Parse(tr.Body)
			if err != nil {
				t.Fatalf("agent request %d: %v", tr.N, err)
			}
			if field(cr, maxField) == nil {
				t.Errorf("agent request %d: no %s field (the scenario configures pi to send it)", tr.N, maxField)
			}
			if cr.MaxTokens < window/4 {
				t.Errorf("agent request %d: max tokens %d, want >= window/4 = %d (the scenario needs it)", tr.N, cr.MaxTokens, window/4)
			}
		}
	})

	t.Run("upstream_requests_pair_strictly", func(t *testing.T) {
		for i, u := range ups {
			for _, v := range u.Pairing {
				t.Errorf("upstream request %d (turn %d, summarize %v): %s", i, u.Turn, u.Summarize, v.Message())
			}
			for _, p := range u.Problems {
				t.Errorf("upstream request %d (turn %d): %s", i, u.Turn, p)
			}
		}
	})

	t.Run("system_prompt_and_tools_unchanged", func(t *testing.T) {
		if len(turns) == 0 {
			t.Fatal("no agent request")
		}
		first, err := chat.Parse(turns[0].Body)
		if err != nil || len(first.Messages) == 0 || first.Messages[0].Role != "system" {
			t.Fatalf("the agent's first request has no leading system message (err %v)", err)
		}
		t.Logf("agent's fixed part: system message %d bytes, tools %d bytes (%d and %d tokens at the mock's rate)",
			len(first.Messages[0].Raw), len(field(first, "tools")),
			int(float64(len(first.Messages[0].Raw))/bytesPerToken), int(float64(len(field(first, "tools")))/bytesPerToken))
		for _, tr := range turns {
			sent, err := chat.Parse(tr.Body)
			if err != nil {
				t.Fatal(err)
			}
			if len(byTurn[tr.N]) == 0 {
				t.Errorf("turn %d never reached the upstream as an agent request (with tools, tool_choice not none)", tr.N)
			}
			for _, u := range byTurn[tr.N] {
				got, err := chat.Parse(u.Body)
				if err != nil {
					t.Errorf("turn %d: forwarded body: %v", tr.N, err)
					continue
				}
				if !bytes.Equal(field(got, "tools"), field(sent, "tools")) {
					t.Errorf("turn %d: the tools array reached the upstream changed (%d bytes sent, %d received)", tr.N, len(field(sent, "tools")), len(field(got, "tools")))
				}
				if len(got.Messages) == 0 || !bytes.Equal(got.Messages[0].Raw, sent.Messages[0].Raw) {
					t.Errorf("turn %d: the system message reached the upstream changed", tr.N)
				}
			}
		}
	})

	t.Run("compaction_happened", func(t *testing.T) {
		actions := map[string]int{}
		for _, tr := range turns {
			actions[tr.Header.Get("X-Compactproxy-Compaction")]++
		}
		t.Logf("X-Compactproxy-Compaction over %d agent requests: %v", len(turns), actions)
		t.Logf("metrics: %s", strings.Join(metricLines(t, proxy,
			"compactproxy_compactions_total", "compactproxy_summarize_total", "compactproxy_compaction_invariant_failures_total",
			"compactproxy_compaction_impossible_total", "compactproxy_upstream_retries_total"), "; "))
		if actions["none"]+actions[""] == len(turns) {
			t.Errorf("no agent request was compacted (the conversation grew to ~%d tokens against a %d window)", maxPrompt(ups), window)
		}
		if got := metricSum(t, proxy, "compactproxy_compactions_total"); got <= 0 {
			t.Errorf("compactproxy_compactions_total = %v, want > 0", got)
		}
		// Issue 8's goal: a summary is made and then reused; no drop while
		// the summarizer works (the mock's always does). A summary is made
		// on a request's path ("summarized") or, when the conversation
		// grows in small steps, in the background after a response
		// (presummarize_ratio), and the request that crosses the trigger
		// applies it ("reused"): count the summarize calls the mock
		// answered.
		made := 0
		for _, s := range summarizes {
			if s.Status == http.StatusOK {
				made++
			}
		}
		if made == 0 {
			t.Errorf("no summary was made: no summarize call answered (actions %v)", actions)
		}
		if made < actions["summarized"] {
			t.Errorf("%d requests summarized with %d summarize calls answered", actions["summarized"], made)
		}
		if made > 0 && actions["reused"] == 0 {
			t.Errorf("a summary was made but never reused (actions %v, %d summarize calls)", actions, made)
		}
		if actions["dropped"] > 0 {
			t.Errorf("%d requests were forwarded with turns dropped while the summarizer works", actions["dropped"])
		}
	})

	t.Run("newest_message_and_task_verbatim", func(t *testing.T) {
		var taskMsg []byte
		if len(turns) > 0 {
			if first, err := chat.Parse(turns[0].Body); err == nil {
				for _, m := range first.Messages {
					if m.Role == "user" && bytes.Contains(m.Raw, []byte(task)) {
						taskMsg = m.Raw
					}
				}
			}
		}
		if taskMsg == nil {
			t.Fatal("the agent's first request carries no user message with the task")
		}
		for _, tr := range turns {
			sent, err := chat.Parse(tr.Body)
			if err != nil {
				t.Fatal(err)
			}
			newest := sent.Messages[len(sent.Messages)-1].Raw
			for _, u := range byTurn[tr.N] {
				got, err := chat.Parse(u.Body)
				if err != nil || len(got.Messages) == 0 {
					continue // reported above
				}
				if !bytes.Equal(got.Messages[len(got.Messages)-1].Raw, newest) {
					t.Errorf("turn %d (%s): the newest message did not reach the upstream verbatim as the last one", tr.N, tr.Header.Get("X-Compactproxy-Compaction"))
				}
				if !holdsMessage(got, taskMsg) {
					t.Errorf("turn %d (%s): the task (the agent's first and only user message) is not in the forwarded view verbatim", tr.N, tr.Header.Get("X-Compactproxy-Compaction"))
				}
			}
		}
	})

	t.Run("cache_reuse", func(t *testing.T) {
		if wl.minCacheReuse == 0 {
			t.Logf("logged only for %s: cache reuse %.2f, ceiling %.2f, efficiency %.2f", wl.name, figures.cacheReuse(), figures.ceiling(), figures.efficiency())
			return
		}
		if !(figures.cacheReuse() >= wl.minCacheReuse) {
			t.Errorf("cache reuse after the first request Σcached ÷ Σprompt = %d ÷ %d = %.3f, want >= %.2f (ceiling %.3f, efficiency %.3f)",
				figures.Cached, figures.Prompt, figures.cacheReuse(), wl.minCacheReuse, figures.ceiling(), figures.efficiency())
			if figures.ceiling() < wl.minCacheReuse {
				t.Errorf("the ceiling itself (%.3f) is under the bound: the agent appends more per step than the %s workload was sized for, so no proxy could reach it", figures.ceiling(), wl.name)
			}
		}
	})

	t.Run("upstream_never_overflowed", func(t *testing.T) {
		for i, u := range ups {
			if u.Prompt > window {
				t.Errorf("upstream request %d (turn %d, summarize %v): %d tokens, over the %d window", i, u.Turn, u.Summarize, u.Prompt, window)
			}
		}
	})

	if err := proxy.Stop(10 * time.Second); err != nil {
		t.Errorf("compactproxy after SIGTERM: %v", err)
	}
}

// holdsMessage reports whether the request carries a message with exactly
// these bytes.
func holdsMessage(cr *chat.Request, raw []byte) bool {
	for _, m := range cr.Messages {
		if bytes.Equal(m.Raw, raw) {
			return true
		}
	}
	return false
}

func maxPrompt(ups []upstreamReq) int {
	m := 0
	for _, u := range ups {
		m = max(m, u.Prompt)
	}
	return m
}

// runFigures are a run's sums over the agent's requests after the first
// (the first has nothing to reuse): prompt and cached tokens as the mock
// reported them, and what the agent appended since its previous request,
// at the mock's rate. The mean estimate errors are over anchored
// uncompacted requests and over compacted ones.
type runFigures struct {
	Prompt, Cached, Appended int
	// Appends is how many requests Appended sums over; Room is the room
	// compactproxy leaves the conversation: its budget (three quarters of
	// the window: reserve_tokens 4096 is a quarter of it, and a request's
	// max tokens count at most a quarter) less the fixed part (system
	// message and tools), at the mock's rate.
	Appends, Room             int
	AnchoredErr, CompactedErr float64
	AnchoredN, CompactedN     int
}

// cacheReuse is Σcached ÷ Σprompt; NaN without requests.
func (f runFigures) cacheReuse() float64 { return ratio(f.Cached, f.Prompt) }

// ceiling is Σ(prompt − appended) ÷ Σprompt: what any proxy could have
// served from the cache, given what the agent appended.
func (f runFigures) ceiling() float64 { return ratio(f.Prompt-f.Appended, f.Prompt) }

// efficiency is Σcached ÷ Σ(prompt − appended): the share of the ceiling
// reached.
func (f runFigures) efficiency() float64 { return ratio(f.Cached, f.Prompt-f.Appended) }

func ratio(a, b int) float64 {
	if b <= 0 {
		return math.NaN()
	}
	return float64(a) / float64(b)
}

// logTable logs one line per agent request and one per summarize call,
// then the estimate's error and the cache reuse over the run, and returns
// those figures.
func logTable(t *testing.T, turns []turn, byTurn map[int][]upstreamReq, summarizes []upstreamReq) runFigures {
	t.Helper()
	t.Logf("%4s %6s %7s %-10s %6s %-22s %-13s %9s %9s %7s %7s %6s", "turn", "status", "msgs", "action", "maxtok", "field", "ctx(src)", "fwd-est", "reported", "err%", "cached", "tries")
	var anchoredErr, freshErr []float64
	var f runFigures
	if len(turns) > 0 {
		if first, err := chat.Parse(turns[0].Body); err == nil && len(first.Messages) > 0 {
			fixed := int(float64(len(first.Messages[0].Raw)+len(field(first, "tools"))) / bytesPerToken)
			f.Room = window - window/4 - fixed
		}
	}
	prevBody := -1
	for _, tr := range turns {
		sent, _ := chat.Parse(tr.Body)
		in, maxTok := 0, 0
		if sent != nil {
			in, maxTok = len(sent.Messages), sent.MaxTokens
		}
		ups := byTurn[tr.N]
		out, reported, cached, fieldName := -1, -1, -1, ""
		if len(ups) > 0 {
			u := ups[len(ups)-1]
			if got, err := chat.Parse(u.Body); err == nil {
				out = len(got.Messages)
			}
			reported, cached, fieldName = u.Prompt, u.Cached, fmt.Sprintf("%s=%d", u.MaxField, u.MaxTokens)
			if tr.N > 0 {
				f.Prompt += u.Prompt
				f.Cached += u.Cached
				if prevBody >= 0 {
					// What the agent appended since its previous request, at
					// the mock's rate: evaluated however the proxy compacts.
					f.Appended += min(max(int(float64(len(tr.Body)-prevBody)/bytesPerToken), 0), u.Prompt)
					f.Appends++
				}
			}
		}
		prevBody = len(tr.Body)
		action := tr.Header.Get("X-Compactproxy-Compaction")
		ctxTok := headerInt(tr.Header, "X-Compactproxy-Context-Tokens")
		src := tr.Header.Get("X-Compactproxy-Context-Source")
		fwd := headerInt(tr.Header, "X-Compactproxy-Forwarded-Tokens")
		errPct := math.NaN()
		if fwd >= 0 && reported > 0 {
			errPct = 100 * float64(fwd-reported) / float64(reported)
			if action == "none" && src == "anchor" {
				anchoredErr = append(anchoredErr, math.Abs(errPct))
			} else if action != "none" {
				freshErr = append(freshErr, math.Abs(errPct))
			}
		}
		t.Logf("%4d %6d %3d→%-3d %-10s %6d %-22s %-13s %9d %9d %7.1f %7d %6d",
			tr.N, tr.Status, in, out, action, maxTok, fieldName, fmt.Sprintf("%d(%s)", ctxTok, src), fwd, reported, errPct, cached, len(ups))
	}
	for _, s := range summarizes {
		cr, _ := chat.Parse(s.Body)
		n := -1
		if cr != nil {
			n = len(cr.Messages)
		}
		t.Logf("summarize call: status %d, %d messages, %d tokens reported (window %d), %s=%d, stream %v",
			s.Status, n, s.Prompt, window, s.MaxField, s.MaxTokens, s.Stream)
	}
	f.AnchoredErr, f.AnchoredN = mean(anchoredErr), len(anchoredErr)
	f.CompactedErr, f.CompactedN = mean(freshErr), len(freshErr)
	t.Logf("estimate error |fwd-est − reported| ÷ reported: anchored uncompacted requests mean %.1f%% (n=%d); compacted requests mean %.1f%% (n=%d)",
		f.AnchoredErr, f.AnchoredN, f.CompactedErr, f.CompactedN)
	if f.Prompt > 0 {
		t.Logf("cache reuse after the first request: Σcached ÷ Σprompt = %d ÷ %d = %.2f", f.Cached, f.Prompt, f.cacheReuse())
		if f.Prompt-f.Appended > 0 {
			t.Logf("  ceiling Σ(prompt − appended) ÷ Σprompt = %.2f (the agent appended %d tokens); efficiency Σcached ÷ Σ(prompt − appended) = %.2f",
				f.ceiling(), f.Appended, f.efficiency())
		}
	}
	if f.Appends > 0 && f.Room > 0 {
		per := f.Appended / f.Appends
		t.Logf("  the agent appended %d tokens per request on average, %.1f%% of the room (%d tokens)", per, 100*float64(per)/float64(f.Room), f.Room)
	}
	return f
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
