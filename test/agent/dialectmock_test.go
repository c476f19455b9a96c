package agent

// The scripted model for the agents that do not speak Chat Completions
// (issue 21): Codex CLI sends OpenAI's Responses API (POST /v1/responses),
// Claude Code Anthropic's Messages API (POST /v1/messages). One mock serves
// both on 127.0.0.1, each in its own SSE (and non-streaming JSON), in the
// spirit of mockModel (mock_test.go): it answers with the agent's own
// declared tools from a script it finds its place in from the newest tool
// results' call ids, counts a request's tokens from its body bytes at a fixed
// rate, refuses prompts over its window in that API's overflow shape, reports
// as cached the prefix a request shares with the previous one of its kind,
// and answers compactproxy's own summarize calls (requests without the
// recorder's turn header) with a short summary in the dialect they came in.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// dialect is the API an agent speaks.
type dialect string

const (
	dialectResponses dialect = "responses" // POST /v1/responses (Codex CLI)
	dialectMessages  dialect = "messages"  // POST /v1/messages (Claude Code)
)

// The overflow answers, as the providers word them.
const (
	responsesOverflowMessage = "Your input exceeds the context window of this model. Please adjust your input and try again."
	// claudeCompactMarker is a sentence of Claude Code's own summary
	// instruction (its /compact and its reactive compaction after "prompt
	// is too long"): a request whose last user message holds it asks the
	// model for a summary of the conversation, not for the next step.
	claudeCompactMarker = "create a detailed summary of the conversation"
	// codexCompactMarker is the heading of Codex CLI's own compaction
	// instruction (DESIGN § Other APIs).
	codexCompactMarker = "CONTEXT CHECKPOINT COMPACTION"
	// selfSummaryText is what the mock answers an agent's own compaction
	// request with.
	selfSummaryText = "<analysis>The user asked for a review of every Go file.</analysis>\n<summary>\n1. Primary Request: review every Go file of the project for unsafe retries, then report.\n2. Progress: the project was listed and files were read in order; nothing is wrong so far.\n3. Next Step: read the remaining files, then answer.\n</summary>"
)

// Kinds of request the dialect mock tells apart.
const (
	kindAgent       = "agent"       // a step of the agent's task
	kindSummarize   = "summarize"   // compactproxy's own summarize call (no turn header)
	kindSelfCompact = "selfcompact" // the agent's own compaction request
	kindAux         = "aux"         // a side request of the agent that declares no tools
)

// dreq is one request as the dialect mock received it, with what it found.
type dreq struct {
	Turn   int // the recorder's turn number; -1 when absent
	Path   string
	Kind   string
	Body   []byte
	Status int
	// Overflow: refused as over the window (a 400, or a response.failed
	// event in a 200 stream).
	Overflow bool
	Prompt   int // tokens counted from the body (and reported when answered)
	Cached   int // tokens reported cached: the rendered prompt's prefix shared with the previous request of its kind
	Step     int // the script step answered; -1 otherwise
	Stream   bool
	// Pairing: violations of the dialect's pairing rules in the body.
	Pairing []string
	// Problems: the script's expectations the body broke.
	Problems []string
	// Resumed: the step was taken from the mock's memory, the request
	// carrying no tool result to tell it by (Claude Code after its own
	// compaction goes on from a summary and a user message).
	Resumed bool
}

// dialectMock is the scripted model of one run.
type dialectMock struct {
	d         dialect
	window    int
	rate      float64 // bytes per token
	dir       string
	prompt    string
	finalText string
	pairAt    int
	files     []projectFile
	// failedStream: the Responses overflow comes as a 200 stream whose
	// first events are response.created and response.failed (code
	// context_length_exceeded), not as a 400.
	failedStream bool
	srv          *httptest.Server

	mu         sync.Mutex
	reqs       []dreq
	others     []string
	prevPrompt map[string][]byte
	seq        int
	// lastResults is the newest script step whose tool results the mock
	// has seen; -1 before any.
	lastResults int
	// edit: the script is the edit–test workload (editOps) over files,
	// not the read-every-file-once one; rereads are the steps before
	// which it re-read the file it was about to edit.
	edit    bool
	rereads map[int]bool
}

func newDialectMock(t *testing.T, d dialect, window int, rate float64, dir string, files []projectFile, pairAt int, failedStream bool) *dialectMock {
	t.Helper()
	m := &dialectMock{d: d, window: window, rate: rate, dir: dir, prompt: task, finalText: finalText, pairAt: pairAt, files: files,
		failedStream: failedStream, prevPrompt: map[string][]byte{}, lastResults: -1, rereads: map[int]bool{}}
	m.srv = httptest.NewServer(http.HandlerFunc(m.serve))
	t.Cleanup(m.srv.Close)
	return m
}

func (m *dialectMock) requests() []dreq {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]dreq(nil), m.reqs...)
}

func (m *dialectMock) otherRequests() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.others...)
}

func (m *dialectMock) record(r dreq) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reqs = append(m.reqs, r)
}

func (m *dialectMock) tokens(body []byte) int { return int(float64(len(body))/m.rate) + 1 }

