// Command loadgen is the load harness's client: it sends the same
// chat-completions requests to three targets — the mock upstream directly,
// a bare httputil.ReverseProxy in front of it, and compactproxy in front of
// it — in interleaved rounds (every round visits every target for every
// scenario, in a rotating order, so drift on a shared machine hits all of
// them alike), with keep-alive clients at fixed concurrencies and fixed
// request counts. It prints latency, latency added over direct, time to
// first byte for streams, throughput and each proxy's CPU time per request
// (from /proc/<pid>/stat), then issue 2's targets as ratios measured in this
// one run, and writes the same to -out as JSON and text.
//
// bench/run.sh starts the processes and calls it; see there.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

// scenario is one kind of request. Bodies come from chattest.AgentBody, the
// same agent requests the parser's `go test -bench` functions use: system
// prompt, user ask, then assistant tool calls each answered by a long tool
// output (16 KiB: one call; 1 MiB: about 1,000 messages).
type scenario struct {
	Name   string
	Bytes  int
	Stream bool
	// Count is the number of requests per round at each concurrency.
	Count map[int]int
	body  []byte
}

// target is one endpoint under test.
type target struct {
	Name   string
	Base   string // base URL incl. /v1
	PID    int    // 0: the CPU time is not measured
	client *http.Client

	failed   bool
	failNote string
}

// sample is one request's outcome.
type sample struct {
	lat, ttfb time.Duration
	err       error
	compacted bool // compactproxy said it compacted (should not happen here)
}

// cell accumulates one (target, scenario, concurrency) over all rounds.
type cell struct {
	lat, ttfb []time.Duration
	ok, errs  int
	compacted int
	elapsed   time.Duration
	cpuTicks  int64
	cpuRounds int
	firstErr  string
}

type key struct {
	target, scenario string
	conc             int
}

