package agent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// piBytesPerToken is how the mock model counts pi's prompts: len(body)/1.5,
// 2.7x the tokens of compactproxy's local bytes/4 estimate, so the
// undercount compaction exists for is exercised (CRAFT 19).
const piBytesPerToken = 1.5

// turnHeader is set by the recorder in front of compactproxy on every chat
// request of the agent (its sequence number); compactproxy forwards client
// headers, so a request that reaches the mock without it is compactproxy's
// own (a summarize call).
const turnHeader = "X-Agent-Turn"

// summaryText is what the mock answers a summarize call with.
const summaryText = "## Goal\nReview every Go file of the project and report.\n## Progress\nThe project was listed and the first files were read; nothing is wrong so far.\n## Next\nRead the remaining files, then answer."

// auxText is what the mock answers an agent's side request with (a request
// that declares no tools: opencode's session title).
const auxText = "Review Go files for unsafe retries"

// projectFile is one file of the temporary project; Marker is a line only
// that file holds, so the mock can tell the agent really read it.
type projectFile struct {
	Name   string
	Marker string
}

// scriptCall is one tool call the mock makes; Expect is a string its result
// must contain (the file's marker, or a file name for the listing).
type scriptCall = dcall

// upstreamReq is one request as the mock received it, with what it found.
type upstreamReq struct {
	Turn      int // the recorder's turn number; -1 when absent
	Summarize bool
	// Aux: a request of the agent that declares no tools, a side request
	// of its own (opencode asks for a session title); answered with a
	// short text, not a script step.
	Aux bool
	// SelfCompact: the agent's own compaction request (selfCompactChat),
	// answered with a summary.
	SelfCompact bool
	Body        []byte
	Status      int
	Prompt      int // prompt_tokens the mock counted (and reported when 200)
	Cached      int // cached_tokens reported: the rendered prompt's prefix shared with the previous request of its kind (renderPrompt)
	MaxTokens   int
	MaxField    string // "max_tokens", "max_completion_tokens" or ""
	Step        int    // the script step answered; -1 for summarize calls and errors
	Stream      bool
	// Pairing is the strict pairing check's violations of the body.
	Pairing []pairing.Violation
	// Problems: the script's expectations that the body broke.
	Problems []string
}

// mockModel is a scripted OpenAI-compatible model on 127.0.0.1. For the
// agent's requests it reads the agent's own declared tools, lists the
// project with the shell tool, reads every file with the read tool (two of
// them in one parallel turn), then answers finalText. It knows which step
// it is at from the newest tool result's call id ("call_s<step>_<k>"), so it
// needs no memory of the conversation and compaction may cut anything
// older. Requests over its window get llama.cpp's overflow answer.
type mockModel struct {
	window    int
	rate      float64 // bytes per token: prompt_tokens = len(body)/rate + 1
	dir       string  // the project's directory, for a read tool that wants absolute paths
	prompt    string  // the agent's task, the conversation's first user message
	finalText string
	pairAt    int // files pairAt and pairAt+1 are read in one parallel turn
	files     []projectFile
	srv       *httptest.Server
	// resumable: a user message that is not the task resumes after the
	// newest step answered (the agent's own compaction is on).
	resumable bool

	mu         sync.Mutex
	reqs       []upstreamReq
	prevPrompt map[string][]byte // previous rendered prompt per kind (agent, summarize, aux), for cached_tokens
	seq        int
	otherReqs  []string // non-chat requests: "GET /v1/models"
	// lastResults is the newest script step whose tool results the mock
	// has seen (-1 before any): where an agent that compacted its own
	// history goes on.
	lastResults int
	// lastAnswered is the newest script step the mock answered with tool
	// calls (-1 before any): an agent that compacts itself right after
	// running them (opencode) sends their results only in its summary.
	lastAnswered int
	// edit: the script is the edit–test workload (editOps); rereads are
	// the steps before which the mock re-read the file it was to edit.
	edit    bool
	rereads map[int]bool
}

func newMockModel(t *testing.T, window int, rate float64, dir, prompt, finalText string, pairAt int, files []projectFile) *mockModel {
	t.Helper()
	m := &mockModel{window: window, rate: rate, dir: dir, prompt: prompt, finalText: finalText, pairAt: pairAt, files: files, prevPrompt: map[string][]byte{}, lastResults: -1, lastAnswered: -1, rereads: map[int]bool{}}
	m.srv = httptest.NewServer(http.HandlerFunc(m.serve))
	t.Cleanup(m.srv.Close)
	return m
}

func (m *mockModel) baseURL() string { return m.srv.URL + "/v1" }

