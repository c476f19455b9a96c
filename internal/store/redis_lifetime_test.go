package store

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
)

// pttl is the remaining TTL of a Redis key in ms (-2: absent).
func pttl(t *testing.T, rd *storetest.Redis, key string) int {
	t.Helper()
	line, err := rd.Do("PTTL", key)
	if err != nil {
		t.Fatal(err)
	}
	ms, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, ":")))
	return ms
}

// Issue 20 item 4: a conversation's keys share one lifetime. A write of
// either key (an anchor after each response, a compaction record) refreshes
// the TTL of both, so a conversation that keeps re-applying its summary
// never loses it. The aging is simulated with PEXPIRE: no clock involved.
func TestRedisWriteRefreshesSiblingTTL(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), time.Hour, time.Second)
	ctx := context.Background()
	if err := r.UpdateLineages(ctx, "k", saveLineage(lineage(1, "the summary"), 0, true)); err != nil {
		t.Fatal(err)
	}
	for i, tc := range []struct{ aged, write string }{{"cp:r:k", "anchors"}, {"cp:a:k", "lineages"}} {
		if _, err := rd.Do("PEXPIRE", tc.aged, "10000"); err != nil {
			t.Fatal(err)
		}
		var err error
		if tc.write == "anchors" {
			err = r.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 4 + i, Input: 400 + i}))
		} else {
			err = r.UpdateLineages(ctx, "k", saveLineage(lineage(2, "another"), 0, true))
		}
		if err != nil {
			t.Fatal(err)
		}
		if ms := pttl(t, rd, tc.aged); ms < int(30*time.Minute/time.Millisecond) {
			t.Errorf("a write of the %s left %s with PTTL %d ms: the conversation's keys do not share one lifetime", tc.write, tc.aged, ms)
		}
	}
}

// Suspicion: Load kept a partially decoded lineage list (the readable ones,
// the broken one half read, zero values for the rest), and the next write
// re-encoded it. An unreadable value reads as absent, whole.
func TestRedisUnreadableLineagesReadAsAbsent(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), time.Hour, time.Second)
	ctx := context.Background()
	good := encodeLineages([]compaction.Lineage{lineage(1, "one"), lineage(2, "two"), lineage(3, "three")})
	cut := good[:bytes.Index(good, []byte("three"))+2] // ends inside the third summary
	texts := map[uint64]string{1: "one", 2: "two", 3: "three", 4: "four"}
	whole := func(ls []compaction.Lineage) bool {
		for _, l := range ls {
			if l.State.Summary == nil || l.State.Summary.Text != texts[l.ID] {
				return false
			}
		}
		return true
	}
	if _, err := rd.Do("SET", "cp:r:k", string(cut)); err != nil {
		t.Fatal(err)
	}
	c, _, err := r.Load(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if !whole(c.Lineages) {
		t.Fatalf("Load returned a partially decoded lineage list: %+v", c.Lineages)
	}
	if err := r.UpdateLineages(ctx, "k", saveLineage(lineage(4, "four"), 0, true)); err != nil {
		t.Fatal(err)
	}
	c, _, err = r.Load(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if !whole(c.Lineages) || len(c.Lineages) == 0 {
		t.Fatalf("a write re-encoded a partially decoded list: %+v", c.Lineages)
	}
}
