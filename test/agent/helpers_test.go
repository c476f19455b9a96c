package agent

// Process helpers: build and run the real binary. Copied from test/e2e (a
// test package cannot import another's _test files); keep them in step.

import (
	"bytes"
	"context"
	"errors"
	"github.com/compactproxy/compactproxy/test/internal/testproc"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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

// ensureAgentDeps checks node and installs the agent when needed.
func ensureAgentDeps(t *testing.T, root string) {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		skipOrFail(t, "node is not installed: the real-agent test needs Node.js >= 20.6 (and npm)")
	}
	if _, err := os.Stat(filepath.Join(root, agentCLI)); err != nil {
		if _, err := exec.LookPath("npm"); err != nil {
			skipOrFail(t, "npm is not installed and test/agent/node_modules is missing: run scripts/agent-deps.sh on a machine with npm")
		}
	}
	// The script is idempotent and cheap when node_modules matches the lockfile.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "scripts", "agent-deps.sh"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == 127 {
			skipOrFail(t, "scripts/agent-deps.sh: %s", bytes.TrimSpace(out))
		}
		t.Fatalf("scripts/agent-deps.sh: %v\n%s", err, out)
	}
}

// lockedBuffer collects a process's output (the agent's).
type lockedBuffer = testproc.Buffer

func tail(s string, n int) string { return testproc.Tail(s, n) }

// proxyProc is a running compactproxy binary (testproc.StartProxy).
type proxyProc = testproc.Proxy

// startProxy runs the binary configured by environment alone; extra env
// entries (KEY=value) win.
func startProxy(t *testing.T, bin, upstream string, extra ...string) *proxyProc {
	t.Helper()
	return testproc.StartProxy(t, bin, upstream, extra...)
}

// metrics reads the proxy's /metrics and returns the sum of every sample
// of the named metric (all label sets), or -1 when it is absent.
func metricSum(t *testing.T, p *proxyProc, name string) float64 {
	t.Helper()
	resp, err := http.Get(p.URL + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum, seen := 0.0, false
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			sum, seen = sum+v, true
		}
	}
	if !seen {
		return -1
	}
	return sum
}

// metricLines returns the /metrics lines of the named metric, for logs.
func metricLines(t *testing.T, p *proxyProc, names ...string) []string {
	t.Helper()
	resp, err := http.Get(p.URL + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		for _, n := range names {
			if strings.HasPrefix(line, n+"{") || strings.HasPrefix(line, n+" ") {
				out = append(out, line)
			}
		}
	}
	return out
}
