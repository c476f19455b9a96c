package compaction

import (
	"time"

	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
)

func digestChain(tag byte, n int, shared int) []anchor.Digest {
	c := make([]anchor.Digest, n+1)
	for i := range c {
		c[i][0] = byte(i)
		if i > shared {
			c[i][1] = tag
		}
	}
	return c
}

func TestSelectLineage(t *testing.T) {
	a := digestChain('a', 10, 2) // worker A: shares d0..d2 with B
	b := digestChain('b', 10, 2)
	ls := []Lineage{
		{ID: 1, TipLen: 6, Tip: a[6], Used: 10},
		{ID: 2, TipLen: 6, Tip: b[6], Used: 20},
		{ID: 3, TipLen: 2, Tip: a[2], Used: 30}, // the shared template
	}
	cases := []struct {
		name  string
		chain []anchor.Digest
		want  int
	}{
		{"A extends its tip", a[:9], 0},
		{"B extends its tip", b[:9], 1},
		{"same request again", a[:7], 0},
		{"only the template matches", digestChain('c', 8, 2), 2},
		{"shorter than every tip but the template's", a[:5], 2},
		{"nothing matches", digestChain('c', 8, 0)[:2], -1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := SelectLineage(ls, tc.chain); got != tc.want {
				t.Fatalf("got %d want %d", got, tc.want)
			}
		})
	}
	// A client that rewound past its tip still finds its summary.
	ls2 := []Lineage{
		{ID: 1, TipLen: 9, Tip: a[9], State: State{Summary: &Summary{Cut: 5, Head: a[5]}}},
		{ID: 2, TipLen: 9, Tip: b[9], State: State{Trims: []Trim{{Index: 3, Prefix: b[4]}}}},
	}
	edited := append(append([]anchor.Digest{}, a[:7]...), digestChain('e', 8, 0)[7:]...)
	if got := SelectLineage(ls2, edited); got != 0 {
		t.Fatalf("rewound client: got lineage %d, want 0 (its summary matches)", got)
	}
	if got := SelectLineage(ls2, digestChain('z', 9, 2)); got != -1 {
		t.Fatalf("a third worker got lineage %d, want a new one", got)
	}
}

func TestSaveLineage(t *testing.T) {
	var ls []Lineage
	for i := range MaxLineages + 2 {
		var ok bool
		ls, ok = SaveLineage(ls, Lineage{ID: uint64(i + 1), Used: int64(100 + i)}, 0, false)
		if !ok {
			t.Fatalf("new lineage %d not stored", i)
		}
	}
	if len(ls) != MaxLineages {
		t.Fatalf("%d lineages, want %d", len(ls), MaxLineages)
	}
	for _, l := range ls {
		if l.ID <= 2 {
			t.Fatalf("lineage %d survived: the least recently used go first", l.ID)
		}
		if l.Gen != 1 {
			t.Fatalf("new lineage at generation %d", l.Gen)
		}
	}
	// A save computed from generation 1 applies once; a second one from
	// the same generation is stale; a summarize result (force) applies.
	before := ls
	ls, ok := SaveLineage(ls, Lineage{ID: 5, Used: 200, State: State{LatchCount: 1}}, 1, false)
	if !ok || ls[2].Gen != 2 || before[2].Gen != 1 {
		t.Fatalf("first save: ok %v gen %d (the input must not change: %d)", ok, ls[2].Gen, before[2].Gen)
	}
	if _, ok := SaveLineage(ls, Lineage{ID: 5, Used: 201}, 1, false); ok {
		t.Fatal("a stale save applied")
	}
	sum := &Summary{Cut: 3, Text: "s"}
	ls, ok = SaveLineage(ls, Lineage{ID: 5, Used: 202, State: State{Summary: sum, Anchors: []anchor.Anchor{{PrefixLen: 1}}}}, 1, true)
	if !ok || ls[2].State.Summary == nil || ls[2].Gen != 3 || ls[2].State.Anchors != nil {
		t.Fatalf("forced save: ok %v %+v", ok, ls[2])
	}
	sum.Text = "changed"
	if ls[2].State.Summary.Text != "s" {
		t.Fatal("the stored lineage shares the caller's summary")
	}
}

// A background summary takes seconds; a request of the same lineage that
// saved meanwhile (new trims) used to make the background save stale, and
// the summary was discarded: the request that crossed the trigger then paid
// for a summary of its own, on the step after the background one (the real
// 8k large-step llama run: summarize calls on steps 32 and 34, the
// background one lost). MergeBackground keeps both.
func TestMergeBackgroundKeepsWhatRequestsSaved(t *testing.T) {
	d := func(b byte) anchor.Digest { return anchor.Digest{b} }
	base := Lineage{ID: 7, TipLen: 10, Tip: d(1), Gen: 3, State: State{Summary: &Summary{Cut: 4, Head: d(2), Text: "old"}}}
	// A request saved new trims since the background run loaded gen 3.
	saved, ok := SaveLineage([]Lineage{base}, Lineage{ID: 7, TipLen: 12, Tip: d(3), State: State{
		Summary: base.State.Summary, Trims: []Trim{{Index: 6, Prefix: d(4), Keep: 512}}}}, 3, false)
	if !ok {
		t.Fatal("setup: the request's save was refused")
	}
	attempt := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	bg := Lineage{ID: 7, TipLen: 10, Tip: d(1), State: State{Summary: base.State.Summary,
		Pending: &Summary{Cut: 8, Head: d(5), Text: "new"}, LastAttempt: attempt, LastAttemptCount: 10}}
	if _, ok := SaveLineage(saved, bg, 3, false); ok {
		t.Fatal("setup: a save from the older generation should be stale")
	}
	got := MergeBackground(saved, bg)
	if len(got) != 1 {
		t.Fatalf("%d lineages", len(got))
	}
	st := got[0].State
	if st.Pending == nil || st.Pending.Text != "new" {
		t.Fatal("the background summary was lost")
	}
	if len(st.Trims) != 1 || got[0].TipLen != 12 {
		t.Fatalf("what the request saved was lost: trims %v, tip %d", st.Trims, got[0].TipLen)
	}
	if !st.LastAttempt.Equal(attempt) || st.LastAttemptCount != 10 {
		t.Fatal("the background attempt is not recorded (the throttle)")
	}
	if got[0].Gen <= saved[0].Gen {
		t.Fatal("the merge did not advance the generation")
	}
}
