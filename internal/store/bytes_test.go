package store

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/compaction"
)

// Suspicion (issue 20): the memory backend was bounded by entry count, not
// bytes, so max_entries conversations with large summaries held far more
// than max_entries × the per-conversation bound. Its bytes are bounded by
// max_entries × memoryEntryBytes; the least recently used go first.
func TestMemoryBackendBoundedByBytes(t *testing.T) {
	ctx := context.Background()
	const entries = 100
	b := NewMemoryBackend(entries, time.Hour)
	big := strings.Repeat("s", 64<<10) // a 64 KiB summary, far over the per-entry share
	for i := range entries {
		if err := b.UpdateLineages(ctx, fmt.Sprint(i), saveLineage(lineage(1, big), 0, true)); err != nil {
			t.Fatal(err)
		}
	}
	if got, limit := b.Bytes(), int64(entries*memoryEntryBytes); got > limit {
		t.Fatalf("memory backend holds %d bytes, over its bound of %d", got, limit)
	}
	if _, ok, _ := b.Load(ctx, fmt.Sprint(entries-1)); !ok {
		t.Fatal("the newest conversation was evicted")
	}
	if _, ok, _ := b.Load(ctx, "0"); ok {
		t.Fatal("the least recently used conversation was kept past the byte bound")
	}
}

// Suspicion (issue 20): trim records per lineage were unbounded (one per
// long tool result outside the tail). Every backend keeps at most
// maxTrimBytes of them per lineage, the newest (highest index) first.
func TestTrimRecordsBoundedByBytes(t *testing.T) {
	for _, bc := range backendCases(t) {
		t.Run(bc.name, func(t *testing.T) {
			b := bc.open(t)
			ctx := context.Background()
			l := lineage(1, "s")
			for i := range 10000 {
				l.State.Trims = append(l.State.Trims, compaction.Trim{Index: 10 + i, Keep: 100})
			}
			if err := b.UpdateLineages(ctx, "k", saveLineage(l, 0, true)); err != nil {
				t.Fatal(err)
			}
			c, _, err := b.Load(ctx, "k")
			if err != nil || len(c.Lineages) != 1 {
				t.Fatalf("load: %v %+v", err, c.Lineages)
			}
			trims := c.Lineages[0].State.Trims
			if n := len(trims) * trimRecordBytes; n > maxTrimBytes || len(trims) == 0 {
				t.Fatalf("%d trim records (%d bytes) kept, bound %d bytes", len(trims), n, maxTrimBytes)
			}
			if last := trims[len(trims)-1].Index; last != 10+9999 {
				t.Errorf("newest trim record dropped: last index %d", last)
			}
		})
	}
}
