package chat

import (
	"strconv"
)

// parser is the scanner plus what Parse fills in.
type parser struct {
	scanner
	r *Request
	// shape is the first error in the shape of the request (messages not
	// an array, a role missing, ...). It is returned only when the whole
	// body is valid JSON: invalid JSON is reported first, wherever it is.
	shape *ParseError
	// Maximum token fields, -1 when absent (or not a number).
	maxTokens, maxCompletion int
}

func (p *parser) shapeError(param, msg string) {
	if p.shape == nil {
		p.shape = &ParseError{Message: msg, Param: param}
	}
}

// Parse parses a chat-completions request body in one pass, validating all
// of it as JSON. Messages keep the body's bytes (Raw is a sub-slice of body,
// except for messages that carried a "ui_only" key, which get a new slice
// without it); messages with "ui_only": true are removed and counted.
//
// Errors are *ParseError: invalid JSON anywhere (Param ""), a body that is not
// an object (""), "messages" missing or not an array ("messages"), an element
// that is not an object ("messages[N]"), a role missing or not a string
// ("messages[N].role"). Messages with "ui_only": true are dropped without
// checking their role. Duplicate keys: the last occurrence wins, as with
// encoding/json; every "messages" occurrence must have the right shape.
//
// body must not be modified while the Request is in use.
func Parse(body []byte) (*Request, error) {
	p := parser{
		scanner:       scanner{data: body, strict: true},
		r:             &Request{Body: body, Fields: make([]Field, 0, 16)},
		maxTokens:     -1,
		maxCompletion: -1,
	}
	i := p.ws(0)
	switch {
	case i >= len(body):
		i = p.unexpected(i, "where the request object was expected")
	case body[i] == '{':
		i = p.top(i)
	default:
		if i = p.skip(i, 0); i >= 0 {
			p.shapeError("", "request body must be a JSON object")
		}
	}
	return p.finish(i)
}

// finish checks that nothing but whitespace follows the top-level value
// that ended at i (-1: after an error) and returns the request or the
// first error.
func (p *parser) finish(i int) (*Request, error) {
	if i >= 0 {
		if j := p.ws(i); j < len(p.data) {
			p.unexpected(j, "after the top-level value")
		}
	}
	if p.err != nil {
		return nil, p.err
	}
	if p.shape != nil {
		return nil, p.shape
	}
	r := p.r
	switch {
	case p.maxCompletion >= 0:
		r.MaxTokens = p.maxCompletion
	case p.maxTokens >= 0:
		r.MaxTokens = p.maxTokens
	}
	return r, nil
}

// top parses the request object whose '{' is at i.
func (p *parser) top(i int) int {
	i = p.ws(i + 1)
	if i < len(p.data) && p.data[i] == '}' {
		p.shapeError("messages", `"messages" is missing`)
		return i + 1
	}
	return p.members(i, false)
}

// headState is what the parser knows when the "messages" value at v
// begins.
func (p *parser) headState(v int) headState {
	r := p.r
	return headState{fields: len(r.Fields), model: r.Model, stream: r.Stream, includeUsage: r.IncludeUsage,
		maxTokens: p.maxTokens, maxCompletion: p.maxCompletion, value: v}
}

// members parses the request object's members from the key at i to its
// closing brace; sawMessages tells whether a "messages" member came before
// i. It returns the index after the object.
func (p *parser) members(i int, sawMessages bool) int {
	data, r := p.data, p.r
	for {
		if i >= len(data) || data[i] != '"' {
			return p.unexpected(i, "where an object key was expected")
		}
		kend := p.str(i)
		if kend < 0 {
			return -1
		}
		key := data[i+1 : kend-1]
		if p.esc > 0 {
			key = appendUnescaped(nil, key)
		}
		v := p.colon(kend)
		if v < 0 {
			return -1
		}
		switch string(key) {
		case "messages":
			sawMessages = true
			r.messagesKeys++
			r.head = p.headState(v)
			i = p.messages(v)
		case "model":
			r.Model = ""
			if data[v] == '"' {
				if i = p.str(v); i >= 0 {
					r.Model = text(data[v:i], p.esc > 0)
				}
			} else {
				i = p.skip(v, 1)
			}
		case "stream":
			i = p.skip(v, 1)
			r.Stream = i == v+4 && data[v] == 't'
		case "max_tokens":
			i = p.skip(v, 1)
			p.maxTokens = intValue(data[v:max(i, v)])
		case "max_completion_tokens":
			i = p.skip(v, 1)
			p.maxCompletion = intValue(data[v:max(i, v)])
		case "stream_options":
			i = p.streamOptions(v)
		default:
			i = p.skip(v, 1)
		}
		if i < 0 {
			return -1
		}
		r.Fields = append(r.Fields, Field{Key: fieldKey(key), Value: data[v:i]})
		r.fieldAt = append(r.fieldAt, v)
		var more bool
		if i, more = p.next(i, '}'); !more {
			break
		}
	}
	if i >= 0 && !sawMessages {
		p.shapeError("messages", `"messages" is missing`)
	}
	return i
}

