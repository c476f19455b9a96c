package store

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
)

func openTestRedis(t *testing.T, url string, ttl, timeout time.Duration) *Redis {
	t.Helper()
	r, err := OpenRedis(RedisOptions{URL: url, Prefix: "cp:", TTL: ttl, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// Every key carries the TTL: state never outlives store.ttl in Redis.
func TestRedisKeysExpire(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), 300*time.Millisecond, time.Second)
	ctx := context.Background()
	if err := r.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 2})); err != nil {
		t.Fatal(err)
	}
	if err := r.UpdateLineages(ctx, "k", saveLineage(lineage(1, "s"), 0, true)); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"cp:a:k", "cp:r:k"} {
		line, err := rd.Do("PTTL", k)
		if err != nil {
			t.Fatal(err)
		}
		ms, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, ":")))
		if ms <= 0 || ms > 300 {
			t.Fatalf("%s: PTTL %d, want (0, 300]", k, ms)
		}
	}
	time.Sleep(400 * time.Millisecond)
	if _, ok, err := r.Load(ctx, "k"); ok || err != nil {
		t.Fatalf("state outlived its TTL: ok %v err %v", ok, err)
	}
}

// Redis down: operations fail within the timeout, then fail fast without
// a round trip; once Redis is back, the backend recovers by itself.
func TestRedisOutageAndRecovery(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), time.Hour, 200*time.Millisecond)
	r.pause = 200 * time.Millisecond
	ctx := context.Background()
	if err := r.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 2})); err != nil {
		t.Fatal(err)
	}
	rd.Stop()
	start := time.Now()
	if _, _, err := r.Load(ctx, "k"); err == nil {
		t.Fatal("load from a stopped Redis succeeded")
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("a failed load took %v (timeout 200ms)", d)
	}
	start = time.Now()
	_, _, err := r.Load(ctx, "k")
	if !errors.Is(err, ErrUnavailable) || time.Since(start) > 20*time.Millisecond {
		t.Fatalf("second load: %v after %v, want ErrUnavailable at once", err, time.Since(start))
	}
	if _, _, err := r.Lease(ctx, "l", time.Second); err == nil {
		t.Fatal("lease while down")
	}
	rd.Start()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, err = r.Load(ctx, "k"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := r.UpdateLineages(ctx, "k", saveLineage(lineage(1, "s"), 0, true)); err != nil {
		t.Fatalf("write after recovery: %v", err)
	}
}

// DESIGN § State: per conversation ≤ 2 KiB excluding summary text and trim
// records, as Redis itself accounts it (MEMORY USAGE of both keys) and as
// bolt stores it. A full conversation: 4 anchors and 8 lineages, each with
// a summary's metadata, a drop, a latch and a throttle.
func TestConversationSize(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), 24*time.Hour, time.Second)
	b, err := OpenBolt(t.TempDir()+"/size.db", BoltOptions{TTL: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	full := func(n int) (string, []anchor.Anchor, []compaction.Lineage) {
		var as []anchor.Anchor
		for i := range compaction.MaxAnchors {
			var d anchor.Digest
			for j := range d {
				d[j] = byte(200 + i + j)
			}
			as = append(as, anchor.Anchor{PrefixLen: 1000 + i, Prefix: d, Input: 120000 + i, Output: 4000, At: time.Now().Unix()})
		}
		var ls []compaction.Lineage
		for i := range n {
			var d anchor.Digest
			for j := range d {
				d[j] = byte(i*7 + j + 1)
			}
			ls = append(ls, compaction.Lineage{ID: uint64(i+1) << 56, TipLen: 1200, Tip: d, Gen: 40000, Used: time.Now().Unix(),
				State: compaction.State{
					Summary: &compaction.Summary{Cut: 900, Head: d, Lead: 2, Ask: 850, Ack: true},
					Drops:   []compaction.Drop{{From: 2, To: 400, Prefix: d}},
					Latched: true, LatchCount: 1100, LastAttempt: time.Now(), LastAttemptCount: 1150,
				}})
		}
		return "t:" + strings.Repeat("ab", 32) + "|" + strings.Repeat("cd", 16), as, ls
	}
	for _, n := range []int{1, compaction.MaxLineages} {
		key, as, ls := full(n)
		for _, be := range []Backend{r, b} {
			if err := be.UpdateAnchors(ctx, key, func([]anchor.Anchor) ([]anchor.Anchor, bool) { return as, true }); err != nil {
				t.Fatal(err)
			}
			if err := be.UpdateLineages(ctx, key, func([]compaction.Lineage) ([]compaction.Lineage, bool) { return ls, true }); err != nil {
				t.Fatal(err)
			}
		}
		enc := len(encodeAnchors(as)) + len(encodeLineages(ls))
		mem, err := r.MemoryUsage(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		bv := b.ValueSize(key)
		t.Logf("conversation with %d lineage(s), 4 anchors: encoded %d B, redis MEMORY USAGE %d B (2 keys), bolt value %d B (+ key %d B)", n, enc, mem, bv, len(key))
		if mem > 2048 || bv+len(key) > 2048 {
			t.Errorf("%d lineages: over 2 KiB (redis %d B, bolt %d B)", n, mem, bv+len(key))
		}
	}
}

// BenchmarkRedisLoad is one request's read (MGET of both keys) against a
// local redis-server: the round trip the redis backend adds per request.
func BenchmarkRedisLoad(b *testing.B) {
	rd := storetest.StartRedis(b)
	r, err := OpenRedis(RedisOptions{URL: rd.URL(), Prefix: "cp:", TTL: time.Hour, Timeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	_ = r.UpdateLineages(ctx, "k", saveLineage(lineage(1, "a summary"), 0, true))
	_ = r.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 3}))
	b.ResetTimer()
	for b.Loop() {
		if _, _, err := r.Load(ctx, "k"); err != nil {
			b.Fatal(err)
		}
	}
}

// A slow Redis (DEBUG SLEEP blocks the server): each operation gives up at
// the timeout instead of waiting, and the backend comes back after it.
func TestRedisSlow(t *testing.T) {
	rd := storetest.StartRedis(t)
	r := openTestRedis(t, rd.URL(), time.Hour, 100*time.Millisecond)
	r.pause = 50 * time.Millisecond
	ctx := context.Background()
	if err := r.UpdateAnchors(ctx, "k", addAnchor(anchor.Anchor{PrefixLen: 2})); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := rd.Do("DEBUG", "SLEEP", "0.6"); done <- err }()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	_, _, err := r.Load(ctx, "k")
	if err == nil {
		t.Fatal("a load from a sleeping Redis succeeded")
	}
	if d := time.Since(start); d > 400*time.Millisecond {
		t.Fatalf("a load took %v with store.timeout 100ms", d)
	}
	if err := <-done; err != nil {
		t.Fatalf("DEBUG SLEEP: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	if c, ok, err := r.Load(ctx, "k"); err != nil || !ok || len(c.Anchors) != 1 {
		t.Fatalf("after the stall: %v %v %+v", ok, err, c)
	}
}
