// Package ops checks what deploy/ ships with the real tools: promtool on the
// rules and their unit tests, a real Prometheus scraping the real binary
// under a scripted agent loop (every dashboard query and rule expression
// evaluated through its HTTP API), the Kubernetes manifests against the
// config keys and the HTTP contract, and the Dockerfile's build and
// HEALTHCHECK run without a Docker engine.
//
// promtool and prometheus come from Debian's `prometheus` package, which
// scripts/ops-deps.sh installs (make test runs it). Without them the tests
// that need them skip, except under CI=true, where they fail.
package ops

import (
	"bytes"
	"context"
	"fmt"
	"github.com/compactproxy/compactproxy/test/internal/testproc"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// Shared with the other end-to-end packages (test/internal/testproc).
var (
	skipOrFail = testproc.SkipOrFail
	repoRoot   = testproc.RepoRoot
	freeAddr   = testproc.FreeAddr
)

// lookTool finds a binary of Debian's prometheus package.
func lookTool(name string) (string, error) { return exec.LookPath(name) }

// needTool returns the path of a binary from Debian's prometheus package.
func needTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		skipOrFail(t, "%s is not installed (scripts/ops-deps.sh installs Debian's prometheus package)", name)
	}
	return p
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

func (l *lockedBuffer) tail() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.b.String()
	if len(s) > 4000 {
		s = "..." + s[len(s)-4000:]
	}
	return s
}

// process is a started binary whose output is kept for failure messages.
type process struct {
	name string
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{}
}

// start runs bin with args and env (added to a copy of the environment
// without COMPACTPROXY_* variables) in dir, and stops it (SIGTERM, then
// kill) when the test ends.
func start(t *testing.T, name, dir string, env []string, bin string, args ...string) *process {
	t.Helper()
	p := &process{name: name, out: &lockedBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Dir = dir
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPACTPROXY_") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// waitHTTP polls url until it answers 200, failing when the process exits
// or the deadline passes.
func (p *process) waitHTTP(t *testing.T, url string, within time.Duration) {
	t.Helper()
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(within)
	for {
		select {
		case <-p.done:
			t.Fatalf("%s exited before %s answered:\n%s", p.name, url, p.out.tail())
		default:
		}
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s did not answer 200 within %v (last error %v):\n%s", p.name, url, within, err, p.out.tail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// run runs a short command and returns its combined output.
func run(t *testing.T, dir, bin string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w", filepath.Base(bin), strings.Join(args, " "), err)
	}
	return string(out), nil
}