func (m *mockModel) requests() []upstreamReq {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]upstreamReq(nil), m.reqs...)
}

func (m *mockModel) others() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.otherReqs...)
}

// mockView is the part of a chat request the mock decides on.
type mockView struct {
	Model         string          `json:"model"`
	Stream        bool            `json:"stream"`
	ToolChoice    json.RawMessage `json:"tool_choice"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Tools []struct {
		Function struct {
			Name       string `json:"name"`
			Parameters struct {
				Properties map[string]json.RawMessage `json:"properties"`
			} `json:"parameters"`
		} `json:"function"`
	} `json:"tools"`
	Messages []struct {
		Role       string          `json:"role"`
		Content    json.RawMessage `json:"content"`
		ToolCallID string          `json:"tool_call_id"`
	} `json:"messages"`
	MaxTokens           *int `json:"max_tokens"`
	MaxCompletionTokens *int `json:"max_completion_tokens"`
}

// pairingOf runs the strict pairing check on a body, parsed the way the
// proxy parses it (internal/chat), so a view the proxy would reject from a
// client is caught here too.
func pairingOf(body []byte) ([]pairing.Violation, error) {
	cr, err := chat.Parse(body)
	if err != nil {
		return nil, err
	}
	pm := make([]pairing.Message, len(cr.Messages))
	for i, msg := range cr.Messages {
		pm[i] = pairing.Message{
			Role: msg.Role, ToolCallID: msg.ToolCallID, HasToolCallID: msg.HasToolCallID,
			FunctionCall: msg.FunctionCall, Name: msg.Name,
			HasContent: msg.TextBytes > 0 || msg.MediaParts > 0,
		}
		for _, c := range msg.ToolCalls {
			pm[i].Calls = append(pm[i].Calls, pairing.Call{ID: c.ID, HasID: c.HasID, Name: c.Name})
		}
	}
	return pairing.Check(pm), nil
}

// script is the agent's task in tool calls, named from the tools the
// request declares: step 0 lists the project (when a shell tool is
// declared), then one read per step, files pairAt and pairAt+1 in one
// parallel turn.
// A step without calls is the final answer.
//
// The read tool is the one named *read* with a path parameter: "path"
// (pi: relative to the working directory), "filePath" (opencode: an
// absolute path) or "file_path" (qwen-code's read_file: an absolute path).
// The shell tool is the first with a "command" parameter (pi's bash,
// qwen-code's run_shell_command).
func (m *mockModel) script(v *mockView) ([][]scriptCall, error) {
	var read, pathParam, shell string
	for _, tl := range v.Tools {
		f := tl.Function
		_, hasCommand := f.Parameters.Properties["command"]
		_, hasContent := f.Parameters.Properties["content"]
		param := ""
		for _, p := range []string{"path", "filePath", "file_path"} {
			if _, ok := f.Parameters.Properties[p]; ok {
				param = p
				break
			}
		}
		switch {
		case read == "" && param != "" && !hasContent && strings.Contains(strings.ToLower(f.Name), "read"):
			read, pathParam = f.Name, param
		case shell == "" && hasCommand:
			shell = f.Name
		}
	}
	if read == "" {
		return nil, fmt.Errorf("the request declares no read tool (a tool named *read* with a path, filePath or file_path parameter)")
	}
	if m.edit {
		if shell == "" {
			return nil, fmt.Errorf("the request declares no shell tool (a command parameter), which the edit–test workload needs")
		}
		return editSteps(m.dir, m.files, shell, "command", read, pathParam, pathParam != "path"), nil
	}
	var steps [][]scriptCall
	if shell != "" {
		// The listing must name a project file: the first, which ls puts
		// first (retry00.go) and which a shell tool that returns its output
		// cut short still carries (qwen-code's, once in CI under load, ran
		// without the last file straight at the mock).
		steps = append(steps, []scriptCall{{Tool: shell, Args: `{"command":"ls -la"}`, Expect: m.files[0].Name}})
	}
	for i := 0; i < len(m.files); i++ {
		call := func(f projectFile) scriptCall {
			p := f.Name
			if pathParam != "path" { // filePath, file_path: absolute
				p = filepath.Join(m.dir, f.Name)
			}
			args, _ := json.Marshal(map[string]string{pathParam: p})
			return scriptCall{Tool: read, Args: string(args), Expect: f.Marker}
		}
		if i == m.pairAt && i+1 < len(m.files) {
			steps = append(steps, []scriptCall{call(m.files[i]), call(m.files[i+1])})
			i++
			continue
		}
		steps = append(steps, []scriptCall{call(m.files[i])})
	}
	return append(steps, nil), nil
}

// renderPrompt is the prompt as the mock's prefix cache sees it: the tools
// array's raw bytes first, then every message's raw bytes in order, each
// piece followed by a NUL (which valid JSON never holds, so a piece cannot
// run into the next). Providers render the tools before the conversation:
// llama.cpp's chat templates put them in the system turn, and OpenAI's
// prompt caching counts the tools as part of the cached prefix. The JSON
// body's own field order does not matter to them, and pi writes "messages"
// before "tools", so a common prefix of the raw bodies would lose the tools
// (~2,000 tokens here) whenever compaction changes a message. Whether the
// system message goes before or after the tools makes no difference: the
// proxy forwards both unchanged. The other fields (model, stream, max
// tokens) are not part of a rendered prompt. A body internal/chat cannot
// parse is rendered as itself.
func renderPrompt(body []byte) []byte {
	cr, err := chat.Parse(body)
	if err != nil {
		return body
	}
	var b bytes.Buffer
	b.Write(field(cr, "tools"))
	b.WriteByte(0)
	for _, msg := range cr.Messages {
		b.Write(msg.Raw)
		b.WriteByte(0)
	}
	return b.Bytes()
}

func callID(step, k int) string { return fmt.Sprintf("call_s%d_%d", step, k) }

func (m *mockModel) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if r.Method != http.MethodPost || r.URL.Path != "/v1/chat/completions" {
		m.mu.Lock()
		m.otherReqs = append(m.otherReqs, r.Method+" "+r.URL.Path)
		m.mu.Unlock()
		if r.Method == http.MethodGet && r.URL.Path == "/v1/models" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"mock"}]}`)
			return
		}
		mockError(w, http.StatusNotFound, "mock: no route "+r.Method+" "+r.URL.Path)
		return
	}

	rec := upstreamReq{Turn: -1, Body: body, Step: -1}
	if s := r.Header.Get(turnHeader); s != "" {
		rec.Turn, _ = strconv.Atoi(s)
	}
	var v mockView
	if err := json.Unmarshal(body, &v); err != nil || len(v.Messages) == 0 {
		rec.Status = http.StatusBadRequest
		rec.Problems = append(rec.Problems, fmt.Sprintf("bad chat body: %v", err))
		m.record(rec)
		mockError(w, http.StatusBadRequest, "mock: bad chat body")
		return
	}
	rec.Stream = v.Stream
	switch {
	case v.MaxCompletionTokens != nil:
		rec.MaxTokens, rec.MaxField = *v.MaxCompletionTokens, "max_completion_tokens"
	case v.MaxTokens != nil:
		rec.MaxTokens, rec.MaxField = *v.MaxTokens, "max_tokens"
	}
	// A summarize call: compactproxy's own request (no turn header: the
	// summarizer sends the client's credentials only), or one forbidding
	// tools (DESIGN: a summarize request that extends the agent's prefix
	// carries its tools with tool_choice none). An agent request without
	// tools is the agent's own side request (Aux: opencode's title
	// request). A script turn that reaches the mock only in either shape is
	// reported by the test as a turn never forwarded.
	rec.Summarize = rec.Turn < 0 || (len(v.Tools) > 0 && string(bytes.TrimSpace(v.ToolChoice)) == `"none"`)
	rec.SelfCompact = !rec.Summarize && selfCompactChat(&v, m.prompt)
	rec.Aux = !rec.Summarize && !rec.SelfCompact && len(v.Tools) == 0
	rec.Pairing, err = pairingOf(body)
	if err != nil {
		rec.Problems = append(rec.Problems, "internal/chat cannot parse the body: "+err.Error())
	}
	rec.Prompt = int(float64(len(body))/m.rate) + 1

	rendered := renderPrompt(body)
	m.mu.Lock()
	kind := "agent"
	switch {
	case rec.Summarize:
		kind = "summarize"
	case rec.SelfCompact:
		kind = "selfcompact"
	case rec.Aux:
		kind = "aux"
	}
	prev := m.prevPrompt[kind]
	m.prevPrompt[kind] = rendered
	m.seq++
	id := fmt.Sprintf("chatcmpl-agent-%d", m.seq)
	m.mu.Unlock()
	common := 0
	for common < len(prev) && common < len(rendered) && prev[common] == rendered[common] {
		common++
	}
	rec.Cached = min(int(float64(common)/m.rate), rec.Prompt)
	usage := map[string]any{
		"prompt_tokens": rec.Prompt, "completion_tokens": 24, "total_tokens": rec.Prompt + 24,
		"prompt_tokens_details": map[string]any{"cached_tokens": rec.Cached},
	}
	includeUsage := v.StreamOptions != nil && v.StreamOptions.IncludeUsage

	if rec.Prompt > m.window {
		rec.Status = http.StatusBadRequest
		m.record(rec)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"error":{"code":400,"message":"request (%d tokens) exceeds the available context size (%d tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}`,
			rec.Prompt, m.window, rec.Prompt, m.window)
		return
	}

	if rec.Summarize || rec.Aux || rec.SelfCompact {
		rec.Status = http.StatusOK
		m.record(rec)
		text := summaryText
		switch {
		case rec.Aux:
			text = auxText
		case rec.SelfCompact:
			text = selfSummaryText
		}
		if v.Stream {
			streamAnswer(w, id, v.Model, includeUsage, usage, []string{text}, nil)
		} else {
			jsonAnswer(w, id, v.Model, map[string]any{"role": "assistant", "content": text}, "stop", usage)
		}
		return
	}

	steps, err := m.script(&v)
	if err != nil {
		rec.Status = http.StatusBadRequest
		rec.Problems = append(rec.Problems, err.Error())
		m.record(rec)
		mockError(w, http.StatusBadRequest, "mock: "+err.Error())
		return
	}
	step, problems := m.stepOf(&v, steps)
	rec.Problems = append(rec.Problems, problems...)
	if step < 0 || step >= len(steps) {
		rec.Status = http.StatusBadRequest
		m.record(rec)
		mockError(w, http.StatusBadRequest, "mock: cannot tell the script step from the last message")
		return
	}
	calls, ids := steps[step], func(k int) string { return callID(step, k) }
	if m.edit {
		var texts, trailing []string
		for _, msg := range v.Messages {
			if msg.Role == "tool" {
				texts = append(texts, chatText(msg.Content))
			}
		}
		for i := len(v.Messages) - 1; i >= 0 && v.Messages[i].Role == "tool"; i-- {
			trailing = append(trailing, v.Messages[i].ToolCallID)
		}
		if rr := rereadNeeded(m.dir, "call", step, steps, texts, trailing); rr != nil {
			m.mu.Lock()
			m.rereads[step] = true
			m.mu.Unlock()
			calls, ids = []scriptCall{*rr}, func(int) string { return rereadID("call", step) }
		}
	}
	rec.Step, rec.Status = step, http.StatusOK
	m.record(rec)
	if len(calls) > 0 {
		m.mu.Lock()
		answered := step
		if m.rereads[step] && calls[0].Edits == "" && steps[step][0].Edits != "" {
			answered = step - 1 // a re-read: the edit is still to come
		}
		m.lastAnswered = max(m.lastAnswered, answered)
		m.mu.Unlock()
	}
	if len(calls) == 0 {
		pieces := []string{m.finalText[:len(m.finalText)/2], m.finalText[len(m.finalText)/2:]}
		if v.Stream {
			streamAnswer(w, id, v.Model, includeUsage, usage, pieces, nil)
		} else {
			jsonAnswer(w, id, v.Model, map[string]any{"role": "assistant", "content": m.finalText}, "stop", usage)
		}
		return
	}
	if v.Stream {
		streamAnswer(w, id, v.Model, includeUsage, usage, nil, ids, calls...)
		return
	}
	var tcs []any
	for k, c := range calls {
		tcs = append(tcs, map[string]any{"id": ids(k), "type": "function",
			"function": map[string]any{"name": c.Tool, "arguments": c.Args}})
	}
	jsonAnswer(w, id, v.Model, map[string]any{"role": "assistant", "content": nil, "tool_calls": tcs}, "tool_calls", usage)
}

