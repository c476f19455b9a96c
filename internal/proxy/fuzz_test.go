package proxy

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// FuzzChatHandler feeds arbitrary bodies and headers through the whole chat
// handler (auth, body reading, parsing, pairing, compaction, forwarding) and
// checks the contract: no panic; every non-2xx the proxy makes is OpenAI's
// error envelope; a rejected request forwards nothing; an accepted one
// forwards exactly one request.
func FuzzChatHandler(f *testing.F) {
	seeds := []struct {
		body, hk, hv string
		chunked      bool
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "", "", false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, "X-Compactproxy-Conversation", "c1", true},
		{`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"b","content":"x"}]}`, "", "", false},
		{`{"model":"m","messages":[{"role":"user","content":"x","ui_only":true},{"role":"user","content":[{"type":"text","text":"y"}]}]}`, "X-Compactproxy-Bypass", "true", false},
		{`{"model":"m","messages":[]}`, "Content-Type", "text/plain", false},
		{`{"messages":[{"role":"user","content":"` + strings.Repeat("long ", 3000) + `"}],"model":"m","max_tokens":100}`, "Authorization", "Bearer k", false},
		{`[1,2`, "X-Request-Id", "\x00\n", false},
		{`{"model":1e999,"messages":{}}`, "", "", true},
		// Deep nesting in a message (the chat form of a Messages block
		// nesting cache_control deep: quadratic to digest once).
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi","content":` +
			strings.Repeat(`[{"cache_control":{"type":"ephemeral"},"z":1,"content":`, 1000) + `1` + strings.Repeat(`}]`, 1000) + `}]}]}`, "", "", false},
		{"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe \\ud800\"}]}", "", "", false},
	}
	for _, s := range seeds {
		f.Add([]byte(s.body), s.hk, s.hv, s.chunked)
	}
	var forwarded int
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		forwarded++
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(okCompletion))
	}))
	f.Cleanup(up.Close)
	cfg := config.Default()
	cfg.Upstream.URL = up.URL + "/v1"
	cfg.Limits.MaxBodyBytes = 1 << 20
	cfg.Models = []config.Model{{Name: "m", ContextWindow: 4096}} // compaction runs
	cfg.Compaction.Summarizer.Enabled = false                     // trim and drop only: one upstream call per request
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { srv.Close() })
	h := srv.Handler()

	f.Fuzz(func(t *testing.T, body []byte, hk, hv string, chunked bool) {
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
		if chunked {
			req.ContentLength = -1
		}
		req.Header.Set("Content-Type", "application/json")
		if hk != "" {
			req.Header[hk] = []string{hv} // as received, not canonicalized or validated
		}
		before := forwarded
		rec := httptest.NewRecorder()
		// The work per input is bounded: bytes allocated (the proxy's and
		// the mock upstream's, in this process) linear in the body, a
		// measure no slow machine changes. Measured on the seeds: at most
		// ~200 KB for a short body, ~17 bytes per byte for the long ones.
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		h.ServeHTTP(rec, req)
		runtime.ReadMemStats(&m1)
		if a, limit := m1.TotalAlloc-m0.TotalAlloc, uint64(1<<20+256*len(body)); a > limit {
			t.Fatalf("%d bytes allocated for a body of %d bytes (over %d): more than linear work", a, len(body), limit)
		}
		sent := forwarded - before
		if rec.Code >= 200 && rec.Code < 300 {
			if sent != 1 {
				t.Fatalf("status %d with %d upstream requests", rec.Code, sent)
			}
			return
		}
		if sent != 0 {
			t.Fatalf("rejected with %d but %d request(s) forwarded", rec.Code, sent)
		}
		var e struct {
			Error *struct {
				Message string  `json:"message"`
				Type    string  `json:"type"`
				Param   *string `json:"param"`
				Code    *string `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
			t.Fatalf("status %d without an OpenAI envelope: %q", rec.Code, rec.Body.Bytes())
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Fatalf("error answer with Content-Type %q", ct)
		}
	})
}
