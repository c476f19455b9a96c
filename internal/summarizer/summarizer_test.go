package summarizer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// recorded is one request the fake endpoint received.
type recorded struct {
	Path   string
	Header http.Header
	Body   map[string]any
	User   string // the user message's content
}

// endpoint is an httptest upstream that records requests and answers with
// handle (default: a summary naming the call number).
type endpoint struct {
	*httptest.Server
	mu     sync.Mutex
	reqs   []recorded
	handle func(n int, w http.ResponseWriter, r *http.Request)
}

func newEndpoint(t *testing.T, handle func(n int, w http.ResponseWriter, r *http.Request)) *endpoint {
	e := &endpoint{handle: handle}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		data, _ := io.ReadAll(r.Body)
		var body map[string]any
		if err := json.Unmarshal(data, &body); err != nil {
			t.Errorf("request body: %v", err)
		}
		rec := recorded{Path: r.URL.Path, Header: r.Header.Clone(), Body: body}
		if msgs, ok := body["messages"].([]any); ok && len(msgs) == 2 {
			rec.User, _ = msgs[1].(map[string]any)["content"].(string)
		}
		e.mu.Lock()
		e.reqs = append(e.reqs, rec)
		n := len(e.reqs)
		e.mu.Unlock()
		if e.handle != nil {
			e.handle(n, w, r)
			return
		}
		answer(w, fmt.Sprintf("## Goal\nsummary %d", n))
	}))
	t.Cleanup(e.Close)
	return e
}

func (e *endpoint) requests() []recorded {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]recorded(nil), e.reqs...)
}

