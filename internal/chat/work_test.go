package chat

import (
	"runtime"
	"strings"
	"testing"
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

// checkLinearWork fails t when f, run on an input of n bytes, allocates
// more than the linear budget: the fuzzers' bound on the work per input,
// so a body that costs more than linear time fails without a clock.
func checkLinearWork(t *testing.T, n int, f func()) {
	t.Helper()
	if a := allocated(f); a > workBase+workPerByte*uint64(n) {
		t.Fatalf("%d bytes allocated for %d bytes of input (%.0f per byte): more than linear work", a, n, float64(a)/float64(max(n, 1)))
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