func (m *dialectMock) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	path := r.URL.Path
	// The providers' token counters, counted like a request: Anthropic's
	// count_tokens (Claude Code calls it after compacting itself) and
	// OpenAI's input_tokens (DESIGN: compactproxy may count a freshly
	// built view there).
	switch {
	case r.Method == http.MethodPost && path == "/v1/messages/count_tokens":
		m.mu.Lock()
		m.others = append(m.others, fmt.Sprintf("%s %s (turn header %q) → %d tokens", r.Method, path, r.Header.Get(turnHeader), m.tokens(body)))
		m.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"input_tokens":%d}`, m.tokens(body))
		return
	case r.Method == http.MethodPost && path == "/v1/responses/input_tokens":
		m.mu.Lock()
		m.others = append(m.others, fmt.Sprintf("%s %s (turn header %q) → %d tokens", r.Method, path, r.Header.Get(turnHeader), m.tokens(body)))
		m.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"response.input_tokens","input_tokens":%d}`, m.tokens(body))
		return
	}
	if r.Method != http.MethodPost || (path != "/v1/responses" && path != "/v1/messages" && path != "/v1/chat/completions") {
		m.mu.Lock()
		m.others = append(m.others, r.Method+" "+path)
		m.mu.Unlock()
		if r.Method == http.MethodGet && path == "/v1/models" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"mock"}]}`)
			return
		}
		m.errorFor(w, path, http.StatusNotFound, "not_found_error", "mock: no route "+r.Method+" "+path)
		return
	}
	rec := dreq{Turn: -1, Path: path, Body: body, Step: -1, Prompt: m.tokens(body)}
	if s := r.Header.Get(turnHeader); s != "" {
		rec.Turn, _ = strconv.Atoi(s)
	}
	switch path {
	case "/v1/responses":
		m.serveResponses(w, &rec)
	case "/v1/messages":
		m.serveMessages(w, &rec)
	default:
		m.serveChatSummarize(w, &rec)
	}
}

// errorFor answers an error in the envelope of the path's API.
func (m *dialectMock) errorFor(w http.ResponseWriter, path string, code int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	if strings.HasPrefix(path, "/v1/messages") {
		json.NewEncoder(w).Encode(map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": msg}})
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": nil}})
}

// cached computes the prefix of rendered shared with the previous request
// of the same kind, in tokens, and remembers rendered.
func (m *dialectMock) cached(kind string, rendered []byte, prompt int) int {
	m.mu.Lock()
	prev := m.prevPrompt[kind]
	m.prevPrompt[kind] = rendered
	m.mu.Unlock()
	common := 0
	for common < len(prev) && common < len(rendered) && prev[common] == rendered[common] {
		common++
	}
	return min(int(float64(common)/m.rate), prompt)
}

// rereadFirst is the read the mock makes before step (edit workload), or
// nil: when the step edits a file whose current lines are not all in the
// context's tool results (texts), and the newest results (trailing call
// ids) are not already that re-read. It counts the re-read.
func (m *dialectMock) rereadFirst(prefix string, step int, steps [][]dcall, texts, trailing []string) *dcall {
	rr := rereadNeeded(m.dir, prefix, step, steps, texts, trailing)
	if rr != nil {
		m.mu.Lock()
		m.rereads[step] = true
		m.mu.Unlock()
	}
	return rr
}

// rereadCount is how many steps the mock re-read a file before.
func (m *dialectMock) rereadCount() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.rereads)
}

func (m *dialectMock) nextID(prefix string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.seq++
	return fmt.Sprintf("%s_mock%04d", prefix, m.seq)
}

// ---- the script ----

// dcall is one tool call of the script: the tool, its arguments (a JSON
// object) and a string its result must hold.
type dcall struct {
	Tool, Args, Expect string
	// Edits names the file the call changes (the edit–test workload's
	// edits): before making it the mock checks that the file's current
	// lines are in a tool result of the context, and re-reads it first
	// when they are not.
	Edits string
	// Reread is the read of Edits the mock makes first when it must.
	Reread *dcall
}

// dialectScript is the task in the agent's own tools: list the project
// with its shell tool, then read every file (files pairAt and pairAt+1 in
// one parallel turn), with the read tool when the agent declares one
// (Claude Code's Read, an absolute file_path) else with the shell tool
// (`cat`, Codex's exec_command); then the final answer (a nil step).
func (m *dialectMock) dialectScript(shell, shellParam, read, readParam string) [][]dcall {
	if m.edit {
		return editSteps(m.dir, m.files, shell, shellParam, read, readParam, true)
	}
	arg := func(k, v string) string {
		b, _ := json.Marshal(map[string]string{k: v})
		return string(b)
	}
	steps := [][]dcall{{{Tool: shell, Args: arg(shellParam, "ls -la"), Expect: m.files[len(m.files)-1].Name}}}
	readCall := func(f projectFile) dcall {
		if read != "" {
			return dcall{Tool: read, Args: arg(readParam, filepath.Join(m.dir, f.Name)), Expect: f.Marker}
		}
		return dcall{Tool: shell, Args: arg(shellParam, "cat "+f.Name), Expect: f.Marker}
	}
	for i := 0; i < len(m.files); i++ {
		if i == m.pairAt && i+1 < len(m.files) {
			steps = append(steps, []dcall{readCall(m.files[i]), readCall(m.files[i+1])})
			i++
			continue
		}
		steps = append(steps, []dcall{readCall(m.files[i])})
	}
	return append(steps, nil)
}

func dCallID(prefix string, step, k int) string { return fmt.Sprintf("%s_s%d_%d", prefix, step, k) }

// stepFromResults tells the step to answer from the newest tool results
// (call id → output text): step+1 after the results of step's calls,
// checking they hold what the calls should return. ok is false when there
// are no results to tell by.
func (m *dialectMock) stepFromResults(prefix string, results []toolResult, steps [][]dcall) (step int, problems []string, ok bool) {
	if len(results) == 0 {
		return -1, nil, false
	}
	step = -1
	seen := map[int]bool{}
	for _, res := range results {
		if s, ok := parseReread(prefix, res.ID); ok {
			// The mock's own re-read before step s: step s comes again.
			if s >= len(steps) {
				return -1, []string{"re-read result for an unknown step " + res.ID}, true
			}
			if f := steps[s][0].Edits; !strings.Contains(res.Output, fileMarker(m.files, f)) && !readDeduped(res.Output) {
				problems = append(problems, fmt.Sprintf("the re-read %s of %s lacks its marker (result: %.200q)", res.ID, f, res.Output))
			}
			return s, problems, true
		}
		var s, k int
		if _, err := fmt.Sscanf(res.ID, prefix+"_s%d_%d", &s, &k); err != nil {
			return -1, []string{"a tool result answers a call the mock did not make: " + res.ID}, true
		}
		if step >= 0 && s != step {
			problems = append(problems, fmt.Sprintf("the newest tool results answer steps %d and %d", step, s))
		}
		step = s
		if s >= len(steps) || k >= len(steps[s]) {
			return -1, []string{"tool result for an unknown call " + res.ID}, true
		}
		seen[k] = true
		if want := steps[s][k].Expect; !strings.Contains(res.Output, want) && !readDeduped(res.Output) {
			problems = append(problems, fmt.Sprintf("the result of %s (%s %s) lacks %q: the agent did not run the call as asked (result: %.200q)",
				res.ID, steps[s][k].Tool, steps[s][k].Args, want, res.Output))
		}
	}
	if len(seen) != len(steps[step]) {
		problems = append(problems, fmt.Sprintf("step %d made %d calls, %d answered at the end of the request", step, len(steps[step]), len(seen)))
	}
	m.mu.Lock()
	m.lastResults = max(m.lastResults, step)
	m.mu.Unlock()
	return step + 1, problems, true
}

// resumeStep is the step after the newest results the mock has seen: where
// an agent that compacted its own history goes on.
func (m *dialectMock) resumeStep() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastResults + 1
}

type toolResult struct {
	ID     string
	Output string
}

// stripCacheControl removes Anthropic cache_control markers: they say where
// a cache breakpoint goes, they are not part of the prompt, and Claude Code
// moves them on every request.
var cacheControlRE = regexp.MustCompile(`,?"cache_control":\{[^{}]*\}`)

// ---- Responses (Codex CLI) ----

type responsesReq struct {
	Model      string          `json:"model"`
	Stream     bool            `json:"stream"`
	ToolChoice json.RawMessage `json:"tool_choice"`
	Input      json.RawMessage `json:"input"`
	Tools      json.RawMessage `json:"tools"`
	// Instructions: the system prompt when the client sends one there.
	Instructions json.RawMessage `json:"instructions"`
}

// responsesItem is what the mock reads of an input item; Raw keeps its bytes.
type responsesItem struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
	Content   json.RawMessage `json:"content"`
	Raw       json.RawMessage `json:"-"`
}

// parseResponsesReq parses a Responses body; input may be a string.
func parseResponsesReq(body []byte) (*responsesReq, []responsesItem, error) {
	var rr responsesReq
	if err := json.Unmarshal(body, &rr); err != nil {
		return nil, nil, err
	}
	var raws []json.RawMessage
	if in := bytes.TrimSpace(rr.Input); len(in) > 0 && in[0] == '"' {
		var s string
		json.Unmarshal(in, &s)
		b, _ := json.Marshal(map[string]any{"type": "message", "role": "user", "content": s})
		raws = []json.RawMessage{b}
	} else if len(in) > 0 {
		if err := json.Unmarshal(in, &raws); err != nil {
			return nil, nil, fmt.Errorf("input: %w", err)
		}
	}
	items := make([]responsesItem, len(raws))
	for i, raw := range raws {
		if err := json.Unmarshal(raw, &items[i]); err != nil {
			return nil, nil, fmt.Errorf("input[%d]: %w", i, err)
		}
		if items[i].Type == "" && items[i].Role != "" {
			items[i].Type = "message"
		}
		items[i].Raw = raw
	}
	return &rr, items, nil
}

// itemText is the text an input item carries (a message's text parts, a
// tool output's text).
func itemText(it responsesItem) string {
	var b strings.Builder
	for _, raw := range []json.RawMessage{it.Content, it.Output} {
		raw = bytes.TrimSpace(raw)
		if len(raw) == 0 {
			continue
		}
		if raw[0] == '"' {
			var s string
			json.Unmarshal(raw, &s)
			b.WriteString(s)
			continue
		}
		var parts []struct {
			Text string `json:"text"`
		}
		json.Unmarshal(raw, &parts)
		for _, p := range parts {
			b.WriteString(p.Text)
		}
	}
	return b.String()
}

// responsesPairing checks Responses' pairing rules: every
// function_call_output (custom_tool_call_output) answers a call earlier in
// the input by call_id, and every call is answered before the next message
// and by the end of the input; call ids are unique.
func responsesPairing(items []responsesItem) []string {
	var out []string
	pending := map[string]int{}
	calls := map[string]bool{}
	flush := func(at int) {
		for id, i := range pending {
			out = append(out, fmt.Sprintf("input[%d]: call %s is not answered before input[%d]", i, id, at))
		}
		clear(pending)
	}
	for i, it := range items {
		switch it.Type {
		case "function_call", "custom_tool_call", "local_shell_call":
			if calls[it.CallID] {
				out = append(out, fmt.Sprintf("input[%d]: duplicate call_id %s", i, it.CallID))
			}
			calls[it.CallID] = true
			pending[it.CallID] = i
		case "function_call_output", "custom_tool_call_output", "local_shell_call_output":
			if _, ok := pending[it.CallID]; !ok {
				out = append(out, fmt.Sprintf("input[%d]: output for call_id %s answers no earlier unanswered call", i, it.CallID))
			}
			delete(pending, it.CallID)
		case "message":
			if len(pending) > 0 {
				flush(i)
			}
		}
	}
	flush(len(items))
	return out
}

// renderResponses is the prompt as the mock's prefix cache sees it: the
// instructions, the tools, then every input item's bytes.
func renderResponses(rr *responsesReq, items []responsesItem) []byte {
	var b bytes.Buffer
	b.Write(rr.Instructions)
	b.WriteByte(0)
	b.Write(rr.Tools)
	b.WriteByte(0)
	for _, it := range items {
		b.Write(it.Raw)
		b.WriteByte(0)
	}
	return b.Bytes()
}

// responsesTools finds the shell tool (a function with a cmd or command
// parameter: Codex's exec_command or shell) and a read tool, if any.
func responsesTools(raw json.RawMessage) (shell, shellParam string, names []string) {
	var tools []struct {
		Type       string `json:"type"`
		Name       string `json:"name"`
		Parameters struct {
			Properties map[string]json.RawMessage `json:"properties"`
		} `json:"parameters"`
	}
	json.Unmarshal(raw, &tools)
	for _, tl := range tools {
		names = append(names, tl.Name)
		if tl.Type != "function" || shell != "" {
			continue
		}
		for _, p := range []string{"cmd", "command"} {
			if _, ok := tl.Parameters.Properties[p]; ok {
				shell, shellParam = tl.Name, p
				break
			}
		}
	}
	return shell, shellParam, names
}

func (m *dialectMock) serveResponses(w http.ResponseWriter, rec *dreq) {
	rr, items, err := parseResponsesReq(rec.Body)
	if err != nil || len(items) == 0 {
		rec.Status = http.StatusBadRequest
		rec.Problems = append(rec.Problems, fmt.Sprintf("bad Responses body: %v", err))
		m.record(*rec)
		m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: bad Responses body")
		return
	}
	rec.Stream = rr.Stream
	rec.Pairing = responsesPairing(items)
	tools := bytes.TrimSpace(rr.Tools)
	lastText := itemText(items[len(items)-1])
	switch {
	// compactproxy's own request: no turn header (its summarizer sends
	// the client's credentials only), or the agent's tools with
	// tool_choice none (DESIGN: a summarize request that extends the
	// agent's prefix, so the upstream's cache covers it).
	case rec.Turn < 0 || string(bytes.TrimSpace(rr.ToolChoice)) == `"none"`:
		rec.Kind = kindSummarize
	case strings.Contains(lastText, codexCompactMarker) || (len(tools) > 0 && bytes.Equal(tools, []byte("[]")) && strings.Contains(string(rec.Body), codexCompactMarker)):
		rec.Kind = kindSelfCompact
	case len(tools) == 0 || bytes.Equal(tools, []byte("[]")) || bytes.Equal(tools, []byte("null")):
		rec.Kind = kindAux
	default:
		rec.Kind = kindAgent
	}
	rec.Cached = m.cached(rec.Kind, renderResponses(rr, items), rec.Prompt)
	usage := map[string]any{
		"input_tokens":          rec.Prompt,
		"input_tokens_details":  map[string]any{"cached_tokens": rec.Cached},
		"output_tokens":         24,
		"output_tokens_details": map[string]any{"reasoning_tokens": 8},
		"total_tokens":          rec.Prompt + 24,
	}
	respID := m.nextID("resp")

	if rec.Prompt > m.window {
		rec.Overflow = true
		if m.failedStream && rr.Stream {
			rec.Status = http.StatusOK
			m.record(*rec)
			sw := newSSE(w)
			base := map[string]any{"id": respID, "object": "response", "created_at": time.Now().Unix(), "model": rr.Model, "output": []any{}}
			sw.event("response.created", map[string]any{"type": "response.created", "response": with(base, "status", "in_progress")})
			failed := with(base, "status", "failed")
			failed["error"] = map[string]any{"code": "context_length_exceeded", "message": responsesOverflowMessage}
			sw.event("response.failed", map[string]any{"type": "response.failed", "response": failed})
			return
		}
		rec.Status = http.StatusBadRequest
		m.record(*rec)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
			"message": responsesOverflowMessage, "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}})
		return
	}

	var out []map[string]any
	switch rec.Kind {
	case kindSummarize, kindSelfCompact, kindAux:
		text := summaryText
		switch rec.Kind {
		case kindSelfCompact:
			text = selfSummaryText
		case kindAux:
			text = auxText
		}
		out = append(out, responsesMessage(m.nextID("msg"), text))
	default:
		shell, shellParam, names := responsesTools(rr.Tools)
		if shell == "" {
			rec.Status = http.StatusBadRequest
			rec.Problems = append(rec.Problems, fmt.Sprintf("the request declares no shell tool (a function with a cmd or command parameter) among %v", names))
			m.record(*rec)
			m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: no shell tool")
			return
		}
		steps := m.dialectScript(shell, shellParam, "", "")
		step, problems := m.responsesStep(items, steps)
		rec.Problems = append(rec.Problems, problems...)
		if step < 0 || step >= len(steps) {
			rec.Status = http.StatusBadRequest
			m.record(*rec)
			m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: cannot tell the script step from the input")
			return
		}
		rec.Step = step
		calls, id := steps[step], func(k int) string { return dCallID("call", step, k) }
		if m.edit {
			var texts, trailing []string
			for _, it := range items {
				if strings.HasSuffix(it.Type, "_output") {
					texts = append(texts, itemText(it))
				}
			}
			for i := len(items) - 1; i >= 0 && strings.HasSuffix(items[i].Type, "_output"); i-- {
				trailing = append(trailing, items[i].CallID)
			}
			if rr := m.rereadFirst("call", step, steps, texts, trailing); rr != nil {
				calls, id = []dcall{*rr}, func(int) string { return rereadID("call", step) }
			}
		}
		// A reasoning item first, as reasoning models answer; Codex sends
		// it back (include reasoning.encrypted_content, store false).
		out = append(out, map[string]any{"type": "reasoning", "id": m.nextID("rs"), "summary": []any{},
			"encrypted_content": fakeCiphertext(fmt.Sprintf("reasoning for step %d of %s", step, respID), 600)})
		if calls == nil {
			out = append(out, responsesMessage(m.nextID("msg"), m.finalText))
		}
		for k, c := range calls {
			out = append(out, map[string]any{"type": "function_call", "id": m.nextID("fc"), "call_id": id(k),
				"name": c.Tool, "arguments": c.Args, "status": "completed"})
		}
	}
	rec.Status = http.StatusOK
	m.record(*rec)
	base := map[string]any{"id": respID, "object": "response", "created_at": time.Now().Unix(), "model": rr.Model,
		"output": []any{}, "parallel_tool_calls": true, "tool_choice": "auto", "tools": []any{}}
	done := with(base, "status", "completed")
	outAny := make([]any, len(out))
	for i := range out {
		outAny[i] = out[i]
	}
	done["output"] = outAny
	done["usage"] = usage
	if !rr.Stream {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(done)
		return
	}
	sw := newSSE(w)
	sw.event("response.created", map[string]any{"type": "response.created", "response": with(base, "status", "in_progress")})
	sw.event("response.in_progress", map[string]any{"type": "response.in_progress", "response": with(base, "status", "in_progress")})
	for i, it := range out {
		added := map[string]any{}
		for k, v := range it {
			added[k] = v
		}
		switch it["type"] {
		case "message":
			added["content"], added["status"] = []any{}, "in_progress"
		case "function_call":
			added["arguments"], added["status"] = "", "in_progress"
		}
		sw.event("response.output_item.added", map[string]any{"type": "response.output_item.added", "output_index": i, "item": added})
		switch it["type"] {
		case "message":
			text := it["content"].([]any)[0].(map[string]any)["text"].(string)
			part := map[string]any{"type": "output_text", "text": "", "annotations": []any{}}
			sw.event("response.content_part.added", map[string]any{"type": "response.content_part.added", "item_id": it["id"], "output_index": i, "content_index": 0, "part": part})
			for _, piece := range []string{text[:len(text)/2], text[len(text)/2:]} {
				sw.event("response.output_text.delta", map[string]any{"type": "response.output_text.delta", "item_id": it["id"], "output_index": i, "content_index": 0, "delta": piece})
			}
			sw.event("response.output_text.done", map[string]any{"type": "response.output_text.done", "item_id": it["id"], "output_index": i, "content_index": 0, "text": text})
			sw.event("response.content_part.done", map[string]any{"type": "response.content_part.done", "item_id": it["id"], "output_index": i, "content_index": 0,
				"part": map[string]any{"type": "output_text", "text": text, "annotations": []any{}}})
		case "function_call":
			args := it["arguments"].(string)
			for _, piece := range []string{args[:len(args)/2], args[len(args)/2:]} {
				sw.event("response.function_call_arguments.delta", map[string]any{"type": "response.function_call_arguments.delta", "item_id": it["id"], "output_index": i, "delta": piece})
			}
			sw.event("response.function_call_arguments.done", map[string]any{"type": "response.function_call_arguments.done", "item_id": it["id"], "output_index": i, "arguments": args})
		}
		sw.event("response.output_item.done", map[string]any{"type": "response.output_item.done", "output_index": i, "item": it})
	}
	sw.event("response.completed", map[string]any{"type": "response.completed", "response": done})
}

// responsesStep tells the step from the input's trailing tool outputs (the
// task alone: step 0).
func (m *dialectMock) responsesStep(items []responsesItem, steps [][]dcall) (int, []string) {
	var results []toolResult
	for i := len(items) - 1; i >= 0; i-- {
		it := items[i]
		if it.Type != "function_call_output" && it.Type != "custom_tool_call_output" {
			break // the newest turn's outputs follow its calls
		}
		results = append(results, toolResult{ID: it.CallID, Output: itemText(it)})
	}
	if step, problems, ok := m.stepFromResults("call", results, steps); ok {
		return step, problems
	}
	last := items[len(items)-1]
	if last.Type == "message" && last.Role == "user" && strings.Contains(itemText(last), m.prompt) && m.resumeStep() == 0 {
		return 0, nil
	}
	if last.Type == "message" && last.Role == "user" && m.resumeStep() > 0 {
		// Codex CLI going on after its own compaction (told its window):
		// a summary in a user message, no tool output to tell by.
		return m.resumeStep(), nil
	}
	return -1, []string{fmt.Sprintf("the input ends on a %s item (role %q) that is neither the task nor a tool output", last.Type, last.Role)}
}

func responsesMessage(id, text string) map[string]any {
	return map[string]any{"type": "message", "id": id, "role": "assistant", "status": "completed",
		"content": []any{map[string]any{"type": "output_text", "text": text, "annotations": []any{}}}}
}

// with returns a copy of m with key set to v.
func with(m map[string]any, key string, v any) map[string]any {
	c := make(map[string]any, len(m)+1)
	for k, x := range m {
		c[k] = x
	}
	c[key] = v
	return c
}

// fakeCiphertext is an opaque, deterministic base64-looking string of n
// bytes standing for an encrypted reasoning item or a thinking signature.
func fakeCiphertext(seed string, n int) string {
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
	var h uint64 = 14695981039346656037
	for i := 0; i < len(seed); i++ {
		h = (h ^ uint64(seed[i])) * 1099511628211
	}
	b := make([]byte, n)
	for i := range b {
		h ^= h << 13
		h ^= h >> 7
		h ^= h << 17
		b[i] = alphabet[h%64]
	}
	return string(b)
}

// sse writes server-sent events, one flush per event.
type sse struct {
	w http.ResponseWriter
}

func newSSE(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w}
}

func (s *sse) event(name string, data any) {
	b, _ := json.Marshal(data)
	fmt.Fprintf(s.w, "event: %s\ndata: %s\n\n", name, b)
	s.w.(http.Flusher).Flush()
}

// ---- Messages (Claude Code) ----

type messagesReq struct {
	Model      string `json:"model"`
	Stream     bool   `json:"stream"`
	ToolChoice *struct {
		Type string `json:"type"`
	} `json:"tool_choice"`
	System   json.RawMessage   `json:"system"`
	Tools    json.RawMessage   `json:"tools"`
	Messages []json.RawMessage `json:"messages"`
}

type messagesMsg struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// block is what the mock reads of a content block.
type block struct {
	Type      string          `json:"type"`
	Text      string          `json:"text"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
	Thinking  string          `json:"thinking"`
	Signature string          `json:"signature"`
}

