package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// recordingUpstream records every request and answers each API with a
// minimal success carrying usage: prompt = len(body)/3 tokens (more tokens
// per byte than the proxy's own estimate). window, when set, decides a
// Messages request's window from its headers; a larger prompt is refused
// with Anthropic's overflow error.
type recordingUpstream struct {
	mu     sync.Mutex
	reqs   []recorded
	window func(h http.Header) int
}

func (u *recordingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.reqs = append(u.reqs, recorded{Method: r.Method, Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
	u.mu.Unlock()
	n := len(body) / 3
	w.Header().Set("Content-Type", "application/json")
	switch r.URL.Path {
	case "/v1/chat/completions":
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":2}}`, n)
	case "/v1/responses":
		fmt.Fprintf(w, `{"id":"resp_1","object":"response","status":"completed","model":"m","output":[{"type":"message","id":"msg_1","role":"assistant","status":"completed","content":[{"type":"output_text","text":"ok","annotations":[]}]}],"usage":{"input_tokens":%d,"output_tokens":2,"total_tokens":%d}}`, n, n+2)
	case "/v1/messages":
		if u.window != nil {
			if max := u.window(r.Header); n > max {
				w.WriteHeader(http.StatusBadRequest)
				fmt.Fprintf(w, `{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: %d tokens > %d maximum"}}`, n, max)
				return
			}
		}
		fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"output_tokens":2}}`, n)
	default:
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `File Not Found`)
	}
}

func (u *recordingUpstream) requests() []recorded {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]recorded(nil), u.reqs...)
}

func (u *recordingUpstream) last(t *testing.T) recorded {
	t.Helper()
	r := u.requests()
	if len(r) == 0 {
		t.Fatal("upstream received nothing")
	}
	return r[len(r)-1]
}

// do sends one request; hdr is name, value pairs set on the header map as
// written (no canonicalization: Codex's session_id keeps its underscore).
func do(t *testing.T, method, url, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header[hdr[i]] = []string{hdr[i+1]}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func startState(t *testing.T, up http.Handler, extra ...string) *proxyProc {
	t.Helper()
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	return startProxy(t, buildBinary(t, repoRoot(t)), srv.URL+"/v1", extra...)
}

// Every path under /v1/compactproxy/ is the proxy's own: an unknown one, or
// a known one with another method, is answered by the proxy in OpenAI's
// envelope and never reaches the upstream with the client's credentials.
func TestOwnPathsNeverForwarded(t *testing.T) {
	up := &recordingUpstream{}
	p := startState(t, up)
	cases := []struct {
		method, path string
		want         int
	}{
		{"GET", "/v1/compactproxy/preview", 405},
		{"PUT", "/v1/compactproxy/preview", 405},
		{"GET", "/v1/compactproxy/conversations/", 404},
		{"DELETE", "/v1/compactproxy/conversations/", 404},
		{"POST", "/v1/compactproxy/conversations/abc", 405},
		{"GET", "/v1/compactproxy/nothing-here", 404},
		{"GET", "/v1/compactproxy/", 404},
		{"GET", "/v1/compactproxy/conversations/abc/extra", 404},
	}
	for _, tc := range cases {
		resp, body := do(t, tc.method, p.URL+tc.path, "", "Authorization", "Bearer sk-client")
		var env struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if resp.StatusCode != tc.want || json.Unmarshal(body, &env) != nil || !strings.HasPrefix(env.Error.Message, "compactproxy:") {
			t.Errorf("%s %s: %d %s, want %d from the proxy in OpenAI's envelope", tc.method, tc.path, resp.StatusCode, body, tc.want)
		}
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("the upstream received %d of the proxy's own paths: %+v", n, up.requests()[0].Path)
	}
	// An unknown preview dialect is the client's error, named.
	resp, body := do(t, "POST", p.URL+"/v1/compactproxy/preview?dialect=gemini", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(string(body), `"param":"dialect"`) {
		t.Errorf("preview?dialect=gemini: %d %s, want 400 naming dialect", resp.StatusCode, body)
	}
}

// Codex sends its session as `session_id` (underscore), which a
// canonicalizing header lookup never finds: two Codex sessions started
// with the same first message are two conversations.
func TestCodexSessionIDHeader(t *testing.T) {
	up := &recordingUpstream{}
	p := startState(t, up)
	body := `{"model":"m","messages":[{"role":"user","content":"fix the failing test"}]}`
	id := func(session string) string {
		resp, b := do(t, "POST", p.URL+"/v1/chat/completions", body, "session_id", session)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		return resp.Header.Get("X-Compactproxy-Conversation-Id")
	}
	a1, b1, a2 := id("codex-session-a"), id("codex-session-b"), id("codex-session-a")
	if a1 == b1 {
		t.Errorf("session_id codex-session-a and codex-session-b share conversation %s", a1)
	}
	if a1 != a2 {
		t.Errorf("one session_id, two conversations: %s, %s", a1, a2)
	}
	if got := up.last(t).Header.Get("session_id"); got != "codex-session-a" {
		t.Errorf("session_id forwarded as %q, want it unchanged", got)
	}
	// The admin read finds it by the client's own value.
	resp, b := do(t, "GET", p.URL+"/v1/compactproxy/conversations/codex-session-a", "")
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"id":"`+a1+`"`) {
		t.Errorf("GET by session_id value: %d %s, want 200 for %s", resp.StatusCode, b, a1)
	}
}

