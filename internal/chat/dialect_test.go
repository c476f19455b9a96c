package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

const responsesBody = `{"model":"m","instructions":"be brief","store":false,"input":[` +
	`{"type":"message","role":"developer","content":"dev"},` +
	`{"role":"user","content":[{"type":"input_text","text":"fix it"}]},` +
	`{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAAA"},` +
	`{"type":"function_call","call_id":"c1","name":"shell","arguments":"{\"cmd\":\"ls\"}"},` +
	`{"type":"function_call_output","call_id":"c1","output":"a.go\nb.go"},` +
	`{"type":"reasoning","id":"rs_2","summary":[{"type":"summary_text","text":"read a"}],"encrypted_content":"gBBBB"},` +
	`{"type":"custom_tool_call","call_id":"c2","name":"apply_patch","input":"*** Begin"},` +
	`{"type":"custom_tool_call_output","call_id":"c2","output":"ok"},` +
	`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]}` +
	`],"tools":[{"type":"function","name":"shell"}],"max_output_tokens":99,"stream":true}`

func TestResponsesMapping(t *testing.T) {
	r, err := ParseDialect(DialectResponses, []byte(responsesBody))
	if err != nil {
		t.Fatal(err)
	}
	if r.Model != "m" || !r.Stream || r.MaxTokens != 99 {
		t.Fatalf("model %q stream %v max %d", r.Model, r.Stream, r.MaxTokens)
	}
	var roles []string
	for _, m := range r.Messages {
		roles = append(roles, m.Role)
	}
	want := "system developer user assistant tool assistant tool assistant"
	if got := strings.Join(roles, " "); got != want {
		t.Fatalf("roles %q, want %q", got, want)
	}
	if c := r.Messages[3].ToolCalls; len(c) != 1 || c[0].ID != "c1" || c[0].Name != "shell" {
		t.Fatalf("calls %+v", c)
	}
	if m := r.Messages[4]; m.ToolCallID != "c1" || Text(m) != "a.go\nb.go" {
		t.Fatalf("tool %+v", m)
	}
	if r.Param(4) != "input[4]" || r.Param(0) != "instructions" {
		t.Fatalf("params %q %q", r.Param(4), r.Param(0))
	}
	if !r.Unchanged(r.Messages) {
		t.Fatal("the parsed view is not unchanged")
	}
	// Rebuilt as is: the same items, byte for byte.
	same := r.Build(r.Messages, nil)
	if !jsonEqual(t, same, []byte(responsesBody)) {
		t.Fatalf("rebuilt body differs:\n%s", same)
	}
	if !bytes.Contains(same, []byte(`{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAAA"}`)) {
		t.Fatalf("reasoning item not kept byte for byte:\n%s", same)
	}

	// A compacted view: summary + ack, the tail from the second turn on,
	// its tool result trimmed.
	tail := append([]Message(nil), r.Messages[5:]...)
	tail[1] = WithContentText(tail[1], "[trimmed]")
	view := append([]Message{r.Messages[0], NewTextMessage("user", "SUMMARY"), NewTextMessage("assistant", "Noted.")}, tail...)
	body := r.Build(view, []Field{{Key: "stream", Value: []byte("false")}})
	var got struct {
		Instructions string            `json:"instructions"`
		Stream       bool              `json:"stream"`
		Input        []json.RawMessage `json:"input"`
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatalf("%v:\n%s", err, body)
	}
	if got.Instructions != "be brief" || got.Stream || len(got.Input) != 6 {
		t.Fatalf("body:\n%s", body)
	}
	wantItems := []string{
		`{"type":"message","role":"user","content":"SUMMARY"}`,
		`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Noted."}]}`,
		`{"type":"reasoning","id":"rs_2","summary":[{"type":"summary_text","text":"read a"}],"encrypted_content":"gBBBB"}`,
		`{"type":"custom_tool_call","call_id":"c2","name":"apply_patch","input":"*** Begin"}`,
		`{"type":"custom_tool_call_output","call_id":"c2","output":"[trimmed]"}`,
		`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]}`,
	}
	for i, w := range wantItems {
		if string(got.Input[i]) != w {
			t.Errorf("input[%d] = %s, want %s", i, got.Input[i], w)
		}
	}
	// Reparsed, the compacted body's kept items have their digests.
	r2, err := ParseDialect(DialectResponses, body)
	if err != nil {
		t.Fatal(err)
	}
	if r2.Messages[len(r2.Messages)-1].Digest != r.Messages[len(r.Messages)-1].Digest {
		t.Error("a kept turn's digest changed after rendering")
	}
}

