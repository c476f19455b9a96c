package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func runCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestVersion(t *testing.T) {
	code, out, _ := runCmd(t, "version")
	if code != exitOK {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"compactproxy", version, runtime.Version()} {
		if !strings.Contains(out, want) {
			t.Errorf("version output %q lacks %q", out, want)
		}
	}
}

// Raw secret values used by the redaction tests; none may appear in output.
var secrets = map[string]string{
	"COMPACTPROXY_UPSTREAM_API_KEY":              "sk-upstream-RAW-1",
	"COMPACTPROXY_STORE_TENANT_SECRET":           "tenant-RAW-2",
	"COMPACTPROXY_AUTH_CLIENT_KEYS":              "client-RAW-3,client-RAW-4",
	"COMPACTPROXY_COMPACTION_SUMMARIZER_API_KEY": "sum-RAW-5",
}

func TestConfigCommandRedactsSecrets(t *testing.T) {
	clearEnv(t)
	t.Setenv("COMPACTPROXY_UPSTREAM_URL", "http://127.0.0.1:8080/v1")
	for k, v := range secrets {
		t.Setenv(k, v)
	}
	code, out, errOut := runCmd(t, "config")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, raw := range []string{"sk-upstream-RAW-1", "tenant-RAW-2", "client-RAW-3", "client-RAW-4", "sum-RAW-5", "RAW"} {
		if strings.Contains(out+errOut, raw) {
			t.Errorf("config output contains secret %q:\n%s", raw, out)
		}
	}
	if n := strings.Count(out, "[redacted]"); n != 5 {
		t.Errorf("want 5 [redacted] values (api_key, 2 client keys, summarizer key, tenant_secret), got %d:\n%s", n, out)
	}
	for _, want := range []string{"url: http://127.0.0.1:8080/v1", "min_interval: 1m0s", "trigger_ratio: 0.8"} {
		if !strings.Contains(out, want) {
			t.Errorf("config output lacks %q:\n%s", want, out)
		}
	}
}

func TestConfigCommandReportsProblems(t *testing.T) {
	clearEnv(t)
	t.Setenv("COMPACTPROXY_PAIRING_MODE", "lenient")
	code, out, errOut := runCmd(t, "config", "--upstream-url=")
	if code != exitUsage {
		t.Errorf("exit %d, want %d", code, exitUsage)
	}
	if !strings.Contains(out, "listen:") {
		t.Errorf("effective config not printed: %q", out)
	}
	for _, want := range []string{"upstream.url: required", "pairing.mode: must be one of"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
}

func TestRunUsageErrors(t *testing.T) {
	clearEnv(t)
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown flag", []string{"--nope"}, "unknown flag"},
		{"unknown command", []string{"frobnicate"}, "unknown command"},
		{"extra arguments", []string{"version", "extra"}, "unexpected arguments"},
		{"healthcheck flag on serve", []string{"--url", "http://x/healthz"}, "healthcheck only"},
		{"serve with an empty upstream", []string{"--upstream-url="}, "upstream.url: required"},
		{"serve with bad url flag", []string{"--upstream-url", "localhost:8080"}, "upstream.url: must be an absolute"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errOut := runCmd(t, tc.args...)
			if code != exitUsage {
				t.Errorf("exit %d, want %d", code, exitUsage)
			}
			if !strings.Contains(errOut, tc.want) {
				t.Errorf("stderr %q lacks %q", errOut, tc.want)
			}
		})
	}
	if code, _, _ := runCmd(t, "--help"); code != exitOK {
		t.Errorf("--help: exit %d", code)
	}
}

func TestHealthURL(t *testing.T) {
	tests := []struct{ listen, want string }{
		{":8081", "http://127.0.0.1:8081/healthz"},
		{"0.0.0.0:9000", "http://127.0.0.1:9000/healthz"},
		{"[::]:9000", "http://127.0.0.1:9000/healthz"},
		{"127.0.0.2:9000", "http://127.0.0.2:9000/healthz"},
		{"[::1]:9000", "http://[::1]:9000/healthz"},
		{"localhost:9000", "http://localhost:9000/healthz"},
	}
	for _, tc := range tests {
		got, err := healthURL(tc.listen)
		if err != nil || got != tc.want {
			t.Errorf("healthURL(%q) = %q, %v; want %q", tc.listen, got, err, tc.want)
		}
	}
	if _, err := healthURL("8081"); err == nil {
		t.Error("healthURL(8081): want error")
	}
}

