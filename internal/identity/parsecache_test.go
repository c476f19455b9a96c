package identity

import (
	"bytes"
	"net/http"
	"reflect"
	"strconv"
	"sync"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/anchor/anchortest"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

var testSecret = []byte("test tenant secret")

func newTestIdentifier() *Identifier {
	return New("up", anchor.NewLocalEstimator(), ParseCacheBytes)
}

// readParsed parses body as the request path does, as tenant key
// (Authorization) with an optional conversation header.
func readParsed(t *testing.T, x *Identifier, body []byte, key, conv string) (*chat.Request, Parse) {
	t.Helper()
	tenant := Tenant(testSecret, http.Header{"Authorization": {"Bearer " + key}})
	req, p, err := x.ParseChat(tenant, conv, body)
	if err != nil {
		t.Fatalf("ParseChat: %v", err)
	}
	return req, p
}

// remember stores req as the request path does after its digests are set.
func remember(t *testing.T, x *Identifier, req *chat.Request, p Parse) {
	t.Helper()
	conv, err := x.Open("", req, p, req.Messages)
	if err != nil {
		t.Fatal(err)
	}
	x.Remember(conv, req, p, false, req.Messages)
}

func mustParse(t *testing.T, body []byte) *chat.Request {
	t.Helper()
	r, err := chat.Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestParseCacheReuseIsPerTenant(t *testing.T) {
	x := newTestIdentifier()
	prev := chattest.AgentSteps(8, false)
	next := chattest.AgentSteps(9, false)

	req, ps := readParsed(t, x, prev, "alice", "")
	if ps.reused != 0 {
		t.Fatalf("first body reused %d messages", ps.reused)
	}
	remember(t, x, req, ps)

	// The same tenant's next step reuses every message of the first body.
	req2, ps2 := readParsed(t, x, next, "alice", "")
	if want := len(chattest.AgentMessages(8)); ps2.reused != want {
		t.Fatalf("next step reused %d messages, want %d", ps2.reused, want)
	}
	for i, m := range req2.Messages[:ps2.reused] {
		want, _ := anchor.MessageHash(m.Raw)
		if !m.HasDigest || m.Digest != want {
			t.Fatalf("reused message %d carries a wrong digest", i)
		}
	}
	// Another tenant sending the very same bytes reuses nothing.
	_, ps3 := readParsed(t, x, next, "bob", "")
	if ps3.reused != 0 || ps3.from != nil {
		t.Fatalf("another tenant reused %d messages", ps3.reused)
	}
	// Neither does the anonymous tenant.
	_, ps4, err := x.ParseChat(Tenant(testSecret, http.Header{}), "", next)
	if err != nil || ps4.reused != 0 {
		t.Fatalf("anonymous request: %v, reused %d", err, ps4.reused)
	}
	// Another conversation header of the same tenant is another key.
	_, ps5 := readParsed(t, x, next, "alice", "other")
	if ps5.reused != 0 {
		t.Fatalf("another conversation reused %d messages", ps5.reused)
	}
}

func TestParseCacheChangedByteNotReused(t *testing.T) {
	x := newTestIdentifier()
	prev := chattest.AgentSteps(6, false)
	req, ps := readParsed(t, x, prev, "alice", "")
	remember(t, x, req, ps)
	// One byte changed inside the fourth message's tool output.
	msgs := chattest.AgentMessages(6)
	at := 0
	for _, m := range msgs[:3] {
		at += len(m) + 1
	}
	at += bytes.Index(prev, msgs[0]) + len(msgs[3])/2
	changed := bytes.Clone(prev)
	changed[at] ^= 0x01
	if changed[at] == '"' || changed[at] == '\\' || changed[at] < 0x20 {
		changed[at] ^= 0x03
	}
	req2, ps2 := readParsed(t, x, changed, "alice", "")
	if ps2.reused > 3 {
		t.Fatalf("a changed byte in message 3, but %d messages reused", ps2.reused)
	}
	want, err := chat.Parse(changed)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want.Messages {
		if !bytes.Equal(req2.Messages[i].Raw, want.Messages[i].Raw) {
			t.Fatalf("message %d differs from a fresh parse", i)
		}
		if d, _ := anchor.MessageHash(req2.Messages[i].Raw); req2.Messages[i].HasDigest && req2.Messages[i].Digest != d {
			t.Fatalf("message %d carries the digest of other bytes", i)
		}
	}
}

func TestParseCacheBounds(t *testing.T) {
	c := newParseCache(1 << 20)
	body := func(i int) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":"` + strconv.Itoa(i) + `` + string(bytes.Repeat([]byte("x"), 20000)) + `"}]}`)
	}
	k := c.key("t", "", []byte("same head"))
	for i := range 10 {
		r, err := chat.Parse(body(i))
		if err != nil {
			t.Fatal(err)
		}
		c.store(&parseEntry{key: k, snap: r.Snapshot()}, nil, r.Body)
	}
	if n, _ := c.len(); n != parseBucketEntries {
		t.Fatalf("one key holds %d entries, bound is %d", n, parseBucketEntries)
	}
	// The bucket keeps the most recent bodies.
	if e := c.lookup(k, body(9)); e == nil || e.snap.Shared(body(9)) != 1 {
		t.Fatal("the newest body was evicted")
	}
	for i := range 200 {
		r, _ := chat.Parse(body(i))
		c.store(&parseEntry{key: c.key("t", strconv.Itoa(i), nil), snap: r.Snapshot()}, nil, r.Body)
	}
	if _, b := c.len(); b > 1<<20 {
		t.Fatalf("cache holds %d bytes, bound is %d", b, 1<<20)
	}
	// A body over a quarter of the bound is not kept.
	r, _ := chat.Parse([]byte(`{"messages":[{"role":"user","content":"` + string(bytes.Repeat([]byte("y"), 300000)) + `"}]}`))
	big := c.key("t", "big", nil)
	c.store(&parseEntry{key: big, snap: r.Snapshot()}, nil, r.Body)
	if c.lookup(big, r.Body) != nil {
		t.Fatal("an oversized body was cached")
	}
	// Replacing an entry by its successor keeps one entry for the key.
	k2 := c.key("t", "succ", nil)
	r1, _ := chat.Parse(body(1))
	e1 := &parseEntry{key: k2, snap: r1.Snapshot()}
	c.store(e1, nil, r1.Body)
	r2, _ := chat.Parse(body(2))
	c.store(&parseEntry{key: k2, snap: r2.Snapshot()}, e1, r2.Body)
	if got := len(c.buckets[k2]); got != 1 {
		t.Fatalf("successor stored next to its predecessor: %d entries", got)
	}
}

// The chain memo answers what anchortest.ViewChain computes, whatever it
// starts from: nothing, a parse cache entry's prefix, or earlier views of
// the request (a shorter, a longer, a compacted one).
func TestChainMemoMatchesViewChain(t *testing.T) {
	x := newTestIdentifier()
	body := chattest.AgentSteps(6, false)
	fresh := func() []chat.Message { return mustParse(t, body).Messages }
	seed := anchor.Digest{7}
	want := func(view []chat.Message) ([]anchor.Digest, []int) {
		cp := append([]chat.Message(nil), view...)
		for i := range cp {
			cp[i].HasDigest = false
		}
		c, l, err := anchortest.ViewChain(seed, cp, x.local)
		if err != nil {
			t.Fatal(err)
		}
		return c, l
	}
	check := func(name string, m *chainMemo, view []chat.Message) {
		t.Helper()
		c, l, err := m.chain(view)
		if err != nil {
			t.Fatal(err)
		}
		wc, wl := want(view)
		if !reflect.DeepEqual(c, wc) || !reflect.DeepEqual(l, wl) {
			t.Fatalf("%s: memo chain differs from ViewChain", name)
		}
	}
	msgs := fresh()
	m := &chainMemo{local: x.local, seed: seed}
	check("client view", m, msgs)
	check("same view again", m, msgs)
	check("shorter view", m, msgs[:5])
	compacted := append([]chat.Message{msgs[0], chat.NewTextMessage("user", "summary")}, msgs[8:]...)
	check("compacted view", m, compacted)
	check("client view after others", m, msgs)

	// From an entry: the first n messages' chain and estimates carried over.
	full, _, _ := m.chain(msgs)
	k, _ := m.view(msgs)
	e := chainKnown{digests: k.digests, chain: full, local: k.local}
	next := mustParse(t, chattest.AgentSteps(7, false)).Messages
	for i := range len(msgs) {
		next[i].Digest, next[i].HasDigest = msgs[i].Digest, true
	}
	m2 := &chainMemo{local: x.local, seed: seed, known: []chainKnown{e.prefix(len(msgs), next)}}
	check("next step from the entry", m2, next)
	check("a view of other messages", m2, next[2:])
}

// The seed (model and prompt fields) comes from the entry only when its
// bytes are the same: a changed tools array after the messages, or another
// model, gets its own.
func TestParseCacheSeed(t *testing.T) {
	x := newTestIdentifier()
	body := chattest.AgentSteps(4, false)
	req, ps := readParsed(t, x, body, "alice", "")
	remember(t, x, req, ps)
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"same", body},
		{"tools changed", bytes.Replace(body, []byte(`"read_file"`), []byte(`"read_files"`), 1)},
		{"tool_choice added", append(bytes.Clone(body[:len(body)-1]), `,"tool_choice":"none"}`...)},
	} {
		t.Run(c.name, func(t *testing.T) {
			r2, ps2 := readParsed(t, x, c.body, "alice", "")
			if ps2.reused == 0 {
				t.Fatal("nothing reused: the test does not exercise the entry")
			}
			conv, err := x.Open("", r2, ps2, r2.Messages)
			if err != nil {
				t.Fatal(err)
			}
			if conv.memo.seed != x.Seed(r2) {
				t.Fatal("seed differs from the request's own")
			}
		})
	}
}

// Lookups of one key from concurrent requests (a bucket with several
// entries is sorted by last use) do not race with the use they record
// (run with -race).
func TestParseCacheConcurrentLookups(t *testing.T) {
	c := newParseCache(8 << 20)
	k := c.key("t", "", []byte("same head"))
	var bodies [][]byte
	for i := range parseBucketEntries {
		b := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strconv.Itoa(i) + `"}]}`)
		r, err := chat.Parse(b)
		if err != nil {
			t.Fatal(err)
		}
		c.store(&parseEntry{key: k, snap: r.Snapshot()}, nil, r.Body)
		bodies = append(bodies, r.Body)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				b := bodies[(g+i)%len(bodies)]
				if e := c.lookup(k, b); e == nil || e.snap.Shared(b) != 1 {
					t.Error("a stored body was not found")
					return
				}
			}
		}()
	}
	wg.Wait()
}
