package chat

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Dialect is the API a request body speaks. The planner works on one
// message model, chat completions' messages; a Responses or Messages body
// is mapped to it (ParseDialect) and a decision is rendered back in the
// body's own dialect (Build), keeping the client's bytes for every item the
// decision does not change (DESIGN § Other APIs).
type Dialect uint8

// The dialects.
const (
	DialectChat      Dialect = iota // POST /v1/chat/completions
	DialectResponses                // POST /v1/responses (OpenAI Responses API)
	DialectMessages                 // POST /v1/messages (Anthropic Messages)
)

func (d Dialect) String() string {
	switch d {
	case DialectResponses:
		return "responses"
	case DialectMessages:
		return "messages"
	}
	return "chat"
}

// source is how a Responses or Messages request's chat messages map back to
// the client's items: one unit per entry of Request.Messages.
type source struct {
	dialect Dialect
	key     string // the array the messages come from: "input" or "messages"
	units   []unit
	// containers are a Messages body's message objects, as the client sent
	// them (a chat message is one or more of a message's content blocks).
	containers [][]byte
	// spans[c] is the first and last unit of container c.
	spans [][2]int
	// stringInput: a Responses "input" given as one string.
	stringInput bool
}

// unit is what one chat message stands for in the client's body.
type unit struct {
	// field: the top-level "system" (Messages) or "instructions"
	// (Responses), mapped to a leading system message so that it is the
	// fixed part, digested and counted; never rendered into the array.
	field bool
	// at is the client's array index of the unit's first item (a Messages
	// unit: its message's), for error parameters.
	at int
	// container is the Messages body's message the unit's blocks are in;
	// -1 for Responses.
	container int
	// items are the client's items (Responses) or content blocks
	// (Messages), in order; nil when the unit is the whole container (a
	// string content).
	items [][]byte
}

// Dialect returns the dialect r was parsed from.
func (r *Request) Dialect() Dialect {
	if r.src == nil {
		return DialectChat
	}
	return r.src.dialect
}

// Param names message i of r.Messages as the client's body does, for an
// error's param: "messages[N]" for chat and Messages, "input[N]" for
// Responses.
func (r *Request) Param(i int) string {
	if i < 0 || i >= len(r.Messages) {
		return ""
	}
	if r.src == nil {
		return fmt.Sprintf("messages[%d]", r.Messages[i].Index)
	}
	u := &r.src.units[i]
	if u.field {
		if r.src.dialect == DialectResponses {
			return "instructions"
		}
		return "system"
	}
	return fmt.Sprintf("%s[%d]", r.src.key, u.at)
}

// unitOf returns the unit m stands for unchanged-or-edited (nil for a
// message compaction synthesized), and whether m is that unit's message
// exactly as parsed.
func (r *Request) unitOf(m *Message) (*unit, bool) {
	if m.Index < 0 || m.Index >= len(r.src.units) {
		return nil, false
	}
	return &r.src.units[m.Index], bytes.Equal(m.Raw, r.Messages[m.Index].Raw)
}

// ParseDialect parses a Responses or Messages request body into the chat
// model: Fields are the body's top-level members; Messages are chat
// messages (synthesized JSON whose digests are those of the client's item
// bytes) that Build renders back. DialectChat is Parse.
func ParseDialect(d Dialect, body []byte) (*Request, error) {
	if d == DialectChat {
		return Parse(body)
	}
	if err := validText(body); err != nil {
		return nil, err
	}
	fields, err := topFields(body)
	if err != nil {
		return nil, err
	}
	r := &Request{Body: body, Fields: fields}
	src := &source{dialect: d}
	r.src = src
	for _, f := range fields {
		switch f.Key {
		case "model":
			_ = json.Unmarshal(f.Value, &r.Model)
		case "stream":
			r.Stream = string(f.Value) == "true"
		case "max_output_tokens":
			if d == DialectResponses {
				r.MaxTokens = intValue(f.Value)
			}
		case "max_tokens":
			if d == DialectMessages {
				r.MaxTokens = intValue(f.Value)
			}
		}
	}
	b := builder{r: r}
	if d == DialectResponses {
		src.key = "input"
		err = b.responses()
	} else {
		src.key = "messages"
		err = b.messages()
	}
	if err != nil {
		return nil, err
	}
	r.Total = len(r.Messages)
	return r, nil
}

