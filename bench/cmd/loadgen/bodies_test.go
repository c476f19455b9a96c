package main

import (
	"bytes"
	"encoding/json"
	"testing"
)

// TestAgentBody keeps the harness's bodies what the report says they are:
// the asked size within 1%, valid JSON, every tool call answered directly
// after its assistant turn (strict pairing would otherwise reject them and
// the harness would measure error paths), ending on a tool result, and
// about 1,000 messages at 1 MiB.
func TestAgentBody(t *testing.T) {
	for _, tc := range []struct {
		name             string
		size             int
		stream           bool
		minMsgs, maxMsgs int
	}{
		{"16KB", 16 << 10, false, 4, 4},
		{"16KB-stream", 16 << 10, true, 4, 4},
		{"1MiB", 1 << 20, false, 900, 1300},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := agentBody(tc.size, tc.stream)
			if d := len(b) - tc.size; d*100 > tc.size || -d*100 > tc.size {
				t.Errorf("body is %d bytes, want %d ±1%%", len(b), tc.size)
			}
			if !bytes.Equal(b, agentBody(tc.size, tc.stream)) {
				t.Error("not deterministic")
			}
			var v struct {
				Stream   bool `json:"stream"`
				Messages []struct {
					Role       string `json:"role"`
					ToolCallID string `json:"tool_call_id"`
					ToolCalls  []struct {
						ID string `json:"id"`
					} `json:"tool_calls"`
				} `json:"messages"`
			}
			if err := json.Unmarshal(b, &v); err != nil {
				t.Fatal(err)
			}
			if v.Stream != tc.stream {
				t.Errorf("stream = %v", v.Stream)
			}
			if n := len(v.Messages); n < tc.minMsgs || n > tc.maxMsgs {
				t.Errorf("%d messages, want %d..%d", n, tc.minMsgs, tc.maxMsgs)
			}
			seen := map[string]bool{}
			open := map[string]bool{}
			for i, m := range v.Messages {
				if m.Role != "tool" && len(open) > 0 {
					t.Fatalf("message %d (%s) interleaves unanswered calls %v", i, m.Role, open)
				}
				switch m.Role {
				case "assistant":
					for _, c := range m.ToolCalls {
						if seen[c.ID] {
							t.Fatalf("duplicate id %s", c.ID)
						}
						seen[c.ID], open[c.ID] = true, true
					}
				case "tool":
					if !open[m.ToolCallID] {
						t.Fatalf("message %d: orphan tool result %q", i, m.ToolCallID)
					}
					delete(open, m.ToolCallID)
				}
			}
			if len(open) > 0 || v.Messages[len(v.Messages)-1].Role != "tool" {
				t.Errorf("want every call answered and a final tool result; open %v", open)
			}
		})
	}
}
