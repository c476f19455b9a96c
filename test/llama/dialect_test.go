package llama

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/test/internal/testproc"
)

// The Responses and Messages loops (issue 21): the same scripted agent as
// the chat loop (agent_test.go: the same steps, tool results, instructions
// and shapes), sent by the official SDKs (sdkclient.mjs: `openai`'s
// client.responses.create with store:false and the whole history each step,
// `@anthropic-ai/sdk`'s client.messages.create) to llama-server's
// /v1/responses and /v1/messages through compactproxy at its defaults.
//
// llama-server (b10573) renders both dialects through the model's chat
// template exactly as the chat request it converts them to (the same token
// count), so the fixed part, the cache ceiling and the figures are computed
// as for chat; the forwarded bodies are read back into chat form
// (chatForm) for the structural checks, and the summarize requests are
// counted with llama-server's own counters for the dialect
// (/v1/responses/input_tokens, /v1/messages/count_tokens).

// Dialects. "" is Chat Completions.
const (
	dialectResponses = "responses"
	dialectMessages  = "messages"
)

// dialectPath is the endpoint a dialect's client posts to.
func dialectPath(d string) string {
	switch d {
	case dialectResponses:
		return "/v1/responses"
	case dialectMessages:
		return "/v1/messages"
	}
	return "/v1/chat/completions"
}

// reasoningText is the reasoning an agent's model gave before a tool call
// (sent back as a Responses reasoning item, a Messages thinking block).
func reasoningText(c toolCall) string {
	return fmt.Sprintf("To answer I need the output of %s with %s.", c.Function.Name, c.Function.Arguments)
}

// responsesTool is a chat tool in the Responses shape.
func dialectTools(d string, tools []json.RawMessage) []any {
	out := make([]any, 0, len(tools))
	for _, raw := range tools {
		var t struct {
			Function struct {
				Name        string          `json:"name"`
				Description string          `json:"description"`
				Parameters  json.RawMessage `json:"parameters"`
			} `json:"function"`
		}
		if err := json.Unmarshal(raw, &t); err != nil {
			panic(err)
		}
		if d == dialectResponses {
			out = append(out, map[string]any{"type": "function", "name": t.Function.Name,
				"description": t.Function.Description, "parameters": t.Function.Parameters, "strict": false})
		} else {
			out = append(out, map[string]any{"name": t.Function.Name,
				"description": t.Function.Description, "input_schema": t.Function.Parameters})
		}
	}
	return out
}