// validText refuses a body whose text is not UTF-8 (a raw byte, a lone
// surrogate escape) with the scanner's ParseError naming the byte; its
// other faults are left to topFields, whose words they keep. One pass of
// the scanner, several times faster than the decoding after it.
func validText(body []byte) error {
	s := scanner{data: body, strict: true}
	if i := s.ws(0); i < len(body) && s.skip(i, 0) < 0 && s.badText {
		return s.err
	}
	return nil
}

// topFields lists the object body's members in order; a key given twice
// keeps its last value (as encoding/json does), in its first place. It is
// the body's validation too: anything but one JSON object (whitespace
// around it) is a ParseError.
func topFields(body []byte) ([]Field, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, &ParseError{Message: "request body must be a JSON object"}
	}
	var fields []Field
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, &ParseError{Message: "request body is not valid JSON"}
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, &ParseError{Message: "request body is not valid JSON"}
		}
		dup := false
		for j := range fields {
			if fields[j].Key == k {
				fields[j].Value, dup = v, true
			}
		}
		if !dup {
			fields = append(fields, Field{Key: k, Value: v})
		}
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return nil, &ParseError{Message: "request body is not valid JSON"}
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, &ParseError{Message: "request body must be one JSON object"}
	}
	return fields, nil
}

// FieldValue is the raw value of the top-level key, nil when absent.
func (r *Request) FieldValue(key string) []byte {
	for _, f := range r.Fields {
		if f.Key == key {
			return f.Value
		}
	}
	return nil
}

// HasField tells whether the body has the top-level key with a value other
// than null.
func (r *Request) HasField(key string) bool {
	v := r.FieldValue(key)
	return len(v) > 0 && string(v) != "null"
}

// builder accumulates chat messages from a dialect's items.
type builder struct {
	r *Request
	// the assistant turn being gathered (Responses: consecutive
	// assistant-side items)
	open bool
	turn synth
	tu   unit
}

// synth is one chat message being written.
type synth struct {
	role      string
	text      strings.Builder
	reasoning strings.Builder // reasoning and opaque items: counted, never shown
	media     int
	calls     []ToolCall
	args      []string
	callID    string
	hasCallID bool
	native    NativeKind
}

