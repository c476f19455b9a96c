package proxy

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"sync"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

// readParsed runs the chat path's read and parse on body as tenant key
// (Authorization) with an optional conversation header.
func readParsed(t *testing.T, s *Server, body []byte, key, conv string) (*chat.Request, parsed) {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
	r.Header.Set("Authorization", "Bearer "+key)
	if conv != "" {
		r.Header.Set("X-Compactproxy-Conversation", conv)
	}
	w := httptest.NewRecorder()
	cr, err := s.readChat(w, r)
	if err != nil {
		t.Fatalf("readChat: %v", err)
	}
	// The buffer may be pooled: the test keeps what it needs of req only.
	t.Cleanup(cr.release)
	return cr.req, cr.parsed
}

// remember stores req as the chat path does after its digests are set.
func remember(t *testing.T, s *Server, req *chat.Request, ps parsed) {
	t.Helper()
	if err := s.digests.hash(ps.tenant, req.Messages); err != nil {
		t.Fatal(err)
	}
	cr := &chatRequest{req: req, parsed: ps, forward: req.Messages, client: req.Messages}
	cv := &conversation{memo: &chainMemo{s: s, seed: s.seed(req)}}
	s.rememberParse(cr, cv)
}

func TestParseCacheReuseIsPerTenant(t *testing.T) {
	up := newFakeUpstream(t, nil)
	s := newTestProxy(t, testConfig(up.URL)).srv
	prev := chattest.AgentSteps(8, false)
	next := chattest.AgentSteps(9, false)

	req, ps := readParsed(t, s, prev, "alice", "")
	if ps.reused != 0 {
		t.Fatalf("first body reused %d messages", ps.reused)
	}
	remember(t, s, req, ps)

	// The same tenant's next step reuses every message of the first body.
	req2, ps2 := readParsed(t, s, next, "alice", "")
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
	_, ps3 := readParsed(t, s, next, "bob", "")
	if ps3.reused != 0 || ps3.from != nil {
		t.Fatalf("another tenant reused %d messages", ps3.reused)
	}
	// Neither does the anonymous tenant.
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(next))
	cr4, err := s.readChat(httptest.NewRecorder(), r)
	if err != nil || cr4.parsed.reused != 0 {
		t.Fatalf("anonymous request: %v, reused %+v", err, cr4)
	}
	cr4.release()
	// Another conversation header of the same tenant is another key.
	_, ps5 := readParsed(t, s, next, "alice", "other")
	if ps5.reused != 0 {
		t.Fatalf("another conversation reused %d messages", ps5.reused)
	}
}

