package chat

import (
	"bytes"
	"encoding/json"
	"strings"
)

// responseItem is what the mapping reads of one Responses input item.
type responseItem struct {
	Type             string          `json:"type"`
	Role             string          `json:"role"`
	Content          json.RawMessage `json:"content"`
	CallID           *string         `json:"call_id"`
	Name             string          `json:"name"`
	Arguments        *string         `json:"arguments"`
	Input            json.RawMessage `json:"input"`
	Action           json.RawMessage `json:"action"`
	Output           json.RawMessage `json:"output"`
	Summary          json.RawMessage `json:"summary"`
	EncryptedContent string          `json:"encrypted_content"`
}

// kind sorts a Responses item: a message of a role, a tool call (any
// "…_call" with a call_id: function_call, custom_tool_call,
// local_shell_call, computer_call, ...), its output ("…_call_output"), or
// an item of the model's turn that pairs with nothing (reasoning, hosted
// tool calls such as web_search_call, item references).
func (it *responseItem) kind() string {
	switch {
	case it.Type == "message" || (it.Type == "" && it.Role != ""):
		if it.Role == "assistant" {
			return "assistant"
		}
		return "message"
	case it.CallID != nil && strings.HasSuffix(it.Type, "_call_output"):
		return "output"
	case it.CallID != nil && strings.HasSuffix(it.Type, "_call"):
		return "call"
	}
	return "opaque"
}