func TestResponsesDigestFollowsClientBytes(t *testing.T) {
	a := `{"model":"m","input":[{"type":"reasoning","id":"r","summary":[],"encrypted_content":"AAA"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}`
	b := strings.Replace(a, "AAA", "AAB", 1)
	ra, _ := ParseDialect(DialectResponses, []byte(a))
	rb, _ := ParseDialect(DialectResponses, []byte(b))
	if ra.Messages[0].Digest == rb.Messages[0].Digest {
		t.Fatal("two turns that differ in their encrypted reasoning have one digest")
	}
}

func TestResponsesStringInput(t *testing.T) {
	body := `{"model":"m","input":"hello"}`
	r, err := ParseDialect(DialectResponses, []byte(body))
	if err != nil || len(r.Messages) != 1 || Text(r.Messages[0]) != "hello" {
		t.Fatalf("%v %+v", err, r)
	}
	if got := r.Build(r.Messages, nil); string(got) != body {
		t.Fatalf("got %s", got)
	}
}

const messagesBody = `{"model":"claude","max_tokens":512,"system":[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}],"messages":[` +
	`{"role":"user","content":"list files"},` +
	`{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"SIG1"},{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls"}},{"type":"tool_use","id":"t2","name":"Read","input":{"file_path":"a.go"}}]},` +
	`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.go"},{"type":"tool_result","tool_use_id":"t2","content":[{"type":"text","text":"package a"}]},{"type":"text","text":"<system-reminder>x</system-reminder>","cache_control":{"type":"ephemeral"}}]},` +
	`{"role":"assistant","content":[{"type":"thinking","thinking":"next","signature":"SIG2"},{"type":"tool_use","id":"t3","name":"Read","input":{"file_path":"b.go"}}]},` +
	`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t3","content":"package b"}]}` +
	`],"tools":[{"name":"Bash","input_schema":{"type":"object"}}],"stream":true}`

func TestMessagesMapping(t *testing.T) {
	r, err := ParseDialect(DialectMessages, []byte(messagesBody))
	if err != nil {
		t.Fatal(err)
	}
	var roles []string
	for _, m := range r.Messages {
		roles = append(roles, m.Role)
	}
	want := "system user assistant tool tool user assistant tool"
	if got := strings.Join(roles, " "); got != want {
		t.Fatalf("roles %q, want %q", got, want)
	}
	if r.MaxTokens != 512 || r.Param(5) != "messages[2]" {
		t.Fatalf("max %d param %q", r.MaxTokens, r.Param(5))
	}
	if got := r.Build(r.Messages, nil); !jsonEqual(t, got, []byte(messagesBody)) {
		t.Fatalf("rebuilt body differs:\n%s", got)
	}
	// Cut after the first turn's results: the tail opens on the reminder
	// text of message 2, then the last turn, whose result is trimmed.
	tail := append([]Message(nil), r.Messages[5:]...)
	tail[2] = WithContentText(tail[2], "[trimmed]")
	view := append([]Message{r.Messages[0], NewTextMessage("user", "SUMMARY"), NewTextMessage("assistant", "Noted.")}, tail...)
	body := r.Build(view, nil)
	var got struct {
		System   json.RawMessage   `json:"system"`
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatalf("%v:\n%s", err, body)
	}
	wantMsgs := []string{
		`{"role":"user","content":"SUMMARY"}`,
		`{"role":"assistant","content":"Noted."}`,
		`{"role":"user","content":[{"type":"text","text":"<system-reminder>x</system-reminder>","cache_control":{"type":"ephemeral"}}]}`,
		`{"role":"assistant","content":[{"type":"thinking","thinking":"next","signature":"SIG2"},{"type":"tool_use","id":"t3","name":"Read","input":{"file_path":"b.go"}}]}`,
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t3","content":"[trimmed]"}]}`,
	}
	if len(got.Messages) != len(wantMsgs) {
		t.Fatalf("messages:\n%s", body)
	}
	for i, w := range wantMsgs {
		if string(got.Messages[i]) != w {
			t.Errorf("messages[%d] = %s, want %s", i, got.Messages[i], w)
		}
	}
	if !bytes.Contains(body, []byte(`"system":[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}]`)) {
		t.Errorf("system changed:\n%s", body)
	}
}