func answer(w http.ResponseWriter, text string) {
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`, text)
}

// head parses a small conversation head through the real parser.
func head(t *testing.T, msgs ...map[string]any) []chat.Message {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	req, err := chat.Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	return req.Messages
}

func agentHead(t *testing.T, steps, size int) []chat.Message {
	msgs := []map[string]any{{"role": "user", "content": "add a retry to fetch_rows in store.py"}}
	for i := 0; i < steps; i++ {
		id := fmt.Sprintf("call_%d", i)
		msgs = append(msgs,
			map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
				"id": id, "type": "function", "function": map[string]any{"name": "bash", "arguments": fmt.Sprintf(`{"cmd":"cat file%d.py"}`, i)}}}},
			map[string]any{"role": "tool", "tool_call_id": id, "content": fmt.Sprintf("output %d\n", i) + strings.Repeat("x", size)})
	}
	return head(t, msgs...)
}

func TestRequest(t *testing.T) {
	for _, tc := range []struct {
		name       string
		opt        Options
		call       func(*Call)
		wantModel  string
		wantAuth   string
		wantAPIKey string
		wantMax    string // the key carrying the limit
		absentMax  string
	}{
		{"openai dialect, own key", Options{Model: "gpt-sum", APIKey: "sk-sum", MaxTokens: 512, Dialect: "openai"},
			nil, "gpt-sum", "Bearer sk-sum", "", "max_completion_tokens", "max_tokens"},
		{"llamacpp dialect, request model, client credentials", Options{MaxTokens: 512, Dialect: "llamacpp"},
			func(call *Call) {
				h := http.Header{}
				h.Set("Authorization", "Bearer client-key")
				h.Set("X-Api-Key", "client-x")
				h.Set("Cookie", "not-a-credential")
				call.Credentials, call.Model = h, "qwen3-27b"
			}, "qwen3-27b", "Bearer client-key", "client-x", "max_tokens", "max_completion_tokens"},
		{"own key wins over client credentials", Options{Model: "m", APIKey: "sk-sum", MaxTokens: 100},
			func(call *Call) {
				h := http.Header{}
				h.Set("Authorization", "Bearer client-key")
				call.Credentials = h
			}, "m", "Bearer sk-sum", "", "max_tokens", "max_completion_tokens"},
		{"no credentials", Options{Model: "m", MaxTokens: 100, Dialect: "vllm"}, nil, "m", "", "", "max_tokens", "max_completion_tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep := newEndpoint(t, nil)
			tc.opt.URL = ep.URL + "/v1/"
			c := New(ep.Client().Transport, tc.opt)
			call := Call{Request: compaction.SummaryRequest{Head: agentHead(t, 2, 100), Previous: "", MaxTokens: 0}}
			if tc.call != nil {
				tc.call(&call)
			}
			got, err := c.Summarize(context.Background(), call)
			if err != nil || got != "## Goal\nsummary 1" {
				t.Fatalf("%q %v", got, err)
			}
			reqs := ep.requests()
			if len(reqs) != 1 {
				t.Fatalf("%d requests", len(reqs))
			}
			r := reqs[0]
			if r.Path != "/v1/chat/completions" {
				t.Errorf("path %s", r.Path)
			}
			if r.Body["model"] != tc.wantModel || r.Body["stream"] != false {
				t.Errorf("model %v stream %v", r.Body["model"], r.Body["stream"])
			}
			if r.Body[tc.wantMax] != float64(tc.opt.MaxTokens) {
				t.Errorf("%s = %v", tc.wantMax, r.Body[tc.wantMax])
			}
			if _, ok := r.Body[tc.absentMax]; ok {
				t.Errorf("%s sent", tc.absentMax)
			}
			if got := r.Header.Get("Authorization"); got != tc.wantAuth {
				t.Errorf("Authorization %q", got)
			}
			if got := r.Header.Get("X-Api-Key"); got != tc.wantAPIKey {
				t.Errorf("X-Api-Key %q", got)
			}
			if r.Header.Get("Cookie") != "" {
				t.Error("a non-credential header was forwarded")
			}
		})
	}
}

// The prompt: the structured resume instructions, the transcript with tool
// names, arguments and cut results, the previous summary folded.
func TestPrompt(t *testing.T) {
	ep := newEndpoint(t, nil)
	c := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m"})
	h := agentHead(t, 2, 50000)
	if _, err := c.Summarize(context.Background(), Call{Request: compaction.SummaryRequest{Head: h, Previous: "## Goal\nearlier summary", MaxTokens: 0}}); err != nil {
		t.Fatal(err)
	}
	r := ep.requests()[0]
	sys := r.Body["messages"].([]any)[0].(map[string]any)["content"].(string)
	for _, want := range []string{"## Goal", "## Decisions and constraints", "## Files and key facts", "## Commands run and outcomes", "## Errors still open", "## Next step", "Do not invent"} {
		if !strings.Contains(sys, want) {
			t.Errorf("system prompt lacks %q", want)
		}
	}
	for _, want := range []string{
		"<previous_summary>\n## Goal\nearlier summary\n</previous_summary>",
		"[user]\nadd a retry to fetch_rows in store.py",
		`(calls bash with {"cmd":"cat file0.py"})`,
		"[bash result]\noutput 1\n",
		"characters elided by compactproxy ...]",
	} {
		if !strings.Contains(r.User, want) {
			t.Errorf("user message lacks %q", want)
		}
	}
	if len(r.User) > 2*maxToolOutput+4000 {
		t.Errorf("long tool outputs not cut: %d bytes", len(r.User))
	}
}

// A head over ~60% of the summarizer's window is summarized in chunks,
// sequentially, each folding the previous answer.
func TestChunking(t *testing.T) {
	ep := newEndpoint(t, nil)
	const window = 8000 // tokens: ≈ 19 KB of prompt per call
	c := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", MaxTokens: 500, Window: window})
	h := agentHead(t, 12, 5000) // ≈ 60 KB of transcript
	// A small-vocabulary tokenizer: 1.4 bytes per token, the rate the issue
	// measured, counted independently of the client's fallback.
	count := func(text string) int { return len(text)*10/14 + 4 }
	got, err := c.Summarize(context.Background(), Call{Count: count, Request: compaction.SummaryRequest{Head: h, Previous: "## Goal\nolder summary", MaxTokens: 0}})
	if err != nil {
		t.Fatal(err)
	}
	reqs := ep.requests()
	if len(reqs) < 3 {
		t.Fatalf("%d calls, want the head chunked", len(reqs))
	}
	if got != fmt.Sprintf("## Goal\nsummary %d", len(reqs)) {
		t.Errorf("result %q is not the last call's answer", got)
	}
	seen := map[string]bool{}
	for i, r := range reqs {
		prev := "## Goal\nolder summary"
		if i > 0 {
			prev = fmt.Sprintf("## Goal\nsummary %d", i)
		}
		if !strings.Contains(r.User, "<previous_summary>\n"+prev+"\n</previous_summary>") {
			t.Errorf("call %d does not fold %q", i+1, prev)
		}
		if size := count(r.User) + count(systemPrompt) + 500; size > window {
			t.Errorf("call %d: %d tokens with the answer, over the %d-token window", i+1, size, window)
		}
		for k := 0; k < 12; k++ {
			if strings.Contains(r.User, fmt.Sprintf("]\noutput %d\n", k)) {
				if seen[fmt.Sprint(k)] {
					t.Errorf("result %d sent twice", k)
				}
				seen[fmt.Sprint(k)] = true
			}
		}
	}
	if len(seen) != 12 {
		t.Errorf("%d of 12 results sent", len(seen))
	}
	// Without a window, one call.
	ep2 := newEndpoint(t, nil)
	if _, err := New(ep2.Client().Transport, Options{URL: ep2.URL + "/v1", Model: "m"}).Summarize(context.Background(), Call{Request: compaction.SummaryRequest{Head: h, Previous: "", MaxTokens: 0}}); err != nil || len(ep2.requests()) != 1 {
		t.Fatalf("unknown window: %d calls, %v", len(ep2.requests()), err)
	}
}

func TestErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		handle func(n int, w http.ResponseWriter, r *http.Request)
		opt    Options
		check  func(t *testing.T, err error)
	}{
		{"non-2xx with envelope", func(_ int, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"Conversation roles must alternate","type":"invalid_request_error"}}`)
		}, Options{}, func(t *testing.T, err error) {
			var se *StatusError
			if !errors.As(err, &se) || se.StatusCode != 400 || se.Message != "Conversation roles must alternate" || !errors.Is(err, ErrStatus) {
				t.Fatalf("%v", err)
			}
		}},
		{"5xx plain body", func(_ int, w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "Loading model", http.StatusServiceUnavailable)
		}, Options{}, func(t *testing.T, err error) {
			var se *StatusError
			if !errors.As(err, &se) || se.StatusCode != 503 || se.Message != "Loading model" {
				t.Fatalf("%v", err)
			}
		}},
		{"empty text", func(_ int, w http.ResponseWriter, _ *http.Request) { answer(w, "  \n") }, Options{}, func(t *testing.T, err error) {
			if !errors.Is(err, ErrEmptySummary) {
				t.Fatalf("%v", err)
			}
		}},
		{"no choices", func(_ int, w http.ResponseWriter, _ *http.Request) { io.WriteString(w, `{"choices":[]}`) }, Options{}, func(t *testing.T, err error) {
			if !errors.Is(err, ErrBadResponse) {
				t.Fatalf("%v", err)
			}
		}},
		{"not json", func(_ int, w http.ResponseWriter, _ *http.Request) { io.WriteString(w, `<html>`) }, Options{}, func(t *testing.T, err error) {
			if !errors.Is(err, ErrBadResponse) {
				t.Fatalf("%v", err)
			}
		}},
		{"timeout", func(_ int, w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}, Options{Timeout: 50 * time.Millisecond}, func(t *testing.T, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("%v", err)
			}
		}},
		{"no model", nil, Options{Model: "-"}, func(t *testing.T, err error) {
			if !errors.Is(err, ErrNoModel) {
				t.Fatalf("%v", err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep := newEndpoint(t, tc.handle)
			opt := tc.opt
			opt.URL = ep.URL + "/v1"
			if opt.Model == "-" {
				opt.Model = ""
			} else {
				opt.Model = "m"
			}
			start := time.Now()
			_, err := New(ep.Client().Transport, opt).Summarize(context.Background(), Call{Request: compaction.SummaryRequest{Head: agentHead(t, 1, 10), Previous: "", MaxTokens: 0}})
			if err == nil {
				t.Fatal("no error")
			}
			tc.check(t, err)
			if time.Since(start) > 3*time.Second {
				t.Error("timeout not applied")
			}
		})
	}
}