// responses maps the "input" of a Responses body: "instructions" becomes a
// leading system message; a user, system or developer message item is one
// chat message; the items of one model turn (assistant messages,
// reasoning, tool calls, hosted calls) are one assistant message whose
// tool_calls are the turn's calls by call_id; each output item is a tool
// message answering its call_id.
func (b *builder) responses() error {
	r, src := b.r, b.r.src
	if v := r.FieldValue("instructions"); len(v) > 0 && string(v) != "null" {
		text, _ := textOf(v)
		s := synth{role: "system"}
		s.text.WriteString(text)
		b.add(&s, unit{field: true, at: -1, container: -1, items: [][]byte{v}})
	}
	input := bytes.TrimSpace(r.FieldValue("input"))
	if len(input) == 0 || string(input) == "null" {
		return nil
	}
	if input[0] == '"' {
		src.stringInput = true
		var text string
		_ = json.Unmarshal(input, &text)
		s := synth{role: "user"}
		s.text.WriteString(text)
		b.add(&s, unit{at: 0, container: -1, items: [][]byte{input}})
		return nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(input, &items); err != nil {
		return shapeError("input", "input must be a string or an array of items")
	}
	for i, raw := range items {
		var it responseItem
		if len(raw) == 0 || raw[0] != '{' || json.Unmarshal(raw, &it) != nil {
			return shapeError(paramAt("input", i), "input[%d] must be an item object", i)
		}
		if k := nativeKind(it.Type); k != NativeNone {
			// Its own message, so that the planner can cut at it; its
			// opaque payload is counted like a reasoning item's.
			b.flushTurn()
			s := synth{role: "assistant", native: k}
			if k == NativeTrigger {
				s.role = "user" // the client's request, and the last item
			}
			s.reasoning.WriteString(it.EncryptedContent)
			b.add(&s, unit{at: i, container: -1, items: [][]byte{raw}})
			continue
		}
		switch it.kind() {
		case "message":
			b.flushTurn()
			text, media := textOf(it.Content)
			s := synth{role: it.Role, media: media}
			s.text.WriteString(text)
			b.add(&s, unit{at: i, container: -1, items: [][]byte{raw}})
		case "output":
			b.flushTurn()
			text, media := textOf(it.Output)
			s := synth{role: "tool", callID: *it.CallID, hasCallID: true, media: media}
			s.text.WriteString(text)
			b.add(&s, unit{at: i, container: -1, items: [][]byte{raw}})
		default:
			b.openTurn(i)
			b.tu.items = append(b.tu.items, raw)
			t := &b.turn
			switch it.kind() {
			case "assistant":
				text, _ := textOf(it.Content)
				if t.text.Len() > 0 && text != "" {
					t.text.WriteByte('\n')
				}
				t.text.WriteString(text)
			case "call":
				name := it.Name
				if name == "" {
					name = strings.TrimSuffix(it.Type, "_call")
				}
				args := ""
				switch {
				case it.Arguments != nil:
					args = *it.Arguments
				case len(it.Input) > 0 && it.Input[0] == '"':
					_ = json.Unmarshal(it.Input, &args)
				case len(it.Input) > 0:
					args = string(it.Input)
				default:
					args = string(it.Action)
				}
				t.calls = append(t.calls, ToolCall{ID: *it.CallID, HasID: true, Name: name})
				t.args = append(t.args, args)
			case "opaque":
				if it.Type == "reasoning" {
					text, _ := textOf(it.Summary)
					t.reasoning.WriteString(text)
					text, _ = textOf(it.Content)
					t.reasoning.WriteString(text)
					t.reasoning.WriteString(it.EncryptedContent)
				} else {
					t.reasoning.Write(raw)
				}
			}
		}
	}
	b.flushTurn()
	return nil
}

func paramAt(key string, i int) string { return key + "[" + string(intText(i)) + "]" }

func (b *builder) openTurn(at int) {
	if !b.open {
		b.open = true
		b.turn = synth{role: "assistant"}
		b.tu = unit{at: at, container: -1}
	}
}

func (b *builder) flushTurn() {
	if b.open {
		b.open = false
		b.add(&b.turn, b.tu)
	}
}

// renderResponses writes the "input" array for msgs: a message as parsed is
// its items' bytes; an edited one is its items with the edit applied; one
// compaction made (a summary, an acknowledgement) is a message item.
func (r *Request) renderResponses(msgs []Message) []byte {
	if r.src.stringInput && r.unchangedDialect(msgs) {
		return r.FieldValue("input")
	}
	out := []byte{'['}
	n := 0
	emit := func(item []byte) {
		if n > 0 {
			out = append(out, ',')
		}
		n++
		out = append(out, item...)
	}
	for k := range msgs {
		m := &msgs[k]
		u, same := r.unitOf(m)
		switch {
		case u != nil && u.field:
		case u != nil && same && !(r.src.stringInput && u.at == 0):
			for _, it := range u.items {
				emit(it)
			}
		case u == nil || r.src.stringInput:
			emit(newResponseItem(m.Role, Text(*m)))
		default:
			for _, it := range editedItems(r.src.dialect, u, m, &r.Messages[m.Index]) {
				emit(it)
			}
		}
	}
	return append(out, ']')
}

// newResponseItem is a message item compaction made. An assistant text is
// an output_text part (llama-server refuses an assistant item with string
// content).
func newResponseItem(role, text string) []byte {
	out := []byte(`{"type":"message","role":`)
	out = appendString(out, role)
	if role == "assistant" {
		out = append(out, `,"content":[{"type":"output_text","text":`...)
		out = appendString(out, text)
		return append(out, "}]}"...)
	}
	out = append(out, `,"content":`...)
	out = appendString(out, text)
	return append(out, '}')
}

// editedItems renders a unit whose chat message compaction edited (a tool
// result trimmed, a turn excerpted, calls removed by pairing repair): the
// unit's items with the edit applied, every untouched item's bytes kept.
func editedItems(d Dialect, u *unit, m, orig *Message) [][]byte {
	text := Text(*m)
	switch m.Role {
	case "tool":
		key := "output"
		if d == DialectMessages {
			key = "content"
		}
		if len(u.items) == 1 {
			return [][]byte{replaceMember(u.items[0], key, renderText(text))}
		}
	case "assistant":
		return editedTurn(d, u, m, text != Text(*orig), text)
	}
	if d == DialectMessages {
		return [][]byte{textBlock(text)}
	}
	if len(u.items) == 1 {
		return [][]byte{replaceMember(u.items[0], "content", renderText(text))}
	}
	return [][]byte{newResponseItem(m.Role, text)}
}

// editedTurn is an edited assistant turn: its reasoning, thinking and
// hosted items kept, its calls kept while the chat message still has them,
// its text items kept when the text is unchanged, else one text item of
// the new text in place of the first.
//
// The turn's call items are orig's tool_calls in order, and m's are what
// is left of them in order (pairing repair removes a second call that
// reuses an id, keeping the first): a call item is kept when it is the
// next of m's, so of two calls sharing an id only the kept one stays.
func editedTurn(d Dialect, u *unit, m *Message, textChanged bool, text string) [][]byte {
	next := 0 // m's next kept call
	var out [][]byte
	wroteText := false
	for _, it := range u.items {
		var v struct {
			Type   string  `json:"type"`
			Role   string  `json:"role"`
			CallID *string `json:"call_id"`
			ID     string  `json:"id"`
		}
		_ = json.Unmarshal(it, &v)
		var isText, isCall bool
		id := v.ID
		if d == DialectMessages {
			isText, isCall = v.Type == "text", v.Type == "tool_use"
		} else {
			var ri responseItem
			_ = json.Unmarshal(it, &ri)
			k := ri.kind()
			isText, isCall = k == "assistant", k == "call"
			if v.CallID != nil {
				id = *v.CallID
			}
		}
		if isCall {
			if next < len(m.ToolCalls) && m.ToolCalls[next].ID == id {
				next++
				out = append(out, it)
			}
			continue
		}
		switch {
		case isText && textChanged:
			if !wroteText && text != "" {
				wroteText = true
				if d == DialectMessages {
					out = append(out, textBlock(text))
				} else {
					out = append(out, newResponseItem("assistant", text))
				}
			}
		default:
			out = append(out, it)
		}
	}
	return out
}

// textBlock is a Messages text content block.
func textBlock(text string) []byte {
	out := []byte(`{"type":"text","text":`)
	out = appendString(out, text)
	return append(out, '}')
}