// Repair mode removes a second call that reuses a call_id, in every API:
// what reaches the upstream has one call and one result per id.
func TestRepairRemovesDuplicateCalls(t *testing.T) {
	up := &recordingUpstream{}
	p := startState(t, up, "COMPACTPROXY_PAIRING_MODE=repair")
	count := func(body []byte, sub string) int { return strings.Count(string(body), sub) }

	responses := `{"model":"m","input":[
	 {"type":"message","role":"user","content":"list the files"},
	 {"type":"function_call","call_id":"call_dup","name":"ls","arguments":"{\"dir\":\"a\"}"},
	 {"type":"function_call","call_id":"call_dup","name":"ls","arguments":"{\"dir\":\"b\"}"},
	 {"type":"function_call_output","call_id":"call_dup","output":"a.txt"},
	 {"type":"function_call_output","call_id":"call_dup","output":"b.txt"},
	 {"type":"message","role":"user","content":"now summarize"}]}`
	resp, b := do(t, "POST", p.URL+"/v1/responses", responses)
	if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Pairing") != "repaired" {
		t.Fatalf("responses: %d %q %s", resp.StatusCode, resp.Header.Get("X-Compactproxy-Pairing"), b)
	}
	got := up.last(t).Body
	if n := count(got, `"type":"function_call"`); n != 1 || count(got, `\"dir\":\"b\"`) != 0 {
		t.Errorf("responses: %d function_call items reached the upstream (want 1, the first):\n%s", n, got)
	}
	if n := count(got, `"type":"function_call_output"`); n != 1 || count(got, "b.txt") != 0 {
		t.Errorf("responses: %d function_call_output items reached the upstream, want 1:\n%s", n, got)
	}

	messages := `{"model":"claude","max_tokens":100,"messages":[
	 {"role":"user","content":"list the files"},
	 {"role":"assistant","content":[{"type":"tool_use","id":"toolu_dup","name":"ls","input":{"dir":"a"}},{"type":"tool_use","id":"toolu_dup","name":"ls","input":{"dir":"b"}}]},
	 {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_dup","content":"a.txt"},{"type":"tool_result","tool_use_id":"toolu_dup","content":"b.txt"}]},
	 {"role":"assistant","content":"two files"},
	 {"role":"user","content":"now summarize"}]}`
	resp, b = do(t, "POST", p.URL+"/v1/messages", messages, "anthropic-version", "2023-06-01")
	if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Pairing") != "repaired" {
		t.Fatalf("messages: %d %q %s", resp.StatusCode, resp.Header.Get("X-Compactproxy-Pairing"), b)
	}
	got = up.last(t).Body
	if n := count(got, `"type":"tool_use"`); n != 1 || count(got, `"dir":"b"`) != 0 {
		t.Errorf("messages: %d tool_use blocks reached the upstream (want 1, the first):\n%s", n, got)
	}
	if n := count(got, `"type":"tool_result"`); n != 1 || count(got, "b.txt") != 0 {
		t.Errorf("messages: %d tool_result blocks reached the upstream (want 1, the first):\n%s", n, got)
	}
}

