package agent

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestEditWorkloadRereadRule pins the mock's re-read rule on the edit–test
// workload: before an edit it re-reads the file unless every current line
// of it is in a tool result of the context; a summary quoting part of it
// does not count, and an edit's own output carries the line it changed.
func TestEditWorkloadRereadRule(t *testing.T) {
	dir, files := writeEditProject(t, 2000, 2000)
	steps := editSteps(dir, files, "bash", "command", "read", "path", false)
	if len(steps) != 30 || steps[29] != nil {
		t.Fatalf("%d steps, want 29 tool steps and the answer", len(steps))
	}
	const first = 6 // the first edit: ws_a.go, slot 1
	if steps[first][0].Edits != "ws_a.go" || steps[first][0].Reread == nil {
		t.Fatalf("step %d is %+v, want the edit of ws_a.go", first, steps[first][0])
	}
	a, err := os.ReadFile(filepath.Join(dir, "ws_a.go"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(a), "\n")
	partial := strings.Join(lines[:len(lines)/2], "\n")
	check := func(name string, texts, trailing []string, want bool) {
		t.Helper()
		if got := rereadNeeded(dir, "call", first, steps, texts, trailing) != nil; got != want {
			t.Errorf("%s: re-read %v, want %v", name, got, want)
		}
	}
	check("nothing in context", nil, nil, true)
	check("the read in a tool result", []string{"noise", string(a)}, nil, false)
	check("half the file", []string{partial}, nil, true)
	check("the re-read just made", []string{partial}, []string{rereadID("call", first)}, false)
	if rereadNeeded(dir, "call", 1, steps, nil, nil) != nil {
		t.Errorf("a read step asked for a re-read")
	}

	// After the edit on disk the old read lacks the changed line; the
	// edit's own output (a grep of it) supplies it.
	var args map[string]string
	json.Unmarshal([]byte(steps[first][0].Args), &args)
	cmd := exec.Command("sh", "-c", args["command"])
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), steps[first][0].Expect) {
		t.Fatalf("the edit %q: %v, output %q lacks %q", args["command"], err, out, steps[first][0].Expect)
	}
	const next = 18 // ws_a.go's second edit
	check2 := func(name string, texts []string, want bool) {
		t.Helper()
		if got := rereadNeeded(dir, "call", next, steps, texts, nil) != nil; got != want {
			t.Errorf("%s: re-read %v, want %v", name, got, want)
		}
	}
	check2("the read before the edit only", []string{string(a)}, true)
	check2("the read and the edit's output", []string{string(a), string(out)}, false)
}