// add appends the chat message s stands for, mapped to u.
func (b *builder) add(s *synth, u unit) {
	raw := make([]byte, 0, 64+s.text.Len()+s.reasoning.Len())
	raw = append(raw, `{"role":`...)
	raw = appendString(raw, s.role)
	raw = append(raw, `,"content":`...)
	if s.media > 0 {
		raw = append(raw, `[{"type":"text","text":`...)
		raw = appendString(raw, s.text.String())
		raw = append(raw, '}')
		for range s.media {
			raw = append(raw, `,{"type":"image_url","image_url":{"url":""}}`...)
		}
		raw = append(raw, ']')
	} else {
		raw = appendString(raw, s.text.String())
	}
	if len(s.calls) > 0 {
		raw = append(raw, `,"tool_calls":[`...)
		for k, c := range s.calls {
			if k > 0 {
				raw = append(raw, ',')
			}
			raw = append(raw, `{"id":`...)
			raw = appendString(raw, c.ID)
			raw = append(raw, `,"type":"function","function":{"name":`...)
			raw = appendString(raw, c.Name)
			raw = append(raw, `,"arguments":`...)
			raw = appendString(raw, s.args[k])
			raw = append(raw, "}}"...)
		}
		raw = append(raw, ']')
	}
	if s.hasCallID {
		raw = append(raw, `,"tool_call_id":`...)
		raw = appendString(raw, s.callID)
	}
	if s.reasoning.Len() > 0 {
		raw = append(raw, `,"reasoning_content":`...)
		raw = appendString(raw, s.reasoning.String())
	}
	raw = append(raw, '}')
	m := decodeMessage(raw, len(b.r.Messages))
	m.Native = s.native
	// The digest is the client's bytes', not the synthesized JSON's: two
	// items that differ only where the chat form does not look (an
	// encrypted reasoning, a cache_control marker) are different messages.
	h := sha256.New()
	h.Write([]byte("compactproxy/dialect/v1\x00"))
	h.Write([]byte(b.r.src.dialect.String()))
	h.Write([]byte{0})
	h.Write([]byte(s.role))
	if u.items == nil && u.container >= 0 && !u.field {
		writeItem(h, b.r.src.containers[u.container])
	}
	if u.field {
		h.Write([]byte("\x00field"))
	}
	for _, it := range u.items {
		writeItem(h, it)
	}
	copy(m.Digest[:], h.Sum(nil))
	m.HasDigest = true
	b.r.Messages = append(b.r.Messages, m)
	b.r.src.units = append(b.r.src.units, u)
}

func writeItem(h interface{ Write([]byte) (int, error) }, it []byte) {
	if bytes.Contains(it, cacheControlKey) {
		// A cache_control marker moves to the newest block each request
		// (Claude Code) and changes no token: the digest ignores it, so
		// a message keeps its digest, and its anchors, when the marker
		// moves on. The bytes forwarded keep it.
		it = withoutCacheControl(it)
	}
	var n [8]byte
	l := len(it)
	for i := range n {
		n[i] = byte(l >> (8 * i))
	}
	h.Write(n[:])
	h.Write(it)
}

// shapeError is a client error about one of the body's items.
func shapeError(param, format string, args ...any) error {
	return &ParseError{Message: fmt.Sprintf(format, args...), Param: param}
}

// textOf returns the text of a content value: a string, or the text of the
// parts of an array ("text" members; for parts of type tool_result, their
// own content's text), and how many media parts it holds.
func textOf(v json.RawMessage) (string, int) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 || string(v) == "null" {
		return "", 0
	}
	if v[0] == '"' {
		var s string
		_ = json.Unmarshal(v, &s)
		return s, 0
	}
	var parts []json.RawMessage
	if json.Unmarshal(v, &parts) != nil {
		return "", 0
	}
	var sb strings.Builder
	media := 0
	for _, p := range parts {
		var part struct {
			Type    string          `json:"type"`
			Text    *string         `json:"text"`
			Content json.RawMessage `json:"content"`
		}
		if json.Unmarshal(p, &part) != nil {
			continue
		}
		switch {
		case part.Text != nil:
			if sb.Len() > 0 {
				sb.WriteByte('\n')
			}
			sb.WriteString(*part.Text)
		case strings.Contains(part.Type, "image") || strings.Contains(part.Type, "file") ||
			part.Type == "document" || strings.Contains(part.Type, "audio"):
			media++
		}
	}
	return sb.String(), media
}

// renderText is a content string's JSON.
func renderText(s string) []byte { return appendString(nil, s) }

// replaceMember returns the object raw with key's value replaced by value
// (added at the end when absent); the other members keep their bytes.
func replaceMember(raw []byte, key string, value []byte) []byte {
	list, _, close, ok := members(raw)
	if !ok {
		return raw
	}
	out := make([]byte, 0, len(raw)+len(value)+16)
	last, found := 0, false
	for _, mb := range list {
		if mb.key != key {
			continue
		}
		out = append(out, raw[last:mb.val]...)
		out = append(out, value...)
		last, found = mb.end, true
	}
	if !found {
		brace := close - 1
		out = append(out, raw[:brace]...)
		if len(list) > 0 {
			out = append(out, ',')
		}
		out = appendString(out, key)
		out = append(out, ':')
		out = append(out, value...)
		last = brace
	}
	return append(out, raw[last:]...)
}

