// Package purity keeps the pure core pure: internal/chat, pairing, anchor,
// compaction and the wire rules import the standard library and each
// other only (CRAFT habits 1 and 31), so they stay testable with plain
// tables and fuzzing.
package purity

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/compactproxy/compactproxy/"

var pure = []string{"internal/chat", "internal/pairing", "internal/anchor", "internal/compaction", "internal/wire"}

func TestPureCoreImportsOnlyStdAndSiblings(t *testing.T) {
	allowed := map[string]bool{}
	for _, p := range pure {
		allowed[module+p] = true
	}
	for _, p := range pure {
		out, err := exec.Command("go", "list", "-deps", "-f", "{{.Standard}} {{.ImportPath}}", "../../"+p).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", p, err, out)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			std, dep, _ := strings.Cut(line, " ")
			if std == "true" {
				// Decisions, not I/O: no HTTP, no logging in the core.
				if dep == "net/http" || dep == "log" || dep == "log/slog" {
					t.Errorf("%s depends on %s: the pure core does no HTTP or logging", p, dep)
				}
				continue
			}
			if !allowed[dep] {
				t.Errorf("%s depends on %s: the pure core may import only the standard library and %v", p, dep, pure)
			}
		}
	}
}
