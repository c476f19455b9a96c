// Package e2e drives the real compactproxy binary with the official `openai`
// npm SDK (client.mjs) against a Go mock upstream that records what it
// received. It runs under `go test ./...`; it needs node >= 20 and, on a
// fresh machine, npm (scripts/e2e-deps.sh installs the SDK from the
// committed lockfile). Without node/npm it skips, except under CI=true,
// where it fails: CI must run it.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"github.com/compactproxy/compactproxy/test/internal/testproc"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// Shared with the other end-to-end packages (test/internal/testproc).
var (
	skipOrFail  = testproc.SkipOrFail
	repoRoot    = testproc.RepoRoot
	buildBinary = testproc.BuildBinary
	freeAddr    = testproc.FreeAddr
)

// apiKey is the fake key the SDK sends; it must reach the mock unchanged.
const apiKey = "sk-e2e-0123456789abcdef-not-a-real-key"

// clientResult is client.mjs's output.
type clientResult struct {
	OK         bool                       `json:"ok"`
	SDKVersion string                     `json:"sdk_version"`
	Scenarios  map[string]json.RawMessage `json:"scenarios"`
	Failures   []string                   `json:"failures"`
}

// scenarioHeaders is the part of a scenario result the test reads.
type scenarioHeaders struct {
	Headers map[string]string `json:"headers"`
}

// ensureNodeDeps checks node and installs the SDK when needed.
func ensureNodeDeps(t *testing.T, root string) {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		skipOrFail(t, "node is not installed: the npm end-to-end test needs Node.js >= 20 (and npm)")
	}
	if _, err := os.Stat(filepath.Join(root, "test", "e2e", "node_modules", "openai", "package.json")); err != nil {
		if _, err := exec.LookPath("npm"); err != nil {
			skipOrFail(t, "npm is not installed and test/e2e/node_modules is missing: run scripts/e2e-deps.sh on a machine with npm")
		}
	}
	// The script is idempotent and cheap when node_modules matches the lockfile.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "scripts", "e2e-deps.sh"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == 127 {
			skipOrFail(t, "scripts/e2e-deps.sh: %s", bytes.TrimSpace(out))
		}
		t.Fatalf("scripts/e2e-deps.sh: %v\n%s", err, out)
	}
}

// runClient runs client.mjs against baseURL and returns its parsed output.
func runClient(t *testing.T, root, baseURL string) clientResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "client.mjs")
	cmd.Dir = filepath.Join(root, "test", "e2e")
	cmd.Env = append(os.Environ(), "E2E_BASE_URL="+baseURL, "E2E_API_KEY="+apiKey)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	runErr := cmd.Run()
	t.Logf("client.mjs against %s took %v", baseURL, time.Since(start).Round(time.Millisecond))
	var res clientResult
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), &res); err != nil {
		t.Fatalf("client.mjs: %v; output is not its JSON result (%v)\nstdout: %s\nstderr: %s", runErr, err, stdout.Bytes(), stderr.Bytes())
	}
	t.Logf("client.mjs (openai %s): ok=%v", res.SDKVersion, res.OK)
	for _, f := range res.Failures {
		t.Errorf("client.mjs: %s", f)
	}
	if runErr != nil && res.OK {
		t.Errorf("client.mjs exited %v but reported ok", runErr)
	}
	if !res.OK && len(res.Failures) == 0 {
		t.Errorf("client.mjs reported failure without a reason\nstderr: %s", stderr.Bytes())
	}
	return res
}

// findChat returns the recorded chat request with the given scenario marker
// whose last message has role lastRole.
func findChat(t *testing.T, reqs []recorded, marker, lastRole string) (recorded, map[string]any) {
	t.Helper()
	for _, r := range reqs {
		var v chatView
		if json.Unmarshal(r.Body, &v) != nil || len(v.Messages) == 0 {
			continue
		}
		if v.marker() == marker && v.Messages[len(v.Messages)-1].Role == lastRole {
			var m map[string]any
			if err := json.Unmarshal(r.Body, &m); err != nil {
				t.Fatal(err)
			}
			return r, m
		}
	}
	t.Fatalf("the upstream received no chat request for [e2e:%s] ending with role %q", marker, lastRole)
	return recorded{}, nil
}

