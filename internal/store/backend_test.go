package store

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
)

// backends returns one fresh backend of each kind, plus a second handle on
// the same state where the kind allows it (a second replica on one Redis).
type backendCase struct {
	name   string
	open   func(t *testing.T) Backend
	second func(t *testing.T) Backend // nil: single-process backend
}

func backendCases(t *testing.T) []backendCase {
	ttl := time.Hour
	var rd *storetest.Redis
	var prefix string
	openRedis := func(t *testing.T) Backend {
		r, err := OpenRedis(RedisOptions{URL: rd.URL(), Prefix: prefix, TTL: ttl, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	return []backendCase{
		{name: "memory", open: func(t *testing.T) Backend { return NewMemoryBackend(100, ttl) }},
		{name: "bolt", open: func(t *testing.T) Backend {
			b, err := OpenBolt(filepath.Join(t.TempDir(), "state.db"), BoltOptions{MaxEntries: 100, TTL: ttl})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { b.Close() })
			return b
		}},
		{name: "redis", open: func(t *testing.T) Backend {
			rd = storetest.StartRedis(t)
			prefix = "test:" + strings.ReplaceAll(t.Name(), "/", "_") + ":"
			return openRedis(t)
		}, second: openRedis},
	}
}

func lineage(id uint64, text string) compaction.Lineage {
	var d anchor.Digest
	d[0] = byte(id)
	return compaction.Lineage{ID: id, TipLen: 5, Tip: d, Used: int64(id),
		State: compaction.State{Summary: &compaction.Summary{Cut: 3, Head: d, Lead: 1, Text: text, Ask: -1}}}
}

func addAnchor(a anchor.Anchor) func([]anchor.Anchor) ([]anchor.Anchor, bool) {
	return func(as []anchor.Anchor) ([]anchor.Anchor, bool) { return compaction.MergeAnchor(as, a), true }
}

func saveLineage(l compaction.Lineage, base uint32, force bool) func([]compaction.Lineage) ([]compaction.Lineage, bool) {
	return func(ls []compaction.Lineage) ([]compaction.Lineage, bool) {
		return compaction.SaveLineage(ls, l, base, force)
	}
}

func TestBackends(t *testing.T) {
	for _, bc := range backendCases(t) {
		t.Run(bc.name, func(t *testing.T) {
			ctx := context.Background()
			b := bc.open(t)
			if _, ok, err := b.Load(ctx, "t:1|c"); ok || err != nil {
				t.Fatalf("absent key: ok %v err %v", ok, err)
			}

			// Issue 10 item 2: the summarize loaded the state before a
			// response recorded its anchor; its save must keep the anchor.
			if err := b.UpdateAnchors(ctx, "t:1|c", addAnchor(anchor.Anchor{PrefixLen: 3, Input: 30})); err != nil {
				t.Fatal(err)
			}
			// The summarize's read (redis: it also primes the compare-and-set).
			if _, _, err := b.Load(ctx, "t:1|c"); err != nil {
				t.Fatal(err)
			}
			other := b
			if bc.second != nil {
				other = bc.second(t) // the response lands on another replica
			}
			if err := other.UpdateAnchors(ctx, "t:1|c", addAnchor(anchor.Anchor{PrefixLen: 7, Input: 70})); err != nil {
				t.Fatal(err)
			}
			if err := b.UpdateLineages(ctx, "t:1|c", saveLineage(lineage(1, "summary one"), 0, true)); err != nil {
				t.Fatal(err)
			}
			got, ok, err := b.Load(ctx, "t:1|c")
			if err != nil || !ok {
				t.Fatalf("load: %v %v", ok, err)
			}
			if len(got.Anchors) != 2 || got.Anchors[0].PrefixLen != 7 || got.Anchors[1].PrefixLen != 3 {
				t.Fatalf("anchors %+v, want [7 3]", got.Anchors)
			}
			if len(got.Lineages) != 1 || got.Lineages[0].State.Summary == nil || got.Lineages[0].State.Summary.Text != "summary one" {
				t.Fatalf("lineages %+v", got.Lineages)
			}

			// Concurrent writers of different lineages (two replicas when
			// the backend is shared): nobody's save is lost.
			var wg sync.WaitGroup
			errs := make(chan error, 16)
			for i := range 7 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					w := b
					if bc.second != nil && i%2 == 1 {
						w = other
					}
					errs <- w.UpdateLineages(ctx, "t:1|c", saveLineage(lineage(uint64(10+i), fmt.Sprint("s", i)), 0, false))
					errs <- w.UpdateAnchors(ctx, "t:1|c", addAnchor(anchor.Anchor{PrefixLen: 20 + i}))
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			got, _, _ = b.Load(ctx, "t:1|c")
			if len(got.Lineages) != compaction.MaxLineages {
				t.Fatalf("%d lineages after 8 writers, want %d", len(got.Lineages), compaction.MaxLineages)
			}
			if len(got.Anchors) != compaction.MaxAnchors {
				t.Fatalf("%d anchors, want %d", len(got.Anchors), compaction.MaxAnchors)
			}

			// Leases: one holder; release only by the holder.
			rel, ok, err := b.Lease(ctx, "t:1|c|1", time.Minute)
			if err != nil || !ok {
				t.Fatalf("lease: %v %v", ok, err)
			}
			if _, ok, _ := other.Lease(ctx, "t:1|c|1", time.Minute); ok {
				t.Fatal("a second holder got the lease")
			}
			rel()
			rel2, ok, _ := other.Lease(ctx, "t:1|c|1", time.Minute)
			if !ok {
				t.Fatal("the lease was not released")
			}
			rel() // the first holder again: must not free the second's
			if _, ok, _ := b.Lease(ctx, "t:1|c|1", time.Minute); ok {
				t.Fatal("a former holder released the current holder's lease")
			}
			rel2()
			// A holder that dies: the lease expires by itself.
			if _, ok, _ := b.Lease(ctx, "t:1|c|2", 50*time.Millisecond); !ok {
				t.Fatal("lease 2")
			}
			time.Sleep(120 * time.Millisecond)
			if _, ok, _ := other.Lease(ctx, "t:1|c|2", time.Minute); !ok {
				t.Fatal("an expired lease was not free")
			}

			if err := b.Delete(ctx, "t:1|c"); err != nil {
				t.Fatal(err)
			}
			if _, ok, _ := other.Load(ctx, "t:1|c"); ok {
				t.Fatal("deleted state still loads")
			}
		})
	}
}
