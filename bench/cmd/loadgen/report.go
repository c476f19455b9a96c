package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// cellStat is one (target, scenario, concurrency) over all rounds. Times
// are milliseconds; "added" is relative to the direct target at the same
// scenario and concurrency; -1 means not measured.
type cellStat struct {
	Target      string  `json:"target"`
	Scenario    string  `json:"scenario"`
	Concurrency int     `json:"concurrency"`
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	Compacted   int     `json:"compacted"`
	P50         float64 `json:"p50_ms"`
	P99         float64 `json:"p99_ms"`
	AddedP50    float64 `json:"added_p50_ms"`
	AddedP99    float64 `json:"added_p99_ms"`
	TTFBP50     float64 `json:"ttfb_p50_ms,omitempty"`
	TTFBP99     float64 `json:"ttfb_p99_ms,omitempty"`
	AddedTTFB50 float64 `json:"added_ttfb_p50_ms,omitempty"`
	AddedTTFB99 float64 `json:"added_ttfb_p99_ms,omitempty"`
	RPS         float64 `json:"rps"`
	RelDirect   float64 `json:"rps_vs_direct"`
	RelBare     float64 `json:"rps_vs_bare"`
	CPUPerReqMs float64 `json:"cpu_ms_per_request"`
}

// check is one of issue 2's targets, as a ratio of compactproxy to the bare
// proxy measured in the same run.
type check struct {
	Name    string  `json:"name"`
	Ratio   float64 `json:"ratio"`
	Limit   float64 `json:"limit"`
	AtMost  bool    `json:"at_most"` // true: ratio <= limit passes; false: ratio >= limit
	Status  string  `json:"status"`  // PASS, MISS, FAIL (not measurable)
	Detail  string  `json:"detail"`
	Compact float64 `json:"compactproxy"`
	Bare    float64 `json:"bare"`
}