func TestMessagesEditedTurn(t *testing.T) {
	r, err := ParseDialect(DialectMessages, []byte(messagesBody))
	if err != nil {
		t.Fatal(err)
	}
	// Pairing repair drops call t2: its tool_use block goes, the thinking
	// block and the rest stay as they were.
	turn := DropToolCalls(r.Messages[2], []int{1})
	view := []Message{r.Messages[0], r.Messages[1], turn, r.Messages[3]}
	body := r.Build(view, nil)
	if !bytes.Contains(body, []byte(`{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"SIG1"},{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls"}}]}`)) {
		t.Fatalf("edited turn:\n%s", body)
	}
	if !bytes.Contains(body, []byte(`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.go"}]}`)) {
		t.Fatalf("results:\n%s", body)
	}
}

func TestMessagesDigestIgnoresCacheControl(t *testing.T) {
	a := `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}`
	b := `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`
	c := `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":[{"type":"text","text":"ho"}]}]}`
	for _, tc := range [][2]string{
		{`{"cache_control":{"type":"ephemeral"},"type":"text","text":"hi"}`, `{"type":"text","text":"hi"}`},
		{`{"type":"text", "cache_control":{"type":"ephemeral"}, "text":"hi"}`, `{"type":"text", "text":"hi"}`},
		{`{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"x","cache_control":{"type":"ephemeral"}}]}`, `{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"x"}]}`},
	} {
		if got := withoutCacheControl([]byte(tc[0])); string(got) != tc[1] {
			t.Errorf("withoutCacheControl(%s) = %s", tc[0], got)
		}
	}
	ra, _ := ParseDialect(DialectMessages, []byte(a))
	rb, _ := ParseDialect(DialectMessages, []byte(b))
	rc, _ := ParseDialect(DialectMessages, []byte(c))
	if ra.Messages[0].Digest != rb.Messages[0].Digest {
		t.Error("a moved cache_control marker changes the message's digest")
	}
	if rb.Messages[0].Digest == rc.Messages[0].Digest {
		t.Error("two texts have one digest")
	}
	if got := ra.Build(ra.Messages, nil); string(got) != a {
		t.Errorf("the marker is not forwarded as sent: %s", got)
	}
}

