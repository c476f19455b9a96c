package chat

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

// sameParse fails unless got (from ParseAfter) is what Parse returned for
// the same body: every field, unexported ones included (a snapshot taken
// from got must be as good as one taken from a full parse), each Raw and
// Content the same bytes at the same place, pointing into body where Parse's
// do, or for the messages taken from the snapshot into its copy.
func sameParse(t *testing.T, body []byte, got *Request, gotErr error) {
	t.Helper()
	want, wantErr := Parse(body)
	if (gotErr == nil) != (wantErr == nil) {
		t.Fatalf("ParseAfter err = %v, Parse err = %v", gotErr, wantErr)
	}
	if wantErr != nil {
		var a, b *ParseError
		if !errors.As(gotErr, &a) || !errors.As(wantErr, &b) || *a != *b {
			t.Fatalf("ParseAfter err = %#v, Parse err = %#v", gotErr, wantErr)
		}
		return
	}
	// Digests are the caller's; shared and from say where messages came
	// from: compare without them.
	gm := append([]Message(nil), got.Messages...)
	for i := range gm {
		gm[i].Digest, gm[i].HasDigest = [32]byte{}, false
	}
	g := *got
	g.Messages, g.shared, g.from = gm, 0, nil
	g.pos = append([]msgPos(nil), got.pos...)
	if len(g.Messages) == 0 && len(want.Messages) == 0 {
		g.Messages = want.Messages
	}
	if len(g.pos) == 0 && len(want.pos) == 0 {
		g.pos = want.pos
	}
	if !reflect.DeepEqual(&g, want) {
		switch {
		case !reflect.DeepEqual(g.Messages, want.Messages):
			for i := range min(len(g.Messages), len(want.Messages)) {
				if !reflect.DeepEqual(g.Messages[i], want.Messages[i]) {
					t.Fatalf("message %d differs from Parse's (of %d, %d)", i, len(g.Messages), len(want.Messages))
				}
			}
			t.Fatalf("%d messages, Parse has %d", len(g.Messages), len(want.Messages))
		case !reflect.DeepEqual(g.Fields, want.Fields):
			t.Fatalf("fields differ: %q vs %q", g.Fields, want.Fields)
		default:
			g.Messages, g.Fields, g.Body = nil, nil, nil
			w := *want
			w.Messages, w.Fields, w.Body = nil, nil, nil
			t.Fatalf("ParseAfter differs from Parse:\n got %+v\nwant %+v", g, w)
		}
	}
	for i := range got.Messages {
		gr, wr := got.Messages[i].Raw, want.Messages[i].Raw
		p := want.pos[i]
		if i < got.shared {
			if p.raw >= 0 && !sameBytes(gr, got.from.msgs[i].Raw) {
				t.Fatalf("message %d: taken from the snapshot but not its bytes", i)
			}
			continue
		}
		if (&gr[0] == &body[0]) != (&wr[0] == &body[0]) {
			t.Fatalf("message %d: Raw points elsewhere than Parse's", i)
		}
		if p.raw >= 0 && &gr[0] != &body[p.raw] {
			t.Fatalf("message %d: Raw does not point into the body", i)
		}
		if c := got.Messages[i].Content; p.raw >= 0 && len(c) > 0 && &c[0] != &body[p.content] {
			t.Fatalf("message %d: Content does not point into the body", i)
		}
	}
	if got.Unchanged(got.Messages) != want.Unchanged(want.Messages) {
		t.Fatal("Unchanged differs")
	}
}

