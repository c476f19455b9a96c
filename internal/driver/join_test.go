package driver

import (
	"context"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// alternates reports the first place where two user or two assistant
// messages meet in view (-1 when roles alternate).
func alternates(view []chat.Message) int {
	for i := 1; i < len(view); i++ {
		r := view[i].Role
		if (r == "user" || r == "assistant") && r == view[i-1].Role {
			return i
		}
	}
	return -1
}

// Issue 19 review item 2: a re-applied summary decides its
// acknowledgement and ask against the messages that follow now. A client
// that rewinds to the summary's cut and sends a new instruction used to get
// the stored block (summary, acknowledgement, the old ask: a user message)
// followed by its new user message: two user messages in a row upstream.
func TestReappliedSummaryJoinsARewind(t *testing.T) {
	cfg := baseConfig()
	e := newDriver(cfg, okSummarizer(), nil)
	msgs := parse(t, agentSteps(12, 1500))
	first := e.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
	if first.Action != compaction.ActionSummarized || first.State.Summary == nil {
		t.Fatalf("setup: action %q, want a summary", first.Action)
	}
	cut := first.State.Summary.Cut
	rewound := append(agentSteps(12, 1500)[:cut:cut], userMsg("stop; revert the last change and run the tests instead"))
	view := parse(t, rewound)
	out := e.Compact(context.Background(), compaction.Input{Messages: view, Chain: chainOf(t, view), State: first.State, Window: 3500, Estimate: fakeEstimate})
	if out.Action != compaction.ActionReused {
		t.Fatalf("rewound request: action %q, want the summary reused", out.Action)
	}
	if i := alternates(out.Messages); i >= 0 {
		t.Fatalf("two %s messages meet at %d: %s", out.Messages[i].Role, i, roles(out.Messages))
	}
	if got := chat.Text(out.Messages[len(out.Messages)-1]); !strings.HasPrefix(got, "stop; revert") {
		t.Fatalf("final message %.40q is not the client's new instruction", got)
	}
	if n := count(out.Messages, view[1].Raw); n != 0 {
		t.Fatalf("the old ask is re-inserted %d times before a newer instruction", n)
	}
}

// Issue 19 review item 3: the re-inserted ask is the most recent user
// message, text or text with an image. It used to be the newest text-only
// one: a newer instruction with a screenshot was summarized away and the
// older task re-inserted as if it were the latest.
func TestAskIncludesAnInstructionWithAnImage(t *testing.T) {
	conv := agentSteps(4, 1500)
	shot := msg{"role": "user", "content": []any{
		map[string]any{"type": "text", "text": "the layout is broken, see the screenshot; fix the header"},
		map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,iVBORw0KGgo="}},
	}}
	conv = append(conv, shot)
	for _, m := range agentSteps(8, 1500)[2:] {
		conv = append(conv, m)
	}
	// Unique call ids after the screenshot.
	for i := len(conv) - 16; i < len(conv); i++ {
		if tc, ok := conv[i]["tool_calls"].([]any); ok {
			tc[0].(map[string]any)["id"] = "late_" + tc[0].(map[string]any)["id"].(string)
		}
		if conv[i]["role"] == "tool" {
			conv[i]["tool_call_id"] = "late_" + conv[i]["tool_call_id"].(string)
		}
	}
	msgs := parse(t, conv)
	e := newDriver(baseConfig(), okSummarizer(), nil)
	out := e.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
	checkView(t, msgs, out)
	if out.Action != compaction.ActionSummarized || out.State.Summary == nil || out.State.Summary.Cut <= 10 {
		t.Fatalf("setup: action %q, summary %+v: want a summary whose head holds the screenshot", out.Action, out.State.Summary)
	}
	if count(out.Messages, msgs[10].Raw) != 1 {
		t.Fatalf("the latest instruction (with its screenshot) is not re-inserted: %s", roles(out.Messages))
	}
	if count(out.Messages, msgs[1].Raw) != 0 {
		t.Fatal("the older task is re-inserted as if it were the latest instruction")
	}
	if i := alternates(out.Messages); i >= 0 {
		t.Fatalf("two %s messages meet at %d: %s", out.Messages[i].Role, i, roles(out.Messages))
	}
}
