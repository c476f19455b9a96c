package anchor

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// refCanonical is the reference canonicalizer the fuzz target compares
// against: encoding/json decodes (UseNumber keeps number literals; invalid
// UTF-8 and lone surrogates become U+FFFD; a repeated key keeps its last
// value), then the value is re-encoded with sorted keys and the documented
// string rule, and top-level proxy-only keys are dropped.
func refCanonical(raw []byte) ([]byte, error) {
	if !json.Valid(raw) {
		return nil, errors.New("invalid")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if m, ok := v.(map[string]any); ok {
		for _, k := range ProxyOnlyKeys {
			delete(m, k)
		}
	}
	return refEncode(nil, v), nil
}

func refEncode(b []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(b, "null"...)
	case bool:
		if v {
			return append(b, "true"...)
		}
		return append(b, "false"...)
	case json.Number:
		return append(b, v...)
	case string:
		return refString(b, v)
	case []any:
		b = append(b, '[')
		for i, e := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = refEncode(b, e)
		}
		return append(b, ']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = refString(b, k)
			b = append(b, ':')
			b = refEncode(b, v[k])
		}
		return append(b, '}')
	}
	panic("unexpected type")
}

func refString(b []byte, s string) []byte {
	b = append(b, '"')
	for _, r := range s { // s is valid UTF-8 after encoding/json decoded it
		switch {
		case r == '"':
			b = append(b, `\"`...)
		case r == '\\':
			b = append(b, `\\`...)
		case r == '\b':
			b = append(b, `\b`...)
		case r == '\f':
			b = append(b, `\f`...)
		case r == '\n':
			b = append(b, `\n`...)
		case r == '\r':
			b = append(b, `\r`...)
		case r == '\t':
			b = append(b, `\t`...)
		case r < 0x20:
			b = append(b, `\u00`...)
			b = append(b, "0123456789abcdef"[r>>4], "0123456789abcdef"[r&0xf])
		default:
			b = utf8.AppendRune(b, r)
		}
	}
	return append(b, '"')
}

