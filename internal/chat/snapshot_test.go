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
// from got must be as good as one taken from a full parse), and every Raw
// and Content pointing into body where Parse's do.
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
	// Digests are the caller's: compare without them.
	gm := append([]Message(nil), got.Messages...)
	for i := range gm {
		gm[i].Digest, gm[i].HasDigest = [32]byte{}, false
	}
	g := *got
	g.Messages = gm
	if len(g.Messages) == 0 && len(want.Messages) == 0 {
		g.Messages = want.Messages
	}
	if len(g.pos) == 0 && len(want.pos) == 0 {
		g.pos = want.pos
	}
	if !reflect.DeepEqual(&g, want) {
		t.Fatalf("ParseAfter differs from Parse:\n got %+v\nwant %+v", g, *want)
	}
	for i := range got.Messages {
		gr, wr := got.Messages[i].Raw, want.Messages[i].Raw
		if (&gr[0] == &body[0]) != (&wr[0] == &body[0]) {
			t.Fatalf("message %d: Raw points elsewhere than Parse's", i)
		}
		if want.pos[i].raw >= 0 && &gr[0] != &body[want.pos[i].raw] {
			t.Fatalf("message %d: Raw does not point into the body", i)
		}
		if c := got.Messages[i].Content; want.pos[i].raw >= 0 && len(c) > 0 && &c[0] != &body[want.pos[i].content] {
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