// contentText is a scripted message's text (a string or text parts).
func contentText(c any) string {
	switch v := c.(type) {
	case string:
		return v
	case []textPart:
		var b strings.Builder
		for _, p := range v {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return ""
}

// responsesInput is the scripted history (after its system prompt, which
// goes in `instructions`) as Responses input items, the way the Agents SDK
// and Codex send them: the task as an easy input message, later
// instructions as typed messages with input_text parts, a reasoning item
// before each turn's function calls (with a content array: llama-server
// refuses one without), function_call_output with a string or, for
// content-part results, input_text parts.
func responsesInput(msgs []message) []any {
	var items []any
	for _, m := range msgs {
		switch m.Role {
		case "system":
			// instructions
		case "user":
			if s, ok := m.Content.(string); ok && s == firstTask {
				items = append(items, map[string]any{"role": "user", "content": s})
				continue
			}
			items = append(items, map[string]any{"type": "message", "role": "user",
				"content": []any{map[string]any{"type": "input_text", "text": contentText(m.Content)}}})
		case "assistant":
			if len(m.ToolCalls) == 0 {
				items = append(items, map[string]any{"type": "message", "role": "assistant", "status": "completed",
					"content": []any{map[string]any{"type": "output_text", "text": contentText(m.Content), "annotations": []any{}}}})
				continue
			}
			if os.Getenv("LLAMA_NO_REASONING") == "" {
				items = append(items, map[string]any{"type": "reasoning", "id": "rs_" + m.ToolCalls[0].ID, "summary": []any{},
					"content": []any{map[string]any{"type": "reasoning_text", "text": reasoningText(m.ToolCalls[0])}}})
			}
			for _, c := range m.ToolCalls {
				items = append(items, map[string]any{"type": "function_call", "call_id": c.ID,
					"name": c.Function.Name, "arguments": c.Function.Arguments, "status": "completed"})
			}
		case "tool":
			var out any = contentText(m.Content)
			if parts, ok := m.Content.([]textPart); ok {
				var ps []any
				for _, p := range parts {
					ps = append(ps, map[string]any{"type": "input_text", "text": p.Text})
				}
				out = ps
			}
			items = append(items, map[string]any{"type": "function_call_output", "call_id": m.ToolCallID, "output": out})
		}
	}
	return items
}

// messagesHistory is the scripted history (after its system prompt, which
// goes in `system`) as Anthropic messages, the way Claude Code sends them:
// content as blocks (the task too), a thinking block (with a signature)
// before each turn's tool_use blocks,
// the tool results of a turn as tool_result blocks of one user message
// (string content, or text blocks for content-part results), and Claude
// Code's moving cache marker: cache_control on the last block of the last
// message, a marker that moves every request.
func messagesHistory(msgs []message) []any {
	type msg struct {
		role   string
		blocks []any
	}
	var out []*msg
	addUser := func(blocks ...any) {
		if n := len(out); n > 0 && out[n-1].role == "user" {
			out[n-1].blocks = append(out[n-1].blocks, blocks...)
			return
		}
		out = append(out, &msg{role: "user", blocks: blocks})
	}
	for _, m := range msgs {
		switch m.Role {
		case "system":
		case "user":
			addUser(map[string]any{"type": "text", "text": contentText(m.Content)})
		case "assistant":
			if len(m.ToolCalls) == 0 {
				out = append(out, &msg{role: "assistant", blocks: []any{map[string]any{"type": "text", "text": contentText(m.Content)}}})
				continue
			}
			blocks := []any{map[string]any{"type": "thinking", "thinking": reasoningText(m.ToolCalls[0]),
				"signature": "c2lnLQ" + m.ToolCalls[0].ID}}
			if os.Getenv("LLAMA_NO_REASONING") != "" {
				blocks = nil
			}
			for _, c := range m.ToolCalls {
				var input map[string]any
				if err := json.Unmarshal([]byte(c.Function.Arguments), &input); err != nil {
					panic(err)
				}
				blocks = append(blocks, map[string]any{"type": "tool_use", "id": c.ID, "name": c.Function.Name, "input": input})
			}
			out = append(out, &msg{role: "assistant", blocks: blocks})
		case "tool":
			var content any = contentText(m.Content)
			if parts, ok := m.Content.([]textPart); ok {
				var ps []any
				for _, p := range parts {
					ps = append(ps, map[string]any{"type": "text", "text": p.Text})
				}
				content = ps
			}
			addUser(map[string]any{"type": "tool_result", "tool_use_id": m.ToolCallID, "content": content})
		}
	}
	res := make([]any, len(out))
	for i, m := range out {
		if i == len(out)-1 {
			last := m.blocks[len(m.blocks)-1].(map[string]any)
			marked := map[string]any{"cache_control": map[string]any{"type": "ephemeral"}}
			for k, v := range last {
				marked[k] = v
			}
			m.blocks = append(append([]any{}, m.blocks[:len(m.blocks)-1]...), marked)
		}
		res[i] = map[string]any{"role": m.role, "content": m.blocks}
	}
	return res
}

// messagesMaxTokens is what the Messages client sends as max_tokens on
// every step: llama-server's /v1/messages ignores n_predict (max_tokens
// wins) and these models never stop early, so a large max_tokens would
// generate all of it. At 8k and more compactproxy's budget does not depend
// on it (the reserve, capped at a quarter of the window, is larger).
const messagesMaxTokens = generated

// dialectParams is the SDK's request for step i of a loop.
func dialectParams(cfg llamaConfig, msgs []message, tools []json.RawMessage, shape requestShape) map[string]any {
	p := map[string]any{"model": cfg.model(), "temperature": 0, "tools": dialectTools(cfg.dialect, tools)}
	switch cfg.dialect {
	case dialectResponses:
		p["instructions"] = systemPrompt
		p["input"] = responsesInput(msgs)
		p["store"] = false
		// llama-server's /v1/responses honours n_predict over
		// max_output_tokens: the answers are discarded (as for chat).
		p["n_predict"] = generated
		if shape.maxTokens > 0 {
			p["max_output_tokens"] = shape.maxTokens
		}
	case dialectMessages:
		p["system"] = []any{map[string]any{"type": "text", "text": systemPrompt, "cache_control": map[string]any{"type": "ephemeral"}}}
		p["messages"] = messagesHistory(msgs)
		p["max_tokens"] = messagesMaxTokens
	}
	return p
}

// dialectShape is the request shape of step i for a dialect: chat's, but
// a Messages client always sends messagesMaxTokens, and usage is always in
// these streams (no stream_options).
func dialectShape(d string, i, window int) requestShape {
	s := shapeFor(i, window)
	s.includeUsage = false
	if d == dialectMessages {
		s.maxTokens = messagesMaxTokens
	}
	return s
}

// sdkClient is a running sdkclient.mjs.
type sdkClient struct {
	proc  *testproc.Process
	stdin io.WriteCloser
	lines chan string
}

// sdkAnswer is one line of sdkclient.mjs.
type sdkAnswer struct {
	Step     int               `json:"step"`
	Status   int               `json:"status"`
	Headers  map[string]string `json:"headers"`
	Usage    json.RawMessage   `json:"usage"`
	StreamOK bool              `json:"stream_ok"`
	Events   int               `json:"events"`
	Error    string            `json:"error"`
}

// sdkModules is the folder whose node_modules holds the SDKs (test/e2e,
// installed by scripts/e2e-deps.sh from its lockfile). Without node or the
// SDKs the dialect runs skip (fail under CI=true).
func sdkModules(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		testproc.SkipOrFail(t, "node is not installed: the Responses and Messages loops drive llama-server with the official npm SDKs (Node.js >= 20)")
	}
	dir := filepath.Join(repoRoot(t), "test", "e2e")
	for _, pkg := range []string{"openai", "@anthropic-ai/sdk"} {
		if _, err := os.Stat(filepath.Join(dir, "node_modules", pkg, "package.json")); err != nil {
			testproc.SkipOrFail(t, "test/e2e/node_modules has no %s: run scripts/e2e-deps.sh (make e2e-deps) to install the SDKs from the lockfile", pkg)
		}
	}
	return dir
}

// startSDK starts sdkclient.mjs for a dialect against baseURL (ending in /v1).
func startSDK(t *testing.T, dialect, baseURL string) *sdkClient {
	t.Helper()
	modules := sdkModules(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("node", filepath.Join(repoRoot(t), "test", "llama", "sdkclient.mjs"))
	cmd.Env = append(os.Environ(), "SDK_DIALECT="+dialect, "SDK_BASE_URL="+baseURL, "SDK_MODULES="+modules,
		fmt.Sprintf("SDK_TIMEOUT_MS=%d", stepTimeout.Milliseconds()))
	cmd.ExtraFiles = []*os.File{w}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	s := &sdkClient{stdin: stdin, lines: make(chan string, 1)}
	s.proc = testproc.Start(t, "sdkclient.mjs", cmd, &lockedBuffer{Max: 64 << 10})
	w.Close()
	go func() {
		defer r.Close()
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	// Registered after testproc's stop, so it runs first: end of input,
	// the client exits on its own (fd 3 closes), before any SIGTERM.
	t.Cleanup(func() {
		stdin.Close()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case _, ok := <-s.lines:
				if !ok {
					return
				}
			case <-timeout:
				return
			}
		}
	})
	return s
}

// send makes one request and waits for the client's line (stepTimeout is
// the hang guard).
func (s *sdkClient) send(t *testing.T, step int, stream bool, params map[string]any, headers map[string]string) sdkAnswer {
	t.Helper()
	line, err := json.Marshal(map[string]any{"step": step, "stream": stream, "params": params, "headers": headers})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.stdin.Write(append(line, '\n')); err != nil {
		t.Fatalf("step %d: writing to sdkclient.mjs: %v\n%s", step, err, s.proc.Tail(4000))
	}
	select {
	case l, ok := <-s.lines:
		if !ok {
			t.Fatalf("step %d: sdkclient.mjs exited\n%s", step, s.proc.Tail(4000))
		}
		var a sdkAnswer
		if err := json.Unmarshal([]byte(l), &a); err != nil || a.Step != step {
			t.Fatalf("step %d: sdkclient.mjs answered %q (%v)\n%s", step, l, err, s.proc.Tail(4000))
		}
		return a
	case <-time.After(stepTimeout + time.Minute):
		t.Fatalf("step %d: no answer from sdkclient.mjs in %v (a hang)\n%s", step, stepTimeout+time.Minute, s.proc.Tail(4000))
	}
	return sdkAnswer{}
}

// header is the answer's X-Compactproxy-* headers as an http.Header.
func (a sdkAnswer) header() http.Header {
	h := http.Header{}
	for k, v := range a.Headers {
		h.Set(k, v)
	}
	return h
}

// chatForm reads a recorded request body back into the chat messages it
// stands for (what llama-server renders), for the structural checks:
// Responses instructions and system/developer messages are system
// messages, consecutive function_call items one assistant turn with tool
// calls, function_call_output a tool message; Messages system a system
// message, tool_use blocks the assistant's tool calls, tool_result blocks
// tool messages and the user's text blocks after them a user message.
// Reasoning and thinking are left out (Qwen2.5's template renders neither).
func chatForm(path string, body []byte) (fwdBody, error) {
	var b fwdBody
	switch {
	case strings.HasSuffix(path, "/responses"):
		var r struct {
			Instructions    *string           `json:"instructions"`
			Input           json.RawMessage   `json:"input"`
			Tools           []json.RawMessage `json:"tools"`
			MaxOutputTokens int               `json:"max_output_tokens"`
		}
		if err := json.Unmarshal(body, &r); err != nil {
			return b, err
		}
		var msgs []any
		if r.Instructions != nil && *r.Instructions != "" {
			msgs = append(msgs, map[string]any{"role": "system", "content": *r.Instructions})
		}
		var items []map[string]json.RawMessage
		var s string
		if json.Unmarshal(r.Input, &s) == nil {
			msgs = append(msgs, map[string]any{"role": "user", "content": s})
		} else if err := json.Unmarshal(r.Input, &items); err != nil {
			return b, fmt.Errorf("input: %w", err)
		}
		var open map[string]any // the assistant turn function calls join
		for _, it := range items {
			typ := jsonString(it["type"])
			if typ == "" && it["role"] != nil {
				typ = "message"
			}
			switch typ {
			case "message":
				role := jsonString(it["role"])
				if role == "developer" {
					role = "system"
				}
				msgs = append(msgs, map[string]any{"role": role, "content": partsText(it["content"])})
				open = nil
			case "function_call":
				call := map[string]any{"id": jsonString(it["call_id"]), "type": "function",
					"function": map[string]any{"name": jsonString(it["name"]), "arguments": jsonString(it["arguments"])}}
				if open == nil {
					open = map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{}}
					msgs = append(msgs, open)
				}
				open["tool_calls"] = append(open["tool_calls"].([]any), call)
			case "function_call_output":
				msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": jsonString(it["call_id"]), "content": partsText(it["output"])})
				open = nil
			case "reasoning":
			default:
				msgs = append(msgs, map[string]any{"role": "unknown:" + typ})
				open = nil
			}
		}
		return remarshal(map[string]any{"messages": msgs, "tools": r.Tools, "max_tokens": r.MaxOutputTokens})
	case strings.HasSuffix(path, "/messages"):
		var r struct {
			System   json.RawMessage `json:"system"`
			Messages []struct {
				Role    string          `json:"role"`
				Content json.RawMessage `json:"content"`
			} `json:"messages"`
			Tools     []json.RawMessage `json:"tools"`
			MaxTokens int               `json:"max_tokens"`
		}
		if err := json.Unmarshal(body, &r); err != nil {
			return b, err
		}
		var msgs []any
		if len(r.System) > 0 && string(r.System) != "null" {
			msgs = append(msgs, map[string]any{"role": "system", "content": partsText(r.System)})
		}
		for _, m := range r.Messages {
			var s string
			if json.Unmarshal(m.Content, &s) == nil {
				msgs = append(msgs, map[string]any{"role": m.Role, "content": s})
				continue
			}
			var blocks []map[string]json.RawMessage
			if err := json.Unmarshal(m.Content, &blocks); err != nil {
				return b, fmt.Errorf("messages content: %w", err)
			}
			var text strings.Builder
			var calls []any
			hasText := false
			for _, bl := range blocks {
				switch jsonString(bl["type"]) {
				case "text":
					text.WriteString(jsonString(bl["text"]))
					hasText = true
				case "tool_use":
					args := string(bl["input"])
					calls = append(calls, map[string]any{"id": jsonString(bl["id"]), "type": "function",
						"function": map[string]any{"name": jsonString(bl["name"]), "arguments": args}})
				case "tool_result":
					msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": jsonString(bl["tool_use_id"]), "content": partsText(bl["content"])})
				}
			}
			switch {
			case m.Role == "assistant" && len(calls) > 0:
				var content any
				if hasText {
					content = text.String()
				}
				msgs = append(msgs, map[string]any{"role": "assistant", "content": content, "tool_calls": calls})
			case hasText:
				msgs = append(msgs, map[string]any{"role": m.Role, "content": text.String()})
			}
		}
		return remarshal(map[string]any{"messages": msgs, "tools": r.Tools, "max_tokens": r.MaxTokens})
	}
	err := json.Unmarshal(body, &b)
	return b, err
}

