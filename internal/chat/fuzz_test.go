package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

// FuzzParse checks Parse against encoding/json: Parse succeeds exactly when
// json.Valid and the shape rules hold (with the same Param), each Raw is valid
// JSON equal to the client's element minus "ui_only", the view agrees with
// the decoded message, and Build, WithContentText and DropToolCalls produce
// valid JSON with the expected value.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		`{"messages":[]}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{}"}},{"id":"call_2"}]},{"role":"tool","tool_call_id":"call_1","content":"x"},{"role":"tool","tool_call_id":"call_2","content":"y"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a\u00e9\ud83d\ude42"},{"type":"image_url","image_url":{"url":"data:,x"}}]}]}`,
		`{"messages":[{"role":"system","ui_only":true},{ "ui_only" : false , "role":"user"},{"role":"user","ui_only":null,"ui_only":1}]}`,
		`{"messages":[{"role":"user","content":"a","content":"b"}],"messages":[{"role":"tool","tool_call_id":5}]}`,
		`{"n":1e400,"z":-0,"w":1.0E+2,"messages":[{"role":"user","x":[1,{"y":null}],"reasoning_content":"r"}]}`,
		`{"messages":[{"role":5}]}`,
		`{"messages":[1]}`,
		`{"messages":{}}`,
		`[]`,
		`{"messages":[]} x`,
		`{"messages":["\u12"]}`,
		"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}",
		string(chattest.AgentBody(4096, true)),
		`{"messages":[{"role":"user","content":"\ud83d\ude42 \ud83d"}]}`,
		`{"messages":[{"role":"user","content":"a\\udc00"}]}`,
		string(nestedContent(1000)),
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		orig := bytes.Clone(body)
		var (
			r   *Request
			err error
		)
		checkLinearWork(t, len(body), func() { r, err = Parse(body) })
		if !bytes.Equal(body, orig) {
			t.Fatal("Parse modified the body")
		}
		var pe *ParseError
		badText := errors.As(err, &pe) && strings.HasPrefix(pe.Message, "invalid UTF-8 at byte ")
		if badText && (pe.Param != "" || textIsUTF8(body)) {
			t.Fatalf("err = %v for a body whose text is UTF-8", err)
		}
		if !json.Valid(body) {
			if !errors.As(err, &pe) || pe.Param != "" || !strings.HasPrefix(pe.Message, "invalid JSON at byte ") && !badText {
				t.Fatalf("invalid JSON: err = %v", err)
			}
			return
		}
		if !textIsUTF8(body) {
			if !badText {
				t.Fatalf("text that is not UTF-8: err = %v, want an invalid UTF-8 ParseError", err)
			}
			return
		}
		want := oracle(t, body)
		if want.param != "" {
			param := want.param
			if param == notObject {
				param = ""
			}
			var pe *ParseError
			if !errors.As(err, &pe) || pe.Param != param || strings.HasPrefix(pe.Message, "invalid JSON") {
				t.Fatalf("err = %v, want one with param %q", err, want.param)
			}
			return
		}
		if err != nil {
			t.Fatalf("Parse: %v", err)
		}
		checkRequest(t, r, body, want)
	})
}

// textIsUTF8 is the oracle of the UTF-8 rule for valid JSON: the bytes are
// UTF-8 and every \u escape of a surrogate is half of a pair.
func textIsUTF8(body []byte) bool {
	if !utf8.Valid(body) {
		return false
	}
	hex := func(b []byte) rune {
		r, err := strconv.ParseUint(string(b), 16, 32)
		if err != nil {
			return -1
		}
		return rune(r)
	}
	for i := 0; i < len(body); i++ {
		if body[i] != '\\' || i+1 >= len(body) {
			continue
		}
		if body[i+1] != 'u' || i+6 > len(body) {
			i++ // the escaped character
			continue
		}
		r := hex(body[i+2 : i+6])
		switch {
		case utf16.IsSurrogate(r) && r < 0xdc00:
			if i+12 > len(body) || body[i+6] != '\\' || body[i+7] != 'u' {
				return false
			}
			if lo := hex(body[i+8 : i+12]); lo < 0xdc00 || lo >= 0xe000 {
				return false
			}
			i += 11
		case utf16.IsSurrogate(r):
			return false
		default:
			i += 5
		}
	}
	return true
}

