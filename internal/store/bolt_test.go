package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	bolt "go.etcd.io/bbolt"
)

// A reopened file has what was written before the process ended.
func TestBoltSurvivesReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	ctx := context.Background()
	b, err := OpenBolt(path, BoltOptions{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.UpdateLineages(ctx, "k", saveLineage(lineage(3, "the summary"), 0, true)); err != nil {
		t.Fatal(err)
	}
	if err := b.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 9, Input: 900})); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenBolt(path, BoltOptions{LockTimeout: 50 * time.Millisecond}); err == nil {
		t.Fatal("a second process opened the same file")
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	b, err = OpenBolt(path, BoltOptions{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	c, ok, err := b.Load(ctx, "k")
	if err != nil || !ok || len(c.Lineages) != 1 || c.Lineages[0].State.Summary.Text != "the summary" || len(c.Anchors) != 1 || c.Anchors[0].Input != 900 {
		t.Fatalf("after reopen: ok %v err %v %+v", ok, err, c)
	}
}

// The sweep removes expired entries and, beyond max_entries, the least
// recently written; the file stops growing once entries are recycled.
func TestBoltSweepBoundsGrowth(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	ctx := context.Background()
	b, err := OpenBolt(path, BoltOptions{MaxEntries: 200, TTL: time.Hour, SweepInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	now := time.Unix(1_000_000, 0)
	b.now = func() time.Time { return now }
	write := func(round, n int) {
		for i := range n {
			key := fmt.Sprintf("t:x|r%d-%d", round, i)
			if err := b.UpdateLineages(ctx, key, saveLineage(lineage(1, "a summary of some length, like a real one"), 0, true)); err != nil {
				t.Fatal(err)
			}
			now = now.Add(time.Millisecond)
		}
	}
	write(0, 500)
	removed, left, err := b.Sweep()
	if err != nil || left != 200 || removed != 300 {
		t.Fatalf("max_entries sweep: removed %d left %d err %v, want 300/200", removed, left, err)
	}
	if _, ok, _ := b.Load(ctx, "t:x|r0-0"); ok {
		t.Fatal("the oldest entry survived the bound")
	}
	if _, ok, _ := b.Load(ctx, "t:x|r0-499"); !ok {
		t.Fatal("the newest entry was swept")
	}
	now = now.Add(2 * time.Hour)
	if _, ok, _ := b.Load(ctx, "t:x|r0-499"); ok {
		t.Fatal("an expired entry loads")
	}
	if removed, left, _ = b.Sweep(); removed != 200 || left != 0 {
		t.Fatalf("ttl sweep: removed %d left %d", removed, left)
	}
	// Steady state: rounds of writes and sweeps reuse freed pages.
	var sizes []int64
	for round := 1; round <= 6; round++ {
		write(round, 500)
		now = now.Add(2 * time.Hour)
		if _, _, err := b.Sweep(); err != nil {
			t.Fatal(err)
		}
		st, _ := os.Stat(path)
		sizes = append(sizes, st.Size())
	}
	if sizes[5] > sizes[1] {
		t.Fatalf("file keeps growing across sweeps: %v", sizes)
	}
	t.Logf("file size after each write+sweep round: %v", sizes)
}

// The sweep runs in the background.
func TestBoltBackgroundSweep(t *testing.T) {
	b, err := OpenBolt(filepath.Join(t.TempDir(), "state.db"), BoltOptions{TTL: 30 * time.Millisecond, SweepInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	for i := range 20 {
		if err := b.UpdateAnchors(ctx, fmt.Sprint("k", i), addAnchor(anchor.Anchor{PrefixLen: 1})); err != nil {
			t.Fatal(err)
		}
	}
	count := func() (n int) {
		_ = b.db.View(func(tx *bolt.Tx) error { n = tx.Bucket(boltBucket).Stats().KeyN; return nil })
		return n
	}
	if count() != 20 {
		t.Fatalf("%d entries written", count())
	}
	deadline := time.Now().Add(3 * time.Second)
	for count() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d expired entries still in the file", count())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