func TestAppendCanonical(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"sorted keys kept", `{"a":1,"b":2}`, `{"a":1,"b":2}`},
		{"keys sorted", `{"b":2,"a":1}`, `{"a":1,"b":2}`},
		{"nested sorted, arrays keep order", `{"z":[{"y":1,"x":2},3],"a":{"d":null,"c":true}}`, `{"a":{"c":true,"d":null},"z":[{"x":2,"y":1},3]}`},
		{"whitespace", " {\n\t\"a\" : [ 1 , 2 ] ,\r\n \"b\":\"x y\" } ", `{"a":[1,2],"b":"x y"}`},
		{"numbers literal", `[1.0,1e5,-0,1E+2,0.5e-3]`, `[1.0,1e5,-0,1E+2,0.5e-3]`},
		{"escape decoded", `"\u00e9"`, `"é"`},
		{"solidus", `"a\/b"`, `"a/b"`},
		{"surrogate pair", `"\ud83d\ude00"`, `"😀"`},
		{"lone surrogate", `"\ud800x"`, "\"\uFFFDx\""},
		{"high then non-low", `"\ud800\u0041"`, "\"\uFFFDA\""},
		{"short escapes kept", `"a\"b\\c\n\r\t\b\f"`, `"a\"b\\c\n\r\t\b\f"`},
		{"control as unicode", `"\u001B\u0000"`, `"\u001b\u0000"`},
		{"unicode escapes of specials", `"\u0022\u005c\u000a"`, `"\"\\\n"`},
		{"html not escaped", `"\u003c&\u2028"`, "\"<&\u2028\""},
		{"invalid utf8", "\"a\xffb\"", "\"a\uFFFDb\""},
		{"ui_only stripped at top", `{"ui_only":true,"role":"user","content":"x"}`, `{"content":"x","role":"user"}`},
		{"ui_only last", `{"role":"user","ui_only":false}`, `{"role":"user"}`},
		{"ui_only only", `{"ui_only":1}`, `{}`},
		{"ui_only nested kept", `{"a":{"ui_only":true}}`, `{"a":{"ui_only":true}}`},
		{"duplicate last wins", `{"a":1,"b":2,"a":3}`, `{"a":3,"b":2}`},
		{"escaped key order", `{"a#":1,"a\"":2}`, `{"a\"":2,"a#":1}`},
		{"escaped key equal", `{"\u0061":1,"a":2}`, `{"a":2}`},
		{"empty", `{}`, `{}`},
		{"empty array", `[ ]`, `[]`},
		{"scalar", ` true `, `true`},
		{"long ascii", `"` + strings.Repeat("abcdefgh", 20) + `"`, `"` + strings.Repeat("abcdefgh", 20) + `"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := AppendCanonical([]byte("prefix"), []byte(tt.in))
			if err != nil {
				t.Fatalf("AppendCanonical(%q): %v", tt.in, err)
			}
			if string(got) != "prefix"+tt.want {
				t.Errorf("AppendCanonical(%q) = %q, want %q", tt.in, got[6:], tt.want)
			}
			ref, err := refCanonical([]byte(tt.in))
			if err != nil {
				t.Fatalf("reference: %v", err)
			}
			if string(ref) != tt.want {
				t.Errorf("reference disagrees with the table: %q", ref)
			}
		})
	}
}

func TestAppendCanonicalInvalid(t *testing.T) {
	for _, in := range []string{
		``, ` `, `{`, `}`, `{"a"}`, `{"a":}`, `{"a":1,}`, `[1,]`, `[1 2]`, `{a:1}`, `"abc`, `"a` + "\n" + `"`,
		`"\x"`, `"\u12"`, `"\u12g4"`, `01`, `1.`, `1e`, `-`, `+1`, `.5`, `tru`, `nul`, `truex`, `1 2`, `{"a":1}x`,
		`'a'`, `"\'"`, strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1),
	} {
		t.Run(in[:min(len(in), 20)], func(t *testing.T) {
			out, err := AppendCanonical([]byte("keep"), []byte(in))
			if err == nil {
				t.Fatalf("AppendCanonical(%q) = %q, want an error", in, out)
			}
			if !errors.Is(err, ErrInvalidJSON) {
				t.Errorf("error %v does not wrap ErrInvalidJSON", err)
			}
			if string(out) != "keep" {
				t.Errorf("dst changed on error: %q", out)
			}
			if json.Valid([]byte(in)) {
				t.Errorf("json.Valid accepts %q", in)
			}
		})
	}
	deep := strings.Repeat("[", maxDepth) + strings.Repeat("]", maxDepth)
	if _, err := AppendCanonical(nil, []byte(deep)); err != nil {
		t.Errorf("depth %d rejected: %v", maxDepth, err)
	}
}

func mustHash(t testing.TB, raw string) Digest {
	t.Helper()
	d, err := MessageHash([]byte(raw))
	if err != nil {
		t.Fatalf("MessageHash(%q): %v", raw, err)
	}
	return d
}