// Parts: images are never sent, text parts are.
func TestRenderMedia(t *testing.T) {
	h := head(t, map[string]any{"role": "user", "content": []any{
		map[string]any{"type": "text", "text": "see the screenshot"},
		map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64," + strings.Repeat("A", 5000)}},
	}})
	out := renderMessage(&h[0], nil)
	if !strings.Contains(out, "see the screenshot") || !strings.Contains(out, "1 image/audio/file part(s) not shown") || strings.Contains(out, "AAAA") {
		t.Fatalf("%q", out)
	}
}

// buildBody is a test Builder's body: model m, the fields in extra (JSON
// members with a trailing comma), max_tokens and msgs as they are; it
// records msgs in built.
func buildBody(built *[][]chat.Message, extra string, msgs []chat.Message, maxTokens int) []byte {
	*built = append(*built, msgs)
	var b strings.Builder
	fmt.Fprintf(&b, `{"model":"m",%s"max_tokens":%d,"messages":[`, extra, maxTokens)
	for i, m := range msgs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(m.Raw)
	}
	b.WriteString("]}")
	return []byte(b.String())
}

// With a Builder (the summarizer is the chat upstream and model), the
// request continues the forwarded prefix: the prefix's messages byte for
// byte, then one instruction; the body comes from the Builder; the answer's
// usage reaches the hook. A prefix that would not fit the window, or ends
// on a user message, falls back to a transcript.
func TestPrefixShape(t *testing.T) {
	ep := newEndpoint(t, nil)
	c := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", MaxTokens: 300, Window: 4096})
	h := agentHead(t, 2, 100)
	var built [][]chat.Message
	var limits []int
	var usage []anchor.Usage
	ctx := context.Background()
	call := Call{
		Build: func(msgs []chat.Message, maxTokens int) []byte {
			limits = append(limits, maxTokens)
			return buildBody(&built, `"tools":[{"type":"function","function":{"name":"bash"}}],"tool_choice":"none",`, msgs, maxTokens)
		},
		OnUsage: func(u anchor.Usage) { usage = append(usage, u) },
		Count:   func(text string) int { return len(text)/4 + 4 },
	}
	req := &call.Request
	*req = compaction.SummaryRequest{Head: h, MaxTokens: 200, Prefix: h, PrefixTokens: 300}
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	reqs := ep.requests()
	if len(reqs) != 1 || len(built) != 1 || limits[0] != 200 {
		t.Fatalf("%d requests, %d built, limits %v", len(reqs), len(built), limits)
	}
	msgs := reqs[0].Body["messages"].([]any)
	if len(msgs) != len(h)+1 || reqs[0].Body["tool_choice"] != "none" {
		t.Fatalf("prefix request: %d messages for a %d-message prefix, tool_choice %v", len(msgs), len(h), reqs[0].Body["tool_choice"])
	}
	for i := range h {
		if string(built[0][i].Raw) != string(h[i].Raw) {
			t.Fatalf("message %d of the prefix changed", i)
		}
	}
	if last := msgs[len(msgs)-1].(map[string]any); last["role"] != "user" || last["content"] != prefixInstruction {
		t.Fatalf("last message %v is not the instruction", last)
	}
	if len(usage) != 1 || usage[0].Input != 10 {
		t.Fatalf("usage hook got %+v", usage)
	}

	// Too large for the window: a transcript (system prompt + user).
	req.PrefixTokens = 4000
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	// Ends on a user message: a transcript too.
	req.PrefixTokens = 300
	req.Prefix = head(t, map[string]any{"role": "user", "content": "hi"})
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	reqs = ep.requests()
	if len(built) != 1 || len(reqs) != 3 {
		t.Fatalf("built %d prefix bodies over %d requests, want 1 of 3", len(built), len(reqs))
	}
	for _, r := range reqs[1:] {
		if m := r.Body["messages"].([]any); len(m) != 2 || m[0].(map[string]any)["role"] != "system" {
			t.Fatalf("fallback is not a transcript: %v", r.Body)
		}
	}
}