// A usage measured with one reasoning setting is no measurement of the same
// input with another: the prompt-shaping fields of the Responses API are in
// the anchor's seed.
func TestAnchorSeedHasResponsesFields(t *testing.T) {
	up := &recordingUpstream{}
	p := startState(t, up)
	body := func(extra string) string {
		return `{"model":"m",` + extra + `"input":[{"type":"message","role":"user","content":"explain the retry loop in upstream.go"}]}`
	}
	source := func(b string) string {
		resp, out := do(t, "POST", p.URL+"/v1/responses", b, "Authorization", "Bearer sk-seed", "X-Compactproxy-Conversation", "seed")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, out)
		}
		return resp.Header.Get("X-Compactproxy-Context-Source")
	}
	source(body(`"reasoning":{"effort":"low"},`))
	if got := source(body(`"reasoning":{"effort":"low"},`)); got != "anchor" {
		t.Fatalf("the same request again: context source %q, want anchor (the test cannot see a hit)", got)
	}
	for _, other := range []string{
		`"reasoning":{"effort":"high"},`,
		`"text":{"format":{"type":"json_schema","name":"r","schema":{"type":"object"}}},"reasoning":{"effort":"low"},`,
		`"include":["reasoning.encrypted_content"],"reasoning":{"effort":"low"},`,
	} {
		if got := source(body(other)); got != "local" {
			t.Errorf("same input with %s: context source %q, want local (no anchor measured with another setting)", other, got)
		}
	}
}

// One tenant's accepted prompt does not stop another tenant's learning: on
// Anthropic one model name has a 1M window with the context-1m beta and
// 200k without (here 40000 and 8000). Tenant A's 12000-token prompt under
// the beta is accepted; tenant B's prompt of the same size without it is
// refused naming 8000, and B's request is compacted and retried.
func TestWindowLearnedPerTenant(t *testing.T) {
	up := &recordingUpstream{window: func(h http.Header) int {
		if strings.Contains(h.Get("Anthropic-Beta"), "context-1m") {
			return 40000
		}
		return 8000
	}}
	p := startState(t, up,
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=40000",
		"COMPACTPROXY_UPSTREAM_DIALECT=anthropic",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_ENABLED=false",
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=1000",
	)
	body := func(task string) string {
		var msgs []string
		msgs = append(msgs, `{"role":"user","content":`+mustJSON(task)+`}`)
		for i := range 7 {
			id := fmt.Sprintf("toolu_%d", i)
			msgs = append(msgs,
				`{"role":"assistant","content":[{"type":"tool_use","id":"`+id+`","name":"cat","input":{"path":"f`+fmt.Sprint(i)+`.go"}}]}`,
				`{"role":"user","content":[{"type":"tool_result","tool_use_id":"`+id+`","content":`+mustJSON(strings.Repeat(fmt.Sprintf("line %d of a file that was read; ", i), 150))+`}]}`)
		}
		msgs = append(msgs, `{"role":"assistant","content":"read them all"}`, `{"role":"user","content":"now fix the bug"}`)
		return `{"model":"claude-sonnet","max_tokens":1000,"messages":[` + strings.Join(msgs, ",") + `]}`
	}
	a := body("tenant A's task: review the package")
	if n := len(a) / 3; n <= 8000 || n >= 30000 {
		t.Fatalf("the test's prompt is %d tokens; it must be over 8000 and well under 40000", n)
	}
	resp, b := do(t, "POST", p.URL+"/v1/messages", a, "x-api-key", "sk-tenant-a", "anthropic-version", "2023-06-01", "anthropic-beta", "context-1m-2025-08-07")
	if resp.StatusCode != 200 {
		t.Fatalf("tenant A with the 1M beta: %d %s", resp.StatusCode, b)
	}
	resp, b = do(t, "POST", p.URL+"/v1/messages", body("tenant B's task: review the package"), "x-api-key", "sk-tenant-b", "anthropic-version", "2023-06-01")
	if resp.StatusCode != 200 {
		t.Fatalf("tenant B's overflow was not recovered: %d %s\n%s", resp.StatusCode, b, p.LogTail())
	}
	if n := len(up.last(t).Body) / 3; n > 8000 {
		t.Errorf("tenant B's retry is %d tokens, over its 8000 window", n)
	}
	if log := p.Log(); !strings.Contains(log, "context window lowered") || !strings.Contains(log, `"new_window":8000`) {
		t.Errorf("no log line for the window lowered by learning:\n%s", p.LogTail())
	}
}

