package proxy

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// send makes one request to the test proxy; hdr is name, value pairs.
func (p *testProxy) send(t *testing.T, method, path, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, p.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp, readAll(t, resp)
}

// Every path under /v1/compactproxy/ is answered by the proxy: 405 for a
// known path with another method, 404 for any other; nothing reaches the
// upstream.
func TestOwnPathsAnsweredByProxy(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	for _, tc := range []struct {
		method, path string
		want         int
		allow        string
	}{
		{"GET", "/v1/compactproxy/preview", 405, "POST"},
		{"GET", "/v1/compactproxy/conversations/", 404, ""},
		{"DELETE", "/v1/compactproxy/conversations/", 404, ""},
		{"PATCH", "/v1/compactproxy/conversations/abc", 405, "GET, DELETE"},
		{"POST", "/v1/compactproxy/unknown", 404, ""},
		{"GET", "/v1/compactproxy", 404, ""},
	} {
		resp, body := p.send(t, tc.method, tc.path, "", "Authorization", "Bearer sk-a")
		var env struct {
			Error struct{ Message, Code string } `json:"error"`
		}
		if resp.StatusCode != tc.want || json.Unmarshal(body, &env) != nil || !strings.HasPrefix(env.Error.Message, "compactproxy:") {
			t.Errorf("%s %s: %d %s, want %d in OpenAI's envelope", tc.method, tc.path, resp.StatusCode, body, tc.want)
		}
		if tc.allow != "" && resp.Header.Get("Allow") != tc.allow {
			t.Errorf("%s %s: Allow %q, want %q", tc.method, tc.path, resp.Header.Get("Allow"), tc.allow)
		}
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("%d of the proxy's own paths reached the upstream (first %s)", n, up.requests()[0].Path)
	}
}

// An unknown preview dialect is the client's error, naming the parameter;
// the known ones are read as before.
func TestPreviewDialectParam(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	chatBody := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		query string
		want  int
	}{{"?dialect=gemini", 400}, {"?dialect=", 400}, {"?dialect=chat", 200}, {"", 200}} {
		resp, body := p.send(t, "POST", "/v1/compactproxy/preview"+tc.query, chatBody)
		if resp.StatusCode != tc.want {
			t.Errorf("preview%s: %d %s, want %d", tc.query, resp.StatusCode, body, tc.want)
		}
		if tc.want == 400 && !strings.Contains(string(body), `"param":"dialect"`) {
			t.Errorf("preview%s: %s does not name the parameter", tc.query, body)
		}
	}
}

