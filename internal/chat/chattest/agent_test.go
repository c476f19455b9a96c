package chattest

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestAgentBody(t *testing.T) {
	tests := []struct {
		name    string
		target  int
		stream  bool
		minMsgs int
		maxMsgs int
	}{
		{"16KB", 16 << 10, false, 3, 8},
		{"1MiB", 1 << 20, true, 800, 1300},
		{"tiny", 100, false, 3, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := AgentBody(tt.target, tt.stream)
			if !bytes.Equal(b, AgentBody(tt.target, tt.stream)) {
				t.Fatal("not deterministic")
			}
			var req struct {
				Model       string
				Temperature *float64
				CachePrompt bool `json:"cache_prompt"`
				Stream      bool
				Tools       []json.RawMessage
				Messages    []struct {
					Role       string
					Content    *string
					ToolCallID string                `json:"tool_call_id"`
					ToolCalls  []struct{ ID string } `json:"tool_calls"`
				}
			}
			if err := json.Unmarshal(b, &req); err != nil {
				t.Fatal(err)
			}
			n := len(req.Messages)
			if n < tt.minMsgs || n > tt.maxMsgs {
				t.Fatalf("%d messages, want %d..%d", n, tt.minMsgs, tt.maxMsgs)
			}
			if tt.target > 4096 && (len(b) < tt.target*9/10 || len(b) > tt.target*11/10) {
				t.Fatalf("%d bytes for target %d", len(b), tt.target)
			}
			if req.Model == "" || req.Temperature == nil || *req.Temperature != 0 || !req.CachePrompt || len(req.Tools) == 0 || req.Stream != tt.stream {
				t.Fatalf("top-level fields: %+v", req)
			}
			if req.Messages[0].Role != "system" || req.Messages[1].Role != "user" || req.Messages[n-1].Role != "tool" {
				t.Fatal("not system, user, ..., tool")
			}
			// Every call answered by the tool messages right after it.
			for i := 2; i < n; {
				a := req.Messages[i]
				if a.Role != "assistant" || a.Content != nil || len(a.ToolCalls) == 0 {
					t.Fatalf("message %d: %+v", i, a)
				}
				for k, c := range a.ToolCalls {
					tm := req.Messages[i+1+k]
					if tm.Role != "tool" || tm.ToolCallID != c.ID {
						t.Fatalf("message %d does not answer %s", i+1+k, c.ID)
					}
				}
				i += 1 + len(a.ToolCalls)
			}
		})
	}
}

func TestAgentStepsPrefix(t *testing.T) {
	a, b := AgentMessages(5), AgentMessages(9)
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			t.Fatalf("message %d differs", i)
		}
	}
	if !json.Valid(AgentSteps(3, true)) {
		t.Fatal("invalid JSON")
	}
}