func mustParse(t *testing.T, body []byte) *Request {
	t.Helper()
	r, err := Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestParseAfter(t *testing.T) {
	agent := func(steps int) []byte { return chattest.AgentSteps(steps, false) }
	msgs5 := chattest.AgentMessages(5)
	for _, c := range []struct {
		name     string
		old, new []byte
		reused   int // -1: don't check
	}{
		{"same body", agent(4), agent(4), len(chattest.AgentMessages(4))},
		{"appended steps", agent(4), agent(6), len(chattest.AgentMessages(4))},
		{"shorter body", agent(6), agent(4), len(chattest.AgentMessages(4))},
		{"streamed now", agent(4), chattest.AgentSteps(4, true), len(chattest.AgentMessages(4))},
		{"changed byte in message 3", agent(4), bytes.Replace(agent(4), []byte(`"call_2"`), []byte(`"call_X"`), 1), -1},
		{"changed model", agent(4), bytes.Replace(agent(4), []byte(`qwen3`), []byte(`qwen4`), 1), 0},
		{"last message edited", agent(4), append(bytes.Clone(agent(4)[:bytes.LastIndex(agent(4), []byte(`}],"temperature"`))]), []byte(`,"x":1}]}`)...), -1},
		{"ui_only before the cut", []byte(`{"model":"m","messages":[{"role":"user","content":"a"},{"role":"system","ui_only":true,"content":"ui"},{"role":"user","ui_only":false,"content":"b"},{"role":"assistant","content":"c"}]}`),
			[]byte(`{"model":"m","messages":[{"role":"user","content":"a"},{"role":"system","ui_only":true,"content":"ui"},{"role":"user","ui_only":false,"content":"b"},{"role":"assistant","content":"c"},{"role":"user","content":"d"}]}`), 3},
		{"ui_only after the cut", []byte(`{"messages":[{"role":"user","content":"a"}]}`),
			[]byte(`{"messages":[{"role":"user","content":"a"},{"role":"system","ui_only":true},{"role":"user","content":"b","ui_only":false}],"stream":true}`), 1},
		{"shape error after the cut", agent(2), append(bytes.Clone(agent(2)[:bytes.LastIndex(agent(2), []byte(`],"temperature"`))]), []byte(`,{"content":"no role"}]}`)...), -1},
		{"invalid JSON after the cut", agent(2), agent(2)[:len(agent(2))-5], -1},
		{"trailing garbage", agent(2), append(bytes.Clone(agent(2)), " x"...), -1},
		{"messages repeated after", agent(2), append(bytes.Clone(agent(2)[:len(agent(2))-1]), `,"messages":[{"role":"user","content":"z"}]}`...), -1},
		{"max_tokens after", []byte(`{"max_tokens":5,"messages":[{"role":"user","content":"a"}],"max_completion_tokens":7}`),
			[]byte(`{"max_tokens":5,"messages":[{"role":"user","content":"a"}]}`), 1},
		{"whitespace", []byte("{ \"messages\" : [ {\"role\":\"user\"} ,\n {\"role\":\"user\"} ] }"),
			[]byte("{ \"messages\" : [ {\"role\":\"user\"} ,\n {\"role\":\"user\"}\t, {\"role\":\"tool\"} ] }"), 2},
		{"envelope of one more message", chattest.Envelope(msgs5[:4], false), chattest.Envelope(msgs5, false), 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			snap := mustParse(t, c.old).Snapshot()
			if snap == nil {
				t.Fatal("no snapshot")
			}
			r, reused, err := ParseAfter(c.new, snap)
			sameParse(t, c.new, r, err)
			if c.reused >= 0 && err == nil && reused != c.reused {
				t.Fatalf("reused %d messages, want %d", reused, c.reused)
			}
			if err == nil {
				// A snapshot of the resumed parse resumes like one of a full parse.
				next := append(bytes.Clone(c.new[:0]), c.new...)
				r2, _, err2 := ParseAfter(next, r.Snapshot())
				sameParse(t, next, r2, err2)
			}
		})
	}
}

func TestParseAfterChangedByteNotReused(t *testing.T) {
	old := chattest.AgentSteps(6, false)
	snap := mustParse(t, old).Snapshot()
	base := mustParse(t, old)
	// Change one byte inside each message in turn: nothing from that
	// message on may come from the snapshot.
	for k, p := range base.pos {
		body := bytes.Clone(old)
		at := p.raw + (p.end-p.raw)/2
		body[at] ^= 0x01
		if body[at] == '"' || body[at] == '\\' || body[at] < 0x20 {
			body[at] ^= 0x03
		}
		r, reused, err := ParseAfter(body, snap)
		if reused > k {
			t.Fatalf("byte %d changed in message %d, but %d messages reused", at, k, reused)
		}
		sameParse(t, body, r, err)
	}
}

func TestSnapshotCarriesDigestsAndOwnsBytes(t *testing.T) {
	body := chattest.AgentSteps(3, false)
	r := mustParse(t, bytes.Clone(body))
	for i := range r.Messages {
		r.Messages[i].Digest = [32]byte{byte(i + 1)}
		r.Messages[i].HasDigest = true
	}
	snap := r.Snapshot()
	// The snapshot must not depend on the first body's buffer (pooled in
	// the proxy): scribble over it.
	for i := range r.Body {
		r.Body[i] = 'x'
	}
	next := chattest.AgentSteps(4, false)
	r2, reused, err := ParseAfter(next, snap)
	sameParse(t, next, r2, err)
	if reused != len(r.Messages) {
		t.Fatalf("reused %d, want %d", reused, len(r.Messages))
	}
	for i := range reused {
		if !r2.Messages[i].HasDigest || r2.Messages[i].Digest != [32]byte{byte(i + 1)} {
			t.Fatalf("message %d: digest not carried", i)
		}
	}
	for i := reused; i < len(r2.Messages); i++ {
		if r2.Messages[i].HasDigest {
			t.Fatalf("new message %d has a digest", i)
		}
	}
	// Setting a digest on the resumed request leaves the snapshot alone.
	r2.Messages[0].Digest = [32]byte{99}
	r3, _, _ := ParseAfter(next, snap)
	if r3.Messages[0].Digest != [32]byte{1} {
		t.Fatal("a resumed request wrote into the snapshot")
	}
}

func TestSnapshotRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		body string
		edit func(r *Request)
	}{
		{"no messages", `{"messages":[]}`, nil},
		{"messages twice", `{"messages":[{"role":"user"}],"messages":[{"role":"user"}]}`, nil},
		{"message replaced", `{"messages":[{"role":"user","content":"a"}]}`, func(r *Request) { r.Messages[0] = NewTextMessage("user", "a") }},
		{"message removed in place", `{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}`, func(r *Request) { r.Messages = r.Messages[1:] }},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := mustParse(t, []byte(c.body))
			if c.edit != nil {
				c.edit(r)
			}
			if r.Snapshot() != nil {
				t.Fatal("snapshot of a request that cannot be resumed from")
			}
		})
	}
}

