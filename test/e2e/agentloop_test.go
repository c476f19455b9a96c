package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	openai "github.com/sashabaranov/go-openai"
)

// loopUpstream is a small-window model whose tokenizer is not the proxy's:
// it counts a request's prompt as len(body)/1.6 tokens (2.5x the 4 bytes
// per token a local estimate assumes, as small-vocabulary tokenizers spend
// on code), answers 400 like llama.cpp past its window, and otherwise asks
// for the next file until the conversation is 40 steps long.
type loopUpstream struct {
	mu       sync.Mutex
	prompts  []int
	bodies   [][]byte
	overflow int
}

const loopWindow = 8000

// upstreamTokens is the loop model's token count of a request body.
func upstreamTokens(body []byte) int { return len(body) * 5 / 8 }

func (u *loopUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path != "/v1/chat/completions" {
		http.NotFound(w, r) // discovery (/props, /v1/models): no window to learn here
		return
	}
	n := upstreamTokens(body)
	u.mu.Lock()
	u.prompts = append(u.prompts, n)
	u.bodies = append(u.bodies, body)
	step := len(u.prompts)
	if n > loopWindow {
		u.overflow++
	}
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if n > loopWindow {
		w.WriteHeader(400)
		fmt.Fprintf(w, `{"error":{"code":400,"message":"request (%d tokens) exceeds the available context size (%d tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`, n, loopWindow, n, loopWindow)
		return
	}
	fmt.Fprintf(w, `{"id":"c%d","object":"chat.completion","model":"loop","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"cat","arguments":"{\"path\":\"file%d.py\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":%d,"completion_tokens":20,"prompt_tokens_details":{"cached_tokens":%d}}}`,
		step, step, step, n, n/2)
}