// blocksOf parses a message's content: a string is one text block.
func blocksOf(content json.RawMessage) []block {
	content = bytes.TrimSpace(content)
	if len(content) > 0 && content[0] == '"' {
		var s string
		json.Unmarshal(content, &s)
		return []block{{Type: "text", Text: s}}
	}
	var bs []block
	json.Unmarshal(content, &bs)
	return bs
}

// rawBlocksOf returns each content block's raw bytes (nil for a string).
func rawBlocksOf(content json.RawMessage) []json.RawMessage {
	var raws []json.RawMessage
	json.Unmarshal(content, &raws)
	return raws
}

func blockText(b block) string {
	if b.Type == "tool_result" {
		c := bytes.TrimSpace(b.Content)
		if len(c) > 0 && c[0] == '"' {
			var s string
			json.Unmarshal(c, &s)
			return s
		}
		var parts []block
		json.Unmarshal(c, &parts)
		var sb strings.Builder
		for _, p := range parts {
			sb.WriteString(p.Text)
		}
		return sb.String()
	}
	return b.Text
}

func parseMessagesReq(body []byte) (*messagesReq, []messagesMsg, error) {
	var mr messagesReq
	if err := json.Unmarshal(body, &mr); err != nil {
		return nil, nil, err
	}
	msgs := make([]messagesMsg, len(mr.Messages))
	for i, raw := range mr.Messages {
		if err := json.Unmarshal(raw, &msgs[i]); err != nil {
			return nil, nil, fmt.Errorf("messages[%d]: %w", i, err)
		}
	}
	return &mr, msgs, nil
}

