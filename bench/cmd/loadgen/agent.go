package main

// The compaction path under an agent's loop (issue 11), measured on
// compactproxy alone (the bare proxy never compacts):
//
//   - "cross": agents step through a conversation that crosses the
//     compaction trigger, thinking between steps, with a summarizer that
//     takes -summarizer-latency (the harness's second mock). With
//     background pre-summarization the summary is made during the think
//     time after the step below the trigger, and the crossing request only
//     re-applies it. Its added latency is compared with the steps below the
//     trigger (issue 11's target: ≤ 1.5x).
//   - "1MiB-compaction": agents at 1 MiB of history over the trigger: the
//     first over-trigger request of each conversation (trim, summarize),
//     then requests that re-apply the stored compaction while the history
//     grows a step at a time, each with its CPU per request.
//
// The context windows that put these conversations where they should be
// are the models table compactproxy is started with: bench/run.sh takes it
// from `loadgen -print-models`, computed from the same bodies.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

const (
	crossModel   = "bench-cross"
	compactModel = "bench-1mib"
	// summarizerModel is compactproxy's compaction.summarizer.model in the
	// harness (bench/run.sh), with a window that holds the cross
	// conversation's head in one call: "a summarizer that takes 2 s" is one
	// call of the slow mock, not a chunked series of them.
	summarizerModel  = "bench-summarizer"
	summarizerWindow = 131072
	// crossSteps is the conversation's length in tool steps; crossAt the
	// step whose request crosses the trigger.
	crossSteps = 10
	crossAt    = 8
	// crossOutput is each tool result's size: under the trim threshold
	// (1024 tokens), so that crossing the trigger needs a summary.
	crossOutput = 3000
	// compactWindow puts a 1 MiB agent body (about 262k tokens as the mock
	// counts) well over the trigger (0.8 of the room).
	compactWindow = 200000
)

// Defaults of compactproxy that the window computation relies on.
const (
	defaultReserve = 4096
	triggerRatio   = 0.80
)

