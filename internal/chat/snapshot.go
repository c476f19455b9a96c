package chat

import (
	"bytes"
	"sort"
	"sync"
)

// Snapshot is a parsed body kept so that a later body that starts with the
// same bytes is not scanned again: an agent resends its whole history at
// every step, so all but the newest messages of a request were parsed
// before. ParseAfter takes the messages the two bodies share byte for byte
// from the snapshot and resumes parsing after them.
//
// A Snapshot holds a copy of the bytes it covers (the body from its first
// byte to the end of its last message) and its messages, and is immutable
// once made: any number of parses may use one at the same time. It carries
// each message's Digest as it was when the snapshot was taken; a digest is
// a function of the message's bytes alone, so it holds for every body that
// shares them.
//
// The snapshots of one conversation share their storage (an arena): a
// snapshot of the next step, taken from a request parsed after the newest
// snapshot, appends only that step's bytes and messages to it.
type Snapshot struct {
	a      *arena
	prefix []byte    // the body up to the end of the last message
	msgs   []Message // Raw and Content point into prefix (except own-bytes messages)
	pos    []msgPos  // offsets in prefix, as Request.pos
	cuts   []int     // see arena.cuts
	// firstOwn is the index of the first own-bytes message, -1 when none.
	firstOwn int
	// held is the memory of the storage when the snapshot was taken, spare
	// room included.
	held   int
	fields []Field // the top-level fields before "messages", values in prefix
	at     []int   // offsets of fields' values in prefix
	head   headState
}

// arena is the storage the snapshots of one conversation share: the bytes
// of its newest body up to its last message, and its messages, offsets and
// cuts. Each snapshot is a prefix of it (its own slices, capped at its
// length). Only a snapshot of the arena's tip (the newest) extends it, in
// place while there is room: no snapshot ever reads past its own length,
// so appending writes only memory nobody reads. When there is no room the
// arena moves to new arrays (twice the size), and the older snapshots keep
// the old ones.
type arena struct {
	mu    sync.Mutex
	bytes []byte
	msgs  []Message
	pos   []msgPos
	// cuts lists, in body order, the messages ParseAfter may resume after
	// (those whose bytes are the body's: an own-bytes message has no
	// offset to resume at, so the cut before it is the last one).
	cuts []int
	// firstOwn is the index of the first own-bytes message, -1 when none.
	firstOwn int
}

// Len is the number of messages the snapshot holds.
func (s *Snapshot) Len() int { return len(s.msgs) }

// Size is the memory the snapshot holds, roughly, in bytes: its copy of the
// body and its message views, with the room its storage keeps for the
// next steps (shared with the snapshots of the same conversation's earlier
// steps).
func (s *Snapshot) Size() int {
	return s.held + len(s.fields)*64
}

// perMessage is roughly the memory of one stored message: a Message, its
// offsets and cut, tool calls aside.
const perMessage = 256

// Snapshot returns a snapshot of r's messages as they are now (with the
// Digest fields the caller has set), or nil when r cannot be resumed from:
// the body has no message, or more than one "messages" key (the last one
// wins, and a resumed parse would have to replay the first), or r.Messages
// is no longer the parse's own slice (a message was replaced, inserted or
// removed in place: then their offsets are unknown).
//
// When r was parsed after the newest snapshot of its conversation and
// shares all of its messages, the new snapshot extends that one's storage
// with r's new bytes and messages only; otherwise it copies the body up to
// the end of the last message.
func (r *Request) Snapshot() *Snapshot {
	if r.messagesKeys != 1 || len(r.Messages) == 0 || len(r.pos) != len(r.Messages) || r.shared > len(r.Messages) {
		return nil
	}
	// Check that every message still is the parse's: the offsets below are
	// only valid for bytes that sit where Parse found them.
	for k := range r.Messages {
		m, p := &r.Messages[k], r.pos[k]
		if k < r.shared {
			if !sameBytes(m.Raw, r.from.msgs[k].Raw) || !sameBytes(m.Content, r.from.msgs[k].Content) {
				return nil
			}
			continue
		}
		if p.raw < 0 {
			continue
		}
		if len(m.Raw) == 0 || p.raw+len(m.Raw) != p.end || p.end > len(r.Body) || &m.Raw[0] != &r.Body[p.raw] {
			return nil
		}
		if len(m.Content) > 0 && (p.content < p.raw || p.content+len(m.Content) > p.end || &m.Content[0] != &r.Body[p.content]) {
			return nil
		}
	}
	var s *Snapshot
	if r.from != nil && r.shared == len(r.from.msgs) {
		s = r.from.a.extend(r)
	}
	if s == nil {
		s = newArena(r)
	}
	n := r.head.fields
	s.fields = make([]Field, n)
	s.at = make([]int, n)
	for j := range n {
		f, at := r.Fields[j], r.fieldAt[j]
		s.fields[j] = Field{Key: f.Key, Value: s.prefix[at : at+len(f.Value) : at+len(f.Value)]}
		s.at[j] = at
	}
	s.head = r.head
	return s
}