// stepOf tells which step to answer: 0 after the task itself, step+1 after
// the tool results of step's calls. It checks that those results hold what
// the calls were expected to return.
func (m *mockModel) stepOf(v *mockView, steps [][]scriptCall) (int, []string) {
	msgs := v.Messages
	last := msgs[len(msgs)-1]
	switch last.Role {
	case "user":
		m.mu.Lock()
		resume := max(m.lastResults, m.lastAnswered) + 1
		m.mu.Unlock()
		if resume > 0 && (m.edit || m.resumable) {
			// The agent goes on after compacting its own history (a
			// summary and a user message, no tool result to tell by).
			return resume, nil
		}
		if !bytes.Contains(last.Content, []byte(m.prompt)) {
			return -1, []string{"the last message is a user message but not the task"}
		}
		return 0, nil
	case "tool":
	default:
		return -1, []string{"the last message has role " + last.Role}
	}
	var problems []string
	step := -1
	seen := map[int]bool{}
	for i := len(msgs) - 1; i >= 0 && msgs[i].Role == "tool"; i-- {
		if s, ok := parseReread("call", msgs[i].ToolCallID); ok {
			// The mock's own re-read before step s: step s comes again.
			if s >= len(steps) || len(steps[s]) == 0 {
				return -1, []string{"re-read result for an unknown step " + msgs[i].ToolCallID}
			}
			if f := steps[s][0].Edits; !strings.Contains(chatText(msgs[i].Content), fileMarker(m.files, f)) && !readDeduped(chatText(msgs[i].Content)) {
				problems = append(problems, fmt.Sprintf("the re-read %s of %s lacks its marker", msgs[i].ToolCallID, f))
			}
			return s, problems
		}
		var s, k int
		if _, err := fmt.Sscanf(msgs[i].ToolCallID, "call_s%d_%d", &s, &k); err != nil {
			return -1, []string{"a tool result answers a call the mock did not make: " + msgs[i].ToolCallID}
		}
		if step >= 0 && s != step {
			problems = append(problems, fmt.Sprintf("the trailing tool results answer steps %d and %d", step, s))
		}
		step = s
		if s >= len(steps) || k >= len(steps[s]) {
			return -1, []string{"tool result for an unknown call " + msgs[i].ToolCallID}
		}
		seen[k] = true
		if want := steps[s][k].Expect; !bytes.Contains(msgs[i].Content, []byte(want)) && !readDeduped(chatText(msgs[i].Content)) {
			problems = append(problems, fmt.Sprintf("the result of %s (%s %s) lacks %q: the agent did not run the call as asked",
				msgs[i].ToolCallID, steps[s][k].Tool, steps[s][k].Args, want))
		}
	}
	if step >= 0 && len(seen) != len(steps[step]) {
		problems = append(problems, fmt.Sprintf("step %d made %d calls, %d answered at the end of the request", step, len(steps[step]), len(seen)))
	}
	m.mu.Lock()
	m.lastResults = max(m.lastResults, step)
	m.mu.Unlock()
	return step + 1, problems
}

