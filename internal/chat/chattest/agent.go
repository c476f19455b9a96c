// Package chattest builds realistic, deterministic chat-completions request
// bodies for tests, fuzz seeds, benchmarks and load harnesses: an agent loop
// of assistant tool calls and long tool outputs (code, unicode, escapes),
// like the requests compactproxy sits in front of.
package chattest

import (
	"math/rand/v2"
	"strconv"
	"unicode/utf8"
)

// Seed is the seed of every body this package builds: the same arguments
// always give the same bytes.
const Seed = 17

// AgentBody returns an agent request body of about targetBytes (within a few
// hundred bytes, never less than one step): model, messages, temperature 0,
// cache_prompt true, tools, and "stream": true when stream is set. The
// messages are a system prompt, a user ask, then steps of an assistant
// message (content null, one or more tool_calls with ids like "call_17")
// followed by the tool messages answering them; the last message is a tool
// message. 16 KiB gives a handful of messages around one long tool output;
// 1 MiB gives about 1,000 messages.
func AgentBody(targetBytes int, stream bool) []byte {
	g := newGen()
	msgs := g.head()
	size := envelopeSize(stream) + len(msgs[0]) + len(msgs[1]) + 2
	for {
		step := g.step()
		n := 0
		for _, m := range step {
			n += len(m) + 1
		}
		if size+n >= targetBytes && len(msgs) == 2 {
			msgs = append(msgs, step...) // at least one step
			break
		}
		if size+n >= targetBytes {
			// Fill the rest with this step's last tool output, cut to size.
			last := len(step) - 1
			keep := targetBytes - size - (n - len(step[last]))
			if keep > 200 {
				step[last] = g.toolMessageSized(step[last], keep)
				msgs = append(msgs, step...)
			}
			break
		}
		msgs = append(msgs, step...)
		size += n
	}
	return envelope(msgs, stream)
}

// AgentSteps returns the body of the same agent after steps steps (each an
// assistant turn and its tool answers). Bodies for growing steps share their
// message prefix byte for byte, like the requests of one conversation, so
// they suit anchor and cache tests.
func AgentSteps(steps int, stream bool) []byte {
	return envelope(AgentMessages(steps), stream)
}

// AgentMessages returns the messages of AgentSteps(steps, ...), each a JSON
// object.
func AgentMessages(steps int) [][]byte {
	g := newGen()
	msgs := g.head()
	for range steps {
		msgs = append(msgs, g.step()...)
	}
	return msgs
}

// Envelope wraps messages (JSON objects) in the top-level fields AgentBody
// uses.
func Envelope(msgs [][]byte, stream bool) []byte { return envelope(msgs, stream) }

const tools = `[{"type":"function","function":{"name":"read_file","description":"Read a file of the repository.","parameters":{"type":"object","properties":{"path":{"type":"string"},"offset":{"type":"integer"},"limit":{"type":"integer"}},"required":["path"]}}},` +
	`{"type":"function","function":{"name":"run","description":"Run a shell command in the work tree and return its output.","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout_ms":{"type":"integer","minimum":1}},"required":["command"]}}},` +
	`{"type":"function","function":{"name":"edit_file","description":"Replace old_str by new_str in a file.","parameters":{"type":"object","properties":{"path":{"type":"string"},"old_str":{"type":"string"},"new_str":{"type":"string"}},"required":["path","old_str","new_str"]}}}]`

func envelopeSize(stream bool) int {
	return len(envelope(nil, stream))
}

func envelope(msgs [][]byte, stream bool) []byte {
	n := 256 + len(tools)
	for _, m := range msgs {
		n += len(m) + 1
	}
	b := make([]byte, 0, n)
	b = append(b, `{"model":"qwen3-coder-30b","messages":[`...)
	for i, m := range msgs {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, m...)
	}
	b = append(b, `],"temperature":0,"cache_prompt":true,"tools":`...)
	b = append(b, tools...)
	if stream {
		b = append(b, `,"stream":true`...)
	}
	return append(b, '}')
}