func TestHealthcheck(t *testing.T) {
	clearEnv(t)
	var status atomic.Int32
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(int(status.Load()))
	}))
	defer ts.Close()

	status.Store(http.StatusOK)
	if code, _, errOut := runCmd(t, "healthcheck", "--url", ts.URL+"/healthz"); code != exitOK {
		t.Errorf("healthy: exit %d: %s", code, errOut)
	}
	// Without --url the address comes from listen (here via env).
	t.Setenv("COMPACTPROXY_LISTEN", strings.TrimPrefix(ts.URL, "http://"))
	if code, _, errOut := runCmd(t, "healthcheck"); code != exitOK {
		t.Errorf("healthy via listen: exit %d: %s", code, errOut)
	}
	status.Store(http.StatusServiceUnavailable)
	if code, _, _ := runCmd(t, "healthcheck"); code != exitFail {
		t.Errorf("503: exit %d, want %d", code, exitFail)
	}
	// Nothing listening.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	if code, _, _ := runCmd(t, "healthcheck", "--url", "http://"+addr+"/healthz", "--timeout", "1s"); code != exitFail {
		t.Errorf("unreachable: exit %d, want %d", code, exitFail)
	}
}

// TestServeHTTPDrains: a request in flight when the signal arrives still
// completes; new connections are refused; serveHTTP returns nil.
func TestServeHTTPDrains(t *testing.T) {
	started := make(chan struct{})
	release := make(chan struct{})
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		close(started)
		<-release
		_, _ = io.WriteString(w, "done")
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- serveHTTP(ctx, hs, ln, 5*time.Second, zap.NewNop()) }()

	body := make(chan string, 1)
	go func() {
		resp, err := http.Get("http://" + ln.Addr().String() + "/")
		if err != nil {
			body <- "error: " + err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body <- string(b)
	}()
	<-started
	cancel()
	// Wait until the listener is closed, then let the request finish.
	deadline := time.Now().Add(2 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", ln.Addr().String(), 100*time.Millisecond)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("listener still accepting after shutdown began")
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	if got := <-body; got != "done" {
		t.Errorf("in-flight request: got %q, want done", got)
	}
	if err := <-served; err != nil {
		t.Errorf("serveHTTP: %v", err)
	}
}

// TestServeHTTPShutdownTimeout: a request that outlives shutdown_timeout is
// cut and serveHTTP still returns nil (the process exits 0).
func TestServeHTTPShutdownTimeout(t *testing.T) {
	started := make(chan struct{})
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		close(started)
		<-r.Context().Done()
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- serveHTTP(ctx, hs, ln, 100*time.Millisecond, zap.NewNop()) }()
	go func() {
		resp, err := http.Get("http://" + ln.Addr().String() + "/")
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	<-started
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("serveHTTP: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("serveHTTP did not return after the shutdown timeout")
	}
}

// TestServeLogsNoSecrets runs the real serve path (proxy included) with
// secrets everywhere and checks no log field carries them.
func TestServeLogsNoSecrets(t *testing.T) {
	cfg := config.Default()
	cfg.Listen = "127.0.0.1:0"
	cfg.Upstream.URL = "http://user:url-PASSWORD@127.0.0.1:9/v1?key=query-KEY"
	cfg.Upstream.APIKey = "sk-upstream-RAW-1"
	cfg.Auth.ClientKeys = []config.Secret{"client-RAW-3"}
	cfg.Store.TenantSecret = "tenant-RAW-2"
	cfg.Compaction.Summarizer.APIKey = "sum-RAW-5"

	core, logs := observer.New(zapcore.DebugLevel)
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // start, log, shut down at once
	if err := serve(ctx, cfg, "", zap.New(core)); err != nil {
		t.Fatal(err)
	}
	if logs.FilterMessage("starting").Len() != 1 {
		t.Fatalf("no starting log: %v", logs.All())
	}
	for _, e := range logs.All() {
		line := e.Message + fmt.Sprint(e.ContextMap())
		for _, raw := range []string{"RAW", "url-PASSWORD", "query-KEY", "user"} {
			if strings.Contains(line, raw) {
				t.Errorf("log %q contains %q: %s", e.Message, raw, line)
			}
		}
	}
}

func TestNewLogger(t *testing.T) {
	for _, format := range config.LogFormats {
		var buf bytes.Buffer
		log, err := newLogger(config.Log{Level: "info", Format: format}, zapcore.AddSync(&buf))
		if err != nil {
			t.Fatal(err)
		}
		log.Debug("hidden")
		log.Info("shown", zap.String("k", "v"))
		out := buf.String()
		if strings.Contains(out, "hidden") || !strings.Contains(out, "shown") || !strings.Contains(out, "compactproxy") {
			t.Errorf("%s: %q", format, out)
		}
	}
	if _, err := newLogger(config.Log{Level: "loud", Format: "json"}, zapcore.AddSync(io.Discard)); err == nil {
		t.Error("bad level: want error")
	}
}

// `make run` on a fresh clone, with no variable set: the configuration
// (built-in defaults, or the shipped file that `make run` reads from the
// checkout) is valid, upstream.url is llama-server's default address, and
// serve starts and says at start-up which upstream it uses (issue 20).
func TestRunWithNothingSetServes(t *testing.T) {
	for _, args := range [][]string{nil, {"--config", shippedFile}} {
		t.Run(fmt.Sprint(args), func(t *testing.T) {
			clearEnv(t)
			// Only so the test does not collide with a real :8081.
			t.Setenv("COMPACTPROXY_LISTEN", "127.0.0.1:0")
			ctx, cancel := context.WithCancel(t.Context())
			cancel() // start, log, shut down at once
			var stdout bytes.Buffer
			// Locked: the proxy's background discovery may still log
			// after serve returned.
			stderr := &lockedBuffer{}
			if code := run(ctx, args, &stdout, stderr); code != exitOK {
				t.Fatalf("exit %d: %s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), `"upstream":"http://127.0.0.1:8080/v1"`) {
				t.Errorf("the start-up log does not name the default upstream:\n%s", stderr.String())
			}
		})
	}
}

// lockedBuffer is a bytes.Buffer safe for concurrent writers and readers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// The start-up log says which Redis deployment the state lives in (a
// single node, Sentinel or Cluster), without the URL's password.
func TestStartLogNamesRedisMode(t *testing.T) {
	for _, c := range []struct{ url, mode string }{
		{"redis://:pw-RAW@127.0.0.1:6379/0", "single"},
		{"redis+sentinel://:pw-RAW@127.0.0.1:26379/mymaster", "sentinel"},
		{"rediss+cluster://:pw-RAW@10.0.0.1:6379,10.0.0.2:6379", "cluster"},
	} {
		cfg := config.Default()
		cfg.Store.Backend = "redis"
		cfg.Store.Redis.URL = config.Secret(c.url)
		core, logs := observer.New(zapcore.InfoLevel)
		zap.New(core).Info("starting", startFields(cfg, "", "127.0.0.1:1")...)
		fields := logs.All()[0].ContextMap()
		if got := fields["store_redis_mode"]; got != c.mode {
			t.Errorf("%s: store_redis_mode = %v, want %s", c.url, got, c.mode)
		}
		if strings.Contains(fmt.Sprint(fields), "RAW") {
			t.Errorf("%s: the start log carries the password: %v", c.url, fields)
		}
	}
	// Another backend names no Redis mode.
	core, logs := observer.New(zapcore.InfoLevel)
	zap.New(core).Info("starting", startFields(config.Default(), "", "127.0.0.1:1")...)
	if _, ok := logs.All()[0].ContextMap()["store_redis_mode"]; ok {
		t.Error("store_redis_mode logged for the memory backend")
	}
}