// messagesPairing checks Anthropic's pairing rules: every tool_result in a
// user message answers a tool_use of the assistant message right before it,
// every tool_use is answered in the user message right after it, and
// tool_use ids are unique.
func messagesPairing(msgs []messagesMsg) []string {
	var out []string
	ids := map[string]bool{}
	for i, msg := range msgs {
		bs := blocksOf(msg.Content)
		switch msg.Role {
		case "assistant":
			var uses []string
			for _, b := range bs {
				if b.Type == "tool_use" || b.Type == "server_tool_use" {
					if ids[b.ID] {
						out = append(out, fmt.Sprintf("messages[%d]: duplicate tool_use id %s", i, b.ID))
					}
					ids[b.ID] = true
					uses = append(uses, b.ID)
				}
			}
			answered := map[string]bool{}
			if i+1 < len(msgs) && msgs[i+1].Role == "user" {
				for _, b := range blocksOf(msgs[i+1].Content) {
					if b.Type == "tool_result" {
						answered[b.ToolUseID] = true
					}
				}
			}
			for _, id := range uses {
				if !answered[id] {
					out = append(out, fmt.Sprintf("messages[%d]: tool_use %s is not answered in the next user message", i, id))
				}
			}
		case "user":
			uses := map[string]bool{}
			if i > 0 && msgs[i-1].Role == "assistant" {
				for _, b := range blocksOf(msgs[i-1].Content) {
					if b.Type == "tool_use" {
						uses[b.ID] = true
					}
				}
			}
			for _, b := range bs {
				if b.Type == "tool_result" && !uses[b.ToolUseID] {
					out = append(out, fmt.Sprintf("messages[%d]: tool_result for %s answers no tool_use of the previous assistant message", i, b.ToolUseID))
				}
			}
		}
	}
	return out
}

