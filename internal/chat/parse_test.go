package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat/chattest"
)

func TestParseErrors(t *testing.T) {
	deep := strings.Repeat("[", 10001) + strings.Repeat("]", 10001)
	okDeep := strings.Repeat("[", 9999) + strings.Repeat("]", 9999)
	tests := []struct {
		name, body string
		param      string // "-" = no error
		msg        string // substring of the message
	}{
		{"empty", ``, "", "invalid JSON at byte 0"},
		{"spaces", "  \n", "", "invalid JSON at byte 3"},
		{"truncated", `{"messages":[`, "", "invalid JSON at byte 13: unexpected end"},
		{"trailing garbage", `{"messages":[]} x`, "", "invalid JSON at byte 16"},
		{"two objects", `{"messages":[]}{}`, "", "after the top-level value"},
		{"trailing comma", `{"messages":[],}`, "", "invalid JSON"},
		{"array trailing comma", `{"messages":[{"role":"user"},]}`, "", "invalid JSON"},
		{"bad literal", `{"messages":[],"stream":tru}`, "", "literal true"},
		{"leading zero", `{"messages":[],"n":01}`, "", "invalid JSON"},
		{"bare minus", `{"messages":[],"n":-}`, "", "in number"},
		{"dot no digit", `{"messages":[],"n":1.}`, "", "decimal point"},
		{"exp no digit", `{"messages":[],"n":1e+}`, "", "exponent"},
		{"plus number", `{"messages":[],"n":+1}`, "", "invalid JSON"},
		{"control char", "{\"messages\":[],\"s\":\"a\tb\"}", "", "control character"},
		{"bad escape", `{"messages":[],"s":"\x"}`, "", "invalid escape"},
		{"bad unicode", `{"messages":[],"s":"\u12g4"}`, "", "invalid hex"},
		{"unterminated string", `{"messages":[],"s":"abc`, "", "unexpected end of input in string"},
		{"single quotes", `{'messages':[]}`, "", "object key"},
		{"missing colon", `{"messages" []}`, "", "after object key"},
		{"too deep", `{"messages":[],"x":` + deep + `}`, "", "nesting deeper than 10000"},
		{"deep ok", `{"messages":[],"x":` + okDeep + `}`, "-", ""},
		{"bad json wins over shape", `{"messages":5,"x":}`, "", "invalid JSON"},
		{"not object", `[{"role":"user"}]`, "", "must be a JSON object"},
		{"string body", `"hi"`, "", "must be a JSON object"},
		{"messages missing", `{"model":"m"}`, "messages", `"messages" is missing`},
		{"empty object", `{}`, "messages", `"messages" is missing`},
		{"messages null", `{"messages":null}`, "messages", "must be an array"},
		{"messages object", `{"messages":{"role":"user"}}`, "messages", "must be an array"},
		{"element string", `{"messages":[{"role":"user"},"hi"]}`, "messages[1]", "messages[1] must be an object"},
		{"element null", `{"messages":[null]}`, "messages[0]", "must be an object"},
		{"role missing", `{"messages":[{"role":"user"},{"content":"x"}]}`, "messages[1].role", "messages[1].role is missing"},
		{"role number", `{"messages":[{"role":5}]}`, "messages[0].role", "must be a string"},
		{"role null", `{"messages":[{"role":null}]}`, "messages[0].role", "must be a string"},
		{"role last wins", `{"messages":[{"role":"user","role":7}]}`, "messages[0].role", "must be a string"},
		{"index counts ui_only", `{"messages":[{"role":"user","ui_only":true},{"x":1}]}`, "messages[1].role", "is missing"},
		{"ui_only without role", `{"messages":[{"ui_only":true},{"role":"user"}]}`, "-", ""},
		{"ui_only false needs role", `{"messages":[{"ui_only":false}]}`, "messages[0].role", "is missing"},
		{"duplicate messages both checked", `{"messages":5,"messages":[]}`, "messages", "must be an array"},
		{"empty messages", `{"messages":[]}`, "-", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := Parse([]byte(tt.body))
			if tt.param == "-" {
				if err != nil {
					t.Fatalf("Parse: %v", err)
				}
				if r == nil {
					t.Fatal("nil request")
				}
				return
			}
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Fatalf("err = %v (%T), want *ParseError", err, err)
			}
			if r != nil {
				t.Fatal("request with error")
			}
			if pe.Param != tt.param || !strings.Contains(pe.Message, tt.msg) {
				t.Fatalf("err = %q param %q, want %q param %q", pe.Message, pe.Param, tt.msg, tt.param)
			}
		})
	}
}

