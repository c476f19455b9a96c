package chat

// buildItem is one top-level member of the body Build writes.
type buildItem struct {
	key   string
	value []byte // nil for the messages array
}

// Build returns the body to forward: the client's top-level fields in their
// order with their value bytes, except that "messages" becomes the Raw of
// msgs joined by "," inside "[...]", and every field of set replaces the
// field with the same key (a nil Value deletes it); set keys the body does
// not have are appended at the end, in set's order. When the body repeats a
// key that Build writes (messages or a set key), only its last occurrence is
// written. Whitespace between top-level members is not kept.
//
// Every msgs[i].Raw must be a JSON object. The result is one allocation.
func (r *Request) Build(msgs []Message, set []Field) []byte {
	if r.src != nil {
		return r.buildDialect(msgs, set)
	}
	var stack [24]buildItem
	items := r.plan(stack[:0], set)

	size := 2 // braces
	for _, it := range items {
		size += quotedLen(it.key) + 2 // ':' and ','
		if it.value != nil {
			size += len(it.value)
			continue
		}
		size += 2 + len(msgs)
		for k := range msgs {
			size += len(msgs[k].Raw)
		}
	}

	out := make([]byte, 0, size)
	out = append(out, '{')
	for n, it := range items {
		if n > 0 {
			out = append(out, ',')
		}
		out = appendString(out, it.key)
		out = append(out, ':')
		if it.value != nil {
			out = append(out, it.value...)
			continue
		}
		out = append(out, '[')
		for k := range msgs {
			if k > 0 {
				out = append(out, ',')
			}
			out = append(out, msgs[k].Raw...)
		}
		out = append(out, ']')
	}
	return append(out, '}')
}

// plan lists the members Build writes, in order, appending to items.
func (r *Request) plan(items []buildItem, set []Field) []buildItem {
	// last returns the index of the last field with key k, or -1.
	last := func(k string) int {
		for j := len(r.Fields) - 1; j >= 0; j-- {
			if r.Fields[j].Key == k {
				return j
			}
		}
		return -1
	}
	sawMessages := false
	for j, f := range r.Fields {
		if s := setIndex(set, f.Key); s >= 0 {
			if set[s].Value != nil && last(f.Key) == j {
				items = append(items, buildItem{f.Key, set[s].Value})
			}
			continue
		}
		if f.Key == "messages" {
			if last(f.Key) == j {
				items = append(items, buildItem{key: f.Key})
				sawMessages = true
			}
			continue
		}
		value := f.Value
		if value == nil {
			value = []byte("null") // a hand-made Field: never write invalid JSON
		}
		items = append(items, buildItem{f.Key, value})
	}
	for s, f := range set {
		if f.Value != nil && last(f.Key) < 0 && setIndex(set, f.Key) == s {
			if f.Key == "messages" {
				sawMessages = true
			}
			items = append(items, buildItem{f.Key, f.Value})
		}
	}
	if !sawMessages && setIndex(set, "messages") < 0 {
		items = append(items, buildItem{key: "messages"})
	}
	return items
}

// setIndex returns the index of the first field of set with key k, or -1.
func setIndex(set []Field, k string) int {
	for s := range set {
		if set[s].Key == k {
			return s
		}
	}
	return -1
}

// quotedLen returns an upper bound of len(appendString(nil, s)).
func quotedLen(s string) int {
	n := len(s) + 2
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c < 0x20:
			n += 5
		case c == '"' || c == '\\':
			n++
		case c >= 0x80:
			n += 5 // an invalid byte may become \ufffd
		}
	}
	return n
}

// Unchanged tells whether forwarding msgs with no set fields would forward
// the client's body as it is: no message was removed (UI-only) or stripped of
// a "ui_only" key, and msgs are exactly the parsed messages, with Raw still
// pointing at their bytes in Body, in order. Then r.Body can be sent as is.
func (r *Request) Unchanged(msgs []Message) bool {
	if r.src != nil {
		return r.unchangedDialect(msgs)
	}
	if r.UIOnlyRemoved > 0 || r.stripped || len(msgs) != r.Total || r.msgEnd <= r.msgStart {
		return false
	}
	body := r.Body
	s := scanner{data: body}
	pos := s.ws(r.msgStart + 1) // after '['
	first := 0
	if n := r.shared; n > 0 {
		// Messages ParseAfter took from a snapshot hold the snapshot's
		// copy of the body's bytes: they are the body's when they are
		// those very messages.
		if len(msgs) < n {
			return false
		}
		for k := range n {
			if !sameBytes(msgs[k].Raw, r.Messages[k].Raw) {
				return false
			}
		}
		pos, first = s.ws(r.pos[n-1].end), n
	}
	for k := first; k < len(msgs); k++ {
		raw := msgs[k].Raw
		if k > 0 {
			if pos >= len(body) || body[pos] != ',' {
				return false
			}
			pos = s.ws(pos + 1)
		}
		if len(raw) == 0 || pos+len(raw) > len(body) || &raw[0] != &body[pos] {
			return false
		}
		pos = s.ws(pos + len(raw))
	}
	return pos == r.msgEnd-1 // at the ']'
}

// Forward returns r.Body when msgs and set change nothing (see Unchanged),
// else Build(msgs, set).
func (r *Request) Forward(msgs []Message, set []Field) []byte {
	if len(set) == 0 && r.Unchanged(msgs) {
		return r.Body
	}
	return r.Build(msgs, set)
}
