package compaction

// The planner's tests that read its internals (a corrupted view, the
// re-application of records, excerpts) or take inputs the driver never
// gives it (a measured size, a canceled summary, an unknown window). The
// planner's behaviour through a whole request is tested in internal/driver,
// which runs the planner as every caller does.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// testNow is the time every decision here is made at.
var testNow = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// answered is the decision for in once a summary it asks for is
// answered (a driver's second plan, with the text a summarizer would
// write): a test of the planner alone states the answer itself.
func answered(p *Planner, in Input) Output {
	return withAnswer(p, in, "Goal: add a retry. Summary #1 of the earlier messages.", nil, false)
}

// withAnswer is the decision for in once a summary it asks for is answered
// with text or err (canceled: given up because the requester left).
func withAnswer(p *Planner, in Input, text string, err error, canceled bool) Output {
	if in.Now.IsZero() {
		in.Now = testNow
	}
	out := p.Plan(in)
	if out.Need == nil {
		return out
	}
	in.Summary = ResultFor(out.Need, text, 0, err, canceled)
	return p.Plan(in)
}

var errRejected = errors.New("summarizer: 400 strict template rejected the request")

// Overflow recovery ignores the throttle (internal/driver's TestThrottle)
// but honours the latch, and estimates the refused view at its measured
// size.
func TestRecoverHonoursTheLatch(t *testing.T) {
	p := NewPlanner(baseConfig())
	msgs := parse(t, verbatimTailConv(false))
	out := withAnswer(p, Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate}, "", errRejected, false)
	if !out.State.Latched {
		t.Fatalf("setup: a failed summary did not latch: %+v", out.Events)
	}
	out = p.Plan(Input{Messages: msgs, Chain: chainOf(t, msgs), State: out.State, Window: 3500,
		Estimate: fakeEstimate, Pass: PassRecover, Measured: 5000, Now: testNow})
	if out.Need != nil || out.Events.Suppressed != SuppressedLatch {
		t.Fatalf("summary asked %v, suppressed %q", out.Need != nil, out.Events.Suppressed)
	}
	if out.Context.Tokens != 5000 {
		t.Errorf("measured size not used: %d", out.Context.Tokens)
	}
}

// A summary given up because its requester went away is never spliced in
// and does not latch: it says nothing about the summarizer.
func TestCanceledSummaryDoesNotLatch(t *testing.T) {
	msgs := parse(t, verbatimTailConv(false))
	out := withAnswer(NewPlanner(baseConfig()), Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate},
		"", context.Canceled, true)
	checkView(t, msgs, out)
	if !errors.Is(out.Events.SummaryError, context.Canceled) || out.Events.SummarizeOK || out.Action == ActionSummarized {
		t.Fatalf("error %v ok %v action %q", out.Events.SummaryError, out.Events.SummarizeOK, out.Action)
	}
	if out.State.Latched || out.Events.LatchEngaged {
		t.Errorf("latched %v", out.State.Latched)
	}
	for _, m := range out.Messages {
		if strings.Contains(string(m.Raw), "elided by compactproxy") || strings.Contains(string(m.Raw), "Summary of the earlier") {
			t.Fatal("failed summary spliced in")
		}
	}
}