func TestParseRequestFields(t *testing.T) {
	tests := []struct {
		name, body string
		model      string
		stream     bool
		maxTokens  int
		usage      bool
		keys       []string
	}{
		{"all", `{"model":"qwen","stream":true,"max_tokens":10,"max_completion_tokens":20,"stream_options":{"include_usage":true},"messages":[]}`,
			"qwen", true, 20, true, []string{"model", "stream", "max_tokens", "max_completion_tokens", "stream_options", "messages"}},
		{"max_tokens only", `{"messages":[],"max_tokens":1.0E+2}`, "", false, 100, false, []string{"messages", "max_tokens"}},
		{"completion null", `{"messages":[],"max_tokens":5,"max_completion_tokens":null}`, "", false, 5, false, []string{"messages", "max_tokens", "max_completion_tokens"}},
		{"odd types", `{"messages":[],"model":5,"stream":"true","max_tokens":"9","stream_options":{"include_usage":1}}`, "", false, 0, false,
			[]string{"messages", "model", "stream", "max_tokens", "stream_options"}},
		{"huge max", `{"messages":[],"max_tokens":1e400}`, "", false, 0, false, []string{"messages", "max_tokens"}},
		{"last wins", `{"messages":[],"model":"a","model":"b","stream":true,"stream":false}`, "b", false, 0, false,
			[]string{"messages", "model", "model", "stream", "stream"}},
		{"escaped", `{"m\u0065ssages":[],"model":"caf\u00e9"}`, "café", false, 0, false, []string{"messages", "model"}},
		{"stream_options false", `{"messages":[],"stream_options":{"include_usage":false}}`, "", false, 0, false, []string{"messages", "stream_options"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			var keys []string
			for _, f := range r.Fields {
				keys = append(keys, f.Key)
			}
			if r.Model != tt.model || r.Stream != tt.stream || r.MaxTokens != tt.maxTokens || r.IncludeUsage != tt.usage || !reflect.DeepEqual(keys, tt.keys) {
				t.Fatalf("got model %q stream %v max %d usage %v keys %v", r.Model, r.Stream, r.MaxTokens, r.IncludeUsage, keys)
			}
			for _, f := range r.Fields {
				if !bytes.Contains([]byte(tt.body), f.Value) {
					t.Fatalf("field %s value %q not a span of the body", f.Key, f.Value)
				}
			}
		})
	}
}

