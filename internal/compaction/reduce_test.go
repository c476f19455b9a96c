package compaction

import (
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// Every API's calls reach step 0 with their tool's name and arguments:
// chat tool_calls, Responses function_call items, Anthropic tool_use
// blocks (the dialects map them to the chat shape the planner reads).
func TestCallsAllDialects(t *testing.T) {
	bodies := []struct {
		d    chat.Dialect
		body string
	}{
		{chat.DialectChat, `{"model":"m","messages":[{"role":"user","content":"go"},
			{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.go\"}"}}]},
			{"role":"tool","tool_call_id":"c1","content":"package a"}]}`},
		{chat.DialectResponses, `{"model":"m","input":[{"role":"user","content":"go"},
			{"type":"function_call","call_id":"c1","name":"read_file","arguments":"{\"path\":\"a.go\"}"},
			{"type":"function_call_output","call_id":"c1","output":"package a"}]}`},
		{chat.DialectMessages, `{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"go"},
			{"role":"assistant","content":[{"type":"tool_use","id":"c1","name":"read_file","input":{"path":"a.go"}}]},
			{"role":"user","content":[{"type":"tool_result","tool_use_id":"c1","content":"package a"}]}]}`},
	}
	for _, b := range bodies {
		t.Run(b.d.String(), func(t *testing.T) {
			req, err := chat.ParseDialect(b.d, []byte(b.body))
			if err != nil {
				t.Fatal(err)
			}
			r := &run{msgs: req.Messages, n: len(req.Messages)}
			got := r.calls()
			last := len(req.Messages) - 1
			if req.Messages[last].Role != "tool" {
				t.Fatalf("last message is %s", req.Messages[last].Role)
			}
			if c := got[last]; !c.known || c.name != "read_file" || c.path != "a.go" || c.edit {
				t.Fatalf("call of the result: %+v", c)
			}
		})
	}
}

// A pointer keeps the message's shape: a content-part array stays an
// array, the tool message keeps its tool_call_id; re-applied from the
// state, it is the same bytes.
func TestDedupeKeepsShape(t *testing.T) {
	parts := func(s string) []any { return []any{map[string]any{"type": "text", "text": s}} }
	conv := []msg{sysMsg("sys"), userMsg("go"),
		callMsg("", `c1:read_file:{"path":"a.go"}`), {"role": "tool", "tool_call_id": "c1", "content": parts(blob("a", 6000))},
		callMsg("", `c2:read_file:{"path":"b.go"}`), toolMsg("c2", blob("b", 6000)),
		callMsg("", `c3:read_file:{"path":"a.go"}`), {"role": "tool", "tool_call_id": "c3", "content": parts(blob("a", 6000))},
		asstMsg("done"), userMsg("next"),
	}
	msgs := parse(t, conv)
	pl := NewPlanner(Config{KeepTail: 2, Dedupe: true})
	in := Input{Messages: msgs, Chain: chainOf(t, msgs), Window: fakeEstimate(msgs).Tokens * 12 / 10, Estimate: fakeEstimate}
	out := pl.Plan(in)
	if out.Action != ActionMasked || out.Reduced.Dedupe <= 0 || !out.CacheReset || out.ResetAt != 3 {
		t.Fatalf("action %s reduced %+v reset %v at %d", out.Action, out.Reduced, out.CacheReset, out.ResetAt)
	}
	got := out.Messages[3]
	want := `{"content":[{"type":"text","text":"[compactproxy: identical to the later result of read_file {\"path\":\"a.go\"}]"}],"role":"tool","tool_call_id":"c1"}`
	if string(got.Raw) != want {
		t.Fatalf("pointer:\n got %s\nwant %s", got.Raw, want)
	}
	if len(out.State.Trims) != 1 {
		t.Fatalf("records: %+v", out.State.Trims)
	}
	if tr := out.State.Trims[0]; tr.Masked() || tr.Index != 3 {
		t.Fatalf("record %+v", tr)
	} else if later, ok := tr.PointsTo(); !ok || later != 7 {
		t.Fatalf("record %+v points to %d (%v), want 7", tr, later, ok)
	}
	in.State = out.State
	again := pl.Plan(in)
	if string(again.Messages[3].Raw) != want || again.StateChanged || again.CacheReset {
		t.Fatalf("re-applied: %s (changed %v, reset %v)", again.Messages[3].Raw, again.StateChanged, again.CacheReset)
	}
}
