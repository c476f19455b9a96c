package chat

// NewTextMessage returns a message compactproxy synthesizes (a summary, an
// acknowledgement): {"role":role,"content":text}, Index -1, view filled.
func NewTextMessage(role, text string) Message {
	raw := make([]byte, 0, len(role)+len(text)+32)
	raw = append(raw, `{"role":`...)
	raw = appendString(raw, role)
	raw = append(raw, `,"content":`...)
	raw = appendString(raw, text)
	raw = append(raw, '}')
	return decodeMessage(raw, -1)
}

// Text returns the text of m's content: a string content decoded, or the
// "text" of its text parts joined with "\n" (image, audio and file parts
// skipped); "" when the content is null, absent or of another type.
func Text(m Message) string {
	c := m.Content
	if len(c) == 0 {
		return ""
	}
	s := scanner{data: c}
	switch c[0] {
	case '"':
		end := s.str(0)
		if end < 0 {
			return ""
		}
		return text(c[:end], s.esc > 0)
	case '[':
	default:
		return ""
	}
	var b []byte
	n := 0
	i := s.ws(1)
	for i >= 0 && i < len(c) && c[i] != ']' {
		if c[i] == '{' {
			var typ, txt []byte
			media := false
			i = s.object(i, func(key []byte, _, v int) int {
				switch string(key) {
				case "type", "text":
					if c[v] != '"' {
						if string(key) == "type" {
							typ = nil
						} else {
							txt = nil
						}
						return s.skip(v, 0)
					}
					end := s.str(v)
					if end < 0 {
						return -1
					}
					if string(key) == "type" {
						typ = c[v+1 : end-1]
						if s.esc > 0 {
							typ = appendUnescaped(nil, typ)
						}
					} else {
						txt = c[v:end]
					}
					return end
				case "image_url", "input_audio":
					media = true
				}
				return s.skip(v, 0)
			})
			if i >= 0 && txt != nil && !media && !isMediaType(typ) {
				if n > 0 {
					b = append(b, '\n')
				}
				n++
				b = appendUnescaped(b, txt[1:len(txt)-1])
			}
		} else {
			i = s.skip(i, 0)
		}
		if i < 0 {
			break
		}
		if i, _ = s.next(i, ']'); i < 0 {
			break
		}
		i = s.ws(i)
	}
	return string(b)
}

// member is one member of an object: its key and byte offsets.
type member struct {
	key        string
	start, val int // the key's opening quote, the value's first byte
	end        int // after the value
}

// members lists the members of the valid JSON object raw (whitespace
// around it allowed); ok is false when raw is not an object. close is the
// index after the object's '}'.
func members(raw []byte) (list []member, open, close int, ok bool) {
	s := scanner{data: raw}
	open = s.ws(0)
	if open >= len(raw) || raw[open] != '{' {
		return nil, 0, 0, false
	}
	close = s.object(open, func(key []byte, start, v int) int {
		e := s.skip(v, 1)
		list = append(list, member{key: string(key), start: start, val: v, end: e})
		return e
	})
	if close < 0 {
		return nil, 0, 0, false
	}
	return list, open, close, true
}

// WithContentText returns a copy of m whose "content" value is the JSON
// string text (added when m has no content). Every other member keeps its
// bytes and order; the view is decoded again and the digest cleared. A
// message whose Raw is not a JSON object is returned as is.
func WithContentText(m Message, text string) Message {
	return withContent(m, appendString(nil, text))
}

// WithContentTextPart is WithContentText for a message whose content is an
// array of parts: the content becomes an array of one text part holding
// text, so the message keeps its shape (a client or a template that
// expects parts still gets parts).
func WithContentTextPart(m Message, text string) Message {
	value := append([]byte(`[{"type":"text","text":`), appendString(nil, text)...)
	return withContent(m, append(value, "}]"...))
}

// withContent replaces (or adds) m's "content" with the JSON value.
func withContent(m Message, value []byte) Message {
	list, _, close, ok := members(m.Raw)
	if !ok {
		return m
	}
	out := make([]byte, 0, len(m.Raw)+len(value)+16)
	last, found := 0, false
	for _, mb := range list {
		if mb.key != "content" {
			continue
		}
		out = append(out, m.Raw[last:mb.val]...)
		out = append(out, value...)
		last, found = mb.end, true
	}
	if !found {
		brace := close - 1 // the object's '}'
		out = append(out, m.Raw[:brace]...)
		if len(list) > 0 {
			out = append(out, ',')
		}
		out = append(out, `"content":`...)
		out = append(out, value...)
		last = brace
	}
	out = append(out, m.Raw[last:]...)
	return redecode(m, out)
}

// DropToolCalls returns a copy of m without the tool calls at the given
// indexes of m.ToolCalls (out-of-range indexes are ignored). The remaining
// entries keep their bytes; when none remain the "tool_calls" key is removed
// (strict APIs reject an empty array). Earlier duplicate "tool_calls" keys,
// which the view ignores, are removed too. m is returned as is when no index
// names a call.
func DropToolCalls(m Message, drop []int) Message {
	if len(m.ToolCalls) == 0 {
		return m
	}
	hit := false
	for _, d := range drop {
		if d >= 0 && d < len(m.ToolCalls) {
			hit = true
		}
	}
	if !hit {
		return m
	}
	list, open, close, ok := members(m.Raw)
	if !ok {
		return m
	}
	lastTC := -1
	for k, mb := range list {
		if mb.key == "tool_calls" {
			lastTC = k
		}
	}
	if lastTC < 0 || m.Raw[list[lastTC].val] != '[' {
		return m
	}
	// The elements of the array.
	tc := list[lastTC]
	var elems []span
	s := scanner{data: m.Raw}
	i := s.ws(tc.val + 1)
	for i >= 0 && i < tc.end && m.Raw[i] != ']' {
		e := s.skip(i, 2)
		if e < 0 {
			return m
		}
		elems = append(elems, span{i, e})
		i, _ = s.next(e, ']')
		if i >= 0 {
			i = s.ws(i)
		}
	}
	keepElem := make([]bool, len(elems))
	remaining := 0
	for k := range elems {
		keepElem[k] = true
		for _, d := range drop {
			if d == k {
				keepElem[k] = false
			}
		}
		if keepElem[k] {
			remaining++
		}
	}
	raw := m.Raw
	if remaining > 0 {
		arr := appendWithout(make([]byte, 0, tc.end-tc.val), raw, tc.val, tc.end, elems, keepElem)
		out := make([]byte, 0, len(raw))
		out = append(out, raw[:tc.val]...)
		out = append(out, arr...)
		raw = append(out, raw[tc.end:]...)
		if list, open, close, ok = members(raw); !ok {
			return m
		}
	}
	// Remove the "tool_calls" members the view does not use (and the last
	// one too when no call remains).
	items := make([]span, len(list))
	keep := make([]bool, len(list))
	removing := false
	for k, mb := range list {
		items[k] = span{mb.start, mb.end}
		keep[k] = mb.key != "tool_calls" || (k == lastTC && remaining > 0)
		removing = removing || !keep[k]
	}
	if removing {
		out := make([]byte, 0, len(raw))
		out = append(out, raw[:open]...)
		out = appendWithout(out, raw, open, close, items, keep)
		raw = append(out, raw[close:]...)
	}
	return redecode(m, raw)
}

// redecode returns the message raw decoded, keeping m's Index; the digest
// is cleared because the bytes changed.
func redecode(m Message, raw []byte) Message {
	return decodeMessage(raw, m.Index)
}
