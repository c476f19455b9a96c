package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/anchor/anchortest"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/pairing"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/summarizer"
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
	chain, _, err := anchortest.ViewChain(testSeed, msgs, nil)
	if err != nil {
		tb.Fatal(err)
	}
	return chain
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

// violations counts the pairing violations of a view.
func violations(view []chat.Message) int {
	return len(pairing.Check(compaction.PairingView(view)))
}

// fakeClock is a settable clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fakeClock { return &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *fakeClock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// testKey is the conversation every test decision belongs to.
const testKey = "tenant|conversation"

// rig is a Driver on the memory store, a scripted summarizer and a
// settable clock: the planner's tests run through it as a request does.
type rig struct {
	d     *Driver
	store *store.MemoryBackend
	clock *fakeClock
}

// newDriver builds a driver around a planner made from cfg; sum nil means
// no summarizer (the summarize step is off), c nil a fresh fake clock.
func newDriver(cfg compaction.Config, sum *fakeSummarizer, c *fakeClock) *rig {
	if c == nil {
		c = newClock()
	}
	dc := Config{Store: store.NewMemoryBackend(0, 0), ReserveTokens: cfg.ReserveTokens, Now: c.Now}
	if sum == nil {
		cfg.SummarizerEnabled = false
	} else {
		dc.Summarizer = sum
	}
	dc.Planner = compaction.NewPlanner(cfg)
	return &rig{d: New(dc), store: dc.Store.(*store.MemoryBackend), clock: c}
}

// Compact is one request: the decision, with the summary it asks for.
func (r *rig) Compact(ctx context.Context, in compaction.Input) compaction.Output {
	return r.plan(ctx, in, true)
}

// plan stores in.State as the conversation's state (the lineage of
// in.Chain and the anchors) and runs the driver on in's view at the
// clock's time; obtain false is a preview's dry run (a summary that is due
// is only reported, nothing is stored).
func (r *rig) plan(ctx context.Context, in compaction.Input, obtain bool) compaction.Output {
	_ = r.store.Delete(ctx, testKey)
	_ = r.store.UpdateAnchors(ctx, testKey, func([]anchor.Anchor) ([]anchor.Anchor, bool) {
		return in.State.Anchors, true
	})
	if n := len(in.Chain) - 1; n >= 0 {
		l := compaction.Lineage{ID: compaction.LineageID(in.Chain), TipLen: n, Tip: in.Chain[n], State: in.State}
		_ = r.store.UpdateLineages(ctx, testKey, func(ls []compaction.Lineage) ([]compaction.Lineage, bool) {
			return compaction.SaveLineage(ls, l, 0, true)
		})
	}
	estimate := func([]anchor.Anchor) compaction.Estimator { return in.Estimate }
	req := Request{
		ID: "test", Key: testKey, View: in.Messages,
		Chain:     func() ([]anchor.Digest, error) { return in.Chain, nil },
		Estimate:  estimate,
		Window:    in.Window,
		MaxTokens: in.MaxTokens,
		Pass:      in.Pass,

		SummaryInUpstreamTokens: in.SummaryInUpstreamTokens,
		Detach: func() Detached {
			return Detached{View: in.Messages, Estimate: estimate}
		},
	}
	out, _ := r.d.Decide(ctx, req, Mode{Enabled: true, Summarize: obtain, Commit: obtain})
	return out
}

func recoverIf(b bool) compaction.Pass {
	if b {
		return compaction.PassRecover
	}
	return compaction.PassForward
}

func backgroundIf(b bool) compaction.Pass {
	if b {
		return compaction.PassBackground
	}
	return compaction.PassForward
}

// fakeSummarizer records its calls and answers with fn.
type fakeSummarizer struct {
	mu     sync.Mutex
	calls  int
	heads  [][]chat.Message
	prevs  []string
	limits []int
	reqs   []compaction.SummaryRequest
	fn     func(call int, head []chat.Message, previous string) (string, error)
}

func (s *fakeSummarizer) Summarize(_ context.Context, c summarizer.Call) (string, error) {
	req := c.Request
	head, previous, maxTokens := req.Head, req.Previous, req.MaxTokens
	s.mu.Lock()
	s.calls++
	call := s.calls
	s.heads = append(s.heads, head)
	s.prevs = append(s.prevs, previous)
	s.limits = append(s.limits, maxTokens)
	s.reqs = append(s.reqs, req)
	s.mu.Unlock()
	return s.fn(call, head, previous)
}

func (s *fakeSummarizer) Calls() int { s.mu.Lock(); defer s.mu.Unlock(); return s.calls }

var errRejected = errors.New("summarizer: 400 strict template rejected the request")

func failingSummarizer() *fakeSummarizer {
	return &fakeSummarizer{fn: func(int, []chat.Message, string) (string, error) { return "", errRejected }}
}

func okSummarizer() *fakeSummarizer {
	return &fakeSummarizer{fn: func(call int, head []chat.Message, previous string) (string, error) {
		return fmt.Sprintf("Goal: add a retry. Summary #%d of %d messages.", call, len(head)), nil
	}}
}

// blob is n bytes of line-structured text, distinct per tag.
func blob(tag string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s line %d: the quick brown fox jumps over the lazy dog\n", tag, i)
	}
	return b.String()[:n]
}

// session runs requests like the proxy: it carries the state between steps.
type session struct {
	tb    testing.TB
	e     *rig
	st    compaction.State
	win   int
	last  compaction.Output
	dry   bool
	steps int
	// exact: summaries come from the upstream's model
	// (Input.SummaryInUpstreamTokens).
	exact bool
}

func (s *session) step(msgs []chat.Message) compaction.Output {
	s.tb.Helper()
	out := s.e.plan(context.Background(), compaction.Input{
		Messages: msgs, Chain: chainOf(s.tb, msgs), State: s.st,
		Window: s.win, Estimate: fakeEstimate,
		SummaryInUpstreamTokens: s.exact,
	}, !s.dry)
	if out.StateChanged {
		s.st = out.State
	}
	s.last = out
	s.steps++
	return out
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

// tailStart is where the verbatim tail begins (DESIGN § Compaction):
// len − keepTail (the final message always stays), walked backward while
// the message there is a tool result, so the tail starts with the
// assistant call its results answer.
func tailStart(msgs []chat.Message, keepTail int) int {
	c := max(len(msgs)-max(keepTail, 1), 0)
	for c > 0 && isToolRole(msgs[c].Role) {
		c--
	}
	return c
}

// isSystemRole tells whether a message belongs to the leading instructions.
func isSystemRole(role string) bool { return role == "system" || role == "developer" }

// isToolRole tells whether a message is a tool result.
func isToolRole(role string) bool { return role == "tool" || role == "function" }