// A background summary carries the rest of the forwarded view (Kept): the
// request extends prefix+kept byte for byte and names how many messages
// stay verbatim, so the upstream's cache of the whole view survives the
// call. Kept that does not fit the window, or ends on a user message,
// falls back to the prefix alone.
func TestPrefixShapeWithKept(t *testing.T) {
	ep := newEndpoint(t, nil)
	c := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", MaxTokens: 300, Window: 4096})
	h := agentHead(t, 4, 100)
	prefix, kept := h[:len(h)-2], h[len(h)-2:]
	var built [][]chat.Message
	ctx := context.Background()
	call := Call{
		Build: func(msgs []chat.Message, maxTokens int) []byte {
			return buildBody(&built, "", msgs, maxTokens)
		},
		Count: func(text string) int { return len(text)/4 + 4 },
	}
	req := &call.Request
	*req = compaction.SummaryRequest{Head: prefix, MaxTokens: 200, Prefix: prefix, PrefixTokens: 300, Kept: kept, KeptTokens: 100}
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	if len(built) != 1 || len(built[0]) != len(h)+1 {
		t.Fatalf("built %d bodies, first with %d messages; want 1 with %d", len(built), len(built[0]), len(h)+1)
	}
	for i := range h {
		if string(built[0][i].Raw) != string(h[i].Raw) {
			t.Fatalf("message %d of prefix+kept changed", i)
		}
	}
	want := fmt.Sprintf(keptInstruction, len(kept))
	if got := chat.Text(built[0][len(h)]); got != want {
		t.Fatalf("instruction %q, want %q", got, want)
	}

	// Kept too large for the window: the prefix alone.
	req.KeptTokens = 3500
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	// Kept ending on a user message: the prefix alone.
	req.KeptTokens = 100
	req.Kept = append(append([]chat.Message(nil), kept...), head(t, map[string]any{"role": "user", "content": "next"})...)
	if _, err := c.Summarize(ctx, call); err != nil {
		t.Fatal(err)
	}
	if len(built) != 3 {
		t.Fatalf("built %d bodies, want 3", len(built))
	}
	for _, b := range built[1:] {
		if len(b) != len(prefix)+1 || chat.Text(b[len(prefix)]) != prefixInstruction {
			t.Fatalf("fallback is not the prefix alone: %d messages", len(b))
		}
	}
}