// Stored compaction is re-applied with an unknown window (the planner's
// part; the driver only estimates without a window).
func TestStoredSummaryReappliedAtAnUnknownWindow(t *testing.T) {
	p := NewPlanner(baseConfig())
	msgs := parse(t, verbatimTailConv(false))
	first := answered(p, Input{Messages: msgs, Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
	out := p.Plan(Input{Messages: msgs, Chain: chainOf(t, msgs), State: first.State, Estimate: fakeEstimate, Now: testNow})
	if out.Action != ActionReused || len(out.Messages) != len(first.Messages) {
		t.Fatalf("action %q", out.Action)
	}
	if out.Context.Tokens != fakeEstimate(first.Messages).Tokens {
		t.Errorf("context %d is not the re-applied view's", out.Context.Tokens)
	}
}

// (g) A produced view that fails the pairing check is discarded: the
// client's view is forwarded, nothing new is stored, the failure reported.
func TestInvariantFailure(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func([]chat.Message) []chat.Message
		msgs    []msg
		win     int
	}{
		{"summary view loses a result", func(v []chat.Message) []chat.Message { // drops the last tool result but one
			for i := len(v) - 2; i >= 0; i-- {
				if v[i].Role == "tool" {
					return append(v[:i:i], v[i+1:]...)
				}
			}
			return v
		}, verbatimTailConv(false), 3500},
		{"trimmed view gets an orphan", func(v []chat.Message) []chat.Message {
			return append([]chat.Message{v[0], chat.WithContentText(v[3], "x")}, v[1:]...)
		}, agentSteps(6, 6000), 10000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := NewPlanner(baseConfig())
			p.corrupt = tc.corrupt
			msgs := parse(t, tc.msgs)
			out := answered(p, Input{Messages: msgs, Chain: chainOf(t, msgs), Window: tc.win,
				Estimate: fakeEstimate})
			if !out.Events.InvariantFailure || &out.Messages[0] != &msgs[0] || len(out.Messages) != len(msgs) {
				t.Fatalf("invariant failure %v, %d messages", out.Events.InvariantFailure, len(out.Messages))
			}
			if out.Action != ActionNone || len(out.Events.NewActions) != 0 {
				t.Errorf("action %q new %v", out.Action, out.Events.NewActions)
			}
			if out.State.Summary != nil || len(out.State.Trims) != 0 || len(out.State.Drops) != 0 {
				t.Errorf("records stored after an invariant failure: %+v", out.State)
			}
			if out.Forwarded != fakeEstimate(msgs).Tokens {
				t.Errorf("forwarded %d", out.Forwarded)
			}
		})
	}
	t.Run("pairing off: an invalid client view is no failure when nothing is added", func(t *testing.T) {
		conv := verbatimTailConv(false)
		conv = append(conv[:3:3], append([]msg{toolMsg("ghost", "orphan")}, conv[3:]...)...)
		msgs := parse(t, conv)
		if violations(msgs) == 0 {
			t.Fatal("test conversation should be invalid")
		}
		out := answered(NewPlanner(baseConfig()), Input{Messages: msgs,
			Chain: chainOf(t, msgs), Window: 3500, Estimate: fakeEstimate})
		if out.Events.InvariantFailure || out.Action != ActionSummarized {
			t.Fatalf("action %q invariant %v", out.Action, out.Events.InvariantFailure)
		}
	})
}

// Trim: long tool results outside the tail become excerpts, oldest first,
// only as many as needed, recorded and re-applied byte-identically.
func TestTrim(t *testing.T) {
	p := NewPlanner(baseConfig())
	var st State
	step := func(msgs []chat.Message) Output {
		out := p.Plan(Input{Messages: msgs, Chain: chainOf(t, msgs), State: st, Window: 10000, Estimate: fakeEstimate, Now: testNow})
		if out.StateChanged {
			st = out.State
		}
		return out
	}
	conv := agentSteps(6, 6000) // 6 × 1500 tokens
	msgs := parse(t, conv)
	out := step(msgs)
	checkView(t, msgs, out)
	if out.Action != ActionTrimmed || out.Need != nil || out.Forwarded >= out.Target {
		t.Fatalf("action %q summary asked %v forwarded %d target %d", out.Action, out.Need != nil, out.Forwarded, out.Target)
	}
	trims := out.State.Trims
	if len(trims) == 0 || trims[0].Index != 3 {
		t.Fatalf("trims %+v", trims)
	}
	for k, tr := range trims {
		if k > 0 && tr.Index <= trims[k-1].Index {
			t.Fatal("trims not oldest first")
		}
	}
	// Only as many as needed: without the last one the view is over the target.
	if len(trims) > 1 {
		var fewer State
		fewer.Trims = trims[:len(trims)-1]
		p := (&run{cfg: &p.cfg, msgs: msgs, n: len(msgs), chain: true, in: Input{Chain: chainOf(t, msgs)}, st: fewer,
			excerpts: map[[2]int]chat.Message{}, lead: 1}).reapply()
		r := &run{msgs: msgs, n: len(msgs), excerpts: map[[2]int]chat.Message{}, blocks: map[*Summary][]chat.Message{}}
		if fakeEstimate(r.view(p)).Tokens < out.Target {
			t.Error("trimmed more than needed")
		}
	}
	trimmedText := chat.Text(out.Messages[3])
	if !strings.Contains(trimmedText, " characters elided by compactproxy ...]") || len(trimmedText) > 2048+100 {
		t.Fatalf("excerpt %d bytes: %.300q", len(trimmedText), trimmedText)
	}
	if !strings.HasPrefix(trimmedText, "step0 line 0:") || !strings.HasSuffix(trimmedText, chat.Text(msgs[3])[len(chat.Text(msgs[3]))-100:]) {
		t.Error("excerpt does not keep head and tail")
	}
	// The tail is untouched.
	if verbatimTail(msgs, out.Messages) < 3 {
		t.Error("tail changed")
	}
	// Next step: re-applied identically, no new trims.
	conv = append(conv, callMsg("", `n:edit:{}`), toolMsg("n", "ok"))
	msgs2 := parse(t, conv)
	out2 := step(msgs2)
	for i := range out.Messages {
		if string(out2.Messages[i].Raw) != string(out.Messages[i].Raw) {
			t.Fatalf("message %d not re-applied identically", i)
		}
	}
	if out2.Action != ActionTrimmed || len(out2.Events.NewActions) != 0 {
		t.Errorf("re-applied: action %q new %v", out2.Action, out2.Events.NewActions)
	}
}

