package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// orphanBody has a tool message answering a call nobody made (index 3 in
// the client's array, UI-only message counted).
const orphanBody = `{"model":"m","messages":[
 {"role":"user","content":"hi"},
 {"role":"assistant","content":"status","ui_only":true},
 {"role":"assistant","content":null,"tool_calls":[{"id":"call_a","type":"function","function":{"name":"ls","arguments":"{}"}}]},
 {"role":"tool","tool_call_id":"call_zz","content":"nope"},
 {"role":"tool","tool_call_id":"call_a","content":"a.go"}]}`

func TestPairingModes(t *testing.T) {
	for _, mode := range []string{"strict", "repair", "off"} {
		t.Run(mode, func(t *testing.T) {
			up := newFakeUpstream(t, nil)
			cfg := testConfig(up.URL)
			cfg.Pairing.Mode = mode
			p := newTestProxy(t, cfg)
			resp := p.post(t, "/v1/chat/completions", orphanBody)
			b := readAll(t, resp)
			if v := counter(t, p.reg, "compactproxy_pairing_violations_total", map[string]string{"kind": "orphan_tool_result"}); v != 1 {
				t.Errorf("pairing_violations_total{orphan_tool_result} = %v", v)
			}
			switch mode {
			case "strict":
				if resp.StatusCode != 400 {
					t.Fatalf("status %d: %s", resp.StatusCode, b)
				}
				var env struct {
					Error struct {
						Message, Type, Param, Code string
					} `json:"error"`
				}
				if err := json.Unmarshal(b, &env); err != nil {
					t.Fatal(err)
				}
				if env.Error.Code != "invalid_tool_pairing" || env.Error.Param != "messages[3]" || env.Error.Type != "invalid_request_error" ||
					!strings.Contains(env.Error.Message, "call_zz") {
					t.Errorf("error body %s", b)
				}
				if n := len(up.requests()); n != 0 {
					t.Errorf("strict mode forwarded %d requests", n)
				}
			case "repair":
				if resp.StatusCode != 200 || resp.Header.Get("X-Compactproxy-Pairing") != "repaired" {
					t.Fatalf("status %d pairing header %q", resp.StatusCode, resp.Header.Get("X-Compactproxy-Pairing"))
				}
				got := up.last(t).Body
				if bytes.Contains(got, []byte("call_zz")) || !bytes.Contains(got, []byte(`"tool_call_id":"call_a"`)) {
					t.Errorf("repaired body: %s", got)
				}
			case "off":
				if resp.StatusCode != 200 || !bytes.Contains(up.last(t).Body, []byte("call_zz")) {
					t.Errorf("off mode did not forward as is: %d", resp.StatusCode)
				}
			}
		})
	}
}