type report struct {
	Time      string            `json:"time"`
	GoVersion string            `json:"go_version"`
	CPUs      int               `json:"cpus"`
	Rounds    int               `json:"rounds"`
	Note      string            `json:"note,omitempty"`
	Bodies    map[string]int    `json:"body_bytes"`
	Failed    map[string]string `json:"failed_targets,omitempty"`
	Cells     []cellStat        `json:"cells"`
	Agent     *agentReport      `json:"agent,omitempty"`
	Checks    []check           `json:"targets"`
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func buildReport(scenarios []*scenario, targets []*target, cs []int, cells map[key]*cell, clkTck, rounds int, note string) *report {
	rep := &report{
		Time:      time.Now().UTC().Format(time.RFC3339),
		GoVersion: runtime.Version(),
		CPUs:      runtime.NumCPU(),
		Rounds:    rounds,
		Note:      note,
		Bodies:    map[string]int{},
		Failed:    map[string]string{},
	}
	for _, t := range targets {
		if t.failed {
			rep.Failed[t.Name] = t.failNote
		}
	}
	stat := map[key]*cellStat{}
	for _, s := range scenarios {
		rep.Bodies[s.Name] = len(s.body)
		for _, c := range cs {
			for _, t := range targets {
				k := key{t.Name, s.Name, c}
				acc := cells[k]
				if acc == nil {
					continue
				}
				st := &cellStat{
					Target: t.Name, Scenario: s.Name, Concurrency: c,
					Requests: acc.ok, Errors: acc.errs, FirstError: acc.firstErr, Compacted: acc.compacted,
					P50: ms(pct(acc.lat, 50)), P99: ms(pct(acc.lat, 99)),
					CPUPerReqMs: -1,
				}
				if s.Stream {
					st.TTFBP50, st.TTFBP99 = ms(pct(acc.ttfb, 50)), ms(pct(acc.ttfb, 99))
				}
				if acc.elapsed > 0 {
					st.RPS = float64(acc.ok) / acc.elapsed.Seconds()
				}
				if acc.cpuRounds > 0 && acc.ok+acc.errs > 0 {
					st.CPUPerReqMs = float64(acc.cpuTicks) / float64(clkTck) * 1000 / float64(acc.ok+acc.errs)
				}
				stat[k] = st
			}
			d := stat[key{"direct", s.Name, c}]
			b := stat[key{"bare", s.Name, c}]
			for _, t := range targets {
				st := stat[key{t.Name, s.Name, c}]
				if st == nil {
					continue
				}
				if d != nil {
					st.AddedP50, st.AddedP99 = st.P50-d.P50, st.P99-d.P99
					st.AddedTTFB50, st.AddedTTFB99 = st.TTFBP50-d.TTFBP50, st.TTFBP99-d.TTFBP99
					st.RelDirect = ratio(st.RPS, d.RPS)
				}
				if b != nil {
					st.RelBare = ratio(st.RPS, b.RPS)
				}
				rep.Cells = append(rep.Cells, *st)
			}
		}
	}

	cp := func(sc string, c int) (*cellStat, *cellStat) {
		return stat[key{"compactproxy", sc, c}], stat[key{"bare", sc, c}]
	}
	addCheck := func(name, sc string, c int, limit float64, atMost bool, metric func(*cellStat) float64, unit string) {
		if !slices.ContainsFunc(scenarios, func(s *scenario) bool { return s.Name == sc }) {
			return // not run (-scenarios)
		}
		ch := check{Name: name, Limit: limit, AtMost: atMost}
		x, b := cp(sc, c)
		switch {
		case rep.Failed["compactproxy"] != "":
			ch.Status, ch.Detail = "FAIL", "compactproxy failed (see FAILED TARGET above)"
		case x == nil || b == nil || x.Requests == 0 || b.Requests == 0:
			ch.Status, ch.Detail = "FAIL", "not measured"
		default:
			ch.Compact, ch.Bare = metric(x), metric(b)
			// A bare floor at or below zero (noise at tiny costs) would make
			// the ratio meaningless; floor it at 10 µs.
			den := ch.Bare
			if unit == "ms" && den < 0.01 {
				den = 0.01
			}
			ch.Ratio = ch.Compact / den
			pass := ch.Ratio <= limit
			if !atMost {
				pass = ch.Ratio >= limit
			}
			ch.Status = map[bool]string{true: "PASS", false: "MISS"}[pass]
			num := "%.2f"
			if unit != "ms" {
				num = "%.1f"
			}
			ch.Detail = fmt.Sprintf("compactproxy "+num+" %s / bare "+num+" %s", ch.Compact, unit, ch.Bare, unit)
			if x.Errors > 0 {
				ch.Detail += fmt.Sprintf(" (compactproxy had %d errors)", x.Errors)
			}
		}
		rep.Checks = append(rep.Checks, ch)
	}
	added50 := func(s *cellStat) float64 { return s.AddedP50 }
	rps := func(s *cellStat) float64 { return s.RPS }
	ttfb := func(s *cellStat) float64 { return s.AddedTTFB50 }
	addCheck("16KB c=1: added p50 <= 1.5x bare", "16KB", 1, 1.5, true, added50, "ms")
	addCheck("16KB c=32: throughput >= 0.9x bare", "16KB", 32, 0.9, false, rps, "req/s")
	addCheck("16KB stream c=1: added TTFB p50 <= 1.5x bare", "16KB-stream", 1, 1.5, true, ttfb, "ms")
	addCheck("1MiB c=1: added p50 <= 3x bare", "1MiB", 1, 3, true, added50, "ms")
	addCheck("1MiB c=32: throughput >= 0.8x bare", "1MiB", 32, 0.8, false, rps, "req/s")
	return rep
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func (r *report) text() string {
	var b strings.Builder
	fmt.Fprintf(&b, "\ncompactproxy load harness — %s, %s, %d CPUs, %d interleaved rounds; mock latency is in every number\n", r.Time, r.GoVersion, r.CPUs, r.Rounds)
	if r.Note != "" {
		fmt.Fprintf(&b, "note: %s\n", r.Note)
	}
	for name, why := range r.Failed {
		fmt.Fprintf(&b, "FAILED TARGET %s: %s\n", name, why)
	}
	f := func(v float64) string {
		if v < 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", v)
	}
	sgn := func(v float64) string { return fmt.Sprintf("%+.2f", v) }
	var last string
	for _, c := range r.Cells {
		head := fmt.Sprintf("%s c=%d", c.Scenario, c.Concurrency)
		stream := strings.HasSuffix(c.Scenario, "-stream")
		if head != last {
			last = head
			fmt.Fprintf(&b, "\n%s (%d-byte body)\n", head, r.Bodies[c.Scenario])
			fmt.Fprintf(&b, "  %-13s %6s %8s %8s %8s %8s", "target", "reqs", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms")
			if stream {
				fmt.Fprintf(&b, " %8s %9s %9s", "ttfb50", "+ttfb50", "+ttfb99")
			}
			fmt.Fprintf(&b, " %9s %8s %8s %11s %s\n", "req/s", "x direct", "x bare", "cpu ms/req", "errors")
		}
		fmt.Fprintf(&b, "  %-13s %6d %8.2f %8.2f %8s %8s", c.Target, c.Requests, c.P50, c.P99, sgn(c.AddedP50), sgn(c.AddedP99))
		if stream {
			fmt.Fprintf(&b, " %8.2f %9s %9s", c.TTFBP50, sgn(c.AddedTTFB50), sgn(c.AddedTTFB99))
		}
		fmt.Fprintf(&b, " %9.1f %8.3f %8.3f %11s %d", c.RPS, c.RelDirect, c.RelBare, f(c.CPUPerReqMs), c.Errors)
		if c.Compacted > 0 {
			fmt.Fprintf(&b, " (%d compacted: not the pass-through path!)", c.Compacted)
		}
		if c.FirstError != "" {
			fmt.Fprintf(&b, " first error: %.120s", c.FirstError)
		}
		b.WriteByte('\n')
	}
	if r.Agent != nil {
		r.Agent.text(&b)
	}
	fmt.Fprintf(&b, "\ntargets (issue 2: compactproxy vs the bare reverse proxy; issue 11 cross: the crossing request vs the steps below the trigger; same run):\n")
	for _, c := range r.Checks {
		if c.Status == "FAIL" {
			fmt.Fprintf(&b, "  %-4s %-46s %s\n", c.Status, c.Name, c.Detail)
			continue
		}
		fmt.Fprintf(&b, "  %-4s %-46s ratio %.2f  (%s)\n", c.Status, c.Name, c.Ratio, c.Detail)
	}
	return b.String()
}

func (r *report) write(dir, text string) error {
	if err := ensureDir(dir); err != nil {
		return err
	}
	stamp := time.Now().UTC().Format("20060102T150405Z")
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{
		"bench-" + stamp + ".json": js,
		"bench-" + stamp + ".txt":  []byte(text),
		"latest.json":              js,
		"latest.txt":               []byte(text),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return err
		}
	}
	fmt.Printf("\nresults: %s\n", filepath.Join(dir, "bench-"+stamp+".{json,txt}"))
	return nil
}

// addAgent runs the agent scenarios against compactproxy (when it runs) and
// adds their results and issue 11's crossing check to the report.
func (r *report) addAgent(direct, cp *target, o agentOpts, cross, compact bool) {
	const crossCheck = "cross: crossing added p50 <= 1.5x below trigger"
	if cp == nil || cp.failed || direct == nil || direct.failed {
		if cross {
			r.Checks = append(r.Checks, check{Name: crossCheck, Limit: 1.5, AtMost: true, Status: "FAIL", Detail: "compactproxy or the mock failed"})
		}
		return
	}
	nonce := strconv.FormatInt(time.Now().UnixNano(), 36)
	r.Agent = &agentReport{SummarizerLatencyMs: ms(o.sumLatency), ThinkMs: ms(o.think)}
	if cross {
		fmt.Printf("loadgen: cross: %d passes of %d agents, think %v\n", o.passes, o.agents, o.think)
		c := runCross(direct, cp, o, nonce)
		r.Agent.Cross = c
		ch := check{Name: crossCheck, Limit: 1.5, AtMost: true, Compact: c.CrossAdded50, Bare: c.BelowAdded50}
		switch {
		case c.Crossings == 0 || c.BelowN == 0:
			ch.Status, ch.Detail = "FAIL", fmt.Sprintf("not measured: %d crossings, %d samples below, %d errors", c.Crossings, c.BelowN, c.Errors)
		default:
			// The same 10 µs floor as the other added-latency checks.
			ch.Ratio = c.CrossAdded50 / max(c.BelowAdded50, 0.01)
			ch.Status = map[bool]string{true: "PASS", false: "MISS"}[ch.Ratio <= ch.Limit]
			ch.Detail = fmt.Sprintf("crossing %+.2f ms / below %+.2f ms; crossings %v", c.CrossAdded50, c.BelowAdded50, c.Actions)
		}
		r.Checks = append(r.Checks, ch)
	}
	if compact {
		fmt.Printf("loadgen: 1MiB-compaction: %d conversations, %d re-applied steps each\n", o.convs, o.steps)
		r.Agent.Compact = runCompaction(direct, cp, o, nonce)
	}
}