// renderMessages is the prompt as the mock's prefix cache sees it: the
// system blocks, the tools, then every message's bytes, with cache_control
// markers removed.
func renderMessages(mr *messagesReq) []byte {
	var b bytes.Buffer
	b.Write(cacheControlRE.ReplaceAll(mr.System, nil))
	b.WriteByte(0)
	b.Write(cacheControlRE.ReplaceAll(mr.Tools, nil))
	b.WriteByte(0)
	for _, raw := range mr.Messages {
		b.Write(cacheControlRE.ReplaceAll(raw, nil))
		b.WriteByte(0)
	}
	return b.Bytes()
}

// messagesTools finds Claude Code's shell tool (a command parameter: Bash)
// and read tool (a file_path parameter, named *read*: Read).
func messagesTools(raw json.RawMessage) (shell, shellParam, read, readParam string, names []string) {
	var tools []struct {
		Name        string `json:"name"`
		InputSchema struct {
			Properties map[string]json.RawMessage `json:"properties"`
		} `json:"input_schema"`
	}
	json.Unmarshal(raw, &tools)
	for _, tl := range tools {
		names = append(names, tl.Name)
		props := tl.InputSchema.Properties
		if _, ok := props["command"]; ok && shell == "" {
			shell, shellParam = tl.Name, "command"
		}
		_, hasPath := props["file_path"]
		_, hasContent := props["content"]
		_, hasOld := props["old_string"]
		if hasPath && !hasContent && !hasOld && read == "" && strings.Contains(strings.ToLower(tl.Name), "read") {
			read, readParam = tl.Name, "file_path"
		}
	}
	return
}

