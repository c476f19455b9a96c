package chat

import (
	"encoding/json"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

var benchSizes = []struct {
	name string
	size int
}{
	{"16KB", 16 << 10},
	{"1MiB", 1 << 20},
}

func BenchmarkParse(b *testing.B) {
	for _, bs := range benchSizes {
		body := chattest.AgentBody(bs.size, true)
		b.Run(bs.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkBuild(b *testing.B) {
	body := chattest.AgentBody(1<<20, true)
	r, err := Parse(body)
	if err != nil {
		b.Fatal(err)
	}
	// A realistic rewrite: the first tool output excerpted, usage injected.
	msgs := append([]Message(nil), r.Messages...)
	msgs[3] = WithContentText(msgs[3], "[... 12000 bytes elided ...]")
	set := []Field{{Key: "stream_options", Value: []byte(`{"include_usage":true}`)}}
	b.Run("1MiB", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if out := r.Build(msgs, set); len(out) == 0 {
				b.Fatal("empty")
			}
		}
	})
}

// BenchmarkEncodingJSON is the in-run baseline: what the same work costs
// with encoding/json (the messages as RawMessage, then each decoded into a
// small view struct).
func BenchmarkEncodingJSON(b *testing.B) {
	type view struct {
		Role       string          `json:"role"`
		Content    json.RawMessage `json:"content"`
		ToolCallID *string         `json:"tool_call_id"`
		Name       string          `json:"name"`
		ToolCalls  []struct {
			ID       *string `json:"id"`
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		} `json:"tool_calls"`
		UIOnly bool `json:"ui_only"`
	}
	for _, bs := range benchSizes {
		body := chattest.AgentBody(bs.size, true)
		b.Run(bs.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var req struct {
					Model    string            `json:"model"`
					Messages []json.RawMessage `json:"messages"`
				}
				if err := json.Unmarshal(body, &req); err != nil {
					b.Fatal(err)
				}
				for _, m := range req.Messages {
					var v view
					if err := json.Unmarshal(m, &v); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// BenchmarkParseAfter is the parse of an agent's next step (the same history
// plus one assistant turn and its tool answer) resumed from a snapshot of
// the previous step, next to the full parse of the same body, and the cost
// of taking the snapshot.
func BenchmarkParseAfter(b *testing.B) {
	prev := chattest.AgentBody(1<<20, false)
	r, err := Parse(prev)
	if err != nil {
		b.Fatal(err)
	}
	steps := 0
	for len(chattest.AgentSteps(steps, false)) < len(prev) {
		steps += 50
	}
	for len(chattest.AgentSteps(steps, false)) > len(prev) {
		steps--
	}
	prev = chattest.AgentSteps(steps, false)
	next := chattest.AgentSteps(steps+1, false)
	if r, err = Parse(prev); err != nil {
		b.Fatal(err)
	}
	snap := r.Snapshot()
	b.Run("1MiB/full", func(b *testing.B) {
		b.SetBytes(int64(len(next)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Parse(next); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("1MiB/resumed", func(b *testing.B) {
		b.SetBytes(int64(len(next)))
		b.ReportAllocs()
		for b.Loop() {
			if _, n, err := ParseAfter(next, snap); err != nil || n != len(r.Messages) {
				b.Fatal(err, n)
			}
		}
	})
	b.Run("1MiB/snapshot", func(b *testing.B) {
		b.SetBytes(int64(len(prev)))
		b.ReportAllocs()
		for b.Loop() {
			if r.Snapshot() == nil {
				b.Fatal("no snapshot")
			}
		}
	})
}
