package chat

// messageInfo is what decoding a message learns besides the Message view.
type messageInfo struct {
	roleSeen bool // a "role" key is present
	roleOK   bool // "role" (last occurrence) is a string
	uiOnly   bool // "ui_only" (last occurrence) is the literal true
	uiKeys   int  // number of "ui_only" members
	// contentAt is the index of the (last) "content" value, -1 when absent.
	contentAt int
}

// message decodes the object whose '{' is at i, nested inside depth
// containers, into m (view fields only; Raw and Index are the caller's) and
// returns the index after it. Member spans are left in s.members, with the
// "ui_only" members flagged by a negative from (see stripMembers).
//
// Duplicate keys: the last occurrence wins, as with encoding/json.
func (s *scanner) message(i, depth int, m *Message, info *messageInfo) int {
	data := s.data
	s.members = s.members[:0]
	depth++ // the message object
	i = s.ws(i + 1)
	if i < len(data) && data[i] == '}' {
		return i + 1
	}
	for {
		if i >= len(data) || data[i] != '"' {
			return s.unexpected(i, "where an object key was expected")
		}
		memberStart := i
		kend := s.str(i)
		if kend < 0 {
			return -1
		}
		key := data[i+1 : kend-1]
		if s.esc > 0 {
			key = appendUnescaped(nil, key)
		}
		v := s.colon(kend)
		if v < 0 {
			return -1
		}
		i = v
		ui := false
		switch string(key) { // no allocation: the compiler compares in place
		case "role":
			info.roleSeen = true
			if data[v] == '"' {
				i = s.str(v)
				if i < 0 {
					return -1
				}
				m.Role = role(data[v:i], s.esc > 0)
				info.roleOK = true
			} else {
				i = s.skip(v, depth)
				m.Role, info.roleOK = "", false
			}
		case "content":
			info.contentAt = v
			i = s.content(v, depth, m)
		case "tool_calls":
			i = s.toolCalls(v, depth, m)
		case "tool_call_id":
			m.ToolCallID, m.HasToolCallID = "", false
			if data[v] == '"' {
				i = s.str(v)
				if i >= 0 {
					m.ToolCallID, m.HasToolCallID = text(data[v:i], s.esc > 0), true
				}
			} else {
				i = s.skip(v, depth)
			}
		case "name":
			m.Name = ""
			if data[v] == '"' {
				i = s.str(v)
				if i >= 0 {
					m.Name = text(data[v:i], s.esc > 0)
				}
			} else {
				i = s.skip(v, depth)
			}
		case "function_call":
			m.FunctionCall = data[v] == '{'
			i = s.skip(v, depth)
		case "reasoning_content":
			m.HasReasoning = data[v] != 'n' // anything but null
			i = s.skip(v, depth)
		case "ui_only":
			ui = true
			info.uiKeys++
			i = s.skip(v, depth)
			info.uiOnly = i == v+4 && data[v] == 't'
		default:
			i = s.skip(v, depth)
		}
		if i < 0 {
			return -1
		}
		if ui {
			s.members = append(s.members, span{-1 - memberStart, i})
		} else {
			s.members = append(s.members, span{memberStart, i})
		}
		var more bool
		if i, more = s.next(i, '}'); !more {
			return i
		}
	}
}

// role returns the role string, without allocating for the usual ones.
func role(raw []byte, escaped bool) string {
	if !escaped {
		switch string(raw[1 : len(raw)-1]) {
		case "user":
			return "user"
		case "assistant":
			return "assistant"
		case "system":
			return "system"
		case "tool":
			return "tool"
		case "developer":
			return "developer"
		case "function":
			return "function"
		}
	}
	return text(raw, escaped)
}

// content decodes the "content" value at v into m and returns its end.
func (s *scanner) content(v, depth int, m *Message) int {
	data := s.data
	m.ContentIsString, m.TextBytes, m.MediaParts, m.MediaBytes = false, 0, 0, 0
	var end int
	switch data[v] {
	case '"':
		end = s.str(v)
		if end >= 0 {
			m.ContentIsString = true
			m.TextBytes = end - v - 2 - s.esc
		}
	case '[':
		end = s.parts(v, depth+1, m)
	default:
		end = s.skip(v, depth)
	}
	if end >= 0 {
		m.Content = data[v:end]
	}
	return end
}

