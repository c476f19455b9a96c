package driver

import (
	"context"
	"fmt"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"math/rand"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// genConversation builds a random valid agent conversation: 0–2 system
// messages, an ask, then steps of parallel tool calls answered in any
// order (some results long), assistant replies followed by new user asks,
// user messages with an image. Roles never repeat (user/user,
// assistant/assistant) and every user text is distinct.
func genConversation(r *rand.Rand) []msg {
	var out []msg
	for i := r.Intn(3); i > 0; i-- {
		out = append(out, sysMsg(fmt.Sprintf("system %d: %s", i, blob("sys", 50+r.Intn(400)))))
	}
	users := 0
	user := func() msg {
		users++
		return userMsg(fmt.Sprintf("ask %d: %s", users, blob("ask", 20+r.Intn(200))))
	}
	out = append(out, user())
	calls := 0
	steps := 1 + r.Intn(40)
	for s := 0; s < steps; s++ {
		last := out[len(out)-1]["role"]
		switch x := r.Intn(20); {
		case x < 15 || last == "assistant": // a tool step
			k := 1 + r.Intn(3)
			ids := make([]string, k)
			specs := make([]string, k)
			for j := range ids {
				calls++
				ids[j] = fmt.Sprintf("call_%d", calls)
				specs[j] = fmt.Sprintf(`%s:bash:{"cmd":"step %d.%d"}`, ids[j], s, j)
			}
			reasoning := ""
			if r.Intn(2) == 0 {
				reasoning = "thinking " + blob("r", r.Intn(300))
			}
			out = append(out, callMsg(reasoning, specs...))
			for _, j := range r.Perm(k) {
				size := 20 + r.Intn(1500)
				if r.Intn(5) == 0 {
					size = 4500 + r.Intn(30000)
				}
				out = append(out, toolMsg(ids[j], blob(ids[j], size)))
			}
		case x < 17 && last != "user": // the assistant answers, the user asks again
			out = append(out, asstMsg("done: "+blob("reply", r.Intn(500))), user())
		case x < 19 && last != "user": // a user message with an image (not text-only)
			users++
			out = append(out, msg{"role": "user", "content": []any{
				map[string]any{"type": "text", "text": fmt.Sprintf("screenshot %d", users)},
				map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,iVBORw0KGgo="}},
			}})
		default:
			if last != "user" {
				out = append(out, user())
			}
		}
	}
	return out
}

// requestPoints are the prefixes a client sends: each ends before an
// assistant message (the model's turn), plus the whole conversation.
func requestPoints(conv []msg) []int {
	var pts []int
	for i := 1; i < len(conv); i++ {
		if conv[i]["role"] == "assistant" && conv[i-1]["role"] != "system" {
			pts = append(pts, i)
		}
	}
	return append(pts, len(conv))
}

// checkProperties runs one random conversation step by step through the
// engine and checks every forwarded view.
func checkProperties(t *testing.T, seed int64, keepTail, mode int) {
	r := rand.New(rand.NewSource(seed))
	conv := genConversation(r)
	cfg := baseConfig()
	cfg.KeepTail = keepTail
	// mode: 0 reliable summarizer, no throttle; 1 flaky; 2 failing;
	// 3 summarizer off. Modes 1–3 use the throttle too.
	var sum *fakeSummarizer
	switch mode {
	case 0:
		sum = okSummarizer()
		cfg.MinInterval = 0
	case 1:
		sum = &fakeSummarizer{fn: func(call int, head []chat.Message, _ string) (string, error) {
			if call%2 == 1 {
				return "", errRejected
			}
			return fmt.Sprintf("summary %d of %d messages", call, len(head)), nil
		}}
		cfg.LatchGrowth = 4
	case 2:
		sum = failingSummarizer()
	default:
		cfg.SummarizerEnabled = false
	}
	clock := newClock()
	e := newDriver(cfg, sum, clock)

	all := parse(t, conv)
	allChain := chainOf(t, all)
	total := fakeEstimate(all).Tokens
	window := max(total*(30+r.Intn(90))/100, 600)
	var st compaction.State
	var prev compaction.Output
	prevOK := false
	allowed := map[int]bool{} // client positions a tail over the target let compaction touch
	for _, n := range requestPoints(conv) {
		clock.Add(5 * time.Second)
		msgs := all[:n:n] // a prefix parses to the same messages
		out := e.Compact(context.Background(), compaction.Input{Messages: msgs, Chain: allChain[:n+1], State: st,
			Window: window, Estimate: fakeEstimate})
		where := fmt.Sprintf("seed %d K %d mode %d n %d window %d", seed, keepTail, mode, n, window)
		if out.Events.InvariantFailure {
			t.Fatalf("%s: invariant failure", where)
		}
		v := out.Messages
		if violations(v) != 0 {
			t.Fatalf("%s: pairing violation in %s", where, roles(v))
		}
		// The client's final message stays final, verbatim unless the view
		// with it verbatim is over the window (the last resort excerpts
		// it then: head and tail kept, the same message otherwise).
		excerptedFinal := false
		if last, want := v[len(v)-1], msgs[len(msgs)-1]; string(last.Raw) != string(want.Raw) {
			restored := append(slices.Clone(v[:len(v)-1]), want)
			if last.Role != want.Role || !strings.Contains(chat.Text(last), " characters elided by compactproxy ...]") ||
				fakeEstimate(restored).Tokens <= window {
				t.Fatalf("%s: last message is not the client's (nor an excerpt of it needed to fit the window %d: %d tokens with it verbatim)",
					where, window, fakeEstimate(restored).Tokens)
			}
			excerptedFinal = true
		}
		seen := map[string]bool{}
		for i := range v {
			if i > 0 && (v[i].Role == "user" || v[i].Role == "assistant") && v[i].Role == v[i-1].Role {
				t.Fatalf("%s: two %s messages meet at %d: %s", where, v[i].Role, i, roles(v))
			}
			if v[i].Role == "user" {
				if seen[string(v[i].Raw)] {
					t.Fatalf("%s: user message duplicated: %.80s", where, v[i].Raw)
				}
				seen[string(v[i].Raw)] = true
			}
		}
		// The verbatim tail: min(K, n) trailing messages, except where a
		// tail over the target (now or at an earlier step, whose trims are
		// re-applied) let step 4 excerpt or drop.
		tail := tailStart(msgs, keepTail)
		lead := 0
		for lead < len(msgs) && isSystemRole(msgs[lead].Role) {
			lead++
		}
		askTokens := 0
		for i := len(msgs) - 1; i >= lead; i-- {
			if msgs[i].Role == "user" {
				askTokens = len(msgs[i].Raw) / 4
				break
			}
		}
		if mode != 0 || fakeEstimate(msgs[:lead]).Tokens+fakeEstimate(msgs[tail:]).Tokens+max(cfg.SummaryTokens, compaction.DefaultSummaryMinTokens)+len(summaryLabel)/4+askTokens+100 >= out.Target {
			for i := tail; i < len(msgs); i++ {
				allowed[i] = true
			}
		}
		for k := 0; k < min(keepTail, len(msgs)); k++ {
			i := len(msgs) - 1 - k
			if k == 0 && excerptedFinal {
				continue // checked above
			}
			if k >= len(v) || string(v[len(v)-1-k].Raw) != string(msgs[i].Raw) {
				if !allowed[i] {
					t.Fatalf("%s: tail message %d (of %d) not verbatim although the tail was under the target", where, i, len(msgs))
				}
				break
			}
		}
		// The goals, measured on the forwarded view itself:
		// - it fits the budget whenever the messages compaction may never
		//   remove (system messages, the task, the latest instruction, the
		//   final turn) leave room for it;
		// - the latest user instruction is there verbatim, and the task too
		//   unless a summary stands for it;
		// - with a reliable summarizer, nothing is dropped.
		final := len(msgs) - 1
		for final > 0 && isToolRole(msgs[final].Role) {
			final--
		}
		task, latest := -1, -1
		for i := lead; i < len(msgs); i++ {
			if msgs[i].Role == "user" {
				if task < 0 {
					task = i
				}
				latest = i
			}
		}
		keepSize := fakeEstimate(msgs[:lead]).Tokens + fakeEstimate(msgs[final:]).Tokens
		for _, i := range []int{task, latest} {
			if i >= 0 && i < final {
				keepSize += len(msgs[i].Raw) / 4
			}
		}
		if got := fakeEstimate(v).Tokens; out.Budget > 0 && keepSize+400 < out.Budget/2 && got > out.Budget {
			t.Fatalf("%s: forwarded %d tokens over the budget %d (kept part %d)", where, got, out.Budget, keepSize)
		}
		hasText := func(text string) bool {
			for i := range v {
				if strings.Contains(chat.Text(v[i]), text) {
					return true
				}
			}
			return false
		}
		if latest >= 0 && msgs[latest].MediaParts == 0 && !hasText(chat.Text(msgs[latest])) {
			t.Fatalf("%s: the latest instruction (message %d) is not forwarded: %s", where, latest, roles(v))
		}
		summarized := out.Action == compaction.ActionSummarized || out.Action == compaction.ActionReused
		if task >= 0 && !summarized && count(v, msgs[task].Raw) != 1 {
			t.Fatalf("%s: the task (message %d) is not forwarded verbatim once: %s", where, task, roles(v))
		}
		// (A summary fits when there is a head and the view without it,
		// with the summary's label and acknowledgement, leaves
		// summary_min_tokens under the budget.)
		withoutHead := fakeEstimate(msgs[:lead]).Tokens + fakeEstimate(msgs[tail:]).Tokens + askTokens + len(summaryLabel)/4 + 60
		fits := tail > lead && withoutHead+compaction.DefaultSummaryMinTokens <= out.Budget &&
			fakeEstimate(msgs[lead:tail]).Tokens >= 2*compaction.DefaultSummaryMinTokens
		if mode == 0 && fits && slices.Contains(out.Events.NewActions, compaction.ActionDropped) {
			t.Fatalf("%s: dropped while the summarizer works (%v)", where, out.Events.NewActions)
		}
		// No new compaction: the previous forwarded view is a prefix.
		fresh := false
		for _, a := range out.Events.NewActions {
			fresh = fresh || a != compaction.ActionReused
		}
		if prevOK && !fresh && out.Forwarded <= out.Budget {
			for i := range prev.Messages {
				if i >= len(v) || string(v[i].Raw) != string(prev.Messages[i].Raw) {
					t.Fatalf("%s: forwarded prefix changed at %d without a new compaction (%v)", where, i, out.Events.NewActions)
				}
			}
		}
		statsMu.Lock()
		stats[string(out.Action)]++
		if out.Events.SummarizeCalled {
			stats["called"]++
		}
		if out.Events.Suppressed != "" {
			stats["suppressed_"+out.Events.Suppressed]++
		}
		statsMu.Unlock()
		if out.StateChanged {
			st = out.State
		}
		prev, prevOK = out, true
	}
}

var (
	statsMu sync.Mutex
	stats   = map[string]int{}
)

// TestProperties runs the property check over a fixed set of seeds and
// every keep_tail from 0 to 8, in every summarizer mode.
func TestProperties(t *testing.T) {
	seeds := 25
	if testing.Short() {
		seeds = 5
	}
	t.Cleanup(func() { t.Logf("outcomes: %v", stats) })
	for mode := 0; mode < 4; mode++ {
		for k := 0; k <= 8; k++ {
			t.Run(fmt.Sprintf("mode%d/K%d", mode, k), func(t *testing.T) {
				t.Parallel()
				for seed := int64(0); seed < int64(seeds); seed++ {
					checkProperties(t, seed*1000+int64(k*10+mode), k, mode)
				}
			})
		}
	}
}

// FuzzCompact: go test -fuzz FuzzCompact -fuzztime 2m ./internal/compaction
func FuzzCompact(f *testing.F) {
	for _, s := range []struct {
		seed int64
		k    uint8
		mode uint8
	}{{1, 3, 0}, {2, 0, 1}, {3, 8, 2}, {4, 1, 3}, {5, 5, 0}} {
		f.Add(s.seed, s.k, s.mode)
	}
	f.Fuzz(func(t *testing.T, seed int64, k, mode uint8) {
		checkProperties(t, seed, int(k%9), int(mode%4))
	})
}

// The generator itself produces valid conversations.
func TestGenConversation(t *testing.T) {
	for seed := int64(0); seed < 200; seed++ {
		msgs := parse(t, genConversation(rand.New(rand.NewSource(seed))))
		if violations(msgs) != 0 {
			t.Fatalf("seed %d: invalid conversation %s", seed, roles(msgs))
		}
		if strings.Count(roles(msgs), "user,user") > 0 {
			t.Fatalf("seed %d: adjacent users", seed)
		}
	}
}