// sameBytes reports whether a and b are the same bytes in memory.
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// newArena copies r into a new arena, with room for a few more steps, and
// returns its snapshot.
func newArena(r *Request) *Snapshot {
	end := r.pos[len(r.pos)-1].end
	n := len(r.Messages)
	a := &arena{
		firstOwn: -1,
		bytes:    make([]byte, end, end+end/4+4096),
		msgs:     make([]Message, 0, n+n/4+16),
		pos:      append(make([]msgPos, 0, n+n/4+16), r.pos...),
		cuts:     make([]int, 0, n+n/4+16),
	}
	copy(a.bytes, r.Body[:end])
	a.appendMessages(r.Messages, r.pos, 0)
	return a.tip()
}

// appendMessages appends msgs (at pos in the body, which from its first
// byte to the end of the last of them is a.bytes) to a.msgs, their bytes
// re-pointed into a.bytes; first is the index of msgs[0]. a.pos is the
// caller's.
func (a *arena) appendMessages(msgs []Message, pos []msgPos, first int) {
	for k := range msgs {
		m, p := msgs[k], pos[k]
		if p.raw >= 0 {
			m.Raw, m.Content = rebase(a.bytes, p, len(m.Raw), len(m.Content), m.Content != nil)
			a.cuts = append(a.cuts, first+k)
		} else if a.firstOwn < 0 {
			a.firstOwn = first + k
		}
		a.msgs = append(a.msgs, m)
	}
}

// tip returns the snapshot of everything a holds. The caller holds a.mu
// or is a's only user.
func (a *arena) tip() *Snapshot {
	end := len(a.bytes)
	return &Snapshot{
		a:        a,
		firstOwn: a.firstOwn,
		held:     cap(a.bytes) + perMessage*cap(a.msgs),
		prefix:   a.bytes[:end:end],
		msgs:     a.msgs[:len(a.msgs):len(a.msgs)],
		pos:      a.pos[:len(a.pos):len(a.pos)],
		cuts:     a.cuts[:len(a.cuts):len(a.cuts)],
	}
}

// extend appends r's messages after those of r.from (all of which r
// shares) and returns the new tip, or nil when r.from is no longer the
// tip (another request extended it first).
func (a *arena) extend(r *Request) *Snapshot {
	from := r.from
	end := r.pos[len(r.pos)-1].end
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.msgs) != len(from.msgs) || len(a.bytes) != len(from.prefix) {
		return nil
	}
	if end > cap(a.bytes) {
		// Move to arrays twice the size; the messages go along, re-pointed
		// into the new bytes (older snapshots keep the old arrays).
		nb := make([]byte, len(a.bytes), max(2*cap(a.bytes), end+end/4))
		copy(nb, a.bytes)
		old := a.msgs
		a.bytes = nb
		a.msgs = make([]Message, 0, max(2*cap(old), len(r.Messages)+16))
		a.cuts, a.firstOwn = a.cuts[:0:0], -1
		a.appendMessages(old, a.pos, 0)
	}
	// from.prefix is r.Body's first bytes: r shares all of from's messages.
	a.bytes = append(a.bytes, r.Body[len(a.bytes):end]...)
	n := len(a.msgs)
	a.pos = append(a.pos, r.pos[n:]...)
	a.appendMessages(r.Messages[n:], r.pos[n:], n)
	return a.tip()
}

