package compaction

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/anchor/anchortest"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// msg is one message as a client would send it (test builder).
type msg map[string]any

func sysMsg(text string) msg  { return msg{"role": "system", "content": text} }
func userMsg(text string) msg { return msg{"role": "user", "content": text} }
func asstMsg(text string) msg { return msg{"role": "assistant", "content": text} }

// callMsg is an assistant message calling tools; each call is "id:name:args".
func callMsg(reasoning string, calls ...string) msg {
	var tc []any
	for _, c := range calls {
		parts := strings.SplitN(c, ":", 3)
		tc = append(tc, map[string]any{
			"id": parts[0], "type": "function",
			"function": map[string]any{"name": parts[1], "arguments": parts[2]},
		})
	}
	m := msg{"role": "assistant", "content": nil, "tool_calls": tc}
	if reasoning != "" {
		m["reasoning_content"] = reasoning
	}
	return m
}

func toolMsg(id, content string) msg {
	return msg{"role": "tool", "tool_call_id": id, "content": content}
}

// parse turns builder messages into the provider-visible view, through the
// real parser (so Raw, TextBytes etc. are what the proxy would see).
func parse(tb testing.TB, msgs []msg) []chat.Message {
	tb.Helper()
	body, err := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	if err != nil {
		tb.Fatal(err)
	}
	req, err := chat.Parse(body)
	if err != nil {
		tb.Fatalf("parse: %v", err)
	}
	return req.Messages
}

var testSeed = anchor.Seed("test/m", nil)

// chainOf is the client chain the proxy would compute.
func chainOf(tb testing.TB, msgs []chat.Message) []anchor.Digest {
	tb.Helper()
	return anchortest.Chain(testSeed, digestsOf(tb, msgs))
}

// fakeEstimate: tokens = sum(len(Raw))/4, so tests do not depend on the
// anchor package's numbers.
func fakeEstimate(view []chat.Message) anchor.Estimate {
	t := 0
	for i := range view {
		t += len(view[i].Raw)
	}
	return anchor.Estimate{Tokens: t / 4, Source: anchor.SourceLocal, Local: t / 4}
}

// blob is n bytes of line-structured text, distinct per tag.
func blob(tag string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s line %d: the quick brown fox jumps over the lazy dog\n", tag, i)
	}
	return b.String()[:n]
}

// count returns how many messages of view have exactly raw as bytes.
func count(view []chat.Message, raw []byte) int {
	n := 0
	for i := range view {
		if string(view[i].Raw) == string(raw) {
			n++
		}
	}
	return n
}

// verbatimTail is how many trailing messages of out equal in's.
func verbatimTail(in, out []chat.Message) int {
	k := 0
	for k < len(in) && k < len(out) && string(in[len(in)-1-k].Raw) == string(out[len(out)-1-k].Raw) {
		k++
	}
	return k
}

func roles(view []chat.Message) string {
	r := make([]string, len(view))
	for i := range view {
		r[i] = view[i].Role
	}
	return strings.Join(r, ",")
}

const ask = "add a retry to fetch_rows in store.py"

// agentSteps is an agent conversation: system, the ask, then steps
// assistant call + result, each result size bytes.
func agentSteps(steps, size int) []msg {
	out := []msg{sysMsg("You are a coding agent."), userMsg(ask)}
	for i := 0; i < steps; i++ {
		id := fmt.Sprintf("call_%d", i)
		out = append(out,
			callMsg("", fmt.Sprintf(`%s:run:{"cmd":"step %d"}`, id, i)),
			toolMsg(id, blob(fmt.Sprintf("step%d", i), size)))
	}
	return out
}

func baseConfig() Config {
	return Config{
		TriggerRatio: 0.8, TargetRatio: 0.6, KeepTail: 3, LatchGrowth: 20,
		TrimToolResultTokens: 1024, MinInterval: time.Minute, SummarizerEnabled: true,
		SummaryTokens: 200,
	}
}

// defaultConfig is compactproxy's configuration defaults as the proxy
// hands them to the planner (internal/config), not a tuned profile.
func defaultConfig() Config {
	return Config{
		TriggerRatio: 0.8, TargetRatio: 0.6, ReserveTokens: 4096, KeepTail: 3, TailRatio: DefaultTailRatio,
		LatchGrowth: 20, TrimToolResultTokens: 1024, MinInterval: time.Minute,
		SummarizerEnabled: true, SummaryTokens: 1024, SummaryMinTokens: 256,
	}
}

// checkView asserts what every forwarded view must satisfy.
func checkView(t *testing.T, in []chat.Message, out Output) {
	t.Helper()
	if len(out.Messages) == 0 {
		t.Fatal("empty view")
	}
	if v := violations(out.Messages); v != 0 {
		t.Fatalf("view fails pairing (%d violations): %s", v, roles(out.Messages))
	}
	if got, want := out.Messages[len(out.Messages)-1].Raw, in[len(in)-1].Raw; string(got) != string(want) {
		t.Fatalf("last message is not the client's: %.80s", got)
	}
	if out.Events.InvariantFailure {
		t.Fatal("invariant failure")
	}
}

// verbatimTailConv is the case: the ask, exploration (ls, grep,
// git log), then cat store.py and a failing pytest. With askInTail the ask
// comes after the exploration, right before cat.
func verbatimTailConv(askInTail bool) []msg {
	out := []msg{sysMsg("You are a coding agent. Work in /repo.")}
	if askInTail {
		out = append(out, userMsg("look around the repository first"))
	} else {
		out = append(out, userMsg(ask))
	}
	for i, c := range []struct{ name, args string }{
		{"ls", `{"cmd":"ls -la"}`}, {"grep", `{"cmd":"grep -rn fetch_rows ."}`}, {"git_log", `{"cmd":"git log --oneline -20"}`},
	} {
		id := fmt.Sprintf("x%d", i)
		out = append(out, callMsg("", id+":"+c.name+":"+c.args), toolMsg(id, blob(c.name, 3000)))
	}
	if askInTail {
		out = append(out, userMsg(ask))
	}
	out = append(out,
		callMsg("I should read the file before changing it.", `c1:bash:{"cmd":"cat store.py"}`),
		toolMsg("c1", "def fetch_rows(conn, q):\n    return conn.execute(q).fetchall()\n"+blob("store.py", 1500)),
		callMsg("Now run the tests.", `c2:bash:{"cmd":"pytest -q"}`),
		toolMsg("c2", "F.\nFAILED test_store.py::test_fetch_rows_retries - AssertionError\n"+blob("pytest", 800)),
	)
	return out
}
