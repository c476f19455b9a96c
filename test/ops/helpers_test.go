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
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/test/internal/testproc"
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

// start runs bin with args and env (added to a copy of the environment
// without COMPACTPROXY_* variables) in dir, and stops it (SIGTERM, then
// kill) when the test ends.
func start(t *testing.T, name, dir string, env []string, bin string, args ...string) *testproc.Process {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPACTPROXY_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	return testproc.Start(t, name, cmd, nil)
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
