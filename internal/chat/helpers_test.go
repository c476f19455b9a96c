package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

// jsonEqual reports whether a and b decode to the same value.
func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	va, err := decodeJSON(a)
	if err != nil {
		t.Fatalf("not JSON: %v: %q", err, a)
	}
	vb, err := decodeJSON(b)
	if err != nil {
		t.Fatalf("not JSON: %v: %q", err, b)
	}
	return reflect.DeepEqual(va, vb)
}

// decodeJSON decodes b keeping numbers as written (json.Number), so that
// equality also checks that number literals were kept byte for byte.
func decodeJSON(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("trailing data")
	}
	return v, nil
}

func TestNewTextMessage(t *testing.T) {
	tests := []struct {
		name, role, text string
		want             string
	}{
		{"plain", "user", "hello", `{"role":"user","content":"hello"}`},
		{"escapes", "assistant", "a\"b\\c\nd\te\x01", `{"role":"assistant","content":"a\"b\\c\nd\te\u0001"}`},
		{"unicode", "user", "é 日本 🙂", `{"role":"user","content":"é 日本 🙂"}`},
		{"invalid utf8", "user", "a\xffb", `{"role":"user","content":"a\ufffdb"}`},
		{"empty", "system", "", `{"role":"system","content":""}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := NewTextMessage(tt.role, tt.text)
			if string(m.Raw) != tt.want {
				t.Fatalf("Raw = %s, want %s", m.Raw, tt.want)
			}
			if m.Index != -1 || m.Role != tt.role || !m.ContentIsString {
				t.Fatalf("view = %+v", m)
			}
			want := tt.text
			if tt.name == "invalid utf8" {
				want = "a\uFFFDb"
			}
			if got := Text(m); got != want {
				t.Fatalf("Text = %q, want %q", got, want)
			}
			if m.TextBytes != len(want) {
				t.Fatalf("TextBytes = %d, want %d", m.TextBytes, len(want))
			}
		})
	}
}

func TestText(t *testing.T) {
	tests := []struct {
		name, raw, want string
	}{
		{"string", `{"role":"user","content":"a\u00e9\ud83d\ude42\n"}`, "aé🙂\n"},
		{"null", `{"role":"assistant","content":null}`, ""},
		{"absent", `{"role":"assistant"}`, ""},
		{"number", `{"role":"assistant","content":5}`, ""},
		{"parts", `{"role":"user","content":[{"type":"text","text":"one"},{"type":"image_url","image_url":{"url":"data:x"}},{"text":"two","type":"input_text"},{"type":"input_audio","input_audio":{"data":"AAAA"}},"junk",{"type":"text","text":5}]}`, "one\ntwo"},
		{"lone surrogate", `{"role":"user","content":"\ud83d x"}`, "\uFFFD x"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := decodeMessage([]byte(tt.raw), 0)
			if got := Text(m); got != tt.want {
				t.Fatalf("Text = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestWithContentText(t *testing.T) {
	tests := []struct {
		name, raw, text, want string
	}{
		{"string", `{"role":"tool", "tool_call_id" : "c1","content":"long output","x":1e400}`, "short",
			`{"role":"tool", "tool_call_id" : "c1","content":"short","x":1e400}`},
		{"parts", `{"role":"user","content":[{"type":"text","text":"a"}],"name":"n"}`, "b\"",
			`{"role":"user","content":"b\"","name":"n"}`},
		{"absent", `{"role":"assistant" }`, "x", `{"role":"assistant" ,"content":"x"}`},
		{"empty object", `{}`, "x", `{"content":"x"}`},
		{"null", `{"content":null,"role":"assistant","tool_calls":[{"id":"a"}]}`, "x", `{"content":"x","role":"assistant","tool_calls":[{"id":"a"}]}`},
		{"duplicates", `{"role":"user","content":"a","content":"b"}`, "x", `{"role":"user","content":"x","content":"x"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := decodeMessage([]byte(tt.raw), 7)
			in.Digest, in.HasDigest = [32]byte{1}, true
			m := WithContentText(in, tt.text)
			if string(m.Raw) != tt.want {
				t.Fatalf("Raw = %s, want %s", m.Raw, tt.want)
			}
			if string(in.Raw) != tt.raw {
				t.Fatalf("input modified: %s", in.Raw)
			}
			if m.Index != 7 || m.HasDigest || m.Role != in.Role || !m.ContentIsString || m.MediaParts != 0 {
				t.Fatalf("view = %+v", m)
			}
			if Text(m) != tt.text || m.TextBytes != len(tt.text) {
				t.Fatalf("Text = %q TextBytes %d", Text(m), m.TextBytes)
			}
			if !reflect.DeepEqual(m.ToolCalls, in.ToolCalls) {
				t.Fatalf("ToolCalls %v, want %v", m.ToolCalls, in.ToolCalls)
			}
		})
	}
}

func TestDropToolCalls(t *testing.T) {
	tests := []struct {
		name, raw string
		drop      []int
		want      string
		ids       []string
	}{
		{"middle", `{"role":"assistant","content":null,"tool_calls":[{"id":"a"}, {"id":"b"} ,{"id":"c"}],"x":0}`, []int{1},
			`{"role":"assistant","content":null,"tool_calls":[{"id":"a"} ,{"id":"c"}],"x":0}`, []string{"a", "c"}},
		{"first", `{"role":"assistant","tool_calls":[ {"id":"a"}, {"id":"b"} ]}`, []int{0},
			`{"role":"assistant","tool_calls":[ {"id":"b"} ]}`, []string{"b"}},
		{"last", `{"role":"assistant","tool_calls":[{"id":"a"},{"id":"b"}]}`, []int{1},
			`{"role":"assistant","tool_calls":[{"id":"a"}]}`, []string{"a"}},
		{"all", `{"role":"assistant","content":null,"tool_calls":[{"id":"a"},{"id":"b"}],"x":0}`, []int{0, 1},
			`{"role":"assistant","content":null,"x":0}`, nil},
		{"all leading key", `{"tool_calls":[{"id":"a"}], "role":"assistant"}`, []int{0},
			`{"role":"assistant"}`, nil},
		{"only key", `{ "tool_calls":[{"id":"a"}] }`, []int{0}, `{  }`, nil},
		{"out of range", `{"role":"assistant","tool_calls":[{"id":"a"}]}`, []int{5, -1},
			`{"role":"assistant","tool_calls":[{"id":"a"}]}`, []string{"a"}},
		{"duplicate key", `{"tool_calls":[{"id":"z"}],"role":"assistant","tool_calls":[{"id":"a"},{"id":"b"}]}`, []int{0},
			`{"role":"assistant","tool_calls":[{"id":"b"}]}`, []string{"b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := decodeMessage([]byte(tt.raw), 3)
			m := DropToolCalls(in, tt.drop)
			if string(m.Raw) != tt.want {
				t.Fatalf("Raw = %s, want %s", m.Raw, tt.want)
			}
			if string(in.Raw) != tt.raw {
				t.Fatalf("input modified: %s", in.Raw)
			}
			var ids []string
			for _, c := range m.ToolCalls {
				ids = append(ids, c.ID)
			}
			if !reflect.DeepEqual(ids, tt.ids) || m.Index != 3 {
				t.Fatalf("ids = %v, want %v (index %d)", ids, tt.ids, m.Index)
			}
		})
	}
}
