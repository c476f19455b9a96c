package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// closedPort returns a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// apiError is OpenAI's error envelope body (wire.OpenAIError writes it).
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// envelope decodes OpenAI's error envelope; it fails the test for
// anything else.
func envelope(t *testing.T, b []byte) apiError {
	t.Helper()
	var e struct {
		Error *apiError `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("not an OpenAI error envelope: %q", b)
	}
	return *e.Error
}

// logText flattens every observed log entry (message and fields) to text.
func logText(logs *observer.ObservedLogs) string {
	var sb strings.Builder
	for _, e := range logs.All() {
		sb.WriteString(e.Message)
		for k, v := range e.ContextMap() {
			fmt.Fprintf(&sb, " %s=%v", k, v)
		}
		sb.WriteByte('\n')
	}
	return sb.String()
}

// An upstream failure reaches the client, /readyz and the log as a fixed
// text per class: never the URL's userinfo or query, the upstream's address
// or a Go error string (issue 9 item 6).
func TestUpstreamFailureTextIsFixed(t *testing.T) {
	tlsUp := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	tlsUp.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake failures are the point
	tlsUp.StartTLS()
	t.Cleanup(tlsUp.Close)
	tlsAddr := strings.TrimPrefix(tlsUp.URL, "https://")
	dead := closedPort(t)
	cases := []struct {
		name, url, addr, code, text string
	}{
		{"dial refused", "http://user:s3cret@" + dead + "/v1?token=q1w2", dead, "upstream_unreachable", "upstream unreachable"},
		{"TLS unknown authority", "https://user:s3cret@" + tlsAddr + "/v1?token=q1w2", tlsAddr, "upstream_tls_error", "upstream TLS error"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig("")
			cfg.Upstream.URL = tc.url
			p := newTestProxy(t, cfg)
			resp := p.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
			b := readAll(t, resp)
			if resp.StatusCode != http.StatusBadGateway {
				t.Errorf("status %d, want 502", resp.StatusCode)
			}
			e := envelope(t, b)
			if e.Code == nil || *e.Code != tc.code || e.Message != "compactproxy: "+tc.text {
				t.Errorf("envelope %+v, want code %s and fixed text %q", e, tc.code, tc.text)
			}
			ready, err := http.Get(p.URL + "/readyz")
			if err != nil {
				t.Fatal(err)
			}
			rb := readAll(t, ready)
			if ready.StatusCode != http.StatusServiceUnavailable || string(rb) != "not ready: "+tc.text+"\n" {
				t.Errorf("/readyz %d %q", ready.StatusCode, rb)
			}
			logs := logText(p.logs)
			if !strings.Contains(logs, "upstream="+strings.Split(tc.url, ":")[0]+"://"+tc.addr+"/v1/chat/completions") {
				t.Errorf("log does not name the upstream as scheme+host+path:\n%s", logs)
			}
			for _, where := range []struct{ name, text string }{{"client body", string(b)}, {"/readyz", string(rb)}, {"log", logs}} {
				for _, leak := range []string{"s3cret", "user:", "token=", "q1w2", "x509", "dial tcp", "connection refused", "certificate"} {
					if strings.Contains(where.text, leak) {
						t.Errorf("%s carries %q: %s", where.name, leak, where.text)
					}
				}
			}
			if strings.Contains(string(b)+string(rb), tc.addr) {
				t.Errorf("client sees the upstream's address: %s %s", b, rb)
			}
		})
	}
}

// A 3xx from the upstream reaches the client as it is: a followed 301
// turned the chat POST into a GET to another path (issue 9 item 7).
func TestUpstreamRedirectNotFollowed(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.URL.Path == "/v1/chat/completions" {
			http.Redirect(w, r, "/elsewhere", http.StatusMovedPermanently)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	})
	p := newTestProxy(t, testConfig(up.URL))
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"x"}]}`))
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noFollow.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	if resp.StatusCode != http.StatusMovedPermanently || bytes.Contains(b, []byte(`"chat.completion"`)) {
		t.Errorf("client got %d %q, want the upstream's 301", resp.StatusCode, b)
	}
	for _, r := range up.requests() {
		if r.Path != "/v1/chat/completions" || r.Method != http.MethodPost {
			t.Errorf("the proxy followed the redirect: %s %s", r.Method, r.Path)
		}
	}
}

// A pass-through stream the upstream breaks off is aborted by ReverseProxy
// (http.ErrAbortHandler); the access log and metrics still record it,
// without the Go error string ReverseProxy would log.
func TestPassThroughBrokenStreamRecorded(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		sse(w, `{"choices":[{"text":"one"}]}`)
		c, _, _ := w.(http.Hijacker).Hijack()
		c.Close()
	})
	p := newTestProxy(t, testConfig(up.URL))
	resp := p.post(t, "/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Fatalf("pass-through stream ended cleanly after the upstream broke it off: %q", b)
	}
	waitFor(t, func() bool { return counter(t, p.reg, "compactproxy_stream_aborts_total", nil) == 1 })
	waitFor(t, func() bool {
		return p.logs.FilterMessage("request").FilterField(zap.Bool("aborted", true)).Len() == 1
	})
	if v := counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": "passthrough"}); v != 1 {
		t.Errorf("http_requests_total{passthrough} = %v, want 1", v)
	}
}