// buildDialect is Build for a Responses or Messages body: the array the
// messages came from is rendered from msgs, set applied to the other
// top-level fields, which keep their order and bytes.
func (r *Request) buildDialect(msgs []Message, set []Field) []byte {
	var arr []byte
	if r.src.dialect == DialectResponses {
		arr = r.renderResponses(msgs)
	} else {
		arr = r.renderMessages(msgs)
	}
	all := make([]Field, 0, len(set)+1)
	all = append(all, Field{Key: r.src.key, Value: arr})
	all = append(all, set...)
	out := []byte{'{'}
	n := 0
	write := func(k string, v []byte) {
		if n > 0 {
			out = append(out, ',')
		}
		n++
		out = appendString(out, k)
		out = append(out, ':')
		out = append(out, v...)
	}
	done := make([]bool, len(all))
	for _, f := range r.Fields {
		v := f.Value
		for j := len(all) - 1; j >= 0; j-- {
			if all[j].Key == f.Key {
				v, done[j] = all[j].Value, true
				break
			}
		}
		if v != nil {
			write(f.Key, v)
		}
	}
	for j, f := range all {
		if !done[j] && f.Value != nil {
			dup := false
			for k := j + 1; k < len(all); k++ {
				dup = dup || all[k].Key == f.Key
			}
			if !dup {
				write(f.Key, f.Value)
			}
		}
	}
	return append(out, '}')
}

// unchangedDialect is Unchanged for a dialect body: msgs are the parsed
// messages, all of them, as parsed.
func (r *Request) unchangedDialect(msgs []Message) bool {
	if len(msgs) != len(r.Messages) {
		return false
	}
	for k := range msgs {
		if msgs[k].Index != k || !bytes.Equal(msgs[k].Raw, r.Messages[k].Raw) {
			return false
		}
	}
	return true
}

// intText is n as JSON.
func intText(n int) []byte { return strconv.AppendInt(nil, int64(n), 10) }

var cacheControlKey = []byte(`"cache_control"`)

// withoutCacheControl returns the object raw without its "cache_control"
// members, its own and its content blocks' (a tool_result's); every other
// byte is kept, so a block without a marker digests as the same block
// with one.
func withoutCacheControl(raw []byte) []byte { return cutCacheControl(raw, true) }

// cutCacheControl is withoutCacheControl; blocks says whether the content
// blocks are looked into too. Only one level is: the API puts markers on
// a block and on a tool_result's blocks, nowhere deeper, and every level
// looked into costs a pass over all it holds (a body nesting content
// arrays 5,000 deep took 2.5 s of CPU for 68 KB).
func cutCacheControl(raw []byte, blocks bool) []byte {
	list, _, _, ok := members(raw)
	if !ok {
		return raw
	}
	out := make([]byte, 0, len(raw))
	last := 0
	for k, mb := range list {
		switch {
		case mb.key == "cache_control":
			if k > 0 {
				out = append(out, raw[last:list[k-1].end]...)
			} else {
				out = append(out, raw[last:mb.start]...)
			}
			last = mb.end
			if k == 0 && len(list) > 1 {
				last = list[1].start
			}
		case blocks && mb.key == "content" && bytes.Contains(raw[mb.val:mb.end], cacheControlKey):
			var blocks []json.RawMessage
			if json.Unmarshal(raw[mb.val:mb.end], &blocks) != nil {
				continue
			}
			out = append(out, raw[last:mb.val]...)
			out = append(out, '[')
			for j, b := range blocks {
				if j > 0 {
					out = append(out, ',')
				}
				out = append(out, cutCacheControl(b, false)...)
			}
			out = append(out, ']')
			last = mb.end
		}
	}
	return append(out, raw[last:]...)
}