// A 30-message agent conversation grows one step at a time; the upstream
// reports prompt_tokens. Every request that extends an earlier one must be
// estimated from the anchor; an edit, another model or another tenant not.
func TestAnchorHeaders(t *testing.T) {
	up := newFakeUpstream(t, nil) // always reports prompt_tokens 120
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 100000
	p := newTestProxy(t, cfg)
	msgs := []string{`{"role":"system","content":"sys"}`, `{"role":"user","content":"do it"}`}
	body := func(model string, ms []string) string {
		return fmt.Sprintf(`{"model":%q,"messages":[%s]}`, model, strings.Join(ms, ","))
	}
	send := func(b string, key string) *http.Response {
		resp := p.post(t, "/v1/chat/completions", b, "Authorization", "Bearer "+key)
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		return resp
	}
	resp := send(body("m", msgs), "k1")
	if resp.Header.Get("X-Compactproxy-Context-Source") != "local" {
		t.Fatalf("first request source %q", resp.Header.Get("X-Compactproxy-Context-Source"))
	}
	for step := 0; step < 5; step++ {
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":"c%d","type":"function","function":{"name":"cat","arguments":"{}"}}]}`, step),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"c%d","content":"line %d of output"}`, step, step))
		resp = send(body("m", msgs), "k1")
		if src := resp.Header.Get("X-Compactproxy-Context-Source"); src != "anchor" {
			t.Fatalf("step %d: source %q, want anchor", step, src)
		}
		n, _ := strconv.Atoi(resp.Header.Get("X-Compactproxy-Context-Tokens"))
		if n <= 120 {
			t.Errorf("step %d: context tokens %d should be the reported 120 plus the new messages", step, n)
		}
		if resp.Header.Get("X-Compactproxy-Forwarded-Tokens") == "" || resp.Header.Get("X-Compactproxy-Conversation-Id") == "" {
			t.Error("missing forwarded tokens or conversation id header")
		}
	}
	edited := append([]string{msgs[0], `{"role":"user","content":"do it differently"}`}, msgs[2:]...)
	cases := []struct{ name, body, key string }{
		{"edited earlier message", body("m", edited), "k1"},
		{"other model", body("other", msgs), "k1"},
		{"other tenant", body("m", msgs), "k2"},
		{"anonymous", body("m", msgs), ""},
	}
	for _, tc := range cases {
		req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(tc.body))
		if tc.key != "" {
			req.Header.Set("Authorization", "Bearer "+tc.key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		if src := resp.Header.Get("X-Compactproxy-Context-Source"); src != "local" {
			t.Errorf("%s: source %q, want local", tc.name, src)
		}
	}
	if v := counter(t, p.reg, "compactproxy_anchor_lookups_total", map[string]string{"result": "hit"}); v != 5 {
		t.Errorf("anchor hits = %v, want 5", v)
	}
}

// A streamed response records its anchor, and a request sent as soon as the
// stream ended sees it. (That the report comes before [DONE] is written is
// proven deterministically by TestUsageReportedBeforeDone; at this level the
// handler always finishes before the client reads EOF.)
func TestStreamedResponseAnchorsNextRequest(t *testing.T) {
	up := streamingUpstream(t)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 100000
	p := newTestProxy(t, cfg)
	first := `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`
	for i := 0; i < 20; i++ {
		readAll(t, p.post(t, "/v1/chat/completions", first, "X-Compactproxy-Conversation", fmt.Sprint("c", i)))
		next := `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"hi"},{"role":"user","content":"more"}]}`
		resp := p.post(t, "/v1/chat/completions", next, "X-Compactproxy-Conversation", fmt.Sprint("c", i))
		readAll(t, resp)
		if src := resp.Header.Get("X-Compactproxy-Context-Source"); src != "anchor" {
			t.Fatalf("iteration %d: source %q, want anchor", i, src)
		}
	}
}

func TestPreviewIsADryRun(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 100000
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/compactproxy/preview", `{"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y","ui_only":true}]}`)
	b := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var pr previewResponse
	if err := json.Unmarshal(b, &pr); err != nil {
		t.Fatal(err)
	}
	if len(pr.Messages) != 1 || pr.Action != "none" || pr.Window != 100000 || pr.Budget != 100000-4096 || pr.ContextSource != "local" || pr.ContextTokens <= 0 {
		t.Errorf("preview %+v", pr)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("preview called the upstream %d times", n)
	}
	if v := counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": "preview", "code": "200"}); v != 1 {
		t.Errorf("preview route counted %v", v)
	}
}

func TestForgetConversationIsPerTenant(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 100000
	p := newTestProxy(t, cfg)
	resp := p.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, "Authorization", "Bearer k1")
	readAll(t, resp)
	id := resp.Header.Get("X-Compactproxy-Conversation-Id")
	del := func(key string) int {
		req, _ := http.NewRequest(http.MethodDelete, p.URL+"/v1/compactproxy/conversations/"+id, nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		return resp.StatusCode
	}
	if c := del("k2"); c != 404 {
		t.Fatalf("another tenant deleted the conversation: %d", c)
	}
	if c := del("k1"); c != 200 {
		t.Fatalf("owner delete: %d", c)
	}
	if c := del("k1"); c != 404 {
		t.Fatalf("second delete: %d", c)
	}
}
