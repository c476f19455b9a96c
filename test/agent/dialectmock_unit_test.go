package agent

import (
	"strings"
	"testing"
)

// TestDialectMockChecks shows that the dialect mock's own checks, which
// the real-agent test relies on, can fail: broken pairing in each dialect,
// and the overflow recognizers.
func TestDialectMockChecks(t *testing.T) {
	responses := func(input string) []string {
		_, items, err := parseResponsesReq([]byte(`{"model":"m","input":` + input + `}`))
		if err != nil {
			t.Fatal(err)
		}
		return responsesPairing(items)
	}
	call := `{"type":"function_call","call_id":"c1","name":"exec_command","arguments":"{}"}`
	out := `{"type":"function_call_output","call_id":"c1","output":"ok"}`
	user := `{"type":"message","role":"user","content":[{"type":"input_text","text":"go on"}]}`
	reasoning := `{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"x"}`
	for name, tc := range map[string]struct {
		input string
		bad   bool
	}{
		"paired":                {"[" + user + "," + reasoning + "," + call + "," + out + "]", false},
		"orphan output":         {"[" + user + "," + out + "]", true},
		"unanswered at the end": {"[" + user + "," + call + "]", true},
		"message before output": {"[" + call + "," + user + "," + out + "]", true},
		"duplicate call id":     {"[" + call + "," + out + "," + call + "," + out + "]", true},
	} {
		if got := responses(tc.input); (len(got) > 0) != tc.bad {
			t.Errorf("responses %s: violations %v, want bad=%v", name, got, tc.bad)
		}
	}

	messages := func(msgs string) []string {
		_, ms, err := parseMessagesReq([]byte(`{"model":"m","messages":` + msgs + `}`))
		if err != nil {
			t.Fatal(err)
		}
		return messagesPairing(ms)
	}
	task := `{"role":"user","content":"review"}`
	use := `{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"s"},{"type":"tool_use","id":"tu1","name":"Read","input":{}}]}`
	result := `{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu1","content":"ok"}]}`
	text := `{"role":"assistant","content":"fine"}`
	for name, tc := range map[string]struct {
		msgs string
		bad  bool
	}{
		"paired":                 {"[" + task + "," + use + "," + result + "]", false},
		"orphan result":          {"[" + task + "," + text + "," + result + "]", true},
		"unanswered tool_use":    {"[" + task + "," + use + "," + task + "]", true},
		"ends on a tool_use":     {"[" + task + "," + use + "]", true},
		"result not right after": {"[" + task + "," + use + "," + task + "," + text + "," + result + "]", true},
	} {
		if got := messages(tc.msgs); (len(got) > 0) != tc.bad {
			t.Errorf("messages %s: violations %v, want bad=%v", name, got, tc.bad)
		}
	}

	for _, tc := range []struct {
		tr   turn
		over bool
	}{
		{turn{Status: 400, Resp: buf(`{"error":{"code":"context_length_exceeded"}}`)}, true},
		{turn{Status: 400, Resp: buf(`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 41000 tokens > 40000 maximum"}}`)}, true},
		{turn{Status: 200, Resp: buf("event: response.created\ndata: {}\n\nevent: response.failed\ndata: {\"response\":{\"error\":{\"code\":\"context_length_exceeded\"}}}\n\n")}, true},
		{turn{Status: 200, Resp: buf("event: response.completed\ndata: {}\n\n")}, false},
		{turn{Status: 400, Resp: buf(`{"error":{"code":"invalid_tool_pairing"}}`)}, false},
	} {
		if got := isOverflowAnswer(tc.tr); got != tc.over {
			t.Errorf("isOverflowAnswer(%d %q) = %v, want %v", tc.tr.Status, tc.tr.Resp.String(), got, tc.over)
		}
	}

	if !strings.Contains(string(cacheControlRE.ReplaceAll([]byte(`[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}]`), nil)), `"text":"a"}`) {
		t.Errorf("cache_control is not stripped from the rendered prompt")
	}
}

func buf(s string) *lockedBuffer {
	b := &lockedBuffer{}
	b.Write([]byte(s))
	return b
}