// smallVocab is an endpoint like llama-server with a small-vocabulary
// model: a prompt costs one token per 1.5 bytes of its messages' text plus
// 10 per message, and a prompt of the whole window or more is refused with
// llama.cpp's exceed_context_size_error, its sizes included; others are
// answered with their measured prompt_tokens. prompts records each
// request's size, refused or not.
func smallVocab(t *testing.T, window int, prompts *[]int) *endpoint {
	var e *endpoint
	e = newEndpoint(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		body := e.requests()[n-1].Body
		size := 0
		for _, m := range body["messages"].([]any) {
			text, _ := m.(map[string]any)["content"].(string)
			size += len(text)*2/3 + 10
		}
		*prompts = append(*prompts, size)
		w.Header().Set("Content-Type", "application/json")
		if size >= window {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`, size, window)
			return
		}
		fmt.Fprintf(w, `{"choices":[{"index":0,"message":{"role":"assistant","content":"## Goal\nsummary %d"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":5}}`, n, size)
	})
	return e
}

// The smallVocab tests' window and head (agentHead's tool turns).
const vocabWindow, vocabSteps = 2048, 6

// smallVocabClient is a client of a smallVocab endpoint at window, which
// recognizes its refusal, and a head of steps tool turns; prompts records
// the requests' sizes.
func smallVocabClient(t *testing.T) (c *Client, ep *endpoint, prompts *[]int, h []chat.Message) {
	prompts = new([]int)
	ep = smallVocab(t, vocabWindow, prompts)
	c = New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", Window: vocabWindow, OverflowDialect: "llamacpp"})
	return c, ep, prompts, agentHead(t, vocabSteps, 400)
}

// sentResults is which of agentHead's tool results the answered requests
// carried, each at most once.
func sentResults(t *testing.T, reqs []recorded, prompts []int, window, steps int) {
	t.Helper()
	seen := map[int]bool{}
	for i, r := range reqs {
		if prompts[i] >= window {
			continue
		}
		for k := 0; k < steps; k++ {
			if strings.Contains(r.User, fmt.Sprintf("]\noutput %d\n", k)) {
				if seen[k] {
					t.Errorf("result %d sent twice", k)
				}
				seen[k] = true
			}
		}
	}
	if len(seen) != steps {
		t.Errorf("%d of %d results sent in answered requests", len(seen), steps)
	}
}

// A Counter calibrated on whole messages counts a transcript (text only)
// short: on a small-vocabulary model, by more than half. The head's cost in
// the upstream's tokens (HeadTokens, the planner's estimate) scales the
// count, so no request is sent over the window (stories260K at 2k: a
// 3,199-byte transcript counted as fitting measured 2,122 tokens).
func TestTranscriptCountedAtTheHeadsRate(t *testing.T) {
	c, ep, pp, h := smallVocabClient(t)
	headTokens := 0
	for i := range h {
		headTokens += len(renderMessage(&h[i], nil))*2/3 + 10
	}
	count := func(text string) int { return len(text)/4 + 4 }
	got, err := c.Summarize(context.Background(), Call{Count: count,
		Request: compaction.SummaryRequest{Head: h, MaxTokens: 300, HeadTokens: headTokens}})
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range *pp {
		if p >= vocabWindow {
			t.Errorf("request %d: %d tokens, over the %d-token window", i+1, p, vocabWindow)
		}
	}
	reqs := ep.requests()
	if len(reqs) < 2 || !strings.HasPrefix(got, "## Goal") {
		t.Fatalf("%d requests, summary %q: want the head chunked", len(reqs), got)
	}
	sentResults(t, reqs, *pp, vocabWindow, vocabSteps)
}

// An overflow answer (llama.cpp's, with its measured size) is not a
// summarizer failure: the transcript is sent again in chunks counted at the
// measured rate.
func TestOverflowAnswerResendsSmaller(t *testing.T) {
	c, ep, pp, h := smallVocabClient(t)
	call := Call{Count: func(text string) int { return len(text)/4 + 4 },
		Request: compaction.SummaryRequest{Head: h, MaxTokens: 300}}
	got, err := c.Summarize(context.Background(), call)
	if err != nil {
		t.Fatalf("summary after an overflow answer: %v", err)
	}
	over := 0
	for _, p := range *pp {
		if p >= vocabWindow {
			over++
		}
	}
	reqs := ep.requests()
	if over != 1 || len(reqs) < 3 || !strings.HasPrefix(got, "## Goal") {
		t.Fatalf("%d requests, %d refused, summary %q: want one refusal, then the head in chunks", len(reqs), over, got)
	}
	sentResults(t, reqs, *pp, vocabWindow, vocabSteps)

	// A summarizer whose window is not known: the refusal names it, and
	// the transcript is chunked within it.
	*pp = (*pp)[:0]
	unknown := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", OverflowDialect: "llamacpp"})
	if _, err := unknown.Summarize(context.Background(), call); err != nil {
		t.Fatalf("unknown window: %v", err)
	}
	if len(*pp) < 3 || (*pp)[0] < vocabWindow {
		t.Fatalf("unknown window: requests of %v tokens, want one refused, then chunks", *pp)
	}
	for i, p := range (*pp)[1:] {
		if p >= vocabWindow {
			t.Errorf("unknown window, request %d after the refusal: %d tokens", i+2, p)
		}
	}

	// Without a recognizer the refusal is the summarizer's error.
	*pp = (*pp)[:0]
	plain := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", Window: vocabWindow})
	if _, err := plain.Summarize(context.Background(), call); !errors.Is(err, ErrStatus) {
		t.Fatalf("no recognizer: err %v, want the status error", err)
	}
}

// A prefix-shaped request that the upstream measures over its window gives
// way to a transcript that fits.
func TestPrefixShapeOverflowGivesWayToATranscript(t *testing.T) {
	const window = 2048
	var prompts []int
	ep := smallVocab(t, window, &prompts)
	c := New(ep.Client().Transport, Options{URL: ep.URL + "/v1", Model: "m", Window: window, OverflowDialect: "llamacpp"})
	h := agentHead(t, 3, 900)
	var built [][]chat.Message
	call := Call{
		Count: func(text string) int { return len(text)/4 + 4 },
		Build: func(msgs []chat.Message, maxTokens int) []byte { return buildBody(&built, "", msgs, maxTokens) },
		// The planner's estimate of the prefix, short by half.
		Request: compaction.SummaryRequest{Head: h, MaxTokens: 200, Prefix: h, PrefixTokens: 900},
	}
	if _, err := c.Summarize(context.Background(), call); err != nil {
		t.Fatalf("prefix refused: %v, want a transcript", err)
	}
	reqs := ep.requests()
	if len(built) != 1 || len(reqs) < 2 || prompts[0] < window {
		t.Fatalf("%d built, %d requests, first %d tokens: want the prefix refused", len(built), len(reqs), prompts[0])
	}
	for i, r := range reqs[1:] {
		if m := r.Body["messages"].([]any); len(m) != 2 || prompts[i+1] >= window {
			t.Fatalf("request %d after the refusal: %d messages, %d tokens", i+2, len(m), prompts[i+1])
		}
	}
}

// A transcript labels a tool result with its call's tool, not the call id
// (noise the summarizer pays for in tokens); the id stays where the call is
// not in the head.
func TestTranscriptNamesResultsByTool(t *testing.T) {
	h := agentHead(t, 2, 10)
	blocks := renderHead(h[1:])
	all := strings.Join(blocks, "")
	if strings.Contains(all, "call_0") || strings.Contains(all, "call_1") {
		t.Errorf("transcript carries call ids:\n%s", all)
	}
	if n := strings.Count(all, "[bash result]\noutput "); n != 2 {
		t.Errorf("%d results labelled with their tool, want 2:\n%s", n, all)
	}
	if got := renderHead(h[2:])[0]; !strings.HasPrefix(got, "[tool result for call_0]\n") {
		t.Errorf("a result whose call is not in the head: %q", got)
	}
}