func TestParseMessageView(t *testing.T) {
	tests := []struct {
		name, msg string
		want      Message // Raw, Content and Index are checked separately
	}{
		{"user string", `{"role":"user","content":"héllo\n"}`,
			Message{Role: "user", ContentIsString: true, TextBytes: 7}},
		{"assistant calls", `{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"read","arguments":"{}"}},{"function":{"name":"w"}},"junk"],"reasoning_content":"hmm"}`,
			Message{Role: "assistant", ToolCalls: []ToolCall{{"call_1", true, "read"}, {"", false, "w"}, {}}, HasReasoning: true}},
		{"tool_calls null", `{"role":"assistant","tool_calls":null}`, Message{Role: "assistant"}},
		{"tool_calls empty", `{"role":"assistant","tool_calls":[]}`, Message{Role: "assistant"}},
		{"tool_calls string", `{"role":"assistant","tool_calls":"x"}`, Message{Role: "assistant"}},
		{"call id number", `{"role":"assistant","tool_calls":[{"id":7,"function":"f"}]}`, Message{Role: "assistant", ToolCalls: []ToolCall{{}}}},
		{"tool", `{"role":"tool","tool_call_id":"call_\u0031","content":"ok"}`,
			Message{Role: "tool", ToolCallID: "call_1", HasToolCallID: true, ContentIsString: true, TextBytes: 2}},
		{"tool id number", `{"role":"tool","tool_call_id":12,"content":"ok"}`,
			Message{Role: "tool", ContentIsString: true, TextBytes: 2}},
		{"tool id last wins", `{"role":"tool","tool_call_id":"a","tool_call_id":null}`, Message{Role: "tool"}},
		{"function", `{"role":"function","name":"f","content":"r"}`,
			Message{Role: "function", Name: "f", ContentIsString: true, TextBytes: 1}},
		{"function_call", `{"role":"assistant","function_call":{"name":"f","arguments":"{}"}}`,
			Message{Role: "assistant", FunctionCall: true}},
		{"function_call null", `{"role":"assistant","function_call":null,"reasoning_content":null}`, Message{Role: "assistant"}},
		{"parts", `{"role":"user","content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"input_audio","input_audio":{"data":"BB","format":"wav"}},{"image_url":"x"},{"type":"file","file":{}},{"type":"text","text":"\u00e9\n"}]}`,
			Message{Role: "user", TextBytes: 6, MediaParts: 4, MediaBytes: 69 + 65 + 17 + 25}},
		{"custom role", `{"role":"ipython","content":""}`, Message{Role: "ipython", ContentIsString: true}},
		{"unknown keys", `{"role":"user","x":{"content":"no"},"content":"yes","y":[1,2]}`,
			Message{Role: "user", ContentIsString: true, TextBytes: 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := `{"messages":[` + tt.msg + `]}`
			r, err := Parse([]byte(body))
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Messages) != 1 {
				t.Fatalf("%d messages", len(r.Messages))
			}
			m := r.Messages[0]
			if string(m.Raw) != tt.msg || &m.Raw[0] != &r.Body[13] {
				t.Fatalf("Raw = %s, not the body span", m.Raw)
			}
			got := m
			got.Raw, got.Content, got.Index = nil, nil, 0
			if len(got.ToolCalls) == 0 {
				got.ToolCalls = nil
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("view\n got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseMediaBytes(t *testing.T) {
	// MediaBytes is the raw size of the media parts: checked by spans.
	parts := []string{`{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}`, `{"type":"input_audio","input_audio":{"data":"BB"}}`}
	body := `{"messages":[{"role":"user","content":[{"type":"text","text":"abc"},` + strings.Join(parts, ",") + `]}]}`
	r, err := Parse([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	m := r.Messages[0]
	if want := len(parts[0]) + len(parts[1]); m.MediaBytes != want || m.MediaParts != 2 || m.TextBytes != 3 {
		t.Fatalf("media %d/%d text %d, want 2/%d/3", m.MediaParts, m.MediaBytes, m.TextBytes, want)
	}
	if string(m.Content) != `[{"type":"text","text":"abc"},`+strings.Join(parts, ",")+`]` {
		t.Fatalf("Content = %s", m.Content)
	}
}

func TestParseUIOnly(t *testing.T) {
	msgs := []string{
		`{"role":"system","content":"s"}`,
		`{"role":"assistant","content":"status","ui_only":true}`,
		`{ "ui_only" : false , "role":"user","content":"u"}`,
		`{"role":"user","content":"v", "ui_only": null}`,
		`{"role":"user","ui_only":1,"content":"w","ui_only":"x"}`,
		`{"ui_only":true,"ui_only":false,"role":"user"}`,
		`{"ui_only":false,"role":"user","ui_only":true}`,
		`{"role":"tool","tool_call_id":"a","content":"t"}`,
	}
	body := " {\"model\":\"m\", \"messages\" : [ " + strings.Join(msgs, " ,\n") + " ] }"
	r, err := Parse([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		index int
		raw   string
	}{
		{0, msgs[0]},
		{2, `{ "role":"user","content":"u"}`},
		{3, `{"role":"user","content":"v"}`},
		{4, `{"role":"user","content":"w"}`},
		{5, `{"role":"user"}`},
		{7, msgs[7]},
	}
	if r.Total != 8 || r.UIOnlyRemoved != 2 || len(r.Messages) != len(want) {
		t.Fatalf("total %d removed %d kept %d", r.Total, r.UIOnlyRemoved, len(r.Messages))
	}
	for k, w := range want {
		m := r.Messages[k]
		if m.Index != w.index || string(m.Raw) != w.raw {
			t.Errorf("message %d: index %d raw %s, want %d %s", k, m.Index, m.Raw, w.index, w.raw)
		}
		if string(m.Raw) == msgs[w.index] && &m.Raw[0] != &r.Body[bytes.Index(r.Body, m.Raw)] {
			t.Errorf("message %d: untouched message copied", k)
		}
		if len(m.Content) > 0 && !bytes.Contains(m.Raw, m.Content) {
			t.Errorf("message %d: Content outside Raw", k)
		}
	}
	if r.Unchanged(r.Messages) {
		t.Fatal("Unchanged with UI-only messages")
	}
	out := r.Build(r.Messages, nil)
	wantBody := `{"model":"m","messages":[` + strings.Join([]string{msgs[0], want[1].raw, want[2].raw, want[3].raw, want[4].raw, msgs[7]}, ",") + `]}`
	if string(out) != wantBody {
		t.Fatalf("Build:\n got %s\nwant %s", out, wantBody)
	}
}

func TestBuild(t *testing.T) {
	body := []byte(`{ "model" : "m", "temperature":0, "n":1e400, "z":-0, "w":1.0E+2, "messages":[{"role":"user","content":[{"type":"text","text":"a"}],"x_vendor":{"k":[1,2]}},{"role":"assistant","content":"b"}], "cache_prompt":true, "stream_options":{"include_usage":false}, "id_slot":3 }`)
	r, err := Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		msgs []Message
		set  []Field
		want string
	}{
		{"same", r.Messages, nil,
			`{"model":"m","temperature":0,"n":1e400,"z":-0,"w":1.0E+2,"messages":[{"role":"user","content":[{"type":"text","text":"a"}],"x_vendor":{"k":[1,2]}},{"role":"assistant","content":"b"}],"cache_prompt":true,"stream_options":{"include_usage":false},"id_slot":3}`},
		{"fewer and new", []Message{r.Messages[1], NewTextMessage("user", "s")}, nil,
			`{"model":"m","temperature":0,"n":1e400,"z":-0,"w":1.0E+2,"messages":[{"role":"assistant","content":"b"},{"role":"user","content":"s"}],"cache_prompt":true,"stream_options":{"include_usage":false},"id_slot":3}`},
		{"none", nil, nil,
			`{"model":"m","temperature":0,"n":1e400,"z":-0,"w":1.0E+2,"messages":[],"cache_prompt":true,"stream_options":{"include_usage":false},"id_slot":3}`},
		{"set replace delete append", r.Messages[:1], []Field{
			{Key: "stream_options", Value: []byte(`{"include_usage":true}`)},
			{Key: "id_slot"},
			{Key: "absent"},
			{Key: "new", Value: []byte(`"v"`)},
		}, `{"model":"m","temperature":0,"n":1e400,"z":-0,"w":1.0E+2,"messages":[{"role":"user","content":[{"type":"text","text":"a"}],"x_vendor":{"k":[1,2]}}],"cache_prompt":true,"stream_options":{"include_usage":true},"new":"v"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := r.Build(tt.msgs, tt.set)
			if string(got) != tt.want {
				t.Fatalf("Build:\n got %s\nwant %s", got, tt.want)
			}
			if cap(got) < len(got) || cap(got) > len(got)+64 {
				t.Fatalf("buffer sized %d for %d bytes", cap(got), len(got))
			}
		})
	}
	if !jsonEqual(t, r.Build(r.Messages, nil), body) {
		t.Fatal("Build not JSON-equal to the body")
	}
}

func TestBuildDuplicateKeys(t *testing.T) {
	r, err := Parse([]byte(`{"messages":[{"role":"user","content":"a"}],"x":1,"messages":[{"role":"user","content":"b"}],"x":2}`))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Messages) != 1 || Text(r.Messages[0]) != "b" {
		t.Fatalf("last messages should win: %+v", r.Messages)
	}
	got := r.Build(r.Messages, []Field{{Key: "x", Value: []byte("3")}})
	if want := `{"messages":[{"role":"user","content":"b"}],"x":3}`; string(got) != want {
		t.Fatalf("Build = %s, want %s", got, want)
	}
}

func TestUnchanged(t *testing.T) {
	body := []byte(`{"model":"m","messages":[ {"role":"user","content":"a"} ,
	{"role":"assistant","content":"b"}],"stream":true}`)
	r, err := Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	copied := []Message{r.Messages[0], r.Messages[1]}
	copied[1].Raw = append([]byte(nil), copied[1].Raw...)
	tests := []struct {
		name string
		msgs []Message
		want bool
	}{
		{"same", r.Messages, true},
		{"same copy of slice", append([]Message(nil), r.Messages...), true},
		{"dropped", r.Messages[1:], false},
		{"truncated", r.Messages[:1], false},
		{"reordered", []Message{r.Messages[1], r.Messages[0]}, false},
		{"copied bytes", copied, false},
		{"changed", []Message{r.Messages[0], WithContentText(r.Messages[1], "c")}, false},
		{"shortened raw", []Message{r.Messages[0], {Raw: r.Messages[1].Raw[:5]}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := r.Unchanged(tt.msgs); got != tt.want {
				t.Fatalf("Unchanged = %v, want %v", got, tt.want)
			}
			fwd := r.Forward(tt.msgs, nil)
			if tt.want && &fwd[0] != &body[0] {
				t.Fatal("Forward copied an unchanged body")
			}
			if !tt.want && &fwd[0] == &body[0] {
				t.Fatal("Forward returned the body for a change")
			}
		})
	}
	if fwd := r.Forward(r.Messages, []Field{{Key: "stream_options", Value: []byte(`{"include_usage":true}`)}}); !bytes.Contains(fwd, []byte(`"stream":true,"stream_options":{"include_usage":true}}`)) {
		t.Fatalf("Forward with set = %s", fwd)
	}
	empty, err := Parse([]byte(`{"messages":[ ]}`))
	if err != nil || !empty.Unchanged(nil) {
		t.Fatalf("empty messages: %v", err)
	}
	if (&Request{}).Unchanged(nil) {
		t.Fatal("zero Request Unchanged")
	}
}

// TestParseDepthLimit checks the nesting limit against json.Valid at the
// boundary, in each place the parser walks with its own code.
func TestParseDepthLimit(t *testing.T) {
	places := []struct {
		name        string
		prefix, end string
		depth       int // containers around the hole
	}{
		{"top-level value", `{"messages":[],"x":`, `}`, 1},
		{"message value", `{"messages":[{"role":"user","x":`, `}]}`, 3},
		{"content parts", `{"messages":[{"role":"user","content":[`, `]}]}`, 4},
		{"content part value", `{"messages":[{"role":"user","content":[{"type":"text","x":`, `}]}]}`, 5},
		{"tool call value", `{"messages":[{"role":"assistant","tool_calls":[{"id":"a","x":`, `}]}]}`, 5},
		{"function value", `{"messages":[{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","x":`, `}}]}]}`, 6},
		{"stream_options value", `{"messages":[],"stream_options":{"include_usage":`, `}}`, 2},
	}
	for _, p := range places {
		for _, extra := range []int{-1, 0, 1} {
			n := maxDepth - p.depth + extra
			body := p.prefix + strings.Repeat("[", n) + strings.Repeat("]", n) + p.end
			t.Run(p.name+"/"+strconv.Itoa(extra), func(t *testing.T) {
				_, err := Parse([]byte(body))
				if valid := json.Valid([]byte(body)); (err == nil) != valid {
					t.Fatalf("Parse err = %v, json.Valid = %v", err, valid)
				}
				if (err == nil) != (extra <= 0) {
					t.Fatalf("depth %d: err = %v", p.depth+n, err)
				}
			})
		}
	}
}

// TestParseAgentBody parses the benchmark bodies: the view agrees with the
// generator, and an unchanged request is forwarded as is and rebuilt byte
// for byte.
func TestParseAgentBody(t *testing.T) {
	for _, size := range []int{16 << 10, 1 << 20} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			body := chattest.AgentBody(size, true)
			r, err := Parse(body)
			if err != nil {
				t.Fatal(err)
			}
			if !r.Stream || r.Model == "" || r.Total != len(r.Messages) || r.Messages[len(r.Messages)-1].Role != "tool" {
				t.Fatalf("request %q stream %v total %d", r.Model, r.Stream, r.Total)
			}
			calls := 0
			for _, m := range r.Messages {
				calls += len(m.ToolCalls)
				if m.Role == "tool" && (!m.HasToolCallID || !strings.HasPrefix(m.ToolCallID, "call_") || m.TextBytes != len(Text(m))) {
					t.Fatalf("tool message %d: %+v", m.Index, m)
				}
			}
			if calls == 0 || !r.Unchanged(r.Messages) {
				t.Fatalf("%d calls, unchanged %v", calls, r.Unchanged(r.Messages))
			}
			if out := r.Build(r.Messages, nil); !bytes.Equal(out, body) {
				t.Fatal("Build of an unchanged compact body differs")
			}
		})
	}
}
