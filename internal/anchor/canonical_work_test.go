package anchor

import (
	"strings"
	"testing"
)

// TestCanonicalDeepNestingLinear: objects nested deep, none in canonical
// order, with a long value at the bottom, are canonicalized with work
// linear in their size (each object was reordered by copying all it holds:
// 4 s for a 2 MB message nesting 2,000 deep).
func TestCanonicalDeepNestingLinear(t *testing.T) {
	for _, depth := range []int{10, 1000, 5000} {
		raw := `{"role":"user","content":"x","zz":` + strings.Repeat(`{"z":1,"a":`, depth) + `"` + strings.Repeat("x", 100_000) + `"` + strings.Repeat(`}`, depth) + `}`
		c := new(canonicalizer)
		out, err := c.run(nil, []byte(raw), true)
		if err != nil {
			t.Fatal(err)
		}
		if c.moved > 2*len(out) {
			t.Errorf("depth %d: %d bytes moved for a canonical form of %d: more than linear work", depth, c.moved, len(out))
		}
		want := `{"content":"x","role":"user","zz":` + strings.Repeat(`{"a":`, depth) + `"` + strings.Repeat("x", 100_000) + `"` + strings.Repeat(`,"z":1}`, depth) + `}`
		if string(out) != want {
			t.Errorf("depth %d: canonical form is not the sorted one", depth)
		}
	}
}