func TestAddAnchor(t *testing.T) {
	var s State
	for i := 1; i <= 6; i++ {
		s.AddAnchor(anchor.Anchor{PrefixLen: i, Input: i * 10})
	}
	s.AddAnchor(anchor.Anchor{PrefixLen: 4, Input: 99}) // same prefix: replaced, moved first
	var got []int
	for _, a := range s.Anchors {
		got = append(got, a.PrefixLen)
	}
	if fmt.Sprint(got) != "[4 6 5 3]" || s.Anchors[0].Input != 99 {
		t.Fatalf("anchors %v", got)
	}
}

func TestExcerpt(t *testing.T) {
	text := strings.Repeat("é", 20000) // 2-byte runes: cuts land on rune boundaries
	out, ok := excerpt(text, 3000)
	if !ok || !strings.Contains(out, "[... 18,500 characters elided by compactproxy ...]") {
		t.Fatalf("%v %q", ok, out[1990:2080])
	}
	if !strings.HasPrefix(out, "éé") || !strings.HasSuffix(out, "éé") || strings.ContainsRune(out, '\uFFFD') {
		t.Fatal("bad cut")
	}
	if _, ok := excerpt("short", 3000); ok {
		t.Fatal("short text excerpted")
	}
	for n, want := range map[int]string{0: "0", 999: "999", 1000: "1,000", 12345: "12,345", 1234567: "1,234,567"} {
		if got := groupThousands(n); got != want {
			t.Errorf("groupThousands(%d) = %q", n, got)
		}
	}
}

// Tool results with image parts are never excerpted; text-part arrays are.
func TestTrimmable(t *testing.T) {
	long := blob("x", 8000)
	msgs := parse(t, []msg{
		{"role": "tool", "tool_call_id": "a", "content": []any{map[string]any{"type": "text", "text": long}}},
		{"role": "tool", "tool_call_id": "b", "content": []any{map[string]any{"type": "text", "text": long},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,AAAA"}}}},
		{"role": "user", "content": long},
	})
	if m, ok := trimmed(msgs[0], 2048); !ok || m.ContentIsString || m.Content[0] != '[' || m.TextBytes > 2200 || m.ToolCallID != "a" ||
		!strings.Contains(chat.Text(m), "characters elided") {
		t.Errorf("text parts not excerpted as a part array: %v string=%v %d", ok, m.ContentIsString, m.TextBytes)
	}
	if _, ok := trimmed(msgs[1], 2048); ok {
		t.Error("a result with an image was excerpted")
	}
	if _, ok := trimmed(msgs[2], 2048); ok {
		t.Error("a user message was excerpted")
	}
}

// excerptJSON works on the JSON literal: its head and tail are the
// decoded text's, and the marker counts exactly the characters in between.
func TestExcerptJSON(t *testing.T) {
	var texts []string
	for i := 0; i < 50; i++ {
		var b strings.Builder
		for j := 0; b.Len() < 3000+i*397; j++ {
			switch (i + j) % 7 {
			case 0:
				b.WriteString("line with \"quotes\" and \\backslashes\\\n")
			case 1:
				b.WriteString("héllo wörld ✓ 😀 ")
			case 2:
				b.WriteString("\t<tag attr='x'>&amp;</tag>\x01\n")
			default:
				fmt.Fprintf(&b, "plain %d ", j)
			}
		}
		texts = append(texts, b.String())
	}
	for k, text := range texts {
		lit, _ := json.Marshal(text)
		if k%2 == 1 { // escape everything non-ASCII as \uXXXX (surrogate pairs for emoji)
			lit = asciiJSON(text)
			var back string
			if err := json.Unmarshal(lit, &back); err != nil || back != text {
				t.Fatalf("bad literal: %v", err)
			}
		}
		out, ok := excerptJSON(lit, 1500)
		if !ok {
			t.Fatalf("text %d not excerpted", k)
		}
		i := strings.Index(out, "\n[... ")
		j := strings.Index(out, " characters elided by compactproxy ...]\n")
		head, tail := out[:i], out[j+len(" characters elided by compactproxy ...]\n"):]
		if !strings.HasPrefix(text, head) || !strings.HasSuffix(text, tail) || !utf8.ValidString(out) {
			t.Fatalf("text %d: head/tail are not the text's", k)
		}
		n, _ := strconv.Atoi(strings.ReplaceAll(out[i+len("\n[... "):j], ",", ""))
		if want := utf8.RuneCountInString(text) - utf8.RuneCountInString(head) - utf8.RuneCountInString(tail); n != want {
			t.Fatalf("text %d: marker says %d characters, %d were elided", k, n, want)
		}
		if len(out) > 1500+200 {
			t.Fatalf("text %d: excerpt %d bytes", k, len(out))
		}
	}
}

// asciiJSON encodes s as a JSON string with every non-ASCII character
// escaped (surrogate pairs beyond the BMP), as some clients send.
func asciiJSON(s string) []byte {
	b := []byte{'"'}
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b = append(b, '\\', byte(r))
		case r == '\n':
			b = append(b, `\n`...)
		case r < 0x20 || r > 0x7e:
			if r > 0xffff {
				r1, r2 := utf16.EncodeRune(r)
				b = fmt.Appendf(b, `\u%04x\u%04x`, r1, r2)
			} else {
				b = fmt.Appendf(b, `\u%04x`, r)
			}
		default:
			b = append(b, byte(r))
		}
	}
	return append(b, '"')
}