func TestMessageHashSame(t *testing.T) {
	base := `{"role":"user","content":"café /x 😀"}`
	for _, tt := range []struct{ name, raw string }{
		{"key order", `{"content":"café /x 😀","role":"user"}`},
		{"whitespace", "{ \"role\" : \"user\",\n  \"content\" : \"café /x 😀\" }"},
		{"escaped é", `{"role":"user","content":"caf\u00e9 /x 😀"}`},
		{"uppercase hex", `{"role":"user","content":"caf\u00E9 /x 😀"}`},
		{"escaped solidus", `{"role":"user","content":"café \/x 😀"}`},
		{"surrogate pair", `{"role":"user","content":"café /x \ud83d\ude00"}`},
		{"escaped key", `{"r\u006fle":"user","content":"café /x 😀"}`},
		{"ui_only false", `{"role":"user","content":"café /x 😀","ui_only":false}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if mustHash(t, tt.raw) != mustHash(t, base) {
				t.Errorf("%s: digest differs from %s", tt.raw, base)
			}
		})
	}
}

func TestMessageHashDifferent(t *testing.T) {
	base := `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`
	for _, tt := range []struct{ name, raw string }{
		{"role", `{"role":"user","content":"ok","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"content", `{"role":"assistant","content":"ok.","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"content null", `{"role":"assistant","content":null,"name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"name", `{"role":"assistant","content":"ok","name":"b","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"call id", `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"id":"c2","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"call name", `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"write","arguments":"{\"p\":1}"}}]}`},
		{"call arguments", `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\": 1}"}}]}`},
		{"number literal", `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}],"x":1.0}`},
		{"tool_call_id", `{"role":"assistant","content":"ok","name":"a","tool_call_id":"c1","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
		{"nested ui_only", `{"role":"assistant","content":"ok","name":"a","tool_calls":[{"ui_only":true,"id":"c1","type":"function","function":{"name":"read","arguments":"{\"p\":1}"}}]}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if mustHash(t, tt.raw) == mustHash(t, base) {
				t.Errorf("%s: same digest as the base", tt.raw)
			}
		})
	}
	tool := mustHash(t, `{"role":"tool","tool_call_id":"c1","content":"x"}`)
	if tool == mustHash(t, `{"role":"tool","tool_call_id":"c2","content":"x"}`) {
		t.Error("tool_call_id change kept the digest")
	}
}

func TestSeed(t *testing.T) {
	tools := []byte(`[{"type":"function","function":{"name":"read","parameters":{"type":"object"}}}]`)
	toolsReordered := []byte(`[ {"function":{"parameters":{"type":"object"},"name":"read"},"type":"function"} ]`)
	base := Seed("llama/qwen3", map[string][]byte{"tools": tools})
	if got := Seed("llama/qwen3", map[string][]byte{"tools": toolsReordered, "temperature": []byte("0")}); got != base {
		t.Error("canonically equal tools (and a non-prompt field) changed the seed")
	}
	differ := map[string]Digest{
		"model":           Seed("llama/qwen3b", map[string][]byte{"tools": tools}),
		"upstream":        Seed("openai/qwen3", map[string][]byte{"tools": tools}),
		"no tools":        Seed("llama/qwen3", nil),
		"tools null":      Seed("llama/qwen3", map[string][]byte{"tools": []byte("null")}),
		"tools empty":     Seed("llama/qwen3", map[string][]byte{"tools": []byte("[]")}),
		"tool_choice":     Seed("llama/qwen3", map[string][]byte{"tools": tools, "tool_choice": []byte(`"auto"`)}),
		"functions":       Seed("llama/qwen3", map[string][]byte{"tools": tools, "functions": []byte(`[]`)}),
		"response_format": Seed("llama/qwen3", map[string][]byte{"tools": tools, "response_format": []byte(`{"type":"json_object"}`)}),
		"template kwargs": Seed("llama/qwen3", map[string][]byte{"tools": tools, "chat_template_kwargs": []byte(`{"enable_thinking":false}`)}),
		"moved to other":  Seed("llama/qwen3", map[string][]byte{"functions": tools}),
		"invalid":         Seed("llama/qwen3", map[string][]byte{"tools": []byte(`[`)}),
	}
	seen := map[Digest]string{base: "base"}
	for name, d := range differ {
		if prev, ok := seen[d]; ok {
			t.Errorf("%s and %s have the same seed", name, prev)
		}
		seen[d] = name
	}
	// Length prefixes: model "ab" + nothing vs model "a" + ... cannot collide.
	if Seed("ab", nil) == Seed("a", nil) {
		t.Error("seed not length-prefixed")
	}
}

func TestChain(t *testing.T) {
	seed := Seed("m", nil)
	a, b := mustHash(t, `{"role":"user","content":"a"}`), mustHash(t, `{"role":"user","content":"b"}`)
	ab := Chain(seed, []Digest{a, b})
	if len(ab) != 3 || ab[0] != seed {
		t.Fatalf("Chain: len %d", len(ab))
	}
	if ba := Chain(seed, []Digest{b, a}); ba[2] == ab[2] || ba[1] == ab[1] {
		t.Error("order does not matter to the chain")
	}
	if other := Chain(Seed("m2", nil), []Digest{a, b}); other[1] == ab[1] || other[2] == ab[2] {
		t.Error("seed does not matter to the chain")
	}
	if again := Chain(seed, []Digest{a}); again[1] != ab[1] {
		t.Error("prefix digest not stable")
	}
}

// FuzzCanonical: AppendCanonical agrees with the encoding/json reference on
// valid input, is idempotent, and fails exactly when json.Valid does.
func FuzzCanonical(f *testing.F) {
	for _, s := range []string{
		`{"role":"user","content":"x"}`, `{"b":1,"a":[true,false,null,{"d":"\u00e9","c":"\ud83d\ude00"}]}`,
		`"\ud800\udc00\ud800"`, `{"a":1,"a":2}`, `{"ui_only":true,"x":"\/"}`, "\"\xff\xfe\"", `[1.5e-3,-0,0]`,
		`{"a\u0000":1,"a":2,"a\"":3}`, ` [ ] `, `{"`, `tru`, `[01]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, err := AppendCanonical(nil, in)
		if valid := json.Valid(in); valid != (err == nil) {
			t.Fatalf("json.Valid=%v but err=%v for %q", valid, err, in)
		}
		if err != nil {
			return
		}
		ref, rerr := refCanonical(in)
		if rerr != nil {
			t.Fatalf("reference failed on valid input %q: %v", in, rerr)
		}
		if !bytes.Equal(out, ref) {
			t.Fatalf("canonical mismatch for %q:\n got %q\nwant %q", in, out, ref)
		}
		again, err := AppendCanonical(nil, out)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("not idempotent: %q -> %q (%v)", out, again, err)
		}
	})
}

// The Responses and Anthropic prompt-shaping fields change the seed; a
// request without them keeps the seed it had before they were added, so
// persisted anchors and summaries keep matching.
func TestSeedNewerAPIFields(t *testing.T) {
	tools := []byte(`[{"type":"function","function":{"name":"read","parameters":{"type":"object"}}}]`)
	base := Seed("llama/qwen3", map[string][]byte{"tools": tools})
	// d0 of this input as computed before text, reasoning, include and
	// thinking were prompt fields.
	const v1 = "e2623422"
	if got := hex.EncodeToString(base[:4]); got != v1 {
		t.Errorf("seed without the newer fields is %s..., want %s... (the seed every stored anchor was made with)", got, v1)
	}
	seen := map[Digest]string{base: "base"}
	for name, v := range map[string]string{
		"text":      `{"format":{"type":"json_schema","name":"r","schema":{"type":"object"}}}`,
		"reasoning": `{"effort":"high"}`,
		"include":   `["reasoning.encrypted_content"]`,
		"thinking":  `{"type":"enabled","budget_tokens":4096}`,
	} {
		d := Seed("llama/qwen3", map[string][]byte{"tools": tools, name: []byte(v)})
		if prev, ok := seen[d]; ok {
			t.Errorf("%s and %s have the same seed", name, prev)
		}
		seen[d] = name
	}
	low := Seed("llama/qwen3", map[string][]byte{"reasoning": []byte(`{"effort":"low"}`)})
	if low == Seed("llama/qwen3", map[string][]byte{"reasoning": []byte(`{"effort":"high"}`)}) {
		t.Error("two reasoning efforts have the same seed")
	}
}