// FuzzParseDialect: any body either fails to parse with a ParseError or
// maps to messages whose rendering — as parsed, with a prefix cut off and
// with a summary in front — is valid JSON that parses again.
func FuzzParseDialect(f *testing.F) {
	f.Add(uint8(1), responsesBody)
	f.Add(uint8(2), messagesBody)
	f.Add(uint8(1), nativeResponsesBody)
	f.Add(uint8(2), nativeMessagesBody)
	f.Add(uint8(1), `{"input":"x","instructions":null}`)
	f.Add(uint8(2), `{"system":"s","messages":[{"role":"user","content":[]}]}`)
	f.Add(uint8(2), string(nestedCacheControl(4800, "cache_control")))
	f.Add(uint8(1), `{"input":[{"role":"user","content":"\ud800x"}]}`)
	f.Fuzz(func(t *testing.T, which uint8, body string) {
		d := DialectResponses
		if which%2 == 0 {
			d = DialectMessages
		}
		var (
			r   *Request
			err error
		)
		checkLinearWork(t, len(body), func() { r, err = ParseDialect(d, []byte(body)) })
		if err != nil {
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Fatalf("not a ParseError: %v", err)
			}
			return
		}
		views := [][]Message{r.Messages}
		if n := len(r.Messages); n > 1 {
			cut := append([]Message{NewTextMessage("user", "S")}, r.Messages[n/2:]...)
			views = append(views, cut)
			edited := append([]Message(nil), r.Messages...)
			edited[n-1] = WithContentText(edited[n-1], "edited")
			views = append(views, edited)
		}
		for _, v := range views {
			var out []byte
			checkLinearWork(t, len(body), func() { out = r.Build(v, nil) })
			if !json.Valid(out) {
				t.Fatalf("invalid JSON rendered: %s", out)
			}
			if _, err := ParseDialect(d, out); err != nil {
				t.Fatalf("rendered body does not parse: %v\n%s", err, out)
			}
		}
	})
}

func TestParseDialectRejectsWhatIsNotOneObject(t *testing.T) {
	for _, body := range []string{`{"input":"x"} {}`, `{"input":"x"`, `[]`, `{"input":"x",}`, `{"input":"x"} x`, ``} {
		var pe *ParseError
		if _, err := ParseDialect(DialectResponses, []byte(body)); !errors.As(err, &pe) {
			t.Errorf("%q: err %v, want a ParseError", body, err)
		}
	}
	if _, err := ParseDialect(DialectResponses, []byte(" {\"input\":\"x\"}\n")); err != nil {
		t.Errorf("whitespace around the object: %v", err)
	}
}

// Pairing repair removes the second of two calls sharing an id (the first
// is kept): the rendered turn keeps exactly one call item of that id, the
// first, in both APIs.
func TestEditedTurnDropsDuplicateCall(t *testing.T) {
	cases := []struct {
		name     string
		d        Dialect
		body     string
		turn     int
		call     string // how a call item starts
		first    string // a part of the first call only
		second   string // a part of the second call only
		wantKept int
	}{
		{"responses", DialectResponses, `{"model":"m","input":[{"type":"message","role":"user","content":"ls"},{"type":"reasoning","id":"rs_1","summary":[]},{"type":"function_call","call_id":"c","name":"ls","arguments":"{\"dir\":\"a\"}"},{"type":"function_call","call_id":"c","name":"ls","arguments":"{\"dir\":\"b\"}"},{"type":"function_call_output","call_id":"c","output":"a.txt"}]}`,
			1, `{"type":"function_call"`, `\"dir\":\"a\"`, `\"dir\":\"b\"`, 1},
		{"messages", DialectMessages, `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"ls"},{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"S"},{"type":"tool_use","id":"t","name":"ls","input":{"dir":"a"}},{"type":"tool_use","id":"t","name":"ls","input":{"dir":"b"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"a.txt"}]}]}`,
			1, `{"type":"tool_use"`, `"dir":"a"`, `"dir":"b"`, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseDialect(tc.d, []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			view := append([]Message(nil), r.Messages...)
			if len(view[tc.turn].ToolCalls) != 2 {
				t.Fatalf("turn has %d calls, want 2", len(view[tc.turn].ToolCalls))
			}
			view[tc.turn] = DropToolCalls(view[tc.turn], []int{1})
			body := string(r.Build(view, nil))
			if n := strings.Count(body, tc.call); n != tc.wantKept || !strings.Contains(body, tc.first) || strings.Contains(body, tc.second) {
				t.Errorf("%d call items (want %d, the first):\n%s", n, tc.wantKept, body)
			}
			if !strings.Contains(body, `"thinking":"hmm"`) && !strings.Contains(body, `"rs_1"`) {
				t.Errorf("the turn's reasoning was lost:\n%s", body)
			}
		})
	}
}
