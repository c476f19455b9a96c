package agent

// Process helpers: build and run the real binary. Copied from test/e2e (a
// test package cannot import another's _test files); keep them in step.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/compactproxy/compactproxy/test/internal/testproc"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
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

// lockedBuffer collects a process's output; exec writes to it from a
// goroutine while the test may read it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func tail(s string, n int) string {
	if len(s) > n {
		return "...\n" + s[len(s)-n:]
	}
	return s
}

// proxyProc is a running compactproxy binary.
type proxyProc struct {
	url  string
	cmd  *exec.Cmd
	done chan error // receives Wait's result once
	log  *lockedBuffer

	stopOnce sync.Once
	stopErr  error
}

func (p *proxyProc) logTail() string { return tail(p.log.String(), 8000) }

// stop sends SIGTERM and waits up to d for a clean exit (status 0).
func (p *proxyProc) stop(d time.Duration) error {
	p.stopOnce.Do(func() {
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			p.stopErr = fmt.Errorf("signal: %w", err)
		}
		select {
		case err := <-p.done:
			if err != nil {
				p.stopErr = fmt.Errorf("exit: %w", err)
			}
		case <-time.After(d):
			p.cmd.Process.Kill()
			<-p.done
			p.stopErr = fmt.Errorf("did not exit within %v of SIGTERM", d)
		}
	})
	return p.stopErr
}

// startProxy runs the binary configured by environment alone, in an empty
// working directory (so no ./configs/compactproxy.yaml is picked up), and
// waits for /healthz. extra env entries (KEY=value) come last and win.
func startProxy(t *testing.T, bin, upstream string, extra ...string) *proxyProc {
	t.Helper()
	addr := freeAddr(t)
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPACTPROXY_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"COMPACTPROXY_LISTEN="+addr,
		"COMPACTPROXY_UPSTREAM_URL="+upstream,
		"COMPACTPROXY_SHUTDOWN_TIMEOUT=5s",
		"COMPACTPROXY_LOG_LEVEL=info",
	)
	env = append(env, extra...)
	p := &proxyProc{url: "http://" + addr, log: &lockedBuffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin)
	p.cmd.Dir = t.TempDir()
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if err := p.stop(10 * time.Second); err != nil {
			t.Logf("compactproxy stop: %v", err)
		}
	})

	deadline := time.Now().Add(15 * time.Second)
	hc := &http.Client{Timeout: time.Second}
	for {
		select {
		case err := <-p.done:
			p.done <- err // let stop see it
			t.Fatalf("compactproxy exited before serving: %v\n%s", err, p.logTail())
		default:
		}
		resp, err := hc.Get(p.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("compactproxy did not answer /healthz 200 within 15s (last: %v)\n%s", describe(resp, err), p.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func describe(resp *http.Response, err error) string {
	if err != nil {
		return err.Error()
	}
	return resp.Status
}

// metrics reads the proxy's /metrics and returns the sum of every sample
// of the named metric (all label sets), or -1 when it is absent.
func (p *proxyProc) metricSum(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get(p.url + "/metrics")
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
func (p *proxyProc) metricLines(t *testing.T, names ...string) []string {
	t.Helper()
	resp, err := http.Get(p.url + "/metrics")
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
