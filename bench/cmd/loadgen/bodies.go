package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
)

// agentBody returns a realistic coding-agent chat-completions request of
// about targetBytes: a system prompt, tool definitions, a user task, then
// assistant tool calls each answered by a role "tool" result (file contents,
// command output), with now and then an assistant remark and a user nudge.
// Every call is answered (it passes strict pairing) and the request ends on
// a tool result, as an agent's request does mid-loop. Contents carry what
// real ones do: quotes, backslashes, tabs, newlines and some non-ASCII, so
// JSON escapes are exercised. Deterministic for a given size.
//
// Small targets (< 64 KiB) are one call with one long tool output; large
// ones are many ~1 KiB messages (1 MiB ≈ 1,000 messages: tool results
// of ~2 KB after ~300-byte calls).
//
// It mirrors internal/chat/chattest.AgentBody; the harness keeps its own copy
// so it measures the same bodies whatever that package becomes.
func agentBody(targetBytes int, stream bool) []byte {
	rng := rand.New(rand.NewPCG(uint64(targetBytes), 7))
	req := request{
		Model:       "bench-model",
		Temperature: 0,
		Stream:      stream,
		Tools:       benchTools,
		Messages: []message{
			{Role: "system", Content: strp(systemPrompt)},
			{Role: "user", Content: strp("The integration test TestUploadResume fails on CI with a timeout. Find the cause in internal/upload, fix it, and run the package's tests.")},
		},
	}
	size := func() int { b, _ := json.Marshal(req); return len(b) }
	turn := 0
	call := func(tool string, args map[string]any, output string) {
		turn++
		id := fmt.Sprintf("call_%06d_%08x", turn, rng.Uint32())
		a, _ := json.Marshal(args)
		req.Messages = append(req.Messages,
			message{Role: "assistant", Content: nil, ToolCalls: []toolCall{{ID: id, Type: "function", Function: fnCall{Name: tool, Arguments: string(a)}}}},
			message{Role: "tool", ToolCallID: id, Content: strp(output)},
		)
	}

	// fill ends the request with a read_file result sized so that the body
	// lands on targetBytes: JSON escapes make the encoded text longer than
	// the raw one, so the size is corrected once after measuring.
	fill := func() {
		n := max(256, targetBytes-size()-260)
		call("read_file", map[string]any{"path": "internal/upload/resume.go"}, codeText(rng, n))
		if over := size() - targetBytes; over != 0 {
			last := &req.Messages[len(req.Messages)-1]
			enc, _ := json.Marshal(*last.Content)
			raw := len(*last.Content)
			n = max(256, raw-over*raw/len(enc))
			last.Content = strp(codeText(rng, n))
		}
	}

	if targetBytes < 64<<10 {
		// One read_file call whose output fills the rest.
		fill()
		return mustMarshal(req)
	}

	cur := size()
	for step := 1; cur < targetBytes-4096; step++ {
		switch {
		case step%9 == 0:
			req.Messages = append(req.Messages,
				message{Role: "assistant", Content: strp("The retry loop re-reads the whole part after a reset; checking how the offset is persisted.")},
				message{Role: "user", Content: strp("Keep going, and don't touch the public API.")})
			cur += 230
		case step%3 == 1:
			call("run_command", map[string]any{"command": "go test ./internal/upload/ -run TestUploadResume -count=1 -v"}, logText(rng, 1500+rng.IntN(300)))
			cur += 1900
		default:
			call("read_file", map[string]any{"path": fmt.Sprintf("internal/upload/part_%03d.go", turn%173), "offset": turn * 40, "limit": 40}, codeText(rng, 1500+rng.IntN(300)))
			cur += 1950
		}
		if step%64 == 0 {
			cur = size() // the estimates above drift with JSON escapes
		}
	}
	fill()
	return mustMarshal(req)
}

type request struct {
	Model       string    `json:"model"`
	Messages    []message `json:"messages"`
	Tools       []tool    `json:"tools"`
	Temperature float64   `json:"temperature"`
	Stream      bool      `json:"stream,omitempty"`
}