func main() {
	direct := flag.String("direct", "", "mock upstream base URL incl. /v1")
	bare := flag.String("bare", "", "bare reverse proxy base URL incl. /v1")
	compact := flag.String("compact", "", "compactproxy base URL incl. /v1 (empty: not measured)")
	barePID := flag.Int("bare-pid", 0, "bare proxy pid, for CPU time")
	compactPID := flag.Int("compact-pid", 0, "compactproxy pid, for CPU time")
	clkTck := flag.Int("clk-tck", 100, "kernel clock ticks per second (getconf CLK_TCK)")
	rounds := flag.Int("rounds", 5, "interleaved rounds")
	scale := flag.Float64("scale", 1, "multiply every request count by this")
	concs := flag.String("concurrency", "1,32", "comma-separated concurrencies")
	cellTimeout := flag.Duration("cell-timeout", 60*time.Second, "give up on a target's round of one cell after this")
	reqTimeout := flag.Duration("request-timeout", 30*time.Second, "per-request timeout")
	budget := flag.Duration("budget", 270*time.Second, "stop starting new rounds when the next one would end after this (the rounds done are reported)")
	out := flag.String("out", "", "directory for results (JSON and text); empty: none")
	note := flag.String("note", "", "free text recorded with the results (e.g. why compactproxy is absent)")
	convs := flag.String("conversations", "same", `"same": every request is the same conversation (identical bytes to every target, the worst case for per-conversation state); "per-worker": each worker sends X-Compactproxy-Conversation: bench-wN (N agents at concurrency N; the header is ignored by the mock and passed by the bare proxy)`)
	freePort := flag.Bool("freeport", false, "print a free 127.0.0.1 port and exit")
	only := flag.String("scenarios", "", "comma-separated scenario names to run (empty: all): 16KB, 16KB-stream, 1MiB, and the agent scenarios cross and 1MiB-compaction (compactproxy only)")
	printModels := flag.Bool("print-models", false, "print the models table (COMPACTPROXY_MODELS) the agent scenarios need and exit")
	think := flag.Duration("think", 2500*time.Millisecond, "agent scenarios: an agent's think time between a response and its next request")
	sumLatency := flag.Duration("summarizer-latency", 0, "agent scenarios: the summarizer's latency, for the report (bench/run.sh's second mock)")
	crossAgents := flag.Int("cross-agents", 4, "cross: concurrent agents per pass")
	crossPasses := flag.Int("cross-passes", 2, "cross: passes (each agent runs the conversation once per pass)")
	compactConvs := flag.Int("compact-convs", 6, "1MiB-compaction: conversations")
	compactStepsN := flag.Int("compact-steps", 10, "1MiB-compaction: re-applied requests per conversation")
	onlyTargets := flag.String("targets", "", "comma-separated target names to run (empty: all); for profiling one process")
	flag.Parse()

	if *freePort {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fatalf("freeport: %v", err)
		}
		fmt.Println(l.Addr().(*net.TCPAddr).Port)
		l.Close()
		return
	}
	if *printModels {
		fmt.Println(modelsJSON())
		return
	}
	if *convs != "same" && *convs != "per-worker" {
		fatalf("-conversations: want same or per-worker, got %q", *convs)
	}
	perWorker = *convs == "per-worker"
	if perWorker {
		*note = strings.TrimPrefix(*note+"; conversations per worker (X-Compactproxy-Conversation)", "; ")
	}
	if *direct == "" || *bare == "" {
		fatalf("-direct and -bare are required")
	}
	var cs []int
	for _, f := range strings.Split(*concs, ",") {
		c, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || c < 1 {
			fatalf("-concurrency: bad value %q", f)
		}
		cs = append(cs, c)
	}

	scenarios := []*scenario{
		{Name: "16KB", Bytes: 16 << 10, Count: map[int]int{1: 100, 32: 640}},
		{Name: "16KB-stream", Bytes: 16 << 10, Stream: true, Count: map[int]int{1: 100, 32: 640}},
		{Name: "1MiB", Bytes: 1 << 20, Count: map[int]int{1: 40, 32: 128}},
	}
	runCrossScenario, runCompactScenario := true, true
	if *only != "" {
		names := strings.Split(*only, ",")
		scenarios = slices.DeleteFunc(scenarios, func(s *scenario) bool { return !slices.Contains(names, s.Name) })
		runCrossScenario, runCompactScenario = slices.Contains(names, "cross"), slices.Contains(names, "1MiB-compaction")
		if len(scenarios) == 0 && !runCrossScenario && !runCompactScenario {
			fatalf("-scenarios: none of %q", *only)
		}
	}
	for _, s := range scenarios {
		s.body = chattest.AgentBody(s.Bytes, s.Stream)
	}

	targets := []*target{
		{Name: "direct", Base: *direct},
		{Name: "bare", Base: *bare, PID: *barePID},
	}
	if *compact != "" {
		targets = append(targets, &target{Name: "compactproxy", Base: *compact, PID: *compactPID})
	} else {
		targets = append(targets, &target{Name: "compactproxy", failed: true, failNote: "not started: " + *note})
	}
	if *onlyTargets != "" {
		names := strings.Split(*onlyTargets, ",")
		targets = slices.DeleteFunc(targets, func(t *target) bool { return !slices.Contains(names, t.Name) })
	}
	maxConc := slices.Max(cs)
	for _, t := range targets {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns = 2 * maxConc
		tr.MaxIdleConnsPerHost = 2 * maxConc
		tr.DisableCompression = true
		t.client = &http.Client{Transport: tr, Timeout: *reqTimeout}
	}

	fmt.Printf("loadgen: %d rounds, concurrency %v, %d CPUs, %s; bodies:", *rounds, cs, runtime.NumCPU(), runtime.Version())
	for _, s := range scenarios {
		fmt.Printf(" %s=%d bytes/%d messages", s.Name, len(s.body), countMessages(s.body))
	}
	fmt.Println()

	// Warm-up: connections, pools, JIT-less but allocator and caches.
	for _, t := range targets {
		if t.failed {
			continue
		}
		for _, s := range scenarios {
			r := runCell(t, s, maxConc, 2*maxConc, *cellTimeout, *clkTck)
			if r.errs > 0 && r.ok == 0 {
				t.failed = true
				t.failNote = "warm-up: every request failed: " + r.firstErr
				fmt.Printf("loadgen: %s fails: %s\n", t.Name, r.firstErr)
				break
			}
		}
	}

	cells := map[key]*cell{}
	started := time.Now()
	done := 0
	for round := 0; round < *rounds; round++ {
		if el := time.Since(started); round > 0 && el+el/time.Duration(round) > *budget {
			fmt.Printf("loadgen: stopping after %d of %d rounds: the next would exceed -budget %v\n", round, *rounds, *budget)
			*note = strings.TrimSpace(fmt.Sprintf("%s; stopped after %d of %d rounds (budget %v)", *note, round, *rounds, *budget))
			break
		}
		for _, s := range scenarios {
			for _, c := range cs {
				n := max(1, int(float64(s.Count[c])**scale))
				if s.Count[c] == 0 {
					n = max(1, int(float64(16*c)**scale))
				}
				// Rotate the order of the targets each round.
				for i := range targets {
					t := targets[(i+round)%len(targets)]
					if t.failed {
						continue
					}
					r := runCell(t, s, c, n, *cellTimeout, *clkTck)
					k := key{t.Name, s.Name, c}
					acc := cells[k]
					if acc == nil {
						acc = &cell{}
						cells[k] = acc
					}
					acc.merge(r)
					if r.errs > 0 && r.ok == 0 {
						t.failed = true
						t.failNote = fmt.Sprintf("round %d %s c=%d: every request failed: %s", round+1, s.Name, c, r.firstErr)
						fmt.Printf("loadgen: %s fails, skipped from now on: %s\n", t.Name, t.failNote)
					}
				}
			}
		}
		done++
		fmt.Printf("loadgen: round %d/%d done (%.0fs)\n", round+1, *rounds, time.Since(started).Seconds())
	}

	rep := buildReport(scenarios, targets, cs, cells, *clkTck, done, strings.TrimPrefix(*note, "; "))
	if runCrossScenario || runCompactScenario {
		var direct, cp *target
		for _, t := range targets {
			switch t.Name {
			case "direct":
				direct = t
			case "compactproxy":
				cp = t
			}
		}
		o := agentOpts{think: *think, agents: *crossAgents, passes: *crossPasses, convs: *compactConvs, steps: *compactStepsN,
			sumLatency: *sumLatency, clkTck: *clkTck, timeout: *reqTimeout}
		rep.addAgent(direct, cp, o, runCrossScenario, runCompactScenario)
	}
	text := rep.text()
	fmt.Print(text)
	if *out != "" {
		if err := rep.write(*out, text); err != nil {
			fatalf("write results: %v", err)
		}
	}
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "loadgen: "+format+"\n", args...)
	os.Exit(2)
}