// TestOpenAISDK runs client.mjs twice: against the mock directly (which
// checks the script and the mock, and records what the SDK itself sends),
// then through the real binary, comparing what the upstream received.
func TestOpenAISDK(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end test: skipped with -short")
	}
	root := repoRoot(t)
	ensureNodeDeps(t, root)

	// 1. The SDK straight at the mock: the reference for what a client sends.
	direct := newMockUpstream(t)
	if res := runClient(t, root, direct.baseURL()); !res.OK {
		t.Fatalf("client.mjs fails against the mock itself: fix the script or the mock before blaming the proxy")
	}
	directReqs := direct.chats()

	// 2. The same client through the real binary.
	mock := newMockUpstream(t)
	bin := buildBinary(t, root)
	proxy := startProxy(t, bin, mock.baseURL())
	res := runClient(t, root, proxy.URL+"/v1")

	reqs := mock.chats()
	if len(reqs) != len(directReqs) {
		t.Errorf("upstream received %d chat requests through the proxy, %d directly (retries or extra calls?)", len(reqs), len(directReqs))
	}

	t.Run("authorization_passes_through", func(t *testing.T) {
		for i, r := range reqs {
			if got := r.Header.Get("Authorization"); got != "Bearer "+apiKey {
				t.Errorf("chat request %d: upstream Authorization = %q, want the client's bearer key unchanged", i, got)
			}
		}
	})

	t.Run("plain_body_forwarded_as_sent", func(t *testing.T) {
		_, want := findChat(t, directReqs, "plain", "user")
		r, got := findChat(t, reqs, "plain", "user")
		if !reflect.DeepEqual(got, want) {
			t.Errorf("forwarded body differs from what the SDK sent:\n got %s\nwant %s", r.Body, mustJSON(want))
		}
		for _, lit := range []string{`"temperature":0`, `"cache_prompt":true`} {
			if !bytes.Contains(r.Body, []byte(lit)) {
				t.Errorf("forwarded body lost %s: %s", lit, r.Body)
			}
		}
	})

	t.Run("stream_usage_injected_and_hidden", func(t *testing.T) {
		_, want := findChat(t, directReqs, "stream", "user")
		r, got := findChat(t, reqs, "stream", "user")
		so, _ := got["stream_options"].(map[string]any)
		if so["include_usage"] != true {
			t.Errorf("stream without usage: upstream stream_options = %v, want include_usage injected (upstream.stream_usage auto)", got["stream_options"])
		}
		delete(got, "stream_options")
		if !reflect.DeepEqual(got, want) {
			t.Errorf("forwarded stream body differs beyond stream_options:\n got %s\nwant %s", r.Body, mustJSON(want))
		}
		// client.mjs already failed if a usage chunk reached it.
	})

	t.Run("tool_round_trip_reaches_upstream", func(t *testing.T) {
		for _, tc := range []struct{ marker, id string }{{"tool", toolCallID}, {"stream_tool", streamToolCallID}} {
			_, want := findChat(t, directReqs, tc.marker, "tool")
			r, got := findChat(t, reqs, tc.marker, "tool")
			var v struct {
				Messages []struct {
					Role       string `json:"role"`
					Content    any    `json:"content"`
					ToolCallID string `json:"tool_call_id"`
					ToolCalls  []struct {
						ID string `json:"id"`
					} `json:"tool_calls"`
				} `json:"messages"`
				Tools []any `json:"tools"`
			}
			if err := json.Unmarshal(r.Body, &v); err != nil {
				t.Fatal(err)
			}
			n := len(v.Messages)
			if n < 2 || v.Messages[n-1].Role != "tool" || v.Messages[n-1].ToolCallID != tc.id || v.Messages[n-1].Content != toolResult {
				t.Errorf("%s: upstream's last message is not the tool answer for %s with its content: %s", tc.marker, tc.id, r.Body)
			} else if a := v.Messages[n-2]; a.Role != "assistant" || len(a.ToolCalls) != 1 || a.ToolCalls[0].ID != tc.id {
				t.Errorf("%s: the tool answer does not directly follow the assistant call %s: %s", tc.marker, tc.id, r.Body)
			}
			if len(v.Tools) != 1 {
				t.Errorf("%s: tools not forwarded: %s", tc.marker, r.Body)
			}
			// The stream_tool second request streams without usage: the
			// proxy injects stream_options; everything else is as sent.
			if tc.marker == "stream_tool" {
				delete(got, "stream_options")
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s: forwarded body differs from what the SDK sent:\n got %s\nwant %s", tc.marker, r.Body, mustJSON(want))
			}
		}
	})

	t.Run("response_headers", func(t *testing.T) {
		for _, name := range []string{"plain", "stream", "tool"} {
			var sc scenarioHeaders
			if raw, ok := res.Scenarios[name]; !ok || json.Unmarshal(raw, &sc) != nil {
				t.Errorf("%s: no scenario result", name)
				continue
			}
			if got := sc.Headers["x-compactproxy-compaction"]; got != "none" {
				t.Errorf("%s: X-Compactproxy-Compaction = %q, want none", name, got)
			}
			if sc.Headers["x-request-id"] == "" {
				t.Errorf("%s: no X-Request-Id in the response", name)
			}
		}
		var sc scenarioHeaders
		json.Unmarshal(res.Scenarios["stream"], &sc)
		if ct := sc.Headers["content-type"]; !strings.HasPrefix(ct, "text/event-stream") {
			t.Errorf("stream: Content-Type = %q, want text/event-stream", ct)
		}
	})

	t.Run("sigterm_exits_zero", func(t *testing.T) {
		if err := proxy.Stop(10 * time.Second); err != nil {
			t.Errorf("after SIGTERM: %v", err)
		}
	})
	if t.Failed() {
		t.Logf("proxy log (tail):\n%s", proxy.LogTail())
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// proxyProc is a running compactproxy binary (testproc.StartProxy).
type proxyProc = testproc.Proxy

// startProxy runs the binary configured by environment alone, with a
// 131,072-token window unless extra says otherwise; extra env entries
// (KEY=value) win.
func startProxy(t *testing.T, bin, upstream string, extra ...string) *proxyProc {
	t.Helper()
	return testproc.StartProxy(t, bin, upstream, append([]string{"COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=131072"}, extra...)...)
}
