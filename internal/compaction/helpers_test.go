package compaction

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
	return anchor.Chain(testSeed, digestsOf(tb, msgs))
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

// fakeClock is a settable clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fakeClock { return &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *fakeClock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// summarizer is what the driver obtains summaries from.
type summarizer interface {
	Summarize(ctx context.Context, req SummaryRequest) (string, error)
}

// driver runs the planner as the proxy does: plan; when the decision asks
// for a summary, obtain it and plan the same input again with the answer.
type driver struct {
	p     *Planner
	sum   summarizer
	clock *fakeClock
}

// newDriver builds a planner from cfg; sum nil means no summarizer (the
// summarize step is off), c nil a fresh fake clock.
func newDriver(cfg Config, sum summarizer, c *fakeClock) *driver {
	if sum == nil {
		cfg.SummarizerEnabled = false
	}
	if c == nil {
		c = newClock()
	}
	return &driver{p: NewPlanner(cfg), sum: sum, clock: c}
}

// Compact is one request: the decision, with the summary it asks for.
func (d *driver) Compact(ctx context.Context, in Input) Output { return d.plan(ctx, in, true) }

// plan decides at the clock's time; obtain false is a dry run (a preview:
// a summary that is due is only reported).
func (d *driver) plan(ctx context.Context, in Input, obtain bool) Output {
	in.Now = d.clock.Now()
	out := d.p.Plan(in)
	if out.Need == nil || !obtain {
		return out
	}
	text, err := d.sum.Summarize(ctx, *out.Need)
	in.Summary = ResultFor(out.Need, text, 0, err, ctx.Err() != nil)
	return d.p.Plan(in)
}

func recoverIf(b bool) Pass {
	if b {
		return PassRecover
	}
	return PassForward
}

func backgroundIf(b bool) Pass {
	if b {
		return PassBackground
	}
	return PassForward
}

// fakeSummarizer records its calls and answers with fn.
type fakeSummarizer struct {
	mu     sync.Mutex
	calls  int
	heads  [][]chat.Message
	prevs  []string
	limits []int
	reqs   []SummaryRequest
	fn     func(call int, head []chat.Message, previous string) (string, error)
}

func (s *fakeSummarizer) Summarize(ctx context.Context, req SummaryRequest) (string, error) {
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

// session runs Compact like the proxy: it carries the state between steps.
type session struct {
	tb    testing.TB
	e     *driver
	st    State
	win   int
	last  Output
	dry   bool
	steps int
	// exact: summaries come from the upstream's model
	// (Input.SummaryInUpstreamTokens).
	exact bool
}

func (s *session) step(msgs []chat.Message) Output {
	s.tb.Helper()
	out := s.e.plan(context.Background(), Input{
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
