package store

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
)

// Issue 20 item 5: the sweep deletes an entry only if it is still expired
// inside the write transaction that deletes it; a request that wrote it
// between the sweep's read and its delete keeps its state.
func TestBoltSweepKeepsAFreshWrite(t *testing.T) {
	b, err := OpenBolt(filepath.Join(t.TempDir(), "state.db"), BoltOptions{TTL: time.Minute, SweepInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	now := time.Unix(1_000_000, 0)
	b.now = func() time.Time { return now }
	if err := b.UpdateLineages(ctx, "k", saveLineage(lineage(1, "the summary"), 0, true)); err != nil {
		t.Fatal(err)
	}
	now = now.Add(2 * time.Minute) // expired
	b.sweepGap = func() {
		// A request writes its anchor while the sweep is between its read
		// and its delete.
		if err := b.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 4, Input: 400})); err != nil {
			t.Error(err)
		}
	}
	if _, _, err := b.Sweep(); err != nil {
		t.Fatal(err)
	}
	c, ok, err := b.Load(ctx, "k")
	if err != nil || !ok || len(c.Anchors) != 1 || c.Anchors[0].Input != 400 {
		t.Fatalf("the sweep deleted a fresh write: ok %v err %v %+v", ok, err, c)
	}
}
