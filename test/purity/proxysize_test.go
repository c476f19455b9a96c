package purity

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// proxyLineBudget is what internal/proxy may hold: HTTP only (routes,
// stages, answers, auth, access log, health, admin, pass-through). At 5,214
// lines it did five jobs (the upstream client, the wire rules, conversation
// identity, summary orchestration and HTTP); work that is not HTTP belongs
// in internal/upstream, internal/wire, internal/identity or internal/driver.
const proxyLineBudget = 2500

// TestProxyDoesHTTPOnly keeps internal/proxy within its line budget, so a
// job that is not HTTP grows a package of its own instead.
func TestProxyDoesHTTPOnly(t *testing.T) {
	files, err := filepath.Glob("../../internal/proxy/*.go")
	if err != nil {
		t.Fatal(err)
	}
	lines := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		lines += bytes.Count(b, []byte("\n"))
	}
	if lines == 0 {
		t.Fatal("no internal/proxy sources found")
	}
	if lines > proxyLineBudget {
		t.Errorf("internal/proxy has %d non-test lines, over its budget of %d: move what is not HTTP to the package that owns it", lines, proxyLineBudget)
	}
}