// GET /v1/compactproxy/conversations/{id} shows the caller's conversation:
// its lineages (what compaction stored) and newest anchors, by the opaque
// id and by the client's own conversation header; another tenant and an
// unknown id get the same 404. Each compaction is logged with the
// conversation and its cut.
func TestConversationAdminRead(t *testing.T) {
	up := &recordingUpstream{}
	p := startState(t, up,
		"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=6000",
		"COMPACTPROXY_COMPACTION_SUMMARIZER_ENABLED=false",
		"COMPACTPROXY_COMPACTION_RESERVE_TOKENS=500",
	)
	var msgs []string
	msgs = append(msgs, `{"role":"user","content":"review every file"}`)
	for i := range 8 {
		id := fmt.Sprintf("call_%d", i)
		msgs = append(msgs,
			`{"role":"assistant","content":null,"tool_calls":[{"id":"`+id+`","type":"function","function":{"name":"cat","arguments":"{}"}}]}`,
			`{"role":"tool","tool_call_id":"`+id+`","content":`+mustJSON(strings.Repeat(fmt.Sprintf("content of file %d; ", i), 300))+`}`)
	}
	msgs = append(msgs, `{"role":"user","content":"continue"}`)
	body := `{"model":"m","messages":[` + strings.Join(msgs, ",") + `]}`
	resp, b := do(t, "POST", p.URL+"/v1/chat/completions", body, "Authorization", "Bearer sk-owner", "X-Compactproxy-Conversation", "my-conv")
	if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Compaction") == "none" {
		t.Fatalf("the request was not compacted: %d %q %s", resp.StatusCode, resp.Header.Get("X-Compactproxy-Compaction"), b)
	}
	id := resp.Header.Get("X-Compactproxy-Conversation-Id")
	type state struct {
		ID       string `json:"id"`
		Object   string `json:"object"`
		Lineages []struct {
			Cut   int `json:"cut"`
			Trims []struct {
				Index int `json:"index"`
			} `json:"trims"`
			Masks   []int `json:"masks"`
			Dedupes []struct {
				Index int `json:"index"`
			} `json:"dedupes"`
			Drops []struct {
				From int `json:"from"`
				To   int `json:"to"`
			} `json:"drops"`
			Latched bool `json:"latched"`
		} `json:"lineages"`
		Anchors []struct {
			Messages    int `json:"messages"`
			InputTokens int `json:"input_tokens"`
		} `json:"anchors"`
	}
	for _, ref := range []string{id, "my-conv"} {
		resp, b = do(t, "GET", p.URL+"/v1/compactproxy/conversations/"+ref, "", "Authorization", "Bearer sk-owner")
		var st state
		if resp.StatusCode != 200 || json.Unmarshal(b, &st) != nil {
			t.Fatalf("GET %s: %d %s", ref, resp.StatusCode, b)
		}
		if st.ID != id || len(st.Lineages) != 1 || len(st.Lineages[0].Trims)+len(st.Lineages[0].Masks)+len(st.Lineages[0].Dedupes)+len(st.Lineages[0].Drops) == 0 || len(st.Anchors) == 0 || st.Anchors[0].InputTokens <= 0 {
			t.Errorf("GET %s: %s, want one lineage with its records (trims, masks, dedupes or drops) and an anchor", ref, b)
		}
		if strings.Contains(string(b), "content of file") {
			t.Errorf("GET %s shows message content: %s", ref, b)
		}
	}
	for _, c := range []struct{ ref, key string }{{id, "sk-other"}, {"my-conv", "sk-other"}, {"0123456789abcdef0123456789abcdef", "sk-owner"}} {
		resp, b = do(t, "GET", p.URL+"/v1/compactproxy/conversations/"+c.ref, "", "Authorization", "Bearer "+c.key)
		if resp.StatusCode != 404 || !strings.Contains(string(b), "conversation_not_found") {
			t.Errorf("GET %s as %s: %d %s, want 404 conversation_not_found", c.ref, c.key, resp.StatusCode, b)
		}
	}
	if n := len(up.requests()); n != 1 {
		t.Errorf("the upstream received %d requests, want the chat request only", n)
	}
	var line map[string]any
	for _, l := range strings.Split(p.Log(), "\n") {
		if strings.Contains(l, `"msg":"compaction"`) {
			_ = json.Unmarshal([]byte(l), &line)
		}
	}
	if line == nil || line["conversation"] != id || line["cut"] == nil || line["context_tokens"] == nil || line["forwarded_tokens"] == nil {
		t.Errorf("compaction log line %v, want conversation %s, cut and the sizes before and after", line, id)
	}
}