func (m *mockModel) record(r upstreamReq) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reqs = append(m.reqs, r)
}

func mockError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "code": nil}})
}

func jsonAnswer(w http.ResponseWriter, id, model string, msg map[string]any, finish string, usage map[string]any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"id": id, "object": "chat.completion", "created": time.Now().Unix(), "model": model,
		"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": finish, "logprobs": nil}},
		"usage":   usage,
	})
}

// streamAnswer writes an SSE answer, one flush per event: text pieces, or
// tool calls (each call's arguments split in two deltas, as real servers
// stream them), then the finish reason, the usage-only chunk when asked
// for, and [DONE].
func streamAnswer(w http.ResponseWriter, id, model string, includeUsage bool, usage map[string]any, text []string, ids func(int) string, calls ...scriptCall) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	chunk := func(choices []any, u map[string]any) {
		c := map[string]any{"id": id, "object": "chat.completion.chunk", "created": time.Now().Unix(), "model": model, "choices": choices}
		if includeUsage {
			c["usage"] = nil
			if u != nil {
				c["usage"] = u
			}
		}
		b, _ := json.Marshal(c)
		fmt.Fprintf(w, "data: %s\n\n", b)
		w.(http.Flusher).Flush()
	}
	delta := func(d map[string]any, finish any) {
		chunk([]any{map[string]any{"index": 0, "delta": d, "finish_reason": finish}}, nil)
	}
	if len(calls) == 0 {
		delta(map[string]any{"role": "assistant", "content": ""}, nil)
		for _, p := range text {
			delta(map[string]any{"content": p}, nil)
		}
		delta(map[string]any{}, "stop")
	} else {
		delta(map[string]any{"role": "assistant", "content": nil}, nil)
		for k, c := range calls {
			half := len(c.Args) / 2
			delta(map[string]any{"tool_calls": []any{map[string]any{"index": k, "id": ids(k), "type": "function",
				"function": map[string]any{"name": c.Tool, "arguments": c.Args[:half]}}}}, nil)
			delta(map[string]any{"tool_calls": []any{map[string]any{"index": k,
				"function": map[string]any{"arguments": c.Args[half:]}}}}, nil)
		}
		delta(map[string]any{}, "tool_calls")
	}
	if includeUsage {
		chunk([]any{}, usage)
	}
	io.WriteString(w, "data: [DONE]\n\n")
	w.(http.Flusher).Flush()
}
