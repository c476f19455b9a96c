package proxy

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/chat/chattest"
	"github.com/compactproxy/compactproxy/internal/identity"
)

// The chat path gives the same answers, headers and forwarded bytes with
// the parse cache as without it, over a conversation that grows, changes a
// message in the middle, goes back, and compacts.
func TestParseCacheSameBehaviour(t *testing.T) {
	run := func(cacheBytes int) (bodies [][]byte, headers []http.Header) {
		up := countingUpstream(t)
		sum := newSummarizerServer(t)
		p := newTestProxy(t, compactionConfig(up.URL, sum.URL))
		p.srv.ids = identity.New(p.srv.upstreamName, p.srv.local, cacheBytes)
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
		// The last body, read again, is known to the cache (with its
		// pairing verdict) exactly when there is a cache.
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(a.body()))
		r.Header.Set("Authorization", "Bearer k")
		r.Header.Set("X-Compactproxy-Conversation", "conv")
		ar, err := p.srv.read(httptest.NewRecorder(), r)
		if err != nil {
			t.Fatal(err)
		}
		known := ar.parse.PairingClean(ar.req, ar.req.Messages)
		ar.release()
		if known != (cacheBytes > 0) {
			t.Fatalf("cache of %d bytes: last body known = %v", cacheBytes, known)
		}
		return bodies, headers
	}
	withB, withH := run(identity.ParseCacheBytes)
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
	out := identity.Detach(req.Messages, req)
	for i := range out {
		shares := identity.SameView(out[i:i+1], req.Messages[i:i+1])
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
	for i, m := range identity.Detach(req.Messages, nil) {
		if identity.SameView([]chat.Message{m}, req.Messages[i:i+1]) {
			t.Fatalf("message %d not copied", i)
		}
	}
}