type message struct {
	Role       string     `json:"role"`
	Content    *string    `json:"content"`
	ToolCalls  []toolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

type toolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function fnCall `json:"function"`
}

type fnCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type tool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string         `json:"name"`
		Description string         `json:"description"`
		Parameters  map[string]any `json:"parameters"`
	} `json:"function"`
}

func strp(s string) *string { return &s }

func mustMarshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

var benchTools = func() []tool {
	mk := func(name, desc string, props map[string]any, required ...string) tool {
		var t tool
		t.Type = "function"
		t.Function.Name = name
		t.Function.Description = desc
		t.Function.Parameters = map[string]any{"type": "object", "properties": props, "required": required}
		return t
	}
	str := map[string]any{"type": "string"}
	num := map[string]any{"type": "integer"}
	return []tool{
		mk("read_file", "Read a file of the repository, optionally a line range.", map[string]any{"path": str, "offset": num, "limit": num}, "path"),
		mk("run_command", "Run a shell command in the repository and return its output.", map[string]any{"command": str}, "command"),
		mk("edit_file", "Replace an exact string in a file.", map[string]any{"path": str, "old": str, "new": str}, "path", "old", "new"),
	}
}()

const systemPrompt = `You are a coding agent working in a Go repository. You can read files, run commands and edit files with the tools provided.
Rules:
- Read before you edit; keep edits minimal and explain each in one sentence.
- Run the package's tests after every change ("go test ./pkg/...").
- Never print secrets; never run commands that touch the network.
- When you are done, answer with a short summary of the cause and the fix.
Style: "gofmt" clean, errors wrapped with %w, no panics on the request path.`

var codeLines = []string{
	"func (u *Uploader) Resume(ctx context.Context, id string) error {",
	"\tst, err := u.store.Load(ctx, id)",
	"\tif err != nil {\n\t\treturn fmt.Errorf(\"upload: load %q: %w\", id, err)\n\t}",
	"\tfor part := st.Next; part < st.Parts; part++ {",
	"\t\tbuf := make([]byte, st.PartSize) // reused below",
	"\t\tn, err := io.ReadFull(r, buf)",
	"\t\tif errors.Is(err, io.ErrUnexpectedEOF) { buf = buf[:n] }",
	"\t// The offset is persisted only after the server acknowledged the part → resume is idempotent.",
	"\tlog.Printf(\"upload: part %d/%d of %s (%s)\", part, st.Parts, id, \"réessai\")",
	"}",
	"// backoff returns the delay before attempt n: 200ms·2ⁿ, capped at 5s.",
	"\treturn time.Duration(min(5000, 200<<n)) * time.Millisecond",
	"\tpath := `C:\\uploads\\tmp` // Windows CI uses backslashes",
}

var logLines = []string{
	"=== RUN   TestUploadResume",
	"    resume_test.go:88: part 3/12 acknowledged after 1.204s",
	"    resume_test.go:91: server reset connection; retrying (attempt 2)",
	"--- FAIL: TestUploadResume (30.00s)",
	"panic: test timed out after 30s\n\trunning tests:\n\t\tTestUploadResume (30s)",
	"goroutine 42 [select]:\ngithub.com/example/upload.(*Uploader).Resume(0xc0001a2000, {0x7f3c20, 0xc000126000}, {0x6a1f2e, 0x8})",
	"\t/home/ci/work/internal/upload/resume.go:57 +0x2c5",
	"FAIL\tgithub.com/example/upload\t30.017s",
	"ok  \tgithub.com/example/upload/internal/store\t0.412s",
}

func fillText(rng *rand.Rand, lines []string, n int) string {
	var b strings.Builder
	b.Grow(n + 128)
	for b.Len() < n {
		b.WriteString(lines[rng.IntN(len(lines))])
		b.WriteByte('\n')
	}
	s := b.String()
	// Cut at n bytes without splitting a UTF-8 sequence.
	for n > 0 && n < len(s) && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:min(n, len(s))]
}

func codeText(rng *rand.Rand, n int) string { return fillText(rng, codeLines, n) }
func logText(rng *rand.Rand, n int) string  { return fillText(rng, logLines, n) }