func TestUnescape(t *testing.T) {
	for _, lit := range []string{
		`"plain"`, `"a\nb\tc\"d\\e\/f\b\f\r"`, `"\u00e9\u2713\ud83d\ude00"`, `"lone \ud800 high"`, `"lone \ude00 low"`,
		`"\ud800\u0041"`, `"end \ud83d"`, string(asciiJSON("héllo 😀 \x01 \"q\"\n")),
	} {
		var want string
		if err := json.Unmarshal([]byte(lit), &want); err != nil {
			t.Fatalf("%s: %v", lit, err)
		}
		if got := chat.Unescape([]byte(lit[1 : len(lit)-1])); got != want {
			t.Errorf("unescape(%s) = %q, want %q", lit, got, want)
		}
	}
}

// TestFoldsTheTurnBeforeTheFloorRatherThanDrop sweeps the size of the
// fixed part under qwen-code's third request at 16k (test/agent): the task
// as the only user message (the ask, re-inserted after a summary), a
// listing and a read, keep_tail's floor reaching back to the listing. Where
// a summary fits beside the floor, no size may answer with a drop (DESIGN:
// a drop is never chosen while a summary fits). The real-agent case
// qwen-code/16k is the one that failed before the fix (a cut at the floor
// folded only the task it re-inserts); this sweep guards the planner's side.
func TestFoldsTheTurnBeforeTheFloorRatherThanDrop(t *testing.T) {
	cfg := defaultConfig()
	build := func(system int) []chat.Message {
		return parse(t, []msg{
			sysMsg(blob("system prompt and tools", system)), // ~10,900 tokens
			userMsg(blob("environment and task", 2560)),     // ~640
			// The listing's turn: the model's reasoning, then a listing
			// that an excerpt shortens, not enough.
			callMsg(blob("reasoning", 1500), `ls:run_shell_command:{"command":"ls -R"}`), toolMsg("ls", blob("listing", 3480)),
			callMsg("", `r1:read_file:{"file_path":"/p/a.go"}`), toolMsg("r1", blob("a.go", 2000)),
		})
	}
	// The upstream measured the view at 3 bytes a token (the agent test's
	// mock), a third more than the estimate.
	plan := func(msgs []chat.Message) Output {
		return answered(NewPlanner(cfg), Input{Messages: msgs, Chain: chainOf(t, msgs),
			Window: 16384, MaxTokens: 32000, Estimate: fakeEstimate, Measured: fakeEstimate(msgs).Tokens * 4 / 3})
	}
	// Every size of the fixed part under the budget, from a view that
	// fits to one whose floor alone does not.
	summarized := 0
	for n := 28000; n < 40000; n += 40 {
		msgs := build(n)
		out := plan(msgs)
		if out.Fixed >= out.Budget {
			break
		}
		checkView(t, msgs, out)
		// A summary fits where the dropped view leaves it its least room
		// (summary_min_tokens) and its label.
		if out.Action == ActionDropped && fakeEstimate(out.Messages).Tokens*4/3+cfg.SummaryMinTokens+80 <= out.Budget {
			t.Fatalf("system prompt of %d bytes: dropped while a summary of the listing's turn fits (fixed %d, budget %d): %s",
				n, out.Fixed, out.Budget, roles(out.Messages))
		}
		if out.Action == ActionSummarized {
			summarized++
			if count(out.Messages, msgs[1].Raw) != 1 || verbatimTail(msgs, out.Messages) < 2 {
				t.Fatalf("system prompt of %d bytes: the task (re-inserted) and the final turn must stay verbatim: %s", n, roles(out.Messages))
			}
		}
	}
	if summarized == 0 {
		t.Fatal("setup: no size summarized")
	}
}
