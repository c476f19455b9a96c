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
// depend on the machine's speed.
func allocated(f func()) uint64 {
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	f()
	runtime.ReadMemStats(&m1)
	return m1.TotalAlloc - m0.TotalAlloc
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