// gen is the deterministic generator of one conversation.
type gen struct {
	rng   *rand.Rand
	call  int // last tool call number
	steps int
}

func newGen() *gen { return &gen{rng: rand.New(rand.NewPCG(Seed, Seed))} }

func (g *gen) head() [][]byte {
	sys := "You are a coding agent working in a Go repository. Use the tools to read files, run commands and edit code. " +
		"Keep changes small and explain them. When a command fails, read its output before retrying. " +
		"Never invent file contents: read them first. Answer in the user's language (français, 日本語, ...).\n\n" +
		"Rules:\n1. Prefer the standard library.\n2. Run \"go test ./...\" after every edit.\n3. Quote paths like `internal/chat/chat.go`.\n"
	for len(sys) < 1400 {
		sys += "- Tool results can be long; summarize what matters, keep exact error messages.\n"
	}
	return [][]byte{
		textMessage("system", sys),
		textMessage("user", "The proxy answers 400 \"invalid_tool_pairing\" after a long session. Find why, fix it and add a test. The logs say: `param: messages[812]` — café ☕ 🙂"),
	}
}

// step returns one assistant turn with its tool answers.
func (g *gen) step() [][]byte {
	g.steps++
	calls := 1
	if g.rng.IntN(5) == 0 {
		calls = 2 + g.rng.IntN(2) // parallel calls
	}
	ids := make([]string, calls)
	var a []byte
	a = append(a, `{"role":"assistant","content":null,"tool_calls":[`...)
	for c := range calls {
		g.call++
		ids[c] = "call_" + strconv.Itoa(g.call)
		if c > 0 {
			a = append(a, ',')
		}
		a = append(a, `{"id":"`...)
		a = append(a, ids[c]...)
		a = append(a, `","type":"function","function":{"name":"`...)
		name, args := g.callArgs()
		a = append(a, name...)
		a = append(a, `","arguments":`...)
		a = appendJSON(a, args, false)
		a = append(a, `}}`...)
	}
	a = append(a, ']')
	if g.steps%7 == 0 {
		a = append(a, `,"reasoning_content":"The error names a tool message; check the pairing of call ids first."`...)
	}
	a = append(a, '}')
	out := [][]byte{a}
	for _, id := range ids {
		size := 300 + g.rng.IntN(1200)
		if g.steps == 1 || g.rng.IntN(7) == 0 {
			size = 3000 + g.rng.IntN(3000) // a file read
		}
		if g.steps == 1 {
			size = 12000
		}
		out = append(out, g.toolMessage(id, g.output(size), g.steps%3 == 0))
	}
	return out
}

func (g *gen) callArgs() (name, args string) {
	switch g.rng.IntN(3) {
	case 0:
		return "read_file", `{"path":"internal/chat/` + files[g.rng.IntN(len(files))] + `","offset":` + strconv.Itoa(g.rng.IntN(400)) + `}`
	case 1:
		return "run", `{"command":"go test -run 'TestParse/ui_only' ./internal/chat/ 2>&1 | tail -n 40"}`
	default:
		return "edit_file", `{"path":"internal/chat/parse.go","old_str":"if i < 0 {\n\treturn -1\n}","new_str":"if i < 0 {\n\treturn s.fail(i, \"bad\")\n}"}`
	}
}

var files = []string{"parse.go", "scan.go", "build.go", "message.go", "edit.go", "chat.go"}

// toolMessage is a role "tool" message; escapeUnicode writes non-ASCII as
// \u escapes (as Python's json.dumps does by default).
func (g *gen) toolMessage(id, output string, escapeUnicode bool) []byte {
	b := make([]byte, 0, len(output)+len(output)/8+64)
	b = append(b, `{"role":"tool","tool_call_id":"`...)
	b = append(b, id...)
	b = append(b, `","content":`...)
	b = appendJSON(b, output, escapeUnicode)
	return append(b, '}')
}