func remarshal(v any) (fwdBody, error) {
	var b fwdBody
	raw, err := json.Marshal(v)
	if err != nil {
		return b, err
	}
	err = json.Unmarshal(raw, &b)
	return b, err
}

func jsonString(raw json.RawMessage) string {
	var s string
	json.Unmarshal(raw, &s)
	return s
}

// partsText is the text of a string or of an array of text parts
// (input_text, output_text, text).
func partsText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Text string `json:"text"`
	}
	json.Unmarshal(raw, &parts)
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.Text)
	}
	return b.String()
}

// countBody is the exact prompt size of a recorded request body, by
// llama-server's own counter for its endpoint.
func (s *llamaServer) countBody(path string, body []byte) (int, error) {
	var url string
	switch {
	case strings.HasSuffix(path, "/responses"):
		url = s.url + "/v1/responses/input_tokens"
	case strings.HasSuffix(path, "/messages"):
		url = s.url + "/v1/messages/count_tokens"
	default:
		return s.countTokens(body)
	}
	var r struct {
		InputTokens int `json:"input_tokens"`
	}
	if err := postJSON(url, body, &r); err != nil {
		return 0, err
	}
	return r.InputTokens, nil
}

// countClientView counts the client's view of the first k scripted
// messages as the run's client sends it.
func (s *llamaServer) countClientView(cfg llamaConfig, msgs []message, tools []json.RawMessage) (int, error) {
	if cfg.dialect == "" {
		return s.countTokens(requestBody(cfg.model(), msgs, tools, requestShape{}))
	}
	body, err := json.Marshal(dialectParams(cfg, msgs, tools, requestShape{}))
	if err != nil {
		return 0, err
	}
	return s.countBody(dialectPath(cfg.dialect), body)
}