func countMessages(body []byte) int {
	var v struct {
		Messages []json.RawMessage `json:"messages"`
	}
	json.Unmarshal(body, &v)
	return len(v.Messages)
}

// runResult is one target's round of one cell.
type runResult struct {
	samples  []sample
	ok, errs int
	elapsed  time.Duration
	cpuTicks int64 // -1: not measured
	firstErr string
}

func (c *cell) merge(r runResult) {
	for _, s := range r.samples {
		if s.err != nil {
			continue
		}
		c.lat = append(c.lat, s.lat)
		if s.ttfb > 0 {
			c.ttfb = append(c.ttfb, s.ttfb)
		}
		if s.compacted {
			c.compacted++
		}
	}
	c.ok += r.ok
	c.errs += r.errs
	c.elapsed += r.elapsed
	if r.cpuTicks >= 0 {
		c.cpuTicks += r.cpuTicks
		c.cpuRounds++
	}
	if c.firstErr == "" {
		c.firstErr = r.firstErr
	}
}

// runCell sends n requests of scenario s to t with c workers and measures
// them. The process's CPU ticks are read before and after.
func runCell(t *target, s *scenario, c, n int, timeout time.Duration, clkTck int) runResult {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	samples := make([]sample, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	cpu0 := procTicks(t.PID)
	start := time.Now()
	for w := 0; w < c; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				samples[i] = doRequest(ctx, t, s, w)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu1 := procTicks(t.PID)

	r := runResult{samples: samples, elapsed: elapsed, cpuTicks: -1}
	if cpu0 >= 0 && cpu1 >= 0 {
		r.cpuTicks = cpu1 - cpu0
	}
	for i := range samples {
		switch {
		case samples[i].err != nil:
			r.errs++
			if r.firstErr == "" {
				r.firstErr = samples[i].err.Error()
			}
		case samples[i].lat == 0: // not sent: the cell timed out
			r.errs++
			if r.firstErr == "" {
				r.firstErr = fmt.Sprintf("cell timed out after %v", timeout)
			}
		default:
			r.ok++
		}
	}
	return r
}

var errNoDone = errors.New("stream ended without data: [DONE]")

// perWorker: each worker is its own conversation (-conversations per-worker).
var perWorker bool

func doRequest(ctx context.Context, t *target, s *scenario, worker int) sample {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.Base+"/chat/completions", bytes.NewReader(s.body))
	if err != nil {
		return sample{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk-bench-not-a-real-key")
	if perWorker {
		req.Header.Set("X-Compactproxy-Conversation", "bench-w"+strconv.Itoa(worker))
	}
	start := time.Now()
	resp, err := t.client.Do(req)
	if err != nil {
		return sample{err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		return sample{err: fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))}
	}
	smp := sample{}
	if a := resp.Header.Get("X-Compactproxy-Compaction"); a != "" && a != "none" {
		smp.compacted = true
	}
	var buf [8192]byte
	var tail []byte
	for {
		n, err := resp.Body.Read(buf[:])
		if n > 0 {
			if smp.ttfb == 0 && s.Stream {
				smp.ttfb = time.Since(start)
			}
			tail = append(tail, buf[:n]...)
			if len(tail) > 64 {
				tail = tail[len(tail)-64:]
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return sample{err: err}
		}
	}
	smp.lat = time.Since(start)
	if s.Stream && !bytes.Contains(tail, []byte("data: [DONE]")) {
		return sample{err: errNoDone}
	}
	return smp
}

// procTicks returns utime+stime of pid in clock ticks, or -1.
func procTicks(pid int) int64 {
	if pid <= 0 {
		return -1
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return -1
	}
	// Fields after the command name, which is in parentheses and may hold
	// spaces: state is field 3, utime 14, stime 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return -1
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return -1
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return -1
	}
	return ut + st
}

// pct returns the p-th percentile (nearest rank) of ds, sorted in place.
func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(p/100*float64(len(ds))+0.999999) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

// ensureDir creates dir.
func ensureDir(dir string) error { return os.MkdirAll(filepath.Clean(dir), 0o755) }