func TestParseCacheChangedByteNotReused(t *testing.T) {
	up := newFakeUpstream(t, nil)
	s := newTestProxy(t, testConfig(up.URL)).srv
	prev := chattest.AgentSteps(6, false)
	req, ps := readParsed(t, s, prev, "alice", "")
	remember(t, s, req, ps)
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
	req2, ps2 := readParsed(t, s, changed, "alice", "")
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

// The chat path gives the same answers, headers and forwarded bytes with
// the parse cache as without it, over a conversation that grows, changes a
// message in the middle, goes back, and compacts.
func TestParseCacheSameBehaviour(t *testing.T) {
	run := func(cacheBytes int) (bodies [][]byte, headers []http.Header) {
		up := countingUpstream(t)
		sum := newSummarizerServer(t)
		p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
		p.srv.parses = newParseCache(cacheBytes)
		a := newAgent()
		for i := range 24 {
			a.toolStep(700)
			body := a.body()
			switch i {
			case 10: // an edited old message (a client rewriting history)
				body = string(bytes.Replace([]byte(body), []byte("line 3 of output"), []byte("LINE 3 of output"), 1))
			case 14: // a step back (a retried earlier request)
				a.msgs = a.msgs[:len(a.msgs)-4]
				body = a.body()
			}
			resp := p.chatOK(t, body)
			p.srv.driver.WaitBackground()
			h := http.Header{}
			for _, k := range []string{"X-Compactproxy-Compaction", "X-Compactproxy-Context-Tokens", "X-Compactproxy-Context-Source", "X-Compactproxy-Forwarded-Tokens", "X-Compactproxy-Conversation-Id"} {
				h.Set(k, resp.Header.Get(k))
			}
			headers = append(headers, h)
		}
		for _, r := range up.requests() {
			bodies = append(bodies, r.Body)
		}
		if n, _ := p.srv.parses.len(); (n > 0) != (cacheBytes > 0) {
			t.Fatalf("cache of %d bytes holds %d entries", cacheBytes, n)
		}
		return bodies, headers
	}
	withB, withH := run(parseCacheBytes)
	withoutB, withoutH := run(0)
	if len(withB) != len(withoutB) {
		t.Fatalf("%d upstream requests with the cache, %d without", len(withB), len(withoutB))
	}
	for i := range withB {
		if !bytes.Equal(withB[i], withoutB[i]) {
			t.Fatalf("upstream request %d differs with the cache", i)
		}
	}
	compacted := false
	for i := range withH {
		for k := range withH[i] {
			if withH[i].Get(k) != withoutH[i].Get(k) {
				t.Fatalf("step %d: %s = %q with the cache, %q without", i, k, withH[i].Get(k), withoutH[i].Get(k))
			}
		}
		compacted = compacted || withH[i].Get("X-Compactproxy-Compaction") != "none"
	}
	if !compacted {
		t.Fatal("the conversation never compacted: the test does not exercise the compaction path")
	}
}

// The chain memo answers what anchor.ViewChain computes, whatever it
// starts from: nothing, a parse cache entry's prefix, or earlier views of
// the request (a shorter, a longer, a compacted one).
func TestChainMemoMatchesViewChain(t *testing.T) {
	up := newFakeUpstream(t, nil)
	s := newTestProxy(t, testConfig(up.URL)).srv
	body := chattest.AgentSteps(6, false)
	fresh := func() []chat.Message { return mustParseProxy(t, body).Messages }
	seed := anchor.Digest{7}
	want := func(view []chat.Message) ([]anchor.Digest, []int) {
		cp := append([]chat.Message(nil), view...)
		for i := range cp {
			cp[i].HasDigest = false
		}
		c, l, err := anchor.ViewChain(seed, cp, s.local)
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
	m := &chainMemo{s: s, seed: seed}
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
	next := mustParseProxy(t, chattest.AgentSteps(7, false)).Messages
	for i := range len(msgs) {
		next[i].Digest, next[i].HasDigest = msgs[i].Digest, true
	}
	m2 := &chainMemo{s: s, seed: seed, known: []chainKnown{e.prefix(len(msgs), next)}}
	check("next step from the entry", m2, next)
	check("a view of other messages", m2, next[2:])
}

func mustParseProxy(t *testing.T, body []byte) *chat.Request {
	t.Helper()
	r, err := chat.Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// The pairing verdict an entry carries is only ever a clean one: a body
// with a violation sent again is checked (and counted, and repaired) again.
func TestParseCachePairingVerdict(t *testing.T) {
	for _, mode := range []string{"repair", "off", "strict"} {
		t.Run(mode, func(t *testing.T) {
			up := newFakeUpstream(t, nil)
			cfg := testConfig(up.URL)
			cfg.Pairing.Mode = mode
			p := newTestProxy(t, cfg)
			bad := `{"model":"m","messages":[{"role":"user","content":"go"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"user","content":"and?"}]}`
			good := `{"model":"m","messages":[{"role":"user","content":"go"}]}`
			for i := range 3 {
				resp := p.post(t, "/v1/chat/completions", good, "Authorization", "Bearer k")
				readAll(t, resp)
				resp = p.post(t, "/v1/chat/completions", bad, "Authorization", "Bearer k")
				readAll(t, resp)
				switch mode {
				case "strict":
					if resp.StatusCode != 400 {
						t.Fatalf("request %d: status %d, want 400", i, resp.StatusCode)
					}
				case "repair":
					if resp.Header.Get("X-Compactproxy-Pairing") != "repaired" {
						t.Fatalf("request %d: not repaired", i)
					}
				}
				if v := counter(t, p.reg, "compactproxy_pairing_violations_total", map[string]string{"kind": "unanswered_tool_call"}); v != float64(i+1) {
					t.Fatalf("request %d: violations counted %v times", i, v)
				}
			}
		})
	}
}

// Detaching a view for a background summary copies the messages whose
// bytes are the (pooled) body's and keeps those the request shares with a
// parse cache snapshot: once the body buffer is reused, every detached
// message still reads as it did.
func TestDetachMessagesKeepsSharedBytes(t *testing.T) {
	prev, err := chat.Parse(chattest.AgentSteps(5, false))
	if err != nil {
		t.Fatal(err)
	}
	for i := range prev.Messages {
		prev.Messages[i].HasDigest = true
	}
	body := chattest.AgentSteps(6, false)
	req, reused, err := chat.ParseAfter(body, prev.Snapshot())
	if err != nil || reused == 0 {
		t.Fatalf("ParseAfter: %v, reused %d", err, reused)
	}
	want := make([][]byte, len(req.Messages))
	for i, m := range req.Messages {
		want[i] = bytes.Clone(m.Raw)
	}
	out := detachMessages(req.Messages, req)
	for i := range out {
		shares := sameView(out[i:i+1], req.Messages[i:i+1])
		if shares != (i < reused) {
			t.Fatalf("message %d: shares the request's bytes = %v, want %v (shared %d)", i, shares, i < reused, reused)
		}
	}
	for i := range body {
		body[i] = 'x' // the pooled buffer, reused by the next request
	}
	for i, m := range out {
		if !bytes.Equal(m.Raw, want[i]) {
			t.Fatalf("detached message %d changed with the body buffer", i)
		}
	}
	// Without the request, everything is copied.
	for i, m := range detachMessages(req.Messages, nil) {
		if sameView([]chat.Message{m}, req.Messages[i:i+1]) {
			t.Fatalf("message %d not copied", i)
		}
	}
}

// The seed (model and prompt fields) comes from the entry only when its
// bytes are the same: a changed tools array after the messages, or another
// model, gets its own.
func TestParseCacheSeed(t *testing.T) {
	up := newFakeUpstream(t, nil)
	s := newTestProxy(t, testConfig(up.URL)).srv
	body := chattest.AgentSteps(4, false)
	req, ps := readParsed(t, s, body, "alice", "")
	remember(t, s, req, ps)
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"same", body},
		{"tools changed", bytes.Replace(body, []byte(`"read_file"`), []byte(`"read_files"`), 1)},
		{"tool_choice added", append(bytes.Clone(body[:len(body)-1]), `,"tool_choice":"none"}`...)},
	} {
		t.Run(c.name, func(t *testing.T) {
			r2, ps2 := readParsed(t, s, c.body, "alice", "")
			if ps2.reused == 0 {
				t.Fatal("nothing reused: the test does not exercise the entry")
			}
			hr := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
			cr := &chatRequest{req: r2, parsed: ps2, tenant: ps2.tenant, forward: r2.Messages}
			cv := s.openConversation(hr, cr)
			if cv.memo.seed != s.seed(r2) {
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