// parts decodes a content part array whose '[' is at i (depth counts it).
func (s *scanner) parts(i, depth int, m *Message) int {
	data := s.data
	if depth > maxDepth {
		return s.fail(i, "nesting too deep")
	}
	i = s.ws(i + 1)
	if i < len(data) && data[i] == ']' {
		return i + 1
	}
	for {
		if i >= len(data) {
			return s.unexpected(i, "inside array")
		}
		if data[i] == '{' {
			i = s.part(i, depth, m)
		} else {
			i = s.skip(i, depth)
		}
		if i < 0 {
			return -1
		}
		var more bool
		if i, more = s.next(i, ']'); !more {
			return i
		}
	}
}

// part decodes one content part object at i and adds it to m's counts.
func (s *scanner) part(i, depth int, m *Message) int {
	data := s.data
	start := i
	depth++
	if depth > maxDepth {
		return s.fail(i, "nesting too deep")
	}
	media, textBytes := false, -1
	var typ []byte
	i = s.ws(i + 1)
	if i < len(data) && data[i] == '}' {
		return i + 1
	}
	for {
		if i >= len(data) || data[i] != '"' {
			return s.unexpected(i, "where an object key was expected")
		}
		kend := s.str(i)
		if kend < 0 {
			return -1
		}
		key := data[i+1 : kend-1]
		if s.esc > 0 {
			key = appendUnescaped(nil, key)
		}
		v := s.colon(kend)
		if v < 0 {
			return -1
		}
		switch string(key) {
		case "type":
			typ = nil
			if data[v] == '"' {
				i = s.str(v)
				if i >= 0 {
					typ = data[v+1 : i-1]
					if s.esc > 0 {
						typ = appendUnescaped(nil, typ)
					}
				}
			} else {
				i = s.skip(v, depth)
			}
		case "text":
			textBytes = -1
			if data[v] == '"' {
				i = s.str(v)
				if i >= 0 {
					textBytes = i - v - 2 - s.esc
				}
			} else {
				i = s.skip(v, depth)
			}
		case "image_url", "input_audio":
			media = true
			i = s.skip(v, depth)
		default:
			i = s.skip(v, depth)
		}
		if i < 0 {
			return -1
		}
		var more bool
		if i, more = s.next(i, '}'); !more {
			break
		}
	}
	if i < 0 {
		return -1
	}
	if media || isMediaType(typ) {
		m.MediaParts++
		m.MediaBytes += i - start
	} else if textBytes >= 0 {
		m.TextBytes += textBytes
	}
	return i
}

// isMediaType tells whether a content part "type" is image, audio or file.
func isMediaType(t []byte) bool {
	switch string(t) {
	case "image_url", "input_image", "image", "input_audio", "audio", "file", "input_file":
		return true
	}
	return false
}

// toolCalls decodes the "tool_calls" value at v into m.ToolCalls. null, []
// and values that are not arrays mean no calls; an element that is not an
// object is a call without an id (pairing then reports it).
func (s *scanner) toolCalls(v, depth int, m *Message) int {
	data := s.data
	m.ToolCalls = nil
	if data[v] != '[' {
		return s.skip(v, depth)
	}
	depth++
	if depth > maxDepth {
		return s.fail(v, "nesting too deep")
	}
	first := len(s.calls)
	i := s.ws(v + 1)
	if i < len(data) && data[i] == ']' {
		return i + 1
	}
	for {
		if i >= len(data) {
			return s.unexpected(i, "inside array")
		}
		var c ToolCall
		if data[i] == '{' {
			i = s.call(i, depth, &c)
		} else {
			i = s.skip(i, depth)
		}
		if i < 0 {
			return -1
		}
		s.calls = append(s.calls, c)
		var more bool
		if i, more = s.next(i, ']'); !more {
			break
		}
	}
	if i >= 0 {
		// Full slice expression: a later append to one message's calls
		// can never write into the next message's.
		m.ToolCalls = s.calls[first:len(s.calls):len(s.calls)]
	}
	return i
}

