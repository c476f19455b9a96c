package ops

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestMakeHelpListsEveryTarget: `make help` names every target of the
// Makefile (a target it omits is one nobody finds).
func TestMakeHelpListsEveryTarget(t *testing.T) {
	root := repoRoot(t)
	mk, err := exec.LookPath("make")
	if err != nil {
		skipOrFail(t, "make is not installed")
	}
	b, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := run(t, root, mk, "-s", "help")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^make ([a-z][a-z0-9-]*)`).FindAllStringSubmatch(out, -1) {
		listed[m[1]] = true
	}
	targets := regexp.MustCompile(`(?m)^([a-z][a-z0-9-]*):([^=]|$)`).FindAllStringSubmatch(string(b), -1)
	if len(targets) < 10 {
		t.Fatalf("found %d targets in the Makefile", len(targets))
	}
	for _, m := range targets {
		if !listed[m[1]] {
			t.Errorf("make help does not list %q", m[1])
		}
	}
}

// TestReadmeNamesWhatMakeTestInstalls: the README's prerequisites name
// every package the dependency scripts `make test` runs install with
// apt-get, and the toolchains they need.
func TestReadmeNamesWhatMakeTestInstalls(t *testing.T) {
	root := repoRoot(t)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, prereq, ok := strings.Cut(string(readme), "\n### Prerequisites\n")
	if !ok {
		t.Fatal(`README.md has no "### Prerequisites" section`)
	}
	prereq, _, _ = strings.Cut(prereq, "\n## ")
	scripts, _ := filepath.Glob(filepath.Join(root, "scripts", "*-deps.sh"))
	if len(scripts) == 0 {
		t.Fatal("no scripts/*-deps.sh")
	}
	install := regexp.MustCompile(`apt-get install[^\n]*?((?:\s+[a-z0-9][a-z0-9.+-]*)+)\s*(?:>|$)`)
	pkgs := 0
	for _, s := range scripts {
		b, err := os.ReadFile(s)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range install.FindAllStringSubmatch(string(b), -1) {
			for _, pkg := range strings.Fields(m[1]) {
				pkgs++
				if !strings.Contains(prereq, "`"+pkg+"`") {
					t.Errorf("%s installs the apt package %s; README's prerequisites do not name it", filepath.Base(s), pkg)
				}
			}
		}
	}
	if pkgs == 0 {
		t.Error("found no apt-get install in scripts/*-deps.sh")
	}
	for _, tool := range []string{"Go 1.26", "Node.js", "npm", "apt-get"} {
		if !strings.Contains(prereq, tool) {
			t.Errorf("README's prerequisites do not name %s", tool)
		}
	}
}

// TestLicense: the repository carries the Apache License 2.0, whole, and
// the README names it.
func TestLicense(t *testing.T) {
	root := repoRoot(t)
	b, err := os.ReadFile(filepath.Join(root, "LICENSE"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	for _, want := range []string{"Apache License", "Version 2.0, January 2004", "http://www.apache.org/licenses/",
		"TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional Liability.",
		"END OF TERMS AND CONDITIONS", "Copyright 2026 The compactproxy authors"} {
		if !strings.Contains(text, want) {
			t.Errorf("LICENSE lacks %q", want)
		}
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "[Apache License 2.0](LICENSE)") {
		t.Error("README.md does not name the license ([Apache License 2.0](LICENSE))")
	}
}
