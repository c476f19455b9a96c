package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/proxy"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// TestRequestHeadersBounded: request headers are bounded by the server
// compactproxy listens with (DESIGN § Request bodies and abuse:
// MaxHeaderBytes 1 MiB). Headers past the bound, in one header or in many,
// get 431 and nothing reaches the upstream; headers well under it are
// forwarded. The server is the one serve builds (newHTTPServer) in front of
// the real proxy handler.
func TestRequestHeadersBounded(t *testing.T) {
	var forwarded atomic.Int32
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		forwarded.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`)
	}))
	// The upstream itself takes any header size, so whatever the proxy
	// lets through is counted here (not refused by the upstream's own
	// net/http bound).
	up.Config.MaxHeaderBytes = 64 << 20
	up.Start()
	t.Cleanup(up.Close)

	cfg := config.Default()
	cfg.Upstream.URL = up.URL + "/v1"
	cfg.Upstream.ContextWindow = 100000
	p, err := proxy.New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() {
		served <- serveHTTP(ctx, newHTTPServer(p.Handler(), zap.NewNop()), ln, 5*time.Second, zap.NewNop())
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("serveHTTP: %v", err)
		}
		_ = p.Close()
	})

	one := func(n int) string { return "X-Pad: " + strings.Repeat("a", n) + "\r\n" }
	many := func(total int) string {
		var sb strings.Builder
		for i := 0; sb.Len() < total; i++ {
			fmt.Fprintf(&sb, "X-Pad-%d: %s\r\n", i, strings.Repeat("b", 500))
		}
		return sb.String()
	}
	for _, tc := range []struct {
		name    string
		headers string
		status  int
	}{
		{"well under the bound", one(256 << 10), http.StatusOK},
		{"one header past the bound", one(maxHeaderBytes + 64<<10), http.StatusRequestHeaderFieldsTooLarge},
		{"many headers past the bound", many(maxHeaderBytes + 64<<10), http.StatusRequestHeaderFieldsTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := forwarded.Load()
			status := rawChat(t, ln.Addr().String(), tc.headers)
			if status != tc.status {
				t.Errorf("status %d, want %d", status, tc.status)
			}
			n := forwarded.Load() - before
			if tc.status != http.StatusOK && n != 0 {
				t.Errorf("a request with oversized headers reached the upstream (%d requests)", n)
			}
			if tc.status == http.StatusOK && n != 1 {
				t.Errorf("upstream got %d requests, want 1", n)
			}
		})
	}
}

// rawChat sends a chat request with the given extra header lines over a
// raw connection (a Go client would refuse nothing, but a raw write shows
// exactly what the server reads) and returns the response status.
func rawChat(t *testing.T, addr, headers string) int {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	req := "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n" +
		fmt.Sprintf("Content-Length: %d\r\nConnection: close\r\n", len(body)) + headers + "\r\n" + body
	// The server may answer and close before it read everything: write
	// from another goroutine and let that write fail.
	go func() { _, _ = io.WriteString(c, req) }()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}