// call decodes one tool call object at i: "id" and "function"."name".
func (s *scanner) call(i, depth int, c *ToolCall) int {
	data := s.data
	depth++
	if depth > maxDepth {
		return s.fail(i, "nesting too deep")
	}
	return s.object(i, func(key []byte, _, v int) int {
		switch string(key) {
		case "id":
			c.ID, c.HasID = "", false
			if data[v] == '"' {
				end := s.str(v)
				if end >= 0 {
					c.ID, c.HasID = text(data[v:end], s.esc > 0), true
				}
				return end
			}
		case "function":
			c.Name = ""
			if data[v] == '{' && depth < maxDepth {
				return s.object(v, func(key []byte, _, v int) int {
					if string(key) == "name" && data[v] == '"' {
						end := s.str(v)
						if end >= 0 {
							c.Name = text(data[v:end], s.esc > 0)
						}
						return end
					}
					if string(key) == "name" {
						c.Name = ""
					}
					return s.skip(v, depth+1)
				})
			}
		}
		return s.skip(v, depth)
	})
}

// object walks the members of the object whose '{' is at i, calling member
// with each unescaped key, the index of its opening quote and the index of
// its value; member returns the end
// of the value (or -1). It returns the index after the object.
func (s *scanner) object(i int, member func(key []byte, start, v int) int) int {
	data := s.data
	i = s.ws(i + 1)
	if i < len(data) && data[i] == '}' {
		return i + 1
	}
	for {
		if i >= len(data) || data[i] != '"' {
			return s.unexpected(i, "where an object key was expected")
		}
		kend := s.str(i)
		if kend < 0 {
			return -1
		}
		key := data[i+1 : kend-1]
		if s.esc > 0 {
			key = appendUnescaped(nil, key)
		}
		v := s.colon(kend)
		if v < 0 {
			return -1
		}
		if i = member(key, i, v); i < 0 {
			return -1
		}
		var more bool
		if i, more = s.next(i, '}'); !more {
			return i
		}
	}
}

// stripMembers returns the object data[from:to] without its "ui_only"
// members (flagged in s.members by a negative from) as a new slice.
func (s *scanner) stripMembers(from, to int) []byte {
	items := make([]span, len(s.members))
	keep := make([]bool, len(s.members))
	for k, mb := range s.members {
		if mb.from < 0 {
			items[k] = span{-1 - mb.from, mb.to}
		} else {
			items[k], keep[k] = mb, true
		}
	}
	return appendWithout(make([]byte, 0, to-from), s.data, from, to, items, keep)
}

// appendWithout appends the container data[from:to] (an object or array
// whose members or elements are items, in order) without the items whose
// keep is false. Each removed item goes with the comma and whitespace before
// it (with the ones after it when it leads); every other byte is kept.
func appendWithout(out, data []byte, from, to int, items []span, keep []bool) []byte {
	kept := 0
	prevEnd := -1 // end of the previous item, kept or not
	for k, it := range items {
		switch {
		case prevEnd < 0:
			out = append(out, data[from:it.from]...) // opener and leading whitespace
		case keep[k] && kept > 0:
			out = append(out, data[prevEnd:it.from]...) // separator as written
		}
		if keep[k] {
			out = append(out, data[it.from:it.to]...)
			kept++
		}
		prevEnd = it.to
	}
	if prevEnd < 0 {
		return append(out, data[from:to]...)
	}
	return append(out, data[prevEnd:to]...) // trailing whitespace and closer
}

// decodeMessage decodes a standalone message object (the helpers' results,
// which are known to be valid JSON objects).
func decodeMessage(raw []byte, index int) Message {
	m := Message{Raw: raw, Index: index}
	s := scanner{data: raw}
	var info messageInfo
	i := s.ws(0)
	if i < len(raw) && raw[i] == '{' {
		s.message(i, 0, &m, &info)
	}
	return m
}
