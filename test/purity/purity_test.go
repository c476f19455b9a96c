// Package purity keeps the pure core pure: internal/chat, pairing, anchor,
// compaction, seal and the wire rules import the standard library and
// each other only (CRAFT habits 1 and 31), so they stay testable with plain
// tables and fuzzing.
package purity

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const module = "github.com/compactproxy/compactproxy/"

var pure = []string{"internal/chat", "internal/pairing", "internal/anchor", "internal/compaction", "internal/seal", "internal/wire"}

// noContext are the pure packages that decide without a context: a
// decision takes its clock and its answers as data, and never waits.
var noContext = map[string]bool{"internal/pairing": true, "internal/anchor": true, "internal/compaction": true, "internal/seal": true, "internal/wire": true}

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
				if dep == "context" && noContext[p] {
					t.Errorf("%s depends on context: the pure core takes its clock and answers as data and never waits", p)
				}
				continue
			}
			if !allowed[dep] {
				t.Errorf("%s depends on %s: the pure core may import only the standard library and %v (no zap, prometheus, viper)", p, dep, pure)
			}
		}
	}
}

// The planner's steps each read on their own: no function of
// internal/compaction (tests aside) is over 80 lines.
func TestPlannerFunctionsAreShort(t *testing.T) {
	const limit = 80
	files, err := filepath.Glob("../../internal/compaction/*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no files: %v", err)
	}
	fs := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fs, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			if n := fs.Position(fd.End()).Line - fs.Position(fd.Pos()).Line + 1; n > limit {
				t.Errorf("%s: %s is %d lines (at most %d)", filepath.Base(f), fd.Name.Name, n, limit)
			}
		}
	}
}
