package store

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
)

// A 3-master Redis Cluster: every operation of a conversation (the MGET
// of Load, the compare-and-set script that writes one key and refreshes
// the other's TTL, DEL, the lease) works for conversations spread over
// every master, and a write refreshes the sibling's TTL as on one node.
func TestRedisCluster(t *testing.T) {
	cl := storetest.StartCluster(t, 3)
	r := openTestRedis(t, cl.URL(), time.Hour, 2*time.Second)
	ctx := context.Background()
	nodes := map[string]bool{}
	for i := range 24 {
		key := fmt.Sprintf("t:%064x|%032x", i, i*7919)
		if err := r.UpdateLineages(ctx, key, saveLineage(lineage(1, "the summary"), 0, true)); err != nil {
			t.Fatalf("conversation %d: update lineages: %v", i, err)
		}
		if err := r.UpdateAnchors(ctx, key, addAnchor(anchor.Anchor{PrefixLen: 2, Input: 100 + i})); err != nil {
			t.Fatalf("conversation %d: update anchors: %v", i, err)
		}
		c, ok, err := r.Load(ctx, key)
		if err != nil || !ok || len(c.Anchors) != 1 || len(c.Lineages) != 1 || c.Lineages[0].State.Summary.Text != "the summary" {
			t.Fatalf("conversation %d: load: ok %v err %v %+v", i, ok, err, c)
		}
		// The sibling's lifetime: age the records, write an anchor.
		if err := r.c.PExpire(ctx, r.recordsKey(key), 10*time.Second).Err(); err != nil {
			t.Fatal(err)
		}
		if err := r.UpdateAnchors(ctx, key, addAnchor(anchor.Anchor{PrefixLen: 3, Input: 200 + i})); err != nil {
			t.Fatalf("conversation %d: second anchor: %v", i, err)
		}
		if ttl := r.c.PTTL(ctx, r.recordsKey(key)).Val(); ttl < 30*time.Minute {
			t.Errorf("conversation %d: an anchor write left the records with TTL %v", i, ttl)
		}
		release, ok, err := r.Lease(ctx, key+"|1", time.Minute)
		if err != nil || !ok {
			t.Fatalf("conversation %d: lease: ok %v err %v", i, ok, err)
		}
		if _, again, err := r.Lease(ctx, key+"|1", time.Minute); err != nil || again {
			t.Fatalf("conversation %d: a held lease was taken again (ok %v err %v)", i, again, err)
		}
		release()
		if _, ok, err := r.Lease(ctx, key+"|1", time.Minute); err != nil || !ok {
			t.Fatalf("conversation %d: a released lease could not be taken (ok %v err %v)", i, ok, err)
		}
		if i%2 == 0 {
			if err := r.Delete(ctx, key); err != nil {
				t.Fatalf("conversation %d: delete: %v", i, err)
			}
			if _, ok, err := r.Load(ctx, key); ok || err != nil {
				t.Fatalf("conversation %d: after delete: ok %v err %v", i, ok, err)
			}
		}
		for _, n := range cl.Nodes {
			if got, err := n.Reply("EXISTS", r.anchorsKey(key)); err == nil && len(got) == 1 && got[0] == "1" {
				nodes[n.Addr] = true
			}
		}
	}
	// One seed node is enough: the client learns the others from it.
	one := openTestRedis(t, "redis+cluster://"+cl.Nodes[0].Addr, time.Hour, 2*time.Second)
	for i := 1; i < 24; i += 2 {
		key := fmt.Sprintf("t:%064x|%032x", i, i*7919)
		if c, ok, err := one.Load(ctx, key); err != nil || !ok || len(c.Anchors) != 2 {
			t.Fatalf("conversation %d through one seed node: ok %v err %v %+v", i, ok, err, c)
		}
	}
	if len(nodes) < 2 {
		t.Errorf("the conversations landed on %d of 3 masters: not spread over the cluster", len(nodes))
	}
	for _, k := range []string{r.anchorsKey("t:ab|cd"), r.recordsKey("t:ab|cd")} {
		if !strings.Contains(k, "{t:ab|cd}") {
			t.Errorf("cluster key %q carries no hash tag of the conversation", k)
		}
	}
}

// Sentinel: a master, a replica and two sentinels; the master fails over
// mid-run, by a crash (killed) or by SENTINEL FAILOVER (it stays up as a
// replica and answers writes with READONLY). The backend reaches the new
// master by itself, within a generous deadline; what is written after the
// failover is kept, on the new master.
func TestRedisSentinelFailover(t *testing.T) {
	for _, how := range []string{"killed", "forced"} {
		t.Run(how, func(t *testing.T) {
			sn := storetest.StartSentinel(t, 2)
			r := openTestRedis(t, sn.URL(), time.Hour, time.Second)
			r.pause = 100 * time.Millisecond
			ctx := context.Background()
			if err := r.UpdateLineages(ctx, "t:before|x", saveLineage(lineage(1, "before"), 0, true)); err != nil {
				t.Fatalf("before the failover: %v", err)
			}
			if addr, _ := sn.MasterAddr(); addr != sn.Master.Addr {
				t.Fatalf("master %s, want %s", addr, sn.Master.Addr)
			}
			if how == "killed" {
				sn.KillMaster(t)
			} else {
				sn.Failover(t)
			}
			promoted := time.Now()
			deadline := promoted.Add(30 * time.Second)
			var err error
			failed := 0
			for {
				err = r.UpdateLineages(ctx, "t:after|x", saveLineage(lineage(2, "after"), 0, true))
				if err == nil || time.Now().After(deadline) {
					break
				}
				failed++
				time.Sleep(100 * time.Millisecond)
			}
			t.Logf("first write after the promotion: %v later, %d failed tries before", time.Since(promoted).Round(time.Millisecond), failed)
			if err != nil {
				t.Fatalf("no write within 30 s of the failover: %v", err)
			}
			if err := r.UpdateAnchors(ctx, "t:after|x", addAnchor(anchor.Anchor{PrefixLen: 2})); err != nil {
				t.Fatalf("a second write after the failover: %v", err)
			}
			c, ok, err := r.Load(ctx, "t:after|x")
			if err != nil || !ok || len(c.Lineages) != 1 || c.Lineages[0].State.Summary.Text != "after" || len(c.Anchors) != 1 {
				t.Fatalf("after the failover: ok %v err %v %+v", ok, err, c)
			}
			if got, err := sn.Replica.Reply("EXISTS", r.recordsKey("t:after|x"), r.anchorsKey("t:after|x")); err != nil || len(got) != 1 || got[0] != "2" {
				t.Fatalf("the new master (%s) holds %v of the conversation's 2 keys (%v)", sn.Replica.Addr, got, err)
			}
		})
	}
}

// BenchmarkRedisClusterLoad is BenchmarkRedisLoad against a local 3-master
// cluster: one request's read (MGET of both keys, one slot, one node).
func BenchmarkRedisClusterLoad(b *testing.B) {
	cl := storetest.StartCluster(b, 3)
	r, err := OpenRedis(RedisOptions{URL: cl.URL(), Prefix: "cp:", TTL: time.Hour, Timeout: time.Second})
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