// crossBody is the cross conversation after steps tool steps: a system
// prompt, the task, then assistant tool calls each answered by a
// crossOutput-byte result. Bodies of growing steps share their prefix byte
// for byte, as an agent's requests do.
func crossBody(steps int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"` + crossModel + `","messages":[`)
	b.WriteString(`{"role":"system","content":"You are a coding agent. Use the tools to read files and run commands; keep changes small. ` + strings.Repeat("Read before you edit. ", 40) + `"},`)
	b.WriteString(`{"role":"user","content":"Find why the nightly job fails and fix it."}`)
	for s := 1; s <= steps; s++ {
		id := "call_" + strconv.Itoa(s)
		fmt.Fprintf(&b, `,{"role":"assistant","content":null,"tool_calls":[{"id":%q,"type":"function","function":{"name":"run","arguments":"{\"command\":\"step %d\"}"}}]}`, id, s)
		out := strings.Repeat(fmt.Sprintf("step %d: line of command output, nothing special here\n", s), crossOutput/50+1)[:crossOutput]
		o, _ := json.Marshal(out)
		fmt.Fprintf(&b, `,{"role":"tool","tool_call_id":%q,"content":%s}`, id, o)
	}
	b.WriteString(`],"temperature":0,"tools":[{"type":"function","function":{"name":"run","description":"Run a shell command.","parameters":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}}}]}`)
	return b.Bytes()
}

// mockTokens is the prompt_tokens the mock upstream reports for a body.
func mockTokens(body []byte) int { return len(body)/4 + 1 }

// crossWindow is the context window that puts the trigger halfway between
// the requests of steps crossAt-1 and crossAt (as the mock counts them),
// with compactproxy's default reserve and trigger ratio. The fixed part
// (system prompt and tools) is estimated from the body without steps.
func crossWindow() int {
	fixed := mockTokens(crossBody(0))
	mid := (mockTokens(crossBody(crossAt-1)) + mockTokens(crossBody(crossAt))) / 2
	budget := int((float64(mid) - (1-triggerRatio)*float64(fixed)) / triggerRatio)
	// budget = window − min(reserve, window/4).
	if budget+defaultReserve >= 4*defaultReserve {
		return budget + defaultReserve
	}
	return budget * 4 / 3
}

// compactSteps is the number of chattest agent steps whose body is about
// 1 MiB.
func compactSteps() int {
	n := 0
	for len(chattest.AgentSteps(n+50, false)) < 1<<20 {
		n += 50
	}
	for len(chattest.AgentSteps(n+1, false)) < 1<<20 {
		n++
	}
	return n
}

// compactBody is the chattest agent after steps steps, for compactModel.
func compactBody(steps int) []byte {
	b := chattest.AgentSteps(steps, false)
	return bytes.Replace(b, []byte(`"model":"qwen3-coder-30b"`), []byte(`"model":"`+compactModel+`"`), 1)
}

// modelsJSON is the models table compactproxy needs for these scenarios
// (COMPACTPROXY_MODELS).
func modelsJSON() string {
	return fmt.Sprintf(`[{"name":%q,"context_window":%d},{"name":%q,"context_window":%d},{"name":%q,"context_window":%d}]`,
		crossModel, crossWindow(), compactModel, compactWindow, summarizerModel, summarizerWindow)
}

// agentOpts are the agent scenarios' knobs.
type agentOpts struct {
	think          time.Duration // between a response and the agent's next request
	agents, passes int           // cross: concurrent agents, and how many times each runs the conversation
	convs, steps   int           // 1MiB-compaction: conversations, re-applied steps each
	sumLatency     time.Duration // the summarizer's latency (reported)
	clkTck         int
	timeout        time.Duration
}

// agentSample is one request of an agent.
type agentSample struct {
	step   int
	lat    time.Duration
	action string
	err    error
}

// agentReport is the agent scenarios' part of the report.
type agentReport struct {
	SummarizerLatencyMs float64      `json:"summarizer_latency_ms"`
	ThinkMs             float64      `json:"think_ms"`
	Cross               *crossStat   `json:"cross,omitempty"`
	Compact             *compactStat `json:"compaction_1mib,omitempty"`
}

type crossStat struct {
	Window        int            `json:"window"`
	ExpectedStep  int            `json:"expected_crossing_step"`
	Agents        int            `json:"agent_runs"`
	Crossings     int            `json:"crossings"`
	Actions       map[string]int `json:"crossing_actions"`
	Steps         map[int]int    `json:"crossing_steps"`
	Errors        int            `json:"errors"`
	FirstError    string         `json:"first_error,omitempty"`
	BelowAdded50  float64        `json:"below_added_p50_ms"`
	CrossAdded50  float64        `json:"crossing_added_p50_ms"`
	CrossAddedMax float64        `json:"crossing_added_max_ms"`
	BelowN        int            `json:"below_samples"`
}

type compactStat struct {
	Window       int            `json:"window"`
	BodyBytes    int            `json:"body_bytes"`
	DirectP50    float64        `json:"direct_p50_ms"`
	First        phaseStat      `json:"first"`
	Reapplied    phaseStat      `json:"reapplied"`
	FirstActions map[string]int `json:"first_actions"`
	ReActions    map[string]int `json:"reapplied_actions"`
}

type phaseStat struct {
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	P50         float64 `json:"p50_ms"`
	P99         float64 `json:"p99_ms"`
	CPUPerReqMs float64 `json:"cpu_ms_per_request"`
}

// agentRequest sends one body as tenant key in conversation conv.
func agentRequest(ctx context.Context, t *target, body []byte, key, conv string) agentSample {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.Base+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return agentSample{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	if conv != "" {
		req.Header.Set("X-Compactproxy-Conversation", conv)
	}
	start := time.Now()
	resp, err := t.client.Do(req)
	if err != nil {
		return agentSample{err: err}
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, err = buf.ReadFrom(resp.Body)
	lat := time.Since(start)
	if err != nil {
		return agentSample{err: err}
	}
	if resp.StatusCode != http.StatusOK {
		return agentSample{err: fmt.Errorf("HTTP %d: %.200s", resp.StatusCode, bytes.TrimSpace(buf.Bytes()))}
	}
	return agentSample{lat: lat, action: resp.Header.Get("X-Compactproxy-Compaction")}
}

// directP50 is the mock's own latency for body (n requests).
func directP50(ctx context.Context, direct *target, body []byte, n int) time.Duration {
	var ds []time.Duration
	for range n {
		if s := agentRequest(ctx, direct, body, "sk-bench-direct", ""); s.err == nil {
			ds = append(ds, s.lat)
		}
	}
	return pct(ds, 50)
}

// runCross runs o.passes × o.agents agents through the cross conversation
// against cp, started o.think/o.agents apart, and compares the crossing
// request's added latency (over the mock's own for the same body) with the
// steps below the trigger.
func runCross(direct, cp *target, o agentOpts, nonce string) *crossStat {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(o.passes)*(crossSteps+2)*(o.think+o.timeout))
	defer cancel()
	st := &crossStat{Window: crossWindow(), ExpectedStep: crossAt, Actions: map[string]int{}, Steps: map[int]int{}}
	bodies := make([][]byte, crossSteps+1)
	base := make([]time.Duration, crossSteps+1)
	for s := 1; s <= crossSteps; s++ {
		bodies[s] = crossBody(s)
		base[s] = directP50(ctx, direct, bodies[s], 5)
	}
	var below, crossing []time.Duration
	for p := range o.passes {
		runs := make([][]agentSample, o.agents)
		var wg sync.WaitGroup
		for a := range o.agents {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(a) * o.think / time.Duration(o.agents))
				key := fmt.Sprintf("sk-bench-cross-%s-%d-%d", nonce, p, a)
				conv := fmt.Sprintf("bench-cross-%s-%d-%d", nonce, p, a)
				for s := 1; s <= crossSteps; s++ {
					smp := agentRequest(ctx, cp, bodies[s], key, conv)
					smp.step = s
					runs[a] = append(runs[a], smp)
					if smp.err != nil {
						return
					}
					if s < crossSteps {
						time.Sleep(o.think)
					}
				}
			}()
		}
		wg.Wait()
		for _, run := range runs {
			st.Agents++
			crossed := false
			for _, smp := range run {
				if smp.err != nil {
					st.Errors++
					if st.FirstError == "" {
						st.FirstError = smp.err.Error()
					}
					break
				}
				added := smp.lat - base[smp.step]
				switch {
				case !crossed && smp.action != "" && smp.action != "none":
					crossed = true
					st.Crossings++
					st.Actions[smp.action]++
					st.Steps[smp.step]++
					crossing = append(crossing, added)
				case !crossed && smp.step > 1:
					// The first step of a conversation is its cold start
					// (nothing cached, no anchor): not "a step below".
					below = append(below, added)
				}
			}
		}
	}
	st.BelowN = len(below)
	st.BelowAdded50 = ms(pct(below, 50))
	st.CrossAdded50 = ms(pct(crossing, 50))
	st.CrossAddedMax = ms(pct(crossing, 100))
	return st
}

// runCompaction runs the 1 MiB compaction path against cp: o.convs
// conversations (each its own tenant) send their first over-trigger
// request, three at a time, then o.steps requests each that re-apply the
// stored compaction while the history grows by one step, one at a time.
// CPU is compactproxy's over each phase.
func runCompaction(direct, cp *target, o agentOpts, nonce string) *compactStat {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(o.convs+o.convs*o.steps)*o.timeout)
	defer cancel()
	n := compactSteps()
	st := &compactStat{Window: compactWindow, FirstActions: map[string]int{}, ReActions: map[string]int{}}
	first := compactBody(n)
	st.BodyBytes = len(first)
	st.DirectP50 = ms(directP50(ctx, direct, first, 5))
	key := func(c int) string { return fmt.Sprintf("sk-bench-compact-%s-%d", nonce, c) }
	conv := func(c int) string { return fmt.Sprintf("bench-compact-%s-%d", nonce, c) }

	phase := func(ps *phaseStat, actions map[string]int, run func(record func(agentSample))) {
		var mu sync.Mutex
		var lat []time.Duration
		cpu0 := procTicks(cp.PID)
		run(func(s agentSample) {
			mu.Lock()
			defer mu.Unlock()
			if s.err != nil {
				ps.Errors++
				if ps.FirstError == "" {
					ps.FirstError = s.err.Error()
				}
				return
			}
			ps.Requests++
			lat = append(lat, s.lat)
			actions[s.action]++
		})
		cpu1 := procTicks(cp.PID)
		ps.P50, ps.P99 = ms(pct(lat, 50)), ms(pct(lat, 99))
		ps.CPUPerReqMs = -1
		if cpu0 >= 0 && cpu1 >= 0 && ps.Requests+ps.Errors > 0 {
			ps.CPUPerReqMs = float64(cpu1-cpu0) / float64(o.clkTck) * 1000 / float64(ps.Requests+ps.Errors)
		}
	}
	phase(&st.First, st.FirstActions, func(record func(agentSample)) {
		sem := make(chan struct{}, 3)
		var wg sync.WaitGroup
		for c := range o.convs {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				record(agentRequest(ctx, cp, first, key(c), conv(c)))
			}()
		}
		wg.Wait()
	})
	bodies := make([][]byte, o.steps+1)
	for i := 1; i <= o.steps; i++ {
		bodies[i] = compactBody(n + i)
	}
	phase(&st.Reapplied, st.ReActions, func(record func(agentSample)) {
		for i := 1; i <= o.steps; i++ {
			for c := range o.convs {
				record(agentRequest(ctx, cp, bodies[i], key(c), conv(c)))
			}
		}
	})
	return st
}

func (a *agentReport) text(b *strings.Builder) {
	if c := a.Cross; c != nil {
		fmt.Fprintf(b, "\ncross: an agent crosses the compaction trigger (window %d, expected at step %d of %d), summarizer latency %.0f ms, think time %.0f ms\n",
			c.Window, c.ExpectedStep, crossSteps, a.SummarizerLatencyMs, a.ThinkMs)
		fmt.Fprintf(b, "  %d agent runs, %d crossings %v at steps %v, %d errors", c.Agents, c.Crossings, c.Actions, c.Steps, c.Errors)
		if c.FirstError != "" {
			fmt.Fprintf(b, " (first: %.120s)", c.FirstError)
		}
		fmt.Fprintf(b, "\n  added latency over the mock's own, p50: steps below the trigger %+.2f ms (%d samples), crossing request %+.2f ms (max %+.2f ms)\n",
			c.BelowAdded50, c.BelowN, c.CrossAdded50, c.CrossAddedMax)
	}
	if c := a.Compact; c != nil {
		fmt.Fprintf(b, "\n1MiB-compaction: agents at %d bytes of history over the trigger (window %d); the mock alone answers that body in %.2f ms (p50)\n",
			c.BodyBytes, c.Window, c.DirectP50)
		fmt.Fprintf(b, "  %-34s %6s %8s %8s %11s %s\n", "phase", "reqs", "p50 ms", "p99 ms", "cpu ms/req", "actions / errors")
		row := func(name string, p phaseStat, actions map[string]int) {
			cpu := "-"
			if p.CPUPerReqMs >= 0 {
				cpu = fmt.Sprintf("%.2f", p.CPUPerReqMs)
			}
			fmt.Fprintf(b, "  %-34s %6d %8.2f %8.2f %11s %v / %d", name, p.Requests, p.P50, p.P99, cpu, actions, p.Errors)
			if p.FirstError != "" {
				fmt.Fprintf(b, " first error: %.120s", p.FirstError)
			}
			b.WriteByte('\n')
		}
		row("first over-trigger request", c.First, c.FirstActions)
		row("re-applied, history growing", c.Reapplied, c.ReActions)
	}
}
