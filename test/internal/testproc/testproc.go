// Package testproc holds what the end-to-end test packages (test/e2e,
// test/agent, test/llama, test/ops) share to run the real binary: finding
// the repository, building ./cmd/compactproxy, a free loopback port,
// starting and stopping processes (the binary, llama-server), and the
// skip-or-fail rule for missing tools. Go test files cannot be
// imported across packages, so it is an ordinary package under
// test/internal, importable only by the tests.
package testproc

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// SkipOrFail skips with the reason, except under CI=true, where a missing
// tool is a broken CI image and must fail.
func SkipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true: "+format, args...)
	}
	t.Skipf(format, args...)
}

// RepoRoot is the repository root of a test package two levels below it
// (test/<name>).
func RepoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("repo root %s: %v", root, err)
	}
	return root
}

// BuildBinary builds ./cmd/compactproxy (CGO off) into a temporary
// directory and returns its path.
func BuildBinary(t *testing.T, root string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "compactproxy")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/compactproxy")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	start := time.Now()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/compactproxy: %v\n%s", err, out)
	}
	t.Logf("go build ./cmd/compactproxy took %v", time.Since(start).Round(time.Millisecond))
	return bin
}

// FreeAddr returns a 127.0.0.1 address whose port is free right now.
func FreeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