// GET /v1/compactproxy/conversations/{id} shows what compaction stored for
// the caller's conversation, by the opaque id and by the client's own
// header value, and nothing to another tenant; the compaction is logged
// with its conversation and cut, without content.
func TestConversationStateRead(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 6000
	cfg.Compaction.ReserveTokens = 500
	cfg.Compaction.Summarizer.Enabled = false
	p := newTestProxy(t, cfg)
	var msgs []string
	msgs = append(msgs, `{"role":"user","content":"review every file"}`)
	for i := range 8 {
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"cat","arguments":"{}"}}]}`, i),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"call_%d","content":%q}`, i, strings.Repeat(fmt.Sprintf("secret file %d; ", i), 400)))
	}
	msgs = append(msgs, `{"role":"user","content":"continue"}`)
	body := `{"model":"m","messages":[` + strings.Join(msgs, ",") + `]}`
	resp, out := p.send(t, "POST", "/v1/chat/completions", body, "Authorization", "Bearer sk-owner", "X-Session-Id", "sess-1")
	if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Compaction") == "none" {
		t.Fatalf("not compacted: %d %q %s", resp.StatusCode, resp.Header.Get("X-Compactproxy-Compaction"), out)
	}
	id := resp.Header.Get("X-Compactproxy-Conversation-Id")
	for _, ref := range []string{id, "sess-1"} {
		resp, out = p.send(t, "GET", "/v1/compactproxy/conversations/"+ref, "", "Authorization", "Bearer sk-owner")
		var st conversationState
		if resp.StatusCode != 200 || json.Unmarshal(out, &st) != nil {
			t.Fatalf("GET %s: %d %s", ref, resp.StatusCode, out)
		}
		if st.ID != id || len(st.Lineages) != 1 || len(st.Anchors) != 1 || st.Anchors[0].InputTokens != 120 {
			t.Errorf("GET %s: %s, want one lineage and the anchor of the answer (120 input tokens)", ref, out)
		}
		if l := st.Lineages[0]; len(l.Trims)+len(l.Masks)+len(l.Dedupes)+len(l.Drops) == 0 || l.Messages != len(msgs) {
			t.Errorf("GET %s: lineage %+v, want its records (trims, masks, dedupes or drops) at %d messages", ref, l, len(msgs))
		}
		if strings.Contains(string(out), "secret file") {
			t.Errorf("GET %s shows message content: %s", ref, out)
		}
	}
	for _, c := range []struct{ ref, key string }{{id, "sk-other"}, {"sess-1", "sk-other"}, {"sess-2", "sk-owner"}} {
		resp, out = p.send(t, "GET", "/v1/compactproxy/conversations/"+c.ref, "", "Authorization", "Bearer "+c.key)
		if resp.StatusCode != 404 || !strings.Contains(string(out), "conversation_not_found") {
			t.Errorf("GET %s as %s: %d %s, want 404", c.ref, c.key, resp.StatusCode, out)
		}
	}
	// DELETE by the client's own header value too.
	if resp, out = p.send(t, "DELETE", "/v1/compactproxy/conversations/sess-1", "", "Authorization", "Bearer sk-owner"); resp.StatusCode != 200 {
		t.Errorf("DELETE sess-1: %d %s", resp.StatusCode, out)
	}
	if resp, _ = p.send(t, "GET", "/v1/compactproxy/conversations/"+id, "", "Authorization", "Bearer sk-owner"); resp.StatusCode != 404 {
		t.Errorf("GET after DELETE: %d, want 404", resp.StatusCode)
	}
	lines := p.logs.FilterMessage("compaction").All()
	if len(lines) == 0 {
		t.Fatal("no compaction log line")
	}
	f := lines[0].ContextMap()
	if f["conversation"] != id || f["cut"] == nil || f["context_tokens"] == nil || f["forwarded_tokens"] == nil {
		t.Errorf("compaction log fields %v, want the conversation, the cut and the sizes before and after", f)
	}
	for _, e := range p.logs.All() {
		if strings.Contains(fmt.Sprint(e.ContextMap()), "secret file") {
			t.Errorf("log line %q carries message content", e.Message)
		}
	}
}

// A reasoning setting is in the anchors' seed (a usage measured with one is
// no measurement of another) but not in the compaction records': a request
// that changes it keeps its conversation's lineage instead of starting a
// second one from nothing.
func TestReasoningChangeKeepsLineage(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"resp_1","object":"response","status":"completed","model":"m","output":[{"type":"message","id":"m1","role":"assistant","status":"completed","content":[{"type":"output_text","text":"ok","annotations":[]}]}],"usage":{"input_tokens":%d,"output_tokens":2}}`, len(body)/3)
	})
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 6000
	cfg.Compaction.ReserveTokens = 500
	cfg.Compaction.Summarizer.Enabled = false
	p := newTestProxy(t, cfg)
	var items []string
	items = append(items, `{"type":"message","role":"user","content":"review every file"}`)
	for i := range 8 {
		items = append(items,
			fmt.Sprintf(`{"type":"function_call","call_id":"call_%d","name":"cat","arguments":"{}"}`, i),
			fmt.Sprintf(`{"type":"function_call_output","call_id":"call_%d","output":%q}`, i, strings.Repeat(fmt.Sprintf("file %d; ", i), 600)))
	}
	items = append(items, `{"type":"message","role":"user","content":"continue"}`)
	var sources []string
	for _, effort := range []string{"low", "high"} {
		body := `{"model":"m","reasoning":{"effort":"` + effort + `"},"input":[` + strings.Join(items, ",") + `]}`
		resp, out := p.send(t, "POST", "/v1/responses", body, "Authorization", "Bearer sk-a", "X-Compactproxy-Conversation", "c")
		if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Compaction") == "none" {
			t.Fatalf("effort %s: not compacted: %d %q %s", effort, resp.StatusCode, resp.Header.Get("X-Compactproxy-Compaction"), out)
		}
		sources = append(sources, resp.Header.Get("X-Compactproxy-Context-Source"))
	}
	if sources[1] != "local" {
		t.Errorf("the request with another reasoning effort was estimated from %q, want local", sources[1])
	}
	resp, out := p.send(t, "GET", "/v1/compactproxy/conversations/c", "", "Authorization", "Bearer sk-a")
	var st conversationState
	if resp.StatusCode != 200 || json.Unmarshal(out, &st) != nil {
		t.Fatalf("GET: %d %s", resp.StatusCode, out)
	}
	if len(st.Lineages) != 1 {
		t.Errorf("%d lineages after a reasoning change, want the one the conversation had: %s", len(st.Lineages), out)
	}
}
