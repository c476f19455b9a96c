package chat

import (
	"bytes"
	"sort"
)

// Snapshot is a parsed body kept so that a later body that starts with the
// same bytes is not scanned again: an agent resends its whole history at
// every step, so all but the newest messages of a request were parsed
// before. ParseAfter takes the messages the two bodies share byte for byte
// from the snapshot and resumes parsing after them.
//
// A Snapshot owns a copy of the bytes it covers (the body from its first
// byte to the end of its last message) and is immutable once made: any
// number of parses may use one at the same time. It carries each message's
// Digest as it was when the snapshot was taken; a digest is a function of
// the message's bytes alone, so it holds for every body that shares them.
type Snapshot struct {
	prefix []byte    // the body up to the end of the last message
	msgs   []Message // Raw and Content point into prefix (except own-bytes messages)
	pos    []msgPos  // offsets in prefix, as Request.pos
	fields []Field   // the top-level fields before "messages", values in prefix
	at     []int     // offsets of fields' values in prefix
	head   headState
	// cuts lists, in body order, the messages ParseAfter may resume after
	// (those whose bytes are the body's: an own-bytes message has no
	// offset to resume at, so the cut before it is the last one).
	cuts []int
}

// Len is the number of messages the snapshot holds.
func (s *Snapshot) Len() int { return len(s.msgs) }

// Size is the memory the snapshot holds, roughly, in bytes: its copy of the
// body and its message views.
func (s *Snapshot) Size() int {
	const perMessage = 256 // a Message and its offsets, tool calls aside
	return len(s.prefix) + perMessage*len(s.msgs) + len(s.fields)*64
}

// Snapshot returns a snapshot of r's messages as they are now (with the
// Digest fields the caller has set), or nil when r cannot be resumed from:
// the body has no message, or more than one "messages" key (the last one
// wins, and a resumed parse would have to replay the first), or r.Messages
// is no longer the parse's own slice (a message was replaced, inserted or
// removed in place: then their offsets are unknown). It copies the body up
// to the end of the last message.
func (r *Request) Snapshot() *Snapshot {
	if r.messagesKeys != 1 || len(r.Messages) == 0 || len(r.pos) != len(r.Messages) {
		return nil
	}
	// Check that every message still is the parse's: the offsets below are
	// only valid for bytes that sit where Parse found them.
	for k := range r.Messages {
		m, p := &r.Messages[k], r.pos[k]
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
	end := r.pos[len(r.pos)-1].end
	s := &Snapshot{
		prefix: bytes.Clone(r.Body[:end]),
		msgs:   make([]Message, len(r.Messages)),
		pos:    append([]msgPos(nil), r.pos...),
		head:   r.head,
		cuts:   make([]int, 0, len(r.Messages)),
	}
	for k := range r.Messages {
		m, p := r.Messages[k], s.pos[k]
		if p.raw >= 0 {
			m.Raw, m.Content = rebase(s.prefix, p, len(m.Raw), len(m.Content), m.Content != nil)
			s.cuts = append(s.cuts, k)
		}
		s.msgs[k] = m
	}
	n := r.head.fields
	s.fields = make([]Field, n)
	s.at = make([]int, n)
	for j := range n {
		f, at := r.Fields[j], r.fieldAt[j]
		s.fields[j] = Field{Key: f.Key, Value: s.prefix[at : at+len(f.Value)]}
		s.at[j] = at
	}
	return s
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

// ParseAfter is Parse for a body that may start with the bytes of snap's
// body. The messages the two share byte for byte (every message whose
// element ends within their common prefix) are taken from snap, with their
// Raw and Content pointing into body and their Digest kept, and parsing
// resumes after the last of them. The result and the error are what
// Parse(body) returns, Digest fields aside; reused is the number of leading
// messages that came from snap (0 when snap is nil or nothing is shared:
// then it is a plain Parse).
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
		scanner:       scanner{data: body},
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
	// Room for a few new messages without growing.
	r.Messages = make([]Message, n, n+8)
	r.pos = make([]msgPos, n, n+8)
	copy(r.pos, snap.pos[:n])
	for j := range n {
		m, q := snap.msgs[j], snap.pos[j]
		if q.raw >= 0 {
			m.Raw, m.Content = rebase(body, q, len(m.Raw), len(m.Content), m.Content != nil)
		} else {
			r.stripped = true // own bytes, immutable: shared as they are
		}
		r.Messages[j] = m
	}
	last := r.Messages[k]
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
