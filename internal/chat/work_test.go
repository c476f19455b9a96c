package chat

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// nestedCacheControl is a Messages body whose one content block nests
// depth levels of "content" arrays around a cache_control marker (or, with
// key "cache_xxxxxxx", around a member of the same size that is not one).
func nestedCacheControl(depth int, key string) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"text","text":"hi","content":[`)
	for i := 0; i < depth; i++ {
		b.WriteString(`{"content":[`)
	}
	b.WriteString(`{"` + key + `":{"type":"ephemeral"}}`)
	for i := 0; i < depth; i++ {
		b.WriteString(`]}`)
	}
	b.WriteString(`]}]}]}`)
	return []byte(b.String())
}

// allocated is the heap bytes f allocates: a count of work that does not
// depend on the machine's speed or load, unlike a clock.
func allocated(f func()) uint64 {
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	f()
	runtime.ReadMemStats(&m1)
	return m1.TotalAlloc - m0.TotalAlloc
}

// The linear work budget of parsing n bytes: workBase + workPerByte*n
// bytes allocated. Measured: ~1.3 KB for an empty body; at most ~52
// bytes per byte (a Messages body nesting content 4,800 deep, through
// encoding/json), 10.7 for a 1 MiB agent body. A quadratic parse of the
// 68 KB nested body allocated 17,000 per byte.
const (
	workBase    = 64 << 10
	workPerByte = 128
)

// The linear CPU budget of parsing n bytes, in the parsing thread's own CPU
// time (not a clock: another process on a loaded machine does not add to
// it): cpuBase + cpuPerByte*n. Generous: -race parses a 1 MiB agent body in
// tens of milliseconds (well under a microsecond a byte), while the
// quadratic digest of the 68 KB nested body took 2.5 s (36 µs a byte)
// without -race. An allocation-free superlinear loop, which the allocation
// bound cannot see, trips this one.
const (
	cpuBase    = 250 * time.Millisecond
	cpuPerByte = 5 * time.Microsecond
)

// checkLinearWork fails t when f, run on an input of n bytes, allocates
// more than the linear budget or spends more than the linear CPU budget:
// the fuzzers' bound on the work per input, so a body that costs more than
// linear time fails.
func checkLinearWork(t *testing.T, n int, f func()) {
	t.Helper()
	if problem := linearWorkProblem(n, f); problem != "" {
		t.Fatal(problem)
	}
}

// linearWorkProblem runs f, the work for an input of n bytes, and says how
// it went over the linear budgets ("" when it did not).
func linearWorkProblem(n int, f func()) string {
	var a uint64
	cpu, measured := threadCPU(func() { a = allocated(f) })
	if a > workBase+workPerByte*uint64(n) {
		return fmt.Sprintf("%d bytes allocated for %d bytes of input (%.0f per byte): more than linear work", a, n, float64(a)/float64(max(n, 1)))
	}
	if limit := cpuBase + cpuPerByte*time.Duration(n); measured && cpu > limit {
		return fmt.Sprintf("%v of CPU for %d bytes of input (over %v): more than linear work", cpu, n, limit)
	}
	return ""
}

// TestLinearWorkBoundSeesCPU: work that allocates nothing but spends CPU
// superlinearly (here: twice the base budget on a 1-byte input) is caught
// by the CPU bound, which the allocation bound alone would let through.
func TestLinearWorkBoundSeesCPU(t *testing.T) {
	if _, measured := threadCPU(func() {}); !measured {
		t.Skip("no per-thread CPU time on this platform")
	}
	spin := func() { // runs on threadCPU's locked thread: spins 2*cpuBase of its CPU
		start, _ := threadCPUNow()
		x := 0
		for now, _ := threadCPUNow(); now-start < 2*cpuBase; now, _ = threadCPUNow() {
			for i := 0; i < 1000; i++ {
				x += i
			}
		}
		_ = x
	}
	if problem := linearWorkProblem(1, spin); !strings.Contains(problem, "of CPU") {
		t.Fatalf("a %v CPU spin on a 1-byte input: problem %q, want the CPU bound to trip", 2*cpuBase, problem)
	}
}

// TestNestedCacheControlLinear: a deeply nested cache_control costs the
// parse about what the same body without the key costs (it was digested
// once per nesting level: quadratic, 2.5 s of CPU for 68 KB).
func TestNestedCacheControlLinear(t *testing.T) {
	const depth = 4800 // ~68 KB
	with, without := nestedCacheControl(depth, "cache_control"), nestedCacheControl(depth, "cache_xxxxxxx")
	parse := func(body []byte) func() {
		return func() {
			if _, err := ParseDialect(DialectMessages, body); err != nil {
				t.Fatal(err)
			}
		}
	}
	a, b := allocated(parse(with)), allocated(parse(without))
	t.Logf("body %d bytes: %d bytes allocated with the marker, %d without", len(with), a, b)
	if a > 3*b {
		t.Errorf("parsing with a nested cache_control allocates %.1fx what the same body without it does (%d vs %d bytes); want linear work", float64(a)/float64(b), a, b)
	}
}
