package e2e

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/store/storetest"
	"github.com/redis/go-redis/v9"
)

// Two compactproxy replicas sharing a 3-master Redis Cluster
// (store.redis.url redis+cluster://): a summary made on one replica is
// reused on the other, the lease makes one summarize of concurrent
// over-trigger requests spread over both, and every key has a TTL and
// sits in its conversation's slot, spread over the masters.
func TestReplicasShareRedisCluster(t *testing.T) {
	cl := storetest.StartCluster(t, 3)
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &stateUpstream{latency: 30 * time.Millisecond}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	sum := newCountingSummarizer(t)
	env := stateEnv(sum.URL, "COMPACTPROXY_STORE_BACKEND=redis", "COMPACTPROXY_STORE_REDIS_URL="+cl.URL())
	replicas := []*proxyProc{startProxy(t, bin, upSrv.URL+"/v1", env...), startProxy(t, bin, upSrv.URL+"/v1", env...)}

	alternateShares(t, replicas, up, sum, newLoopAgent(""))
	concurrentSummarizeOnce(t, replicas, sum)
	for _, c := range []string{"a", "b", "c", "d", "e", "f"} {
		if r := send(t, replicas[0].URL, newLoopAgent("spread-"+c)); r.status != 200 {
			t.Fatalf("conversation %s: status %d", c, r.status)
		}
	}

	rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{cl.Nodes[0].Addr}})
	defer rc.Close()
	ctx := context.Background()
	masters := 0
	total := 0
	err := rc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		keys, err := node.Keys(ctx, "*").Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			masters++
		}
		total += len(keys)
		for _, k := range keys {
			if ttl, err := node.PTTL(ctx, k).Result(); err != nil || ttl <= 0 {
				t.Errorf("key %q has no TTL (%v %v)", k, ttl, err)
			}
			open, close := strings.Index(k, "{"), strings.Index(k, "}")
			if open < 0 || close < open+2 {
				t.Errorf("key %q carries no hash tag", k)
			}
			if strings.Contains(k, "sk-replica-key") || strings.Contains(k, "spread") {
				t.Errorf("key %q names a credential or content", k)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys on %d of 3 masters", total, masters)
	if masters < 2 {
		t.Errorf("keys on %d of 3 masters: conversations are not spread over the cluster", masters)
	}
	for _, p := range replicas {
		if strings.Contains(p.Log(), "state store failing") {
			t.Errorf("a replica saw the store fail:\n%s", p.LogTail())
		}
	}
}

// Two replicas sharing a master found through Sentinel
// (store.redis.url redis+sentinel://): the master is killed mid-run.
// While the sentinels fail over, every request is answered (fail open:
// compaction only is lost, counted in store_errors_total); afterwards
// compaction resumes on the new master, and a conversation started after
// the failover has its summary made on one replica and reused on the
// other.
func TestReplicasSentinelFailover(t *testing.T) {
	sn := storetest.StartSentinel(t, 2)
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &stateUpstream{latency: 20 * time.Millisecond}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	sum := newCountingSummarizer(t)
	env := stateEnv(sum.URL, "COMPACTPROXY_STORE_BACKEND=redis", "COMPACTPROXY_STORE_REDIS_URL="+sn.URL())
	replicas := []*proxyProc{startProxy(t, bin, upSrv.URL+"/v1", env...), startProxy(t, bin, upSrv.URL+"/v1", env...)}

	// Before: the loop runs until its summary has been reused.
	a := newLoopAgent("")
	i := 0
	step := func(phase string) stepResult {
		t.Helper()
		i++
		r := send(t, replicas[i%2].URL, a)
		if r.status != 200 {
			t.Fatalf("%s, step %d: status %d %s\n%s", phase, i, r.status, r.answer, replicas[i%2].LogTail())
		}
		a.grow(t, r.answer, i)
		return r
	}
	reused := false
	for !reused && i < 30 {
		reused = step("before the failover").action == "reused"
	}
	if !reused {
		t.Fatal("no summary reused in 30 steps before the failover")
	}

	// The master dies; requests go on while the sentinels promote the
	// replica (down after 1 s, then the election): generous deadline.
	sn.Master.Stop()
	during := 0
	deadline := time.Now().Add(45 * time.Second)
	for !sn.Promoted() {
		if time.Now().After(deadline) {
			t.Fatal("the sentinels did not promote the replica within 45 s")
		}
		r := step("during the failover")
		during++
		t.Logf("during the failover, step %d: %v, compaction %s", i, r.took.Round(time.Millisecond), r.action)
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("%d steps answered while the master was down", during)
	errs := 0
	for _, p := range replicas {
		errs += storeErrors(t, p)
	}
	if during > 0 && errs == 0 {
		t.Errorf("%d steps while the master was down, store_errors_total 0", during)
	}

	// After: each replica reaches the new master by itself (its client
	// asks the sentinels) within a generous deadline: it logs that the
	// store recovered. Then compaction resumes, and a new conversation's
	// summary, written to the new master by one replica, is reused by the
	// other without a second summarize call.
	promoted := time.Now()
	for j, p := range replicas {
		for strings.Count(p.Log(), "state store recovered") < strings.Count(p.Log(), "state store failing") {
			if time.Since(promoted) > 30*time.Second {
				t.Fatalf("replica %d: the store still fails 30 s after the promotion\n%s", j, p.LogTail())
			}
			i++
			r := send(t, p.URL, a)
			if r.status != 200 {
				t.Fatalf("after the failover, step %d: status %d", i, r.status)
			}
			a.grow(t, r.answer, i)
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("replica %d: store recovered by %v after the promotion", j, time.Since(promoted).Round(time.Millisecond))
	}
	resumed := false
	for k := 0; k < 20 && !resumed; k++ {
		r := step("after the failover")
		resumed = r.action == "summarized" || r.action == "reused"
	}
	if !resumed {
		t.Fatalf("compaction did not resume after the failover\n%s", replicas[0].LogTail())
	}
	b := newLoopAgent("after-failover")
	summarizedAt := 0
	var calls int32
	for k := 1; k <= 30; k++ {
		r := send(t, replicas[k%2].URL, b)
		if r.status != 200 {
			t.Fatalf("new conversation, step %d: status %d", k, r.status)
		}
		b.grow(t, r.answer, k)
		t.Logf("new conversation, step %d replica %d: %s (summarize calls %d)", k, k%2, r.action, sum.calls.Load())
		switch {
		case summarizedAt == 0 && r.action == "summarized":
			summarizedAt, calls = k, sum.calls.Load()
		case summarizedAt > 0:
			// The next step, on the other replica, reuses that summary.
			if r.action != "reused" || sum.calls.Load() != calls {
				t.Fatalf("step %d on the other replica: %s, summarize calls %d → %d: the summary written after the failover was not reused",
					k, r.action, calls, sum.calls.Load())
			}
			n, err := sn.Replica.Do("DBSIZE")
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("keys on the new master: %s", strings.TrimSpace(n))
			return
		}
	}
	t.Fatal("the conversation started after the failover was not summarized in 30 steps")
}

// storeErrors is p's compactproxy_store_errors_total, summed over op.
func storeErrors(t *testing.T, p *proxyProc) int {
	t.Helper()
	resp, err := http.Get(p.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "compactproxy_store_errors_total{") {
			if v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64); err == nil {
				n += int(v)
			}
		}
	}
	return n
}