// rebase returns Raw and Content of a message at p in data. Raw is capped at
// its length like the parser's (an append never writes into the next
// message); Content keeps the parser's form too.
func rebase(data []byte, p msgPos, rawLen, contentLen int, hasContent bool) (raw, content []byte) {
	raw = data[p.raw : p.raw+rawLen : p.raw+rawLen]
	if hasContent {
		content = data[p.content : p.content+contentLen]
	}
	return raw, content
}

// commonPrefix returns the length of the longest common prefix of a and b.
func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	const chunk = 4096
	i := 0
	for i+chunk <= n && bytes.Equal(a[i:i+chunk], b[i:i+chunk]) {
		i += chunk
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// Shared is the number of leading messages ParseAfter(body, s) takes from
// s: up to the last message (with bytes of the body's own) whose element
// ends within the common prefix of body and the snapshot's body.
func (s *Snapshot) Shared(body []byte) int {
	lcp := commonPrefix(body, s.prefix)
	c := sort.Search(len(s.cuts), func(c int) bool { return s.pos[s.cuts[c]].end > lcp }) - 1
	if c < 0 {
		return 0
	}
	return s.cuts[c] + 1
}

// Shared is the number of leading messages of r that ParseAfter took from
// a snapshot: their bytes are the snapshot's (immutable, never reused), not
// r.Body's.
func (r *Request) Shared() int { return r.shared }

// ParseAfter is Parse for a body that may start with the bytes of snap's
// body. The messages the two share byte for byte (every message whose
// element ends within their common prefix) are taken from snap as they
// are, and parsing resumes after the last of them. The result and the
// error are what Parse(body) returns, except that the shared messages keep
// their Digest and that their Raw and Content are the snapshot's copy of
// the same bytes; reused is how many leading messages came from snap (0
// when snap is nil or nothing is shared: then it is a plain Parse).
//
// The shared messages are the snapshot's own, in r.Messages too: a caller
// must not write them in place (Digest included; they carry theirs).
// Appending to r.Messages never writes into the snapshot.
//
// The scanner reads a body from left to right and its state after a
// message depends on the bytes up to that message's end alone, so resuming
// there with the state the snapshot recorded is the same parse. The
// bytes before the cut are known to be valid (snap came from a successful
// parse) and to carry no shape error.
func ParseAfter(body []byte, snap *Snapshot) (r *Request, reused int, err error) {
	if snap == nil {
		r, err = Parse(body)
		return r, 0, err
	}
	n := snap.Shared(body)
	if n == 0 {
		r, err = Parse(body)
		return r, 0, err
	}
	k := n - 1 // resume after message k
	p := parser{
		scanner:       scanner{data: body, strict: true},
		r:             &Request{Body: body, Fields: make([]Field, 0, max(16, snap.head.fields+8))},
		maxTokens:     snap.head.maxTokens,
		maxCompletion: snap.head.maxCompletion,
	}
	r = p.r
	for j, f := range snap.fields {
		at := snap.at[j]
		r.Fields = append(r.Fields, Field{Key: f.Key, Value: body[at : at+len(f.Value)]})
		r.fieldAt = append(r.fieldAt, at)
	}
	r.Model, r.Stream, r.IncludeUsage = snap.head.model, snap.head.stream, snap.head.includeUsage
	r.head = snap.head
	r.messagesKeys = 1
	// Capped at n: a message parsed now is appended to a copy.
	r.Messages = snap.msgs[:n:n]
	r.pos = snap.pos[:n:n]
	r.shared, r.from = n, snap
	r.stripped = snap.firstOwn >= 0 && snap.firstOwn < n // an own-bytes message before the cut
	last := &snap.msgs[k]
	r.UIOnlyRemoved = last.Index - k
	v := snap.head.value
	i := p.elements(v, snap.pos[k].end, last.Index+1, true)
	if i >= 0 {
		r.Fields = append(r.Fields, Field{Key: "messages", Value: body[v:i]})
		r.fieldAt = append(r.fieldAt, v)
		if j, more := p.next(i, '}'); more {
			i = p.members(j, true)
		} else {
			i = j
		}
	}
	if r, err = p.finish(i); err != nil {
		return nil, 0, err
	}
	return r, n, nil
}