// FuzzParseAfter: for any two bodies, ParseAfter(b, snapshot of a) is
// Parse(b). The second body is the first with the fuzzer's bytes spliced in
// at a position, so common prefixes of every length are exercised.
func FuzzParseAfter(f *testing.F) {
	seeds := []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"ok"}],"stream":true}`,
		`{"messages":[{"role":"system","ui_only":true},{ "ui_only" : false , "role":"user"},{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
		string(chattest.AgentSteps(2, false)),
	}
	for _, s := range seeds {
		f.Add([]byte(s), uint16(len(s)/2), uint16(0), []byte(`,{"role":"user","content":"new"}`))
		f.Add([]byte(s), uint16(len(s)-2), uint16(2), []byte(`]}`))
	}
	f.Fuzz(func(t *testing.T, old []byte, at, cut uint16, insert []byte) {
		r, err := Parse(old)
		if err != nil {
			return
		}
		snap := r.Snapshot()
		if snap == nil {
			return
		}
		i := int(at) % (len(old) + 1)
		j := min(len(old), i+int(cut))
		body := append(append(bytes.Clone(old[:i]), insert...), old[j:]...)
		got, reused, err := ParseAfter(body, snap)
		sameParse(t, body, got, err)
		if err == nil && reused > 0 && !strings.HasPrefix(string(body), string(old[:snap.pos[reused-1].end])) {
			t.Fatal("reused messages beyond the common prefix")
		}
	})
}

// An agent's steps, each parsed after the snapshot of the step before:
// every parse is Parse's, the snapshots of later steps share the first
// one's storage until it moves, and every older snapshot still resumes
// correctly after later ones extended (or moved) the storage.
func TestSnapshotChainOfSteps(t *testing.T) {
	var snaps []*Snapshot
	var bodies [][]byte
	snap := mustParse(t, chattest.AgentSteps(3, false)).Snapshot()
	moved := 0
	for steps := 4; steps < 60; steps++ {
		body := chattest.AgentSteps(steps, false)
		r, reused, err := ParseAfter(body, snap)
		sameParse(t, body, r, err)
		if reused != snap.Len() {
			t.Fatalf("step %d: reused %d of %d", steps, reused, snap.Len())
		}
		for i := range r.Messages {
			r.Messages[i].HasDigest = true // as the proxy does (shared ones carry theirs)
		}
		next := r.Snapshot()
		if next.a != snap.a {
			t.Fatalf("step %d: a new storage, not the conversation's", steps)
		}
		if &next.prefix[0] != &snap.prefix[0] {
			moved++
		}
		if len(next.msgs) != len(r.Messages) || !bytes.Equal(next.prefix, body[:len(next.prefix)]) {
			t.Fatalf("step %d: snapshot does not hold the body", steps)
		}
		snaps, bodies = append(snaps, snap), append(bodies, body)
		snap = next
	}
	if moved == 0 || moved > 10 {
		t.Fatalf("storage moved %d times over 56 steps: want a few (it grows by doubling)", moved)
	}
	for i, s := range snaps {
		r, reused, err := ParseAfter(bodies[i], s)
		sameParse(t, bodies[i], r, err)
		if reused != s.Len() {
			t.Fatalf("old snapshot %d: reused %d of %d", i, reused, s.Len())
		}
	}
}

// Two requests parsed after the same snapshot both take one: the first
// extends the shared storage, the second (no longer at its tip) copies.
// Parses from the old snapshot run meanwhile (go test -race).
func TestSnapshotConcurrentExtend(t *testing.T) {
	snap := mustParse(t, chattest.AgentSteps(5, false)).Snapshot()
	a, b := chattest.AgentSteps(6, false), chattest.AgentSteps(7, false)
	ra, _, _ := ParseAfter(a, snap)
	rb, _, _ := ParseAfter(b, snap)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 50 {
			r, _, err := ParseAfter(chattest.AgentSteps(5, false), snap)
			if err != nil || len(r.Messages) != snap.Len() {
				t.Error("a parse after the old snapshot failed")
				return
			}
		}
	}()
	sa, sb := ra.Snapshot(), rb.Snapshot()
	<-done
	if sa.a != snap.a || sb.a == snap.a {
		t.Fatal("want the first snapshot to extend the storage and the second to copy")
	}
	for _, c := range []struct {
		s    *Snapshot
		body []byte
	}{{sa, a}, {sb, b}} {
		next := append(bytes.Clone(c.body[:len(c.body)-1]), []byte(`,"x":1}`)...)
		r, reused, err := ParseAfter(next, c.s)
		sameParse(t, next, r, err)
		if reused != c.s.Len() {
			t.Fatalf("reused %d of %d", reused, c.s.Len())
		}
	}
}