func (m *dialectMock) serveMessages(w http.ResponseWriter, rec *dreq) {
	mr, msgs, err := parseMessagesReq(rec.Body)
	if err != nil || len(msgs) == 0 {
		rec.Status = http.StatusBadRequest
		rec.Problems = append(rec.Problems, fmt.Sprintf("bad Messages body: %v", err))
		m.record(*rec)
		m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: bad Messages body")
		return
	}
	rec.Stream = mr.Stream
	rec.Pairing = messagesPairing(msgs)
	last := msgs[len(msgs)-1]
	lastText := ""
	for _, b := range blocksOf(last.Content) {
		if b.Type == "text" {
			lastText += b.Text
		}
	}
	tools := bytes.TrimSpace(mr.Tools)
	switch {
	case rec.Turn < 0 || (mr.ToolChoice != nil && mr.ToolChoice.Type == "none"):
		rec.Kind = kindSummarize
	case last.Role == "user" && strings.Contains(lastText, claudeCompactMarker):
		rec.Kind = kindSelfCompact
	case len(tools) == 0 || bytes.Equal(tools, []byte("[]")) || bytes.Equal(tools, []byte("null")):
		rec.Kind = kindAux
	default:
		rec.Kind = kindAgent
	}
	rec.Cached = m.cached(rec.Kind, renderMessages(mr), rec.Prompt)
	// Anthropic's three disjoint counts: read from the cache, written to
	// it, and the rest.
	uncached := rec.Prompt - rec.Cached
	creation := uncached / 2
	usage := map[string]any{"input_tokens": uncached - creation, "cache_read_input_tokens": rec.Cached,
		"cache_creation_input_tokens": creation, "output_tokens": 1}

	if rec.Prompt > m.window {
		rec.Overflow = true
		rec.Status = http.StatusBadRequest
		m.record(*rec)
		m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error",
			fmt.Sprintf("prompt is too long: %d tokens > %d maximum", rec.Prompt, m.window))
		return
	}

	// The answer's content blocks.
	var content []map[string]any
	stop := "end_turn"
	switch rec.Kind {
	case kindSummarize, kindSelfCompact, kindAux:
		text := summaryText
		switch rec.Kind {
		case kindSelfCompact:
			text = selfSummaryText
		case kindAux:
			text = auxText
		}
		content = append(content, map[string]any{"type": "text", "text": text})
	default:
		shell, shellParam, read, readParam, names := messagesTools(mr.Tools)
		if shell == "" || read == "" {
			rec.Status = http.StatusBadRequest
			rec.Problems = append(rec.Problems, fmt.Sprintf("the request declares no shell tool (command) or no read tool (file_path) among %v", names))
			m.record(*rec)
			m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: no shell or read tool")
			return
		}
		steps := m.dialectScript(shell, shellParam, read, readParam)
		step, problems, resumed := m.messagesStep(msgs, steps)
		rec.Problems = append(rec.Problems, problems...)
		rec.Resumed = resumed
		if step < 0 || step >= len(steps) {
			rec.Status = http.StatusBadRequest
			m.record(*rec)
			m.errorFor(w, rec.Path, http.StatusBadRequest, "invalid_request_error", "mock: cannot tell the script step from the messages")
			return
		}
		rec.Step = step
		calls, id := steps[step], func(k int) string { return dCallID("toolu", step, k) }
		if m.edit {
			var texts, trailing []string
			for i, msg := range msgs {
				for _, b := range blocksOf(msg.Content) {
					if msg.Role == "user" && b.Type == "tool_result" {
						texts = append(texts, blockText(b))
						if i == len(msgs)-1 {
							trailing = append(trailing, b.ToolUseID)
						}
					}
				}
			}
			if rr := m.rereadFirst("toolu", step, steps, texts, trailing); rr != nil {
				calls, id = []dcall{*rr}, func(int) string { return rereadID("toolu", step) }
			}
		}
		// A thinking block with a signature first, as Claude models with
		// extended thinking answer; Claude Code sends it back in every
		// assistant turn, and the API rejects an altered one.
		content = append(content, map[string]any{"type": "thinking",
			"thinking":  fmt.Sprintf("Step %d of the review: the next file to look at follows from the last result.", step),
			"signature": fakeCiphertext(fmt.Sprintf("signature for step %d", step), 320)})
		if calls == nil {
			content = append(content, map[string]any{"type": "text", "text": m.finalText})
		}
		for k, c := range calls {
			var input map[string]any
			json.Unmarshal([]byte(c.Args), &input)
			content = append(content, map[string]any{"type": "tool_use", "id": id(k), "name": c.Tool, "input": input})
			stop = "tool_use"
		}
	}
	rec.Status = http.StatusOK
	m.record(*rec)
	msgID := m.nextID("msg")
	if !mr.Stream {
		final := map[string]any{}
		for k, v := range usage {
			final[k] = v
		}
		final["output_tokens"] = 24
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"id": msgID, "type": "message", "role": "assistant", "model": mr.Model,
			"content": content, "stop_reason": stop, "stop_sequence": nil, "usage": final})
		return
	}
	sw := newSSE(w)
	sw.event("message_start", map[string]any{"type": "message_start", "message": map[string]any{"id": msgID, "type": "message", "role": "assistant",
		"model": mr.Model, "content": []any{}, "stop_reason": nil, "stop_sequence": nil, "usage": usage}})
	for i, c := range content {
		switch c["type"] {
		case "thinking":
			sw.event("content_block_start", map[string]any{"type": "content_block_start", "index": i, "content_block": map[string]any{"type": "thinking", "thinking": "", "signature": ""}})
			sw.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "thinking_delta", "thinking": c["thinking"]}})
			sw.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "signature_delta", "signature": c["signature"]}})
		case "text":
			text := c["text"].(string)
			sw.event("content_block_start", map[string]any{"type": "content_block_start", "index": i, "content_block": map[string]any{"type": "text", "text": ""}})
			for _, piece := range []string{text[:len(text)/2], text[len(text)/2:]} {
				sw.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "text_delta", "text": piece}})
			}
		case "tool_use":
			sw.event("content_block_start", map[string]any{"type": "content_block_start", "index": i, "content_block": map[string]any{"type": "tool_use", "id": c["id"], "name": c["name"], "input": map[string]any{}}})
			args, _ := json.Marshal(c["input"])
			for _, piece := range []string{string(args[:len(args)/2]), string(args[len(args)/2:])} {
				sw.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "input_json_delta", "partial_json": piece}})
			}
		}
		sw.event("content_block_stop", map[string]any{"type": "content_block_stop", "index": i})
	}
	sw.event("message_delta", map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": stop, "stop_sequence": nil}, "usage": map[string]any{"output_tokens": 24}})
	sw.event("message_stop", map[string]any{"type": "message_stop"})
}

