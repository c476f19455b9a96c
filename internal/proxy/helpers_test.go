package proxy

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// recorded is one request the fake upstream received.
type recorded struct {
	Method string
	Path   string
	Query  string
	Header http.Header
	Body   []byte
}

// fakeUpstream is an httptest upstream that records what it received and
// answers with a scripted handler.
type fakeUpstream struct {
	*httptest.Server
	mu     sync.Mutex
	reqs   []recorded
	handle func(w http.ResponseWriter, r *http.Request, body []byte)
}

func newFakeUpstream(t *testing.T, handle func(w http.ResponseWriter, r *http.Request, body []byte)) *fakeUpstream {
	t.Helper()
	f := &fakeUpstream{handle: handle}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.reqs = append(f.reqs, recorded{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Clone(), body})
		f.mu.Unlock()
		if f.handle != nil {
			f.handle(w, r, body)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeUpstream) requests() []recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recorded(nil), f.reqs...)
}

func (f *fakeUpstream) last(t *testing.T) recorded {
	t.Helper()
	r := f.requests()
	if len(r) == 0 {
		t.Fatal("upstream received nothing")
	}
	return r[len(r)-1]
}

const okCompletion = `{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":120,"completion_tokens":5,"total_tokens":125,"prompt_tokens_details":{"cached_tokens":100}}}`

// testProxy is a running compactproxy in front of a fake upstream.
type testProxy struct {
	*httptest.Server
	srv  *Server
	reg  *prometheus.Registry
	logs *observer.ObservedLogs
}

func testConfig(upstreamURL string) config.Config {
	cfg := config.Default()
	cfg.Upstream.URL = upstreamURL + "/v1"
	cfg.Retry.Backoff = time.Millisecond
	cfg.Retry.MaxBackoff = 5 * time.Millisecond
	return cfg
}

func newTestProxy(t *testing.T, cfg config.Config) *testProxy {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	reg := prometheus.NewRegistry()
	srv, err := New(cfg, zap.New(core), reg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { ts.Close(); srv.Close() })
	return &testProxy{Server: ts, srv: srv, reg: reg, logs: logs}
}

func (p *testProxy) post(t *testing.T, path, body string, hdr ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// counter reads a counter's value by labels.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue metric
				}
			}
			if m.Counter != nil {
				return m.Counter.GetValue()
			}
		}
	}
	return 0
}

var _ = bytes.Equal
