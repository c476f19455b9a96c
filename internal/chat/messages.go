package chat

import (
	"bytes"
	"encoding/json"
)

// anthropicBlock is what the mapping reads of one Messages content block.
type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	ToolUseID *string         `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
	Thinking  string          `json:"thinking"`
	Signature string          `json:"signature"`
	Data      string          `json:"data"`
	// EncryptedContent is a compaction block's opaque payload.
	EncryptedContent string `json:"encrypted_content"`
}

// messages maps a Messages body: the top-level "system" becomes a leading
// system message; an assistant message is one chat assistant message whose
// tool_calls are its tool_use blocks (thinking blocks counted as
// reasoning); a user message's tool_result blocks are tool messages
// answering their tool_use_id, and its other blocks, between them, user
// messages; a system-role message inside "messages" (Claude Code sends
// them) is a system message.
func (b *builder) messages() error {
	r, src := b.r, b.r.src
	if v := r.FieldValue("system"); len(v) > 0 && string(v) != "null" {
		text, _ := textOf(v)
		s := synth{role: "system"}
		s.text.WriteString(text)
		b.add(&s, unit{field: true, at: -1, container: -1, items: [][]byte{v}})
	}
	arr := bytes.TrimSpace(r.FieldValue("messages"))
	if len(arr) == 0 || string(arr) == "null" {
		return shapeError("messages", "messages is required")
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(arr, &msgs); err != nil {
		return shapeError("messages", "messages must be an array of message objects")
	}
	for c, raw := range msgs {
		var m struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if len(raw) == 0 || raw[0] != '{' || json.Unmarshal(raw, &m) != nil {
			return shapeError(paramAt("messages", c), "messages[%d] must be a message object", c)
		}
		if m.Role == "" {
			return shapeError(paramAt("messages", c), "messages[%d].role is required", c)
		}
		src.containers = append(src.containers, raw)
		first := len(r.Messages)
		content := bytes.TrimSpace(m.Content)
		var blocks []json.RawMessage
		if len(content) == 0 || content[0] != '[' || json.Unmarshal(content, &blocks) != nil {
			// A string content (or none): the message is one unit.
			text, media := textOf(content)
			s := synth{role: m.Role, media: media}
			s.text.WriteString(text)
			b.add(&s, unit{at: c, container: c})
			src.spans = append(src.spans, [2]int{first, len(r.Messages) - 1})
			continue
		}
		if m.Role == "assistant" {
			// One chat message, except that a compaction block is one
			// of its own (the API reads the conversation from it on).
			s := synth{role: "assistant"}
			items := [][]byte{}
			for _, blk := range blocks {
				var bl anthropicBlock
				_ = json.Unmarshal(blk, &bl)
				if bl.Type == "compaction" {
					if len(items) > 0 {
						b.add(&s, unit{at: c, container: c, items: items})
						s, items = synth{role: "assistant"}, [][]byte{}
					}
					b.add(compactionBlock(m.Role, &bl), unit{at: c, container: c, items: [][]byte{blk}})
					continue
				}
				items = append(items, blk)
				switch bl.Type {
				case "text":
					if bl.Text != nil {
						if s.text.Len() > 0 {
							s.text.WriteByte('\n')
						}
						s.text.WriteString(*bl.Text)
					}
				case "tool_use":
					s.calls = append(s.calls, ToolCall{ID: bl.ID, HasID: bl.ID != "", Name: bl.Name})
					s.args = append(s.args, string(bl.Input))
				case "thinking":
					s.reasoning.WriteString(bl.Thinking)
					s.reasoning.WriteString(bl.Signature)
				case "redacted_thinking":
					s.reasoning.WriteString(bl.Data)
				default:
					s.reasoning.Write(blk)
				}
			}
			if len(items) > 0 || len(r.Messages) == first {
				b.add(&s, unit{at: c, container: c, items: items})
			}
			src.spans = append(src.spans, [2]int{first, len(r.Messages) - 1})
			continue
		}
		// A user (or other role) message: its tool results one by one,
		// the blocks between them as one message of the role.
		var part synth
		var pu unit
		open := false
		flush := func() {
			if open {
				open = false
				b.add(&part, pu)
			}
		}
		for _, blk := range blocks {
			var bl anthropicBlock
			_ = json.Unmarshal(blk, &bl)
			if bl.Type == "compaction" {
				flush()
				b.add(compactionBlock(m.Role, &bl), unit{at: c, container: c, items: [][]byte{blk}})
				continue
			}
			if bl.Type == "tool_result" && bl.ToolUseID != nil {
				flush()
				text, media := textOf(bl.Content)
				s := synth{role: "tool", callID: *bl.ToolUseID, hasCallID: true, media: media}
				s.text.WriteString(text)
				b.add(&s, unit{at: c, container: c, items: [][]byte{blk}})
				continue
			}
			if !open {
				open = true
				part = synth{role: m.Role}
				pu = unit{at: c, container: c}
			}
			pu.items = append(pu.items, blk)
			switch {
			case bl.Text != nil:
				if part.text.Len() > 0 {
					part.text.WriteByte('\n')
				}
				part.text.WriteString(*bl.Text)
			case bl.Type == "image" || bl.Type == "document":
				part.media++
			default:
				part.reasoning.Write(blk)
			}
		}
		flush()
		if len(r.Messages) == first {
			// An empty content array: the message as it is.
			b.add(&synth{role: m.Role}, unit{at: c, container: c, items: [][]byte{}})
		}
		src.spans = append(src.spans, [2]int{first, len(r.Messages) - 1})
	}
	return nil
}

// compactionBlock is the chat message of a "compaction" content block: its
// summary (content; null when the compaction failed) is the text, its
// opaque encrypted_content counted as reasoning.
func compactionBlock(role string, bl *anthropicBlock) *synth {
	s := &synth{role: role, native: NativeCompaction}
	text, _ := textOf(bl.Content)
	s.text.WriteString(text)
	s.reasoning.WriteString(bl.EncryptedContent)
	return s
}

// renderMessages writes the "messages" array for msgs: the chat messages of
// one client message, all of them and as parsed, are that message's bytes;
// otherwise the message is written with the content blocks of the chat
// messages present (edited ones with their edit); a message compaction
// made is {"role":…,"content":"…"}.
func (r *Request) renderMessages(msgs []Message) []byte {
	out := []byte{'['}
	n := 0
	emit := func(msg []byte) {
		if n > 0 {
			out = append(out, ',')
		}
		n++
		out = append(out, msg...)
	}
	for i := 0; i < len(msgs); {
		m := &msgs[i]
		u, _ := r.unitOf(m)
		if u == nil {
			msg := []byte(`{"role":`)
			msg = appendString(msg, m.Role)
			msg = append(msg, `,"content":`...)
			msg = appendString(msg, Text(*m))
			emit(append(msg, '}'))
			i++
			continue
		}
		if u.field {
			i++
			continue
		}
		c := u.container
		j := i + 1
		for j < len(msgs) {
			v, _ := r.unitOf(&msgs[j])
			if v == nil || v.field || v.container != c || msgs[j].Index <= msgs[j-1].Index {
				break
			}
			j++
		}
		group := msgs[i:j]
		span := r.src.spans[c]
		whole := group[0].Index == span[0] && len(group) == span[1]-span[0]+1
		var blocks [][]byte
		stringContent := false
		for k := range group {
			g := &group[k]
			gu, same := r.unitOf(g)
			switch {
			case gu.items == nil:
				stringContent = true
				whole = whole && same
			case same:
				blocks = append(blocks, gu.items...)
			default:
				whole = false
				blocks = append(blocks, editedItems(DialectMessages, gu, g, &r.Messages[g.Index])...)
			}
		}
		switch {
		case whole:
			emit(r.src.containers[c])
		case stringContent:
			emit(replaceMember(r.src.containers[c], "content", renderText(Text(group[0]))))
		default:
			arr := []byte{'['}
			for k, bl := range blocks {
				if k > 0 {
					arr = append(arr, ',')
				}
				arr = append(arr, bl...)
			}
			emit(replaceMember(r.src.containers[c], "content", append(arr, ']')))
		}
		i = j
	}
	return append(out, ']')
}