// TestAgentLoopCompacts drives the real binary with go-openai through a
// 40-step tool loop against a model whose window the conversation outgrows
// four times over.
func TestAgentLoopCompacts(t *testing.T) {
	root := repoRoot(t)
	bin := buildBinary(t, root)
	up := &loopUpstream{}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	var sumCalls int
	var sumMu sync.Mutex
	sumSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		sumMu.Lock()
		sumCalls++
		sumMu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Goal: review every file. Done: file1..fileN read; no errors open. Next: read the next file."},"finish_reason":"stop"}]}`)
	}))
	defer sumSrv.Close()
	p := startProxy(t, bin, upSrv.URL+"/v1",
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW="+strconv.Itoa(loopWindow),
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=1000",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_URL="+sumSrv.URL+"/v1",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS=300",
	)

	cfg := openai.DefaultConfig("sk-loop-key")
	cfg.BaseURL = p.URL + "/v1"
	client := openai.NewClientWithConfig(cfg)
	msgs := []openai.ChatCompletionMessage{
		{Role: "system", Content: "You are a code reviewer. Read files with the cat tool."},
		{Role: "user", Content: "Review every file in the repository for unsafe retries."},
	}
	tools := []openai.Tool{{Type: "function", Function: &openai.FunctionDefinition{Name: "cat", Description: "print a file",
		Parameters: json.RawMessage(`{"type":"object","properties":{"path":{"type":"string"}}}`)}}}
	type stepInfo struct {
		action               string
		context, forwarded   int
		clientMsgs, fwdCount int
	}
	var steps []stepInfo
	for i := 1; i <= 40; i++ {
		resp, err := client.CreateChatCompletion(context.Background(), openai.ChatCompletionRequest{
			Model: "loop", Messages: msgs, Tools: tools,
		})
		if err != nil {
			t.Fatalf("step %d: %v\n%s", i, err, p.LogTail())
		}
		h := resp.Header()
		ctxTok, _ := strconv.Atoi(h.Get("X-Compactproxy-Context-Tokens"))
		fwdTok, _ := strconv.Atoi(h.Get("X-Compactproxy-Forwarded-Tokens"))
		steps = append(steps, stepInfo{h.Get("X-Compactproxy-Compaction"), ctxTok, fwdTok, len(msgs), 0})
		call := resp.Choices[0].Message
		msgs = append(msgs, call)
		content := strings.Repeat(fmt.Sprintf("def handler_%d(x):\n    return retry(x, attempts=%d)\n", i, i), 22)
		msgs = append(msgs, openai.ChatCompletionMessage{Role: "tool", ToolCallID: call.ToolCalls[0].ID, Content: content})
	}

	up.mu.Lock()
	prompts := append([]int(nil), up.prompts...)
	bodies := append([][]byte(nil), up.bodies...)
	overflow := up.overflow
	up.mu.Unlock()
	counts := map[string]int{}
	for i, s := range steps {
		counts[s.action]++
		t.Logf("step %2d: client msgs %3d  context %5d  forwarded %5d  upstream-counted %5d  %s", i+1, s.clientMsgs, s.context, s.forwarded, prompts[min(i, len(prompts)-1)], s.action)
	}
	sumMu.Lock()
	calls := sumCalls
	sumMu.Unlock()
	t.Logf("actions %v; summarize calls %d; upstream requests %d (overflows %d)", counts, calls, len(prompts), overflow)

	if counts["none"] == len(steps) {
		t.Fatal("no step was compacted")
	}
	if counts["dropped"] != 0 {
		t.Errorf("%d steps dropped turns although the summarizer works", counts["dropped"])
	}
	// Estimates against the upstream's own count of what was forwarded,
	// once the calibration has seen a few answers.
	var worst float64
	for i := 3; i < len(steps) && i < len(prompts); i++ {
		if steps[i].action == "summarized" {
			continue // a fresh view: judged by the overflow count above
		}
		e := float64(steps[i].forwarded-prompts[i]) / float64(prompts[i])
		worst = max(worst, math.Abs(e))
	}
	t.Logf("worst forwarded-estimate error after step 3: %.1f%%", 100*worst)
	if worst > 0.10 {
		t.Errorf("forwarded estimates off by up to %.1f%% of the upstream's count", 100*worst)
	}
	// Each step adds ~830 upstream tokens to an 8,000-token window: a
	// summary every 4-5 steps, not one per step.
	if calls == 0 || calls > 10 {
		t.Errorf("summarize calls %d, want between 1 and 10 for 40 steps", calls)
	}
	if overflow != 0 {
		t.Errorf("%d requests overflowed the upstream window", overflow)
	}
	if len(prompts) != 40 {
		t.Errorf("upstream got %d chat requests for 40 steps", len(prompts))
	}
	// Prefix stability: between consecutive steps that both carry the
	// same stored compaction, the earlier forwarded messages are a prefix
	// of the later ones.
	stable, pairs := 0, 0
	for i := 1; i < len(bodies); i++ {
		if steps[i].action == "summarized" || steps[i].action == "none" {
			continue
		}
		pairs++
		var a, b struct {
			Messages []json.RawMessage `json:"messages"`
		}
		json.Unmarshal(bodies[i-1], &a)
		json.Unmarshal(bodies[i], &b)
		ok := len(b.Messages) >= len(a.Messages)
		for j := 0; ok && j < len(a.Messages); j++ {
			ok = string(a.Messages[j]) == string(b.Messages[j])
		}
		if ok {
			stable++
		}
	}
	t.Logf("forwarded prefix stable in %d of %d consecutive compacted steps", stable, pairs)
	if pairs > 0 && stable*2 < pairs {
		t.Errorf("forwarded prefix stable in only %d of %d steps", stable, pairs)
	}

	// Metrics agree with the headers.
	resp, err := http.Get(p.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	metric := func(name string) int {
		for _, line := range strings.Split(string(mb), "\n") {
			if strings.HasPrefix(line, name+" ") {
				v, _ := strconv.ParseFloat(strings.TrimPrefix(line, name+" "), 64)
				return int(v)
			}
		}
		return -1
	}
	if got := metric(`compactproxy_compactions_total{action="summarized"}`); got != counts["summarized"] {
		t.Errorf("compactions_total{summarized} = %d, headers say %d", got, counts["summarized"])
	}
	if got := metric(`compactproxy_summarize_total{result="success"}`); got != calls {
		t.Errorf("summarize_total{success} = %d, summarizer saw %d calls", got, calls)
	}
	if got := metric(`compactproxy_http_requests_total{code="200",route="chat"}`); got != 40 {
		t.Errorf("http_requests_total{chat,200} = %d, want 40", got)
	}
}