// messagesStep tells the step from the last user message's tool results;
// the task alone is step 0; a user message with neither (Claude Code going
// on after its own compaction) resumes after the newest results seen.
func (m *dialectMock) messagesStep(msgs []messagesMsg, steps [][]dcall) (step int, problems []string, resumed bool) {
	last := msgs[len(msgs)-1]
	if last.Role != "user" {
		return -1, []string{"the last message has role " + last.Role}, false
	}
	var results []toolResult
	text := ""
	for _, b := range blocksOf(last.Content) {
		switch b.Type {
		case "tool_result":
			results = append(results, toolResult{ID: b.ToolUseID, Output: blockText(b)})
		case "text":
			text += b.Text
		}
	}
	if step, problems, ok := m.stepFromResults("toolu", results, steps); ok {
		return step, problems, false
	}
	if strings.Contains(text, m.prompt) && m.resumeStep() == 0 {
		return 0, nil, false
	}
	return m.resumeStep(), nil, true
}

// ---- compactproxy's summarize calls in Chat Completions ----

// serveChatSummarize answers a Chat Completions request: compactproxy's
// summarize call when its summarizer speaks chat to the same upstream.
func (m *dialectMock) serveChatSummarize(w http.ResponseWriter, rec *dreq) {
	rec.Kind = kindSummarize
	if rec.Turn >= 0 {
		rec.Kind = kindAux
		rec.Problems = append(rec.Problems, "an agent request reached the mock as Chat Completions")
	}
	var v mockView
	if err := json.Unmarshal(rec.Body, &v); err != nil || len(v.Messages) == 0 {
		rec.Status = http.StatusBadRequest
		rec.Problems = append(rec.Problems, fmt.Sprintf("bad chat body: %v", err))
		m.record(*rec)
		mockError(w, http.StatusBadRequest, "mock: bad chat body")
		return
	}
	rec.Stream = v.Stream
	pv, err := pairingOf(rec.Body)
	for _, x := range pv {
		rec.Pairing = append(rec.Pairing, x.Message())
	}
	if err != nil {
		rec.Problems = append(rec.Problems, "internal/chat cannot parse the body: "+err.Error())
	}
	rec.Cached = m.cached("chat-"+rec.Kind, renderPrompt(rec.Body), rec.Prompt)
	usage := map[string]any{"prompt_tokens": rec.Prompt, "completion_tokens": 24, "total_tokens": rec.Prompt + 24,
		"prompt_tokens_details": map[string]any{"cached_tokens": rec.Cached}}
	if rec.Prompt > m.window {
		rec.Overflow = true
		rec.Status = http.StatusBadRequest
		m.record(*rec)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
			"message": responsesOverflowMessage, "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
		return
	}
	rec.Status = http.StatusOK
	m.record(*rec)
	id := m.nextID("chatcmpl")
	includeUsage := v.StreamOptions != nil && v.StreamOptions.IncludeUsage
	if v.Stream {
		streamAnswer(w, id, v.Model, includeUsage, usage, []string{summaryText}, nil)
		return
	}
	jsonAnswer(w, id, v.Model, map[string]any{"role": "assistant", "content": summaryText}, "stop", usage)
}
