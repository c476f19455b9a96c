package chat

import (
	"bytes"
	"testing"

	"github.com/compactproxy/compactproxy/internal/pairing"
)

// The shapes of the openai and @anthropic-ai/sdk SDKs' types
// (docs/design-notes.md, "The providers' compaction APIs: wire shapes").
const (
	compactionItem = `{"type":"compaction","id":"cmp_1","encrypted_content":"gAAAAB-opaque","created_by":"x"}`
	triggerItem    = `{"type":"compaction_trigger"}`
	compactionBlk  = `{"type":"compaction","content":"Summary: the user builds a web server.","encrypted_content":null}`
)

var nativeResponsesBody = `{"model":"m","store":false,"context_management":[{"type":"compaction","compact_threshold":1000}],"input":[` +
	`{"role":"user","content":"build a web server"},` +
	compactionItem + `,` +
	`{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gCCCC"},` +
	`{"type":"function_call","call_id":"c1","name":"shell","arguments":"{}"},` +
	`{"type":"function_call_output","call_id":"c1","output":"ok"},` +
	`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]},` +
	`{"role":"user","content":"next"},` +
	triggerItem +
	`]}`

var nativeMessagesBody = `{"model":"m","max_tokens":100,"context_management":{"edits":[{"type":"compact_20260112"}]},"messages":[` +
	`{"role":"user","content":"build a web server"},` +
	`{"role":"assistant","content":[` + compactionBlk + `,{"type":"text","text":"Running it."},{"type":"tool_use","id":"tu_1","name":"shell","input":{}}]},` +
	`{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu_1","content":"ok"},{"type":"text","text":"go on"}]},` +
	`{"role":"user","content":[` + compactionBlk + `,{"type":"text","text":"and then?"}]}` +
	`]}`

func TestNativeCompactionItems(t *testing.T) {
	tests := []struct {
		name    string
		dialect Dialect
		body    string
		// want: role and Native of each message, in order
		want []struct {
			role   string
			native NativeKind
		}
		items map[int]string // NativeItem(i) expected bytes
		cut   int
	}{
		{
			name: "responses", dialect: DialectResponses, body: nativeResponsesBody,
			want: []struct {
				role   string
				native NativeKind
			}{
				{"user", NativeNone}, {"assistant", NativeCompaction}, {"assistant", NativeNone},
				{"tool", NativeNone}, {"assistant", NativeNone}, {"user", NativeNone}, {"user", NativeTrigger},
			},
			items: map[int]string{1: compactionItem, 6: triggerItem},
			cut:   1,
		},
		{
			name: "messages", dialect: DialectMessages, body: nativeMessagesBody,
			want: []struct {
				role   string
				native NativeKind
			}{
				{"user", NativeNone}, {"assistant", NativeCompaction}, {"assistant", NativeNone},
				{"tool", NativeNone}, {"user", NativeNone}, {"user", NativeCompaction}, {"user", NativeNone},
			},
			items: map[int]string{1: compactionBlk, 5: compactionBlk},
			cut:   5,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := ParseDialect(tt.dialect, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Messages) != len(tt.want) {
				t.Fatalf("%d messages, want %d", len(r.Messages), len(tt.want))
			}
			for i, w := range tt.want {
				m := r.Messages[i]
				if m.Role != w.role || m.Native != w.native {
					t.Errorf("message %d: role %q native %d, want %q native %d", i, m.Role, m.Native, w.role, w.native)
				}
				item := r.NativeItem(i)
				if want, ok := tt.items[i]; ok != (item != nil) || string(item) != want {
					t.Errorf("NativeItem(%d) = %s, want %s", i, item, want)
				}
			}
			if got := r.LastNativeCompaction(); got != tt.cut {
				t.Errorf("LastNativeCompaction = %d, want %d", got, tt.cut)
			}
			// Kept byte for byte, whole and with the head dropped.
			if got := r.Build(r.Messages, nil); !bytes.Equal(got, []byte(tt.body)) {
				t.Errorf("rebuilt body differs:\n got %s\nwant %s", got, tt.body)
			}
			tail := r.Build(r.Messages[tt.cut:], nil)
			if !bytes.Contains(tail, []byte(tt.items[tt.cut])) {
				t.Errorf("the compaction item is not kept byte for byte in %s", tail)
			}
			// The pairing check sees an ordinary conversation.
			if v := pairing.Check(pairingView(r.Messages)); len(v) != 0 {
				t.Errorf("pairing violations: %+v", v)
			}
		})
	}
}

// TestNativeCompactionCounted: the opaque payload is counted like a
// reasoning item's (it is context the provider reads), the Messages summary
// as text.
func TestNativeCompactionCounted(t *testing.T) {
	r, err := ParseDialect(DialectResponses, []byte(nativeResponsesBody))
	if err != nil {
		t.Fatal(err)
	}
	if m := r.Messages[1]; !m.HasReasoning || !bytes.Contains(m.Raw, []byte("gAAAAB-opaque")) {
		t.Errorf("compaction item's payload not counted: %s", m.Raw)
	}
	r, err = ParseDialect(DialectMessages, []byte(nativeMessagesBody))
	if err != nil {
		t.Fatal(err)
	}
	if got := Text(r.Messages[1]); got != "Summary: the user builds a web server." {
		t.Errorf("compaction block text %q", got)
	}
}

func pairingView(msgs []Message) []pairing.Message {
	out := make([]pairing.Message, len(msgs))
	for i, m := range msgs {
		p := pairing.Message{Role: m.Role, ToolCallID: m.ToolCallID, HasToolCallID: m.HasToolCallID}
		for _, c := range m.ToolCalls {
			p.Calls = append(p.Calls, pairing.Call{ID: c.ID, HasID: c.HasID, Name: c.Name})
		}
		out[i] = p
	}
	return out
}

// TestNativeCompactionAlone: a paused compaction (stop_reason "compaction")
// leaves an assistant message holding only the block; it is one message,
// rebuilt as sent.
func TestNativeCompactionAlone(t *testing.T) {
	body := `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"hi"},` +
		`{"role":"assistant","content":[` + compactionBlk + `]},{"role":"user","content":"go on"}]}`
	r, err := ParseDialect(DialectMessages, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Messages) != 3 || r.Messages[1].Native != NativeCompaction || r.LastNativeCompaction() != 1 {
		t.Fatalf("%d messages, message 1 native %d", len(r.Messages), r.Messages[1].Native)
	}
	if got := r.Build(r.Messages[1:], nil); !bytes.Contains(got, []byte(`{"role":"assistant","content":[`+compactionBlk+`]}`)) {
		t.Fatalf("the paused message is not kept byte for byte: %s", got)
	}
}