// nestedContent is a chat body whose one message nests content arrays
// depth deep (the chat form of nestedCacheControl).
func nestedContent(depth int) []byte {
	return []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"hi","content":` +
		strings.Repeat(`[{"cache_control":{"type":"ephemeral"},"content":`, depth) + `1` + strings.Repeat(`}]`, depth) + `}]}]}`)
}

// notObject stands for the not-an-object error (whose Param is "").
const notObject = "\x00"

// expected is what encoding/json says about a valid body.
type expected struct {
	param    string           // shape error's param; "" = none
	messages []map[string]any // the kept messages, ui_only key removed
	indexes  []int
	removed  int
	top      map[string]any
}

func oracle(t *testing.T, body []byte) expected {
	var e expected
	v, err := decodeJSON(body)
	if err != nil {
		t.Fatalf("decodeJSON of valid JSON: %v", err)
	}
	top, ok := v.(map[string]any)
	if !ok {
		e.param = notObject
		return e
	}
	e.top = top
	// Walk the top-level keys in order: every "messages" must be well
	// shaped; the last one is the view.
	d := json.NewDecoder(bytes.NewReader(body))
	d.UseNumber()
	d.Token() // {
	saw := false
	for d.More() {
		tok, _ := d.Token()
		var raw json.RawMessage
		if err := d.Decode(&raw); err != nil {
			t.Fatalf("decode: %v", err)
		}
		if tok.(string) != "messages" {
			continue
		}
		saw = true
		if p := e.checkMessages(t, raw); p != "" {
			e.param = p
			return e
		}
	}
	if !saw {
		e.param = "messages"
	}
	return e
}

func (e *expected) checkMessages(t *testing.T, raw json.RawMessage) string {
	var elems []json.RawMessage
	if err := json.Unmarshal(raw, &elems); err != nil || bytes.TrimSpace(raw)[0] != '[' {
		return "messages"
	}
	e.messages, e.indexes, e.removed = nil, nil, 0
	for i, el := range elems {
		param := "messages[" + strconv.Itoa(i) + "]"
		v, _ := decodeJSON(el)
		m, ok := v.(map[string]any)
		if !ok {
			return param
		}
		if b, ok := m["ui_only"].(bool); ok && b {
			e.removed++
			continue
		}
		if _, ok := m["role"].(string); !ok {
			return param + ".role"
		}
		delete(m, "ui_only")
		e.messages = append(e.messages, m)
		e.indexes = append(e.indexes, i)
	}
	return ""
}

func checkRequest(t *testing.T, r *Request, body []byte, want expected) {
	if r.Total != len(want.messages)+want.removed || r.UIOnlyRemoved != want.removed || len(r.Messages) != len(want.messages) {
		t.Fatalf("total %d removed %d kept %d, want %d kept, %d removed", r.Total, r.UIOnlyRemoved, len(r.Messages), len(want.messages), want.removed)
	}
	if s, _ := want.top["model"].(string); r.Model != s {
		t.Fatalf("Model = %q, want %q", r.Model, s)
	}
	if b, _ := want.top["stream"].(bool); r.Stream != b {
		t.Fatalf("Stream = %v", r.Stream)
	}
	for k, m := range r.Messages {
		wm := want.messages[k]
		got, err := decodeJSON(m.Raw)
		if err != nil {
			t.Fatalf("message %d: Raw %q: %v", k, m.Raw, err)
		}
		if !reflect.DeepEqual(got, any(wm)) {
			t.Fatalf("message %d: Raw %s\n got %#v\nwant %#v", k, m.Raw, got, wm)
		}
		if m.Index != want.indexes[k] || m.Role != wm["role"] {
			t.Fatalf("message %d: index %d role %q", k, m.Index, m.Role)
		}
		checkView(t, m, wm)

		// Helpers on every message.
		w := WithContentText(m, "new \"text\" é")
		wv, err := decodeJSON(w.Raw)
		if err != nil {
			t.Fatalf("WithContentText: %q: %v", w.Raw, err)
		}
		wm2 := clone(wm)
		wm2["content"] = "new \"text\" é"
		if !reflect.DeepEqual(wv, any(wm2)) || Text(w) != "new \"text\" é" {
			t.Fatalf("WithContentText: %s", w.Raw)
		}
		if len(m.ToolCalls) > 0 {
			d := DropToolCalls(m, []int{0})
			dv, err := decodeJSON(d.Raw)
			if err != nil {
				t.Fatalf("DropToolCalls: %q: %v", d.Raw, err)
			}
			dm := clone(wm)
			calls := wm["tool_calls"].([]any)
			if len(calls) == 1 {
				delete(dm, "tool_calls")
			} else {
				dm["tool_calls"] = calls[1:]
			}
			wantCalls := m.ToolCalls[1:]
			if len(wantCalls) == 0 {
				wantCalls = nil
			}
			if !reflect.DeepEqual(dv, any(dm)) || !reflect.DeepEqual(d.ToolCalls, wantCalls) {
				t.Fatalf("DropToolCalls: %s -> %s", m.Raw, d.Raw)
			}
		}
	}
	// Build: valid JSON, equal to the body with the filtered messages.
	out := r.Build(r.Messages, nil)
	got, err := decodeJSON(out)
	if err != nil {
		t.Fatalf("Build: %q: %v", out, err)
	}
	top := clone(want.top)
	msgs := make([]any, len(want.messages))
	for k := range want.messages {
		msgs[k] = want.messages[k]
	}
	top["messages"] = msgs
	if !reflect.DeepEqual(got, any(top)) {
		t.Fatalf("Build: %s", out)
	}
	if r.Unchanged(r.Messages) != (r.UIOnlyRemoved == 0 && !r.stripped) {
		t.Fatalf("Unchanged = %v with %d removed, stripped %v", r.Unchanged(r.Messages), r.UIOnlyRemoved, r.stripped)
	}
	if r.Unchanged(r.Messages) && !bytes.Equal(r.Forward(r.Messages, nil), body) {
		t.Fatal("Forward of an unchanged request is not the body")
	}
}

func checkView(t *testing.T, m Message, wm map[string]any) {
	t.Helper()
	id, isStr := wm["tool_call_id"].(string)
	if m.HasToolCallID != isStr || m.ToolCallID != id {
		t.Fatalf("tool_call_id view %q/%v, want %q/%v", m.ToolCallID, m.HasToolCallID, id, isStr)
	}
	if name, _ := wm["name"].(string); m.Name != name {
		t.Fatalf("Name %q, want %q", m.Name, name)
	}
	if _, ok := wm["function_call"].(map[string]any); m.FunctionCall != ok {
		t.Fatalf("FunctionCall %v", m.FunctionCall)
	}
	if rc, ok := wm["reasoning_content"]; m.HasReasoning != (ok && rc != nil) {
		t.Fatalf("HasReasoning %v", m.HasReasoning)
	}
	calls, _ := wm["tool_calls"].([]any)
	if len(m.ToolCalls) != len(calls) {
		t.Fatalf("%d tool calls, want %d", len(m.ToolCalls), len(calls))
	}
	for k, c := range calls {
		cm, _ := c.(map[string]any)
		id, isStr := cm["id"].(string)
		fn, _ := cm["function"].(map[string]any)
		name, _ := fn["name"].(string)
		if got := m.ToolCalls[k]; got != (ToolCall{ID: id, HasID: isStr, Name: name}) {
			t.Fatalf("call %d = %+v, want %q %v %q", k, got, id, isStr, name)
		}
	}
	c, has := wm["content"]
	if has != (m.Content != nil) {
		t.Fatalf("Content %q, present %v", m.Content, has)
	}
	if has {
		cv, err := decodeJSON(m.Content)
		if err != nil || !reflect.DeepEqual(cv, c) {
			t.Fatalf("Content %q", m.Content)
		}
		s, isStr := c.(string)
		if m.ContentIsString != isStr {
			t.Fatalf("ContentIsString %v", m.ContentIsString)
		}
		if isStr && Text(m) != s {
			t.Fatalf("Text %q, want %q", Text(m), s)
		}
	}
}

func clone(m map[string]any) map[string]any {
	c := make(map[string]any, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}