// directReference runs a dialect's loop straight at llama-server (through
// the recorder, no compactproxy) until its first refusal: every step before
// it is answered 200 with usage equal to llama-server's own count of the
// request, and the conversation outgrows the window with llama-server's
// overflow answer (400 exceed_context_size_error). It shows the SDK's
// requests are what llama-server accepts, that its usage is read right,
// and that the loop needs compaction.
func directReference(t *testing.T, env llamaEnv, cfg llamaConfig, ws []wsFile) {
	t.Helper()
	ls := startLlama(t, env, cfg)
	rec := newRecorder(t, ls.url)
	sdk := startSDK(t, cfg.dialect, rec.srv.URL+"/v1")
	tools := toolsFor(cfg.ctx)
	script := buildScript(cfg, ws)
	msgs := []message{{Role: "system", Content: systemPrompt}, {Role: "user", Content: firstTask}}
	overflowAt := 0
	for i := 1; i <= steps; i++ {
		shape := dialectShape(cfg.dialect, i, cfg.ctx)
		params := dialectParams(cfg, msgs, tools, shape)
		rec.step.Store(int64(i))
		a := sdk.send(t, i, shape.stream, params, map[string]string{stepHeader: fmt.Sprint(i)})
		calls := rec.snapshot()
		c := calls[len(calls)-1]
		rep := parseReported(c.resp.Bytes())
		body, _ := json.Marshal(params)
		want, err := ls.countBody(dialectPath(cfg.dialect), body)
		if err != nil {
			t.Fatalf("step %d: counting the request: %v", i, err)
		}
		if chat, err := ls.countTokens(requestBody(cfg.model(), msgs, tools, requestShape{})); err != nil || (chat != want && i == 1) {
			t.Logf("step %d: llama-server counts the %s request %d tokens and the same history as chat %d (%v)", i, cfg.dialect, want, chat, err)
		}
		if a.Status != http.StatusOK {
			if a.Status != http.StatusBadRequest || rep.ErrType != "exceed_context_size_error" || rep.NPromptTokens != want {
				t.Fatalf("step %d: direct answer %d %s (recorded %+v), want 200 or llama-server's overflow of a %d-token prompt", i, a.Status, a.Error, rep, want)
			}
			overflowAt = i
			t.Logf("direct: step %d of a %d-token prompt refused at n_ctx %d: %d %s", i, want, ls.nCtx, a.Status, a.Error)
			break
		}
		if !a.StreamOK {
			t.Errorf("step %d: the %s answer did not end cleanly: %s", i, cfg.dialect, a.Error)
		}
		if rep.PromptTokens != want {
			t.Errorf("step %d: llama-server reported %d prompt tokens (cached %d) for a request it counts %d", i, rep.PromptTokens, rep.CachedTokens, want)
		}
		s := script[i-1]
		msgs = append(msgs, s.assistant)
		msgs = append(msgs, s.results...)
		if s.user != "" {
			msgs = append(msgs, message{Role: "user", Content: s.user})
		}
	}
	if overflowAt == 0 {
		t.Fatalf("direct: the %s loop never outgrew llama-server's %d-token window: it does not need compaction", cfg.dialect, ls.nCtx)
	}
}