// streamOptions reads stream_options.include_usage from the value at v.
func (p *parser) streamOptions(v int) int {
	data := p.data
	p.r.IncludeUsage = false
	if data[v] != '{' {
		return p.skip(v, 1)
	}
	return p.object(v, func(key []byte, _, v int) int {
		end := p.skip(v, 2)
		if string(key) == "include_usage" {
			p.r.IncludeUsage = end == v+4 && data[v] == 't'
		}
		return end
	})
}

// intValue returns the integer value of a JSON number span, -1 when it is
// not a number or not a whole number that fits an int.
func intValue(b []byte) int {
	if len(b) == 0 || len(b) > 18 {
		if len(b) > 0 && (b[0] == '-' || isDigit(b[0])) {
			return floatInt(b)
		}
		return -1
	}
	n := 0
	for _, c := range b {
		if !isDigit(c) {
			if c == '-' || c == '.' || c == 'e' || c == 'E' || c == '+' {
				return floatInt(b)
			}
			return -1 // not a number: null, a string, ...
		}
		n = n*10 + int(c-'0')
	}
	return n
}

func floatInt(b []byte) int {
	f, err := strconv.ParseFloat(string(b), 64)
	if err != nil || f != float64(int64(f)) || f < 0 || f > 1<<53 {
		return -1
	}
	return int(f)
}

// fieldKey returns key as a string, without allocating for the usual keys.
func fieldKey(key []byte) string {
	switch string(key) {
	case "model":
		return "model"
	case "messages":
		return "messages"
	case "stream":
		return "stream"
	case "stream_options":
		return "stream_options"
	case "temperature":
		return "temperature"
	case "top_p":
		return "top_p"
	case "max_tokens":
		return "max_tokens"
	case "max_completion_tokens":
		return "max_completion_tokens"
	case "tools":
		return "tools"
	case "tool_choice":
		return "tool_choice"
	case "cache_prompt":
		return "cache_prompt"
	case "parallel_tool_calls":
		return "parallel_tool_calls"
	case "response_format":
		return "response_format"
	case "seed":
		return "seed"
	case "stop":
		return "stop"
	}
	return string(key)
}

// messages parses the "messages" value at v.
func (p *parser) messages(v int) int {
	data, r := p.data, p.r
	if data[v] != '[' {
		p.shapeError("messages", `"messages" must be an array`)
		return p.skip(v, 1)
	}
	// The last "messages" wins.
	r.Messages, r.Total, r.UIOnlyRemoved, r.stripped = r.Messages[:0], 0, 0, false
	r.pos = r.pos[:0]
	if r.shared > 0 {
		// The earlier array was resumed from a snapshot: its messages are
		// the snapshot's, never to be written over.
		r.Messages, r.pos, r.shared, r.from = nil, nil, 0, nil
	}
	r.msgStart = -1
	i := p.ws(v + 1)
	if i < len(data) && data[i] == ']' {
		r.msgStart, r.msgEnd = v, i+1
		return i + 1
	}
	return p.elements(v, i, 0, false)
}

// elements parses the elements of the messages array whose '[' is at v,
// from the one at i (after is false) or from what follows the element that
// ended at i (after is true: a comma and the next element, or the closing
// bracket); idx elements came before. It returns the index after the array.
func (p *parser) elements(v, i, idx int, after bool) int {
	data, r := p.data, p.r
	for {
		if after {
			var more bool
			if i, more = p.next(i, ']'); !more {
				break
			}
		}
		after = true
		if i >= len(data) {
			return p.unexpected(i, "inside array")
		}
		if data[i] == '{' {
			start := i
			r.Messages = append(r.Messages, Message{})
			m := &r.Messages[len(r.Messages)-1]
			info := messageInfo{contentAt: -1}
			if i = p.message(i, 2, m, &info); i < 0 {
				return -1
			}
			switch {
			case info.uiOnly:
				r.UIOnlyRemoved++
				r.Messages = r.Messages[:len(r.Messages)-1]
			default:
				if !info.roleOK {
					param := "messages[" + strconv.Itoa(idx) + "].role"
					if info.roleSeen {
						p.shapeError(param, param+" must be a string")
					} else {
						p.shapeError(param, param+" is missing")
					}
				}
				if info.uiKeys > 0 {
					// Rare: decode the new bytes again so that Content
					// points into Raw like for every other message.
					*m = decodeMessage(p.stripMembers(start, i), idx)
					r.stripped = true
					r.pos = append(r.pos, msgPos{raw: -1, content: -1, end: i})
				} else {
					m.Index = idx
					m.Raw = data[start:i:i]
					r.pos = append(r.pos, msgPos{raw: start, content: info.contentAt, end: i})
				}
			}
		} else {
			param := "messages[" + strconv.Itoa(idx) + "]"
			p.shapeError(param, param+" must be an object")
			if i = p.skip(i, 2); i < 0 {
				return -1
			}
		}
		idx++
	}
	if i >= 0 {
		r.Total = idx
		r.msgStart, r.msgEnd = v, i
	}
	return i
}
