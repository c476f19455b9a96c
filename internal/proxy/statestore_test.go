package proxy

import (
	"bytes"
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
	"github.com/redis/go-redis/v9"
)

// bolt: a restarted proxy re-applies the stored summary and trims: the
// next request makes no summarize call and forwards the same prefix.
func TestBoltRestartReappliesSummary(t *testing.T) {
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Store.Backend = "bolt"
	cfg.Store.Bolt.Path = filepath.Join(t.TempDir(), "state.db")
	cfg.Store.TenantSecret = "a fixed secret: tenants survive the restart"
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	if got := p.chatOK(t, a.body()).Header.Get("X-Compactproxy-Compaction"); got != "summarized" {
		t.Fatalf("compaction %q, want summarized", got)
	}
	first := forwardedMessages(t, up.last(t).Body)
	p.Close()
	if err := p.srv.Close(); err != nil {
		t.Fatal(err)
	}

	p2 := newTestProxy(t, cfg)
	a.toolStep(200)
	if got := p2.chatOK(t, a.body()).Header.Get("X-Compactproxy-Compaction"); got != "reused" {
		t.Fatalf("after restart: compaction %q, want reused", got)
	}
	if n := sum.calls.Load(); n != 1 {
		t.Fatalf("summarize calls %d, want 1 (none after the restart)", n)
	}
	second := forwardedMessages(t, up.last(t).Body)
	for i := range first {
		if i >= len(second) || !bytes.Equal(first[i], second[i]) {
			t.Fatalf("forwarded prefix changed at message %d after the restart", i)
		}
	}
}

// redis unreachable: requests are forwarded (200) without new compaction,
// store_errors_total counts, the outage is logged once, and the proxy
// recovers when Redis is back.
func TestRedisDownFailsOpen(t *testing.T) {
	rd := storetest.StartRedis(t)
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Store.Backend = "redis"
	cfg.Store.Redis.URL = config.Secret(rd.URL())
	cfg.Store.Timeout = 100 * time.Millisecond
	p := newTestProxy(t, cfg)
	a := newAgent()
	for a.step < 16 {
		a.toolStep(800)
	}
	rd.Stop()
	for i := 0; i < 3; i++ {
		a.toolStep(100)
		start := time.Now()
		resp := p.chatOK(t, a.body())
		// No summary (none can be read, coordinated or kept); the
		// no-model-call steps still keep the view inside the window.
		if got := resp.Header.Get("X-Compactproxy-Compaction"); got == "summarized" || got == "reused" {
			t.Fatalf("with Redis down: compaction %q, want no summary (fail open)", got)
		}
		if fwd, _ := strconv.Atoi(resp.Header.Get("X-Compactproxy-Forwarded-Tokens")); fwd > 3500 {
			t.Fatalf("with Redis down: forwarded %d tokens, over the 3500 budget", fwd)
		}
		if d := time.Since(start); d > time.Second {
			t.Fatalf("request took %v with Redis down", d)
		}
	}
	if sum.calls.Load() != 0 {
		t.Fatal("summarized while the state could not be read")
	}
	if v := counter(t, p.reg, "compactproxy_store_errors_total", map[string]string{"op": "load"}); v < 3 {
		t.Fatalf("store_errors_total{op=load} = %v, want >= 3", v)
	}
	if n := p.logs.FilterMessageSnippet("state store failing").Len(); n != 1 {
		t.Fatalf("outage logged %d times, want once", n)
	}
	rd.Start()
	deadline := time.Now().Add(5 * time.Second)
	for {
		a.toolStep(100)
		resp := p.chatOK(t, a.body())
		if resp.Header.Get("X-Compactproxy-Compaction") == "summarized" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("compaction did not resume after Redis came back")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if p.logs.FilterMessageSnippet("state store recovered").Len() != 1 {
		t.Fatal("recovery not logged")
	}
	for _, e := range p.logs.All() {
		for _, f := range e.Context {
			if strings.Contains(f.String, rd.Addr) {
				t.Fatalf("log %q carries the Redis address", e.Message)
			}
		}
	}
}

// DESIGN § State: a constant number of store round trips per request (one
// read, at most two writes), never one per message, counted by Redis
// itself (INFO commandstats) over an agent loop that crosses the trigger.
func TestRedisRoundTripsPerRequest(t *testing.T) {
	rd := storetest.StartRedis(t)
	up := countingUpstream(t)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Store.Backend = "redis"
	cfg.Store.Redis.URL = config.Secret(rd.URL())
	cfg.Compaction.PresummarizeRatio = 0 // round trips of requests, not of background summaries
	p := newTestProxy(t, cfg)
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr})
	defer rc.Close()
	ctx := context.Background()
	a := newAgent()
	a.toolStep(800)
	p.chatOK(t, a.body()) // warm-up: loads the scripts
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := 0; i < n; i++ {
		a.toolStep(800)
		p.chatOK(t, a.body())
	}
	info, err := rc.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok {
			continue
		}
		c, _, _ := strings.Cut(rest, ",")
		calls[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.Atoi(c)
	}
	// commandstats also counts the commands scripts run (get, set, del
	// inside the compare-and-set): the client's own round trips are the
	// reads (MGET) and script calls (EVALSHA, and EVAL once per script
	// when Redis did not know it yet), plus one SET NX per lease.
	total := calls["mget"] + calls["evalsha"] + calls["eval"]
	t.Logf("%d requests (%d messages at the end, %d summarize calls): redis commands %v", n, len(a.msgs), sum.calls.Load(), calls)
	summarizes := int(sum.calls.Load())
	// Per request: 1 MGET, at most 2 writes (EVALSHA); per summarize: the
	// lease (SET), a re-read (MGET) and the release (EVALSHA).
	if calls["mget"] > n+summarizes || calls["evalsha"]+calls["eval"] > 2*n+2*summarizes || total > 3*n+3*summarizes {
		t.Fatalf("redis commands %v for %d requests: over one read and two writes per request", calls, n)
	}
	if calls["mget"] < n {
		t.Fatalf("mget %d for %d requests: some request did not read its state", calls["mget"], n)
	}
}