// toolMessageSized cuts the content of the tool message m so that the
// message is about size bytes.
func (g *gen) toolMessageSized(m []byte, size int) []byte {
	// m is {"role":"tool","tool_call_id":"ID","content":"..."}.
	const pre = `{"role":"tool","tool_call_id":"`
	end := len(pre)
	for m[end] != '"' {
		end++
	}
	id := string(m[len(pre):end])
	text := g.output(size)
	b := g.toolMessage(id, text, false)
	for len(b) > size && len(text) > 0 {
		cut := len(text) - (len(b) - size)
		if cut < 0 {
			cut = 0
		}
		for cut > 0 && !utf8.RuneStart(text[cut]) {
			cut--
		}
		text = text[:cut]
		b = g.toolMessage(id, text, false)
	}
	return b
}

// output returns about size bytes of tool output: Go code with tabs, quotes
// and backslashes, test logs, and text in several scripts.
func (g *gen) output(size int) string {
	b := make([]byte, 0, size+256)
	for len(b) < size {
		b = append(b, chunks[g.rng.IntN(len(chunks))]...)
		b = strconv.AppendInt(b, int64(g.rng.IntN(1000)), 10)
		b = append(b, '\n')
	}
	return string(b)
}

var chunks = []string{
	"func (s *scanner) str(i int) int {\n\tfor j := i + 1; j < len(s.data); j++ {\n\t\tif s.data[j] == '\"' || s.data[j] == '\\\\' {\n\t\t\treturn j\n\t\t}\n\t}\n\treturn -1\n}\n// line ",
	"--- FAIL: TestParse/ui_only (0.00s)\n    parse_test.go:42: got \"messages[3]\", want \"messages[2]\"\nFAIL\texit status 1 — ",
	"\tif err := json.Unmarshal(body, &req); err != nil {\n\t\treturn fmt.Errorf(\"chat: decode: %w\", err)\n\t}\n",
	"ok  \tgithub.com/compactproxy/compactproxy/internal/pairing\t0.012s\tcoverage: 91.3% of statements ",
	"// Commentaire en français : l'été, où, déjà, naïve — et en japonais : 日本語のテキスト、東京 🗼 🙂 ✅ ",
	"path = \"C:\\\\Users\\\\agent\\\\repo\\\\internal\\\\chat\" \r\n\tregex = `^\\d+\\.\\d+$` ",
	"{\"error\":{\"message\":\"tool_call_id call_812 has no matching call\",\"type\":\"invalid_request_error\",\"param\":\"messages[812]\"}} ",
	"    12 │ \tcase '\\u2028', '\\u2029': // line separators\n    13 │ \t\treturn true\u00a0 ",
	"Résumé: the orphan tool message appears after a naïve last-K slice (see DESIGN.md §3). Ω≈ç√∫ ",
	"\x1b[31mred\x1b[0m \x00nul\x7f bell\a form\f backspace\b ",
}

func textMessage(role, text string) []byte {
	b := append([]byte(`{"role":"`), role...)
	b = append(b, `","content":`...)
	b = appendJSON(b, text, false)
	return append(b, '}')
}

// appendJSON appends s as a JSON string; escapeUnicode writes every
// non-ASCII rune as \u escapes (surrogate pairs above the BMP).
func appendJSON(b []byte, s string, escapeUnicode bool) []byte {
	const hex = "0123456789abcdef"
	u4 := func(b []byte, r rune) []byte {
		return append(b, '\\', 'u', hex[r>>12&0xf], hex[r>>8&0xf], hex[r>>4&0xf], hex[r&0xf])
	}
	b = append(b, '"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b = append(b, '\\', byte(r))
		case r == '\n':
			b = append(b, '\\', 'n')
		case r == '\t':
			b = append(b, '\\', 't')
		case r == '\r':
			b = append(b, '\\', 'r')
		case r < 0x20 || r == 0x7f:
			b = u4(b, r)
		case r < utf8.RuneSelf || !escapeUnicode:
			b = utf8.AppendRune(b, r)
		case r > 0xffff:
			r -= 0x10000
			b = u4(b, 0xd800+(r>>10))
			b = u4(b, 0xdc00+(r&0x3ff))
		default:
			b = u4(b, r)
		}
	}
	return append(b, '"')
}
