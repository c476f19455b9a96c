package pairing

import (
	"fmt"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Builders. An id of "" means the id is missing.

func user() Message      { return Message{Role: "user"} }
func system() Message    { return Message{Role: "system"} }
func developer() Message { return Message{Role: "developer"} }
func text() Message      { return Message{Role: "assistant", HasContent: true} }

func asst(ids ...string) Message {
	m := Message{Role: "assistant", Calls: []Call{}}
	for _, id := range ids {
		m.Calls = append(m.Calls, Call{ID: id, HasID: id != "", Name: "f"})
	}
	return m
}

func asstText(ids ...string) Message { m := asst(ids...); m.HasContent = true; return m }

func tool(id string) Message {
	return Message{Role: "tool", ToolCallID: id, HasToolCallID: id != ""}
}

func fcall() Message    { return Message{Role: "assistant", FunctionCall: true} }
func function() Message { return Message{Role: "function", Name: "get_weather"} }

func msgs(ms ...Message) []Message { return ms }

// v is a violation without Role, which the tables do not compare.
func v(i int, k Kind, id string, call int) Violation {
	return Violation{Index: i, Kind: k, ID: id, Call: call}
}

func stripRoles(vs []Violation) []Violation {
	if len(vs) == 0 {
		return nil
	}
	out := make([]Violation, len(vs))
	for i, x := range vs {
		x.Role = ""
		out[i] = x
	}
	return out
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name string
		in   []Message
		want []Violation
	}{
		// Valid shapes.
		{"empty", nil, nil},
		{"plain chat", msgs(system(), user(), text(), user(), text()), nil},
		{"one call answered", msgs(user(), asst("c1"), tool("c1"), text()), nil},
		{"three parallel calls answered in another order", msgs(user(), asst("c1", "c2", "c3"), tool("c3"), tool("c1"), tool("c2"), text()), nil},
		{"calls with text content", msgs(user(), asstText("c1", "c2"), tool("c1"), tool("c2")), nil},
		{"empty calls slice", msgs(user(), asst(), user()), nil},
		{"nil calls", msgs(user(), Message{Role: "assistant"}, user()), nil},
		{"two turns each with calls", msgs(user(), asst("c1", "c2"), tool("c2"), tool("c1"), asst("c3"), tool("c3"), text()), nil},
		{"request ends on answered tool", msgs(user(), asst("c1"), tool("c1")), nil},
		{"legacy function call", msgs(user(), fcall(), function(), text()), nil},
		{"unknown roles without tools", msgs(Message{Role: "ipython"}, user()), nil},
		{"calls on a non-assistant are ignored", msgs(Message{Role: "user", Calls: []Call{{ID: "x", HasID: true}}}, user()), nil},

		// Shapes a naive last-K slice creates.
		{"tail starts on a tool message", msgs(tool("c1"), text(), user()),
			[]Violation{v(0, OrphanToolResult, "c1", -1)}},
		{"tail starts on the second parallel result", msgs(tool("c2"), tool("c3"), text(), user()),
			[]Violation{v(0, OrphanToolResult, "c2", -1), v(1, OrphanToolResult, "c3", -1)}},

		// orphan_tool_result
		{"tool after plain user", msgs(user(), tool("c1")), []Violation{v(1, OrphanToolResult, "c1", -1)}},
		{"tool answering an unknown id", msgs(asst("c1"), tool("c1"), tool("c9")), []Violation{v(2, OrphanToolResult, "c9", -1)}},
		{"tool answering an older turn", msgs(asst("c1"), asst("c2"), tool("c2"), tool("c1")),
			[]Violation{v(0, UnansweredToolCall, "c1", 0), v(3, OrphanToolResult, "c1", -1)}},
		{"answer before its call", msgs(tool("c1"), asst("c1"), tool("c1")), []Violation{v(0, OrphanToolResult, "c1", -1)}},

		// unanswered_tool_call
		{"request ends on unanswered calls", msgs(user(), asst("c1", "c2")),
			[]Violation{v(1, UnansweredToolCall, "c1", 0), v(1, UnansweredToolCall, "c2", 1)}},
		{"one of two parallel calls unanswered", msgs(asst("c1", "c2"), tool("c2"), text()),
			[]Violation{v(0, UnansweredToolCall, "c1", 0)}},
		{"user right after calls, never answered", msgs(asst("c1"), user()), []Violation{v(0, UnansweredToolCall, "c1", 0)}},
		{"next turn before answers", msgs(asst("c1"), asst("c2"), tool("c2")), []Violation{v(0, UnansweredToolCall, "c1", 0)}},

		// duplicate_tool_call_id
		{"id reused by a later call", msgs(asst("c1"), tool("c1"), asst("c1"), tool("c1")),
			[]Violation{v(2, DuplicateToolCallID, "c1", 0), v(3, DuplicateToolCallID, "c1", -1)}},
		{"id twice in one message", msgs(asst("c1", "c1"), tool("c1")), []Violation{v(0, DuplicateToolCallID, "c1", 1)}},
		{"answered twice", msgs(asst("c1"), tool("c1"), tool("c1")), []Violation{v(2, DuplicateToolCallID, "c1", -1)}},
		{"answered again after text", msgs(asst("c1"), tool("c1"), text(), tool("c1")), []Violation{v(3, DuplicateToolCallID, "c1", -1)}},

		// interleaved_message
		{"user between calls and answers", msgs(asst("c1", "c2"), tool("c1"), user(), tool("c2")),
			[]Violation{v(2, InterleavedMessage, "c2", -1)}},
		{"system right after calls", msgs(asst("c1"), system(), tool("c1")), []Violation{v(1, InterleavedMessage, "c1", -1)}},
		{"only the first interleaving message is reported", msgs(asst("c1", "c2"), user(), developer(), tool("c2"), user(), tool("c1")),
			[]Violation{v(1, InterleavedMessage, "c2", -1)}},
		{"assistant text interleaves", msgs(asst("c1", "c2"), tool("c1"), text(), tool("c2")),
			[]Violation{v(2, InterleavedMessage, "c2", -1)}},
		{"interleaved and partly unanswered", msgs(asst("c1", "c2"), user(), tool("c2")),
			[]Violation{v(0, UnansweredToolCall, "c1", 0), v(1, InterleavedMessage, "c2", -1)}},
		{"late answer answered twice", msgs(asst("c1"), user(), tool("c1"), tool("c1")),
			[]Violation{v(1, InterleavedMessage, "c1", -1), v(3, DuplicateToolCallID, "c1", -1)}},

		// missing_tool_call_id
		{"tool without tool_call_id", msgs(asst("c1"), tool("c1"), tool("")), []Violation{v(2, MissingToolCallID, "", -1)}},
		{"tool with empty tool_call_id", msgs(asst("c1"), tool("c1"), Message{Role: "tool", HasToolCallID: true}),
			[]Violation{v(2, MissingToolCallID, "", -1)}},
		{"call without id", msgs(asst("c1", ""), tool("c1")), []Violation{v(0, MissingToolCallID, "", 1)}},

		// orphan_function_result
		{"function after user", msgs(user(), function()), []Violation{v(1, OrphanFunctionResult, "", -1)}},
		{"second function result", msgs(fcall(), function(), function()), []Violation{v(2, OrphanFunctionResult, "", -1)}},
		{"function after tool_calls assistant", msgs(asst("c1"), tool("c1"), function()), []Violation{v(2, OrphanFunctionResult, "", -1)}},
		{"orphan function that also interleaves", msgs(asst("c1"), function(), tool("c1")),
			[]Violation{v(1, OrphanFunctionResult, "", -1), v(1, InterleavedMessage, "c1", -1)}},

		{"first violation in message order", msgs(asst("c1", "c2"), tool("c1"), tool("c9"), user()),
			[]Violation{v(0, UnansweredToolCall, "c2", 1), v(2, OrphanToolResult, "c9", -1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := stripRoles(Check(tt.in))
			if len(got) == 0 && len(tt.want) == 0 {
				return
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Check =\n  %+v\nwant\n  %+v", got, tt.want)
			}
			if o := stripRoles(oracle(tt.in)); !reflect.DeepEqual(o, tt.want) {
				t.Errorf("oracle disagrees with the table: %+v", o)
			}
		})
	}
}

func TestCheckRole(t *testing.T) {
	got := Check(msgs(asst("c1"), developer(), tool("c1")))
	if len(got) != 1 || got[0].Role != "developer" {
		t.Fatalf("got %+v, want one violation naming the developer message", got)
	}
}

func TestDescribe(t *testing.T) {
	tests := []struct {
		name string
		in   []Message
		want string
	}{
		{"orphan", msgs(user(), tool("call_7")),
			`messages[9]: role "tool" message with tool_call_id "call_7" does not answer a tool call of the preceding assistant message (orphan_tool_result); every tool message must directly follow the assistant message whose tool_calls contains its id`},
		{"unanswered", msgs(asst("call_1", "call_2"), tool("call_1")),
			`messages[9]: tool call "call_2" (tool_calls[1]) of this assistant message is not answered (unanswered_tool_call); every id in an assistant message's tool_calls must be answered by a role "tool" message directly following it, before any other message`},
		{"duplicate call", msgs(asst("call_1", "call_1"), tool("call_1")),
			`messages[9]: tool call id "call_1" (tool_calls[1]) is already used by an earlier tool call (duplicate_tool_call_id); tool call ids must be unique in the conversation`},
		{"duplicate answer", msgs(asst("call_1"), tool("call_1"), tool("call_1")),
			`messages[9]: role "tool" message with tool_call_id "call_1" answers a tool call that an earlier tool message already answered (duplicate_tool_call_id); each tool call is answered exactly once`},
		{"interleaved", msgs(asst("call_1"), user(), tool("call_1")),
			`messages[9]: role "user" message comes between an assistant message's tool calls and the role "tool" message answering tool_call_id "call_1" (interleaved_message); tool messages must directly follow the assistant message whose tool_calls they answer, with no other message in between`},
		{"missing call id", msgs(asst("")),
			`messages[9]: tool_calls[0] of this assistant message has no id (missing_tool_call_id); every tool call needs an id for its tool message to answer`},
		{"missing tool_call_id", msgs(tool("")),
			`messages[9]: role "tool" message has no tool_call_id (missing_tool_call_id); every tool message must name the id of the tool call it answers`},
		{"orphan function", msgs(function()),
			`messages[9]: role "function" message does not directly follow an assistant message with a function_call (orphan_function_result); a legacy function result must come right after the assistant message that made the function_call`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vs := Check(tt.in)
			if len(vs) == 0 {
				t.Fatal("no violation")
			}
			if got := vs[0].Describe(9); got != tt.want {
				t.Errorf("Describe(9) =\n  %s\nwant\n  %s", got, tt.want)
			}
			if got, want := vs[0].Message(), "messages["+strconv.Itoa(vs[0].Index)+"]"; !strings.HasPrefix(got, want) {
				t.Errorf("Message() = %q, want prefix %q", got, want)
			}
		})
	}
	if got := (Violation{Kind: "new_rule", ID: "x"}).Describe(1); !strings.Contains(got, "new_rule") {
		t.Errorf("unknown kind: %q", got)
	}
}

func TestRepair(t *testing.T) {
	r := func(i, call int, k Kind, id string) Removal { return Removal{Index: i, Call: call, Kind: k, ID: id} }
	tests := []struct {
		name    string
		in      []Message
		want    []Message
		removed []Removal
	}{
		{"valid stays", msgs(user(), asst("c1", "c2"), tool("c2"), tool("c1"), text()),
			msgs(user(), asst("c1", "c2"), tool("c2"), tool("c1"), text()), nil},
		{"tail starts on a tool message", msgs(tool("c1"), text(), user()),
			msgs(text(), user()), []Removal{r(0, -1, OrphanToolResult, "c1")}},
		{"tail starts on the second parallel result", msgs(tool("c2"), tool("c3"), text(), user()),
			msgs(text(), user()), []Removal{r(0, -1, OrphanToolResult, "c2"), r(1, -1, OrphanToolResult, "c3")}},
		{"unanswered call dropped, message kept for the others", msgs(user(), asst("c1", "c2"), tool("c2")),
			msgs(user(), asst("c2"), tool("c2")), []Removal{r(1, 0, UnansweredToolCall, "c1")}},
		{"request ends on unanswered calls: message removed", msgs(user(), asst("c1", "c2")),
			msgs(user()), []Removal{r(1, -1, UnansweredToolCall, "c1"), r(1, 0, UnansweredToolCall, "c1"), r(1, 1, UnansweredToolCall, "c2")}},
		{"unanswered calls with text: message kept without calls", msgs(user(), asstText("c1")),
			msgs(user(), asstText()), []Removal{r(1, 0, UnansweredToolCall, "c1")}},
		{"unanswered calls with function_call: message kept", msgs(user(), Message{Role: "assistant", FunctionCall: true, Calls: []Call{{ID: "c1", HasID: true}}}, function()),
			msgs(user(), Message{Role: "assistant", FunctionCall: true, Calls: []Call{}}, function()), []Removal{r(1, 0, UnansweredToolCall, "c1")}},
		{"interleaved: late call and answer dropped, user kept", msgs(asst("c1", "c2"), tool("c1"), user(), tool("c2")),
			msgs(asst("c1"), tool("c1"), user()), []Removal{r(0, 1, InterleavedMessage, "c2"), r(3, -1, InterleavedMessage, "c2")}},
		{"interleaved right after the calls", msgs(asst("c1"), system(), tool("c1"), user()),
			msgs(system(), user()), []Removal{r(0, -1, InterleavedMessage, "c1"), r(0, 0, InterleavedMessage, "c1"), r(2, -1, InterleavedMessage, "c1")}},
		{"duplicate call and its answer", msgs(asst("c1"), tool("c1"), asst("c1"), tool("c1"), text()),
			msgs(asst("c1"), tool("c1"), text()), []Removal{r(2, -1, DuplicateToolCallID, "c1"), r(2, 0, DuplicateToolCallID, "c1"), r(3, -1, DuplicateToolCallID, "c1")}},
		{"duplicate answer", msgs(asst("c1"), tool("c1"), tool("c1")),
			msgs(asst("c1"), tool("c1")), []Removal{r(2, -1, DuplicateToolCallID, "c1")}},
		{"id of a dropped call may be reused", msgs(asst("c1"), user(), asst("c1"), tool("c1")),
			msgs(user(), asst("c1"), tool("c1")), []Removal{r(0, -1, UnansweredToolCall, "c1"), r(0, 0, UnansweredToolCall, "c1")}},
		{"missing ids", msgs(asst("c1", ""), tool("c1"), tool("")),
			msgs(asst("c1"), tool("c1")), []Removal{r(0, 1, MissingToolCallID, ""), r(2, -1, MissingToolCallID, "")}},
		{"orphan function removed without ending the turn", msgs(asst("c1"), function(), tool("c1")),
			msgs(asst("c1"), tool("c1")), []Removal{r(1, -1, OrphanFunctionResult, "")}},
		{"legacy function kept", msgs(fcall(), function(), function()),
			msgs(fcall(), function()), []Removal{r(2, -1, OrphanFunctionResult, "")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.in)
			got, removed := Repair(tt.in)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("out =\n  %+v\nwant\n  %+v", got, tt.want)
			}
			if !reflect.DeepEqual(removed, tt.removed) {
				t.Errorf("removed =\n  %+v\nwant\n  %+v", removed, tt.removed)
			}
			if vs := Check(got); vs != nil {
				t.Errorf("output fails Check: %+v", vs)
			}
			if !reflect.DeepEqual(in, tt.in) {
				t.Error("Repair modified its input")
			}
		})
	}
}

// TestPure keeps the package on the standard library (DESIGN § Layout).
func TestPure(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if strings.Contains(strings.SplitN(path, "/", 2)[0], ".") {
				t.Errorf("%s imports %s: pairing is standard library only", name, path)
			}
		}
	}
}

// oracle is an independent, deliberately naive statement of Check's rules:
// every question is answered by scanning the conversation again, with no
// running state. Quadratic (and worse), obviously slow, easy to read.
func oracle(ms []Message) []Violation {
	isTurn := func(i int) bool { return ms[i].Role == "assistant" && len(ms[i].Calls) > 0 }
	callID := func(c Call) (string, bool) { return c.ID, c.HasID && c.ID != "" }
	toolID := func(i int) (string, bool) {
		return ms[i].ToolCallID, ms[i].Role == "tool" && ms[i].HasToolCallID && ms[i].ToolCallID != ""
	}
	// turnOf is the closest preceding assistant message with calls, -1 = none.
	turnOf := func(i int) int {
		for a := i - 1; a >= 0; a-- {
			if isTurn(a) {
				return a
			}
		}
		return -1
	}
	// turnEnd is where the turn opened at a stops: the next assistant with calls.
	turnEnd := func(a int) int {
		for e := a + 1; e < len(ms); e++ {
			if isTurn(e) {
				return e
			}
		}
		return len(ms)
	}
	// firstUse: no call anywhere before (a, j) has the same id.
	firstUse := func(a, j int) bool {
		id, ok := callID(ms[a].Calls[j])
		if !ok {
			return false
		}
		for b := 0; b <= a; b++ {
			if !isTurn(b) {
				continue
			}
			for k, c := range ms[b].Calls {
				if b == a && k >= j {
					break
				}
				if cid, ok := callID(c); ok && cid == id {
					return false
				}
			}
		}
		return true
	}
	eligible := func(a int, id string) bool {
		for j := range ms[a].Calls {
			if cid, ok := callID(ms[a].Calls[j]); ok && cid == id && firstUse(a, j) {
				return true
			}
		}
		return false
	}
	// answers: tool k is the (first) answer to a call of its turn.
	answers := func(k int) bool {
		id, ok := toolID(k)
		if !ok {
			return false
		}
		a := turnOf(k)
		if a < 0 || !eligible(a, id) {
			return false
		}
		for x := a + 1; x < k; x++ {
			if xid, ok := toolID(x); ok && xid == id {
				return false
			}
		}
		return true
	}

	var out []Violation
	for i := range ms {
		m := ms[i]
		switch {
		case isTurn(i):
			end := turnEnd(i)
			for j, c := range m.Calls {
				id, ok := callID(c)
				if !ok {
					out = append(out, Violation{Index: i, Kind: MissingToolCallID, Call: j})
					continue
				}
				if !firstUse(i, j) {
					out = append(out, Violation{Index: i, Kind: DuplicateToolCallID, ID: id, Call: j})
					continue
				}
				answered := false
				for k := i + 1; k < end; k++ {
					if kid, _ := toolID(k); kid == id && answers(k) {
						answered = true
					}
				}
				if !answered {
					out = append(out, Violation{Index: i, Kind: UnansweredToolCall, ID: id, Call: j})
				}
			}
			// Interleaving: the first non-tool message inside the turn,
			// reported when some answer comes after it.
			for b := i + 1; b < end; b++ {
				if ms[b].Role == "tool" {
					continue
				}
				for k := b + 1; k < end; k++ {
					if answers(k) {
						out = append(out, Violation{Index: b, Kind: InterleavedMessage, ID: ms[k].ToolCallID, Call: -1})
						break
					}
				}
				break
			}
		case m.Role == "tool":
			id, ok := toolID(i)
			switch {
			case !ok:
				out = append(out, Violation{Index: i, Kind: MissingToolCallID, Call: -1})
			case answers(i):
			default:
				dup := false
				for k := 0; k < i; k++ {
					if kid, _ := toolID(k); kid == id && answers(k) {
						dup = true
					}
				}
				if dup {
					out = append(out, Violation{Index: i, Kind: DuplicateToolCallID, ID: id, Call: -1})
				} else {
					out = append(out, Violation{Index: i, Kind: OrphanToolResult, ID: id, Call: -1})
				}
			}
		case m.Role == "function":
			if i == 0 || ms[i-1].Role != "assistant" || !ms[i-1].FunctionCall {
				out = append(out, Violation{Index: i, Kind: OrphanFunctionResult, Call: -1})
			}
		}
	}
	// The documented order: index, call (-1 first), the message's own fault
	// before interleaving.
	slices.SortFunc(out, func(a, b Violation) int {
		if a.Index != b.Index {
			return a.Index - b.Index
		}
		if a.Call != b.Call {
			return a.Call - b.Call
		}
		if a.Kind == InterleavedMessage {
			return 1
		}
		if b.Kind == InterleavedMessage {
			return -1
		}
		return 0
	})
	return out
}

// genMessages turns fuzz bytes into a conversation: all roles (unknown ones
// too), ids from a four-letter alphabet so that collisions are common, missing
// and empty ids, function_call and function results, content flags.
func genMessages(data []byte) []Message {
	ids := [...]string{"a", "b", "c", "d", "e", "f"}
	pos := 0
	next := func() byte {
		if pos >= len(data) {
			return 0
		}
		b := data[pos]
		pos++
		return b
	}
	// id decodes one byte: mostly a present id, sometimes missing, sometimes
	// present-but-empty, sometimes absent with a stale value.
	id := func(b byte) (string, bool) {
		switch b >> 4 {
		case 0:
			return "", false
		case 1:
			if b&1 == 0 {
				return "", true
			}
			return ids[int(b>>1)%len(ids)], false
		default:
			return ids[int(b)%len(ids)], true
		}
	}
	var ms []Message
	for pos < len(data) && len(ms) < 48 {
		b := next()
		switch b % 10 {
		case 0:
			ms = append(ms, Message{Role: "user"})
		case 1:
			ms = append(ms, Message{Role: "system"})
		case 2:
			ms = append(ms, Message{Role: "developer"})
		case 3:
			ms = append(ms, Message{Role: []string{"", "ipython", "Tool"}[(b>>4)%3]})
		case 4, 5:
			// A second byte: flags, and whether to append well-formed
			// answers (rotated, so parallel results come in another order),
			// so that valid turns are common and mutations break them.
			f := next()
			m := Message{Role: "assistant", HasContent: f&1 != 0, FunctionCall: f&6 == 6}
			n := int(b>>6) % 4
			if b%10 == 4 && n == 0 {
				m.Calls = []Call{} // empty, not nil
			}
			for range n {
				cid, has := id(next())
				m.Calls = append(m.Calls, Call{ID: cid, HasID: has})
			}
			ms = append(ms, m)
			if f&0x18 != 0 && n > 0 {
				rot := int(f>>5) % n
				for k := range n {
					c := m.Calls[(k+rot)%n]
					ms = append(ms, Message{Role: "tool", ToolCallID: c.ID, HasToolCallID: c.HasID})
				}
			}
			if m.FunctionCall && f&0x80 != 0 {
				ms = append(ms, Message{Role: "function", Name: "f"})
			}
		case 6:
			ms = append(ms, Message{Role: "assistant", HasContent: true})
		case 7, 8:
			tid, has := id(next())
			ms = append(ms, Message{Role: "tool", ToolCallID: tid, HasToolCallID: has})
		case 9:
			ms = append(ms, Message{Role: "function", Name: "f"})
		}
	}
	return ms
}

func fuzzSeeds(f *testing.F) {
	// Hand-made: valid parallel calls, an orphan tail, interleaving, duplicates.
	for _, s := range []string{
		"", "\x00", "\x04", "\x06\xe0",
		"\x00\xc4\xe0\xe1\xe2\x06\xe2\x06\xe0\x07\xe1\x00",
		"\x06\xe1\x06\xe2\x00\x05",
		"\x44\xe0\x06\xe0\x00\x06\xe1",
		"\x44\xe0\x06\xe0\x44\xe0\x06\xe0\x06\xe0",
		"\x34\x09\x09\x44\x00\x09\x06\xe0",
	} {
		f.Add([]byte(s))
	}
}

func FuzzCheck(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		ms := genMessages(data)
		got := Check(ms)
		want := oracle(ms)
		if (len(got) == 0) != (len(want) == 0) {
			t.Fatalf("Check found %d violations, oracle %d\nmsgs %+v\ngot  %+v\nwant %+v", len(got), len(want), ms, got, want)
		}
		if !reflect.DeepEqual(stripRoles(got), want) {
			t.Fatalf("Check and oracle disagree\nmsgs %+v\ngot  %+v\nwant %+v", ms, got, want)
		}
		for _, x := range got {
			if x.Role != ms[x.Index].Role {
				t.Fatalf("violation %+v names role %q, message has %q", x, x.Role, ms[x.Index].Role)
			}
			if !strings.Contains(x.Message(), string(x.Kind)) {
				t.Fatalf("Message() does not name the rule: %s", x.Message())
			}
		}
	})
}

func FuzzRepair(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		ms := genMessages(data)
		orig := deepClone(ms)
		out, removed := Repair(ms)
		if !reflect.DeepEqual(ms, orig) {
			t.Fatalf("Repair modified its input")
		}
		if vs := Check(out); vs != nil {
			t.Fatalf("Repair output fails Check: %+v\nin  %+v\nout %+v\nremoved %+v", vs, ms, out, removed)
		}
		if (len(removed) == 0) != (Check(ms) == nil) {
			t.Fatalf("removed %d things, Check(in) = %+v", len(removed), Check(ms))
		}
		if _, again := Repair(out); again != nil {
			t.Fatalf("Repair is not idempotent: %+v", again)
		}
		if !slices.IsSortedFunc(removed, func(a, b Removal) int {
			if a.Index != b.Index {
				return a.Index - b.Index
			}
			return a.Call - b.Call
		}) {
			t.Fatalf("removals not sorted: %+v", removed)
		}
		// Only tool, function and assistant messages may go; an assistant
		// only when it has no content and no function_call; calls only from
		// assistant messages.
		for _, e := range removed {
			m := ms[e.Index]
			switch {
			case e.Call >= 0 && (m.Role != "assistant" || e.Call >= len(m.Calls)):
				t.Fatalf("removal %+v names no call of %+v", e, m)
			case e.Call == -1 && m.Role == "assistant" && (m.HasContent || m.FunctionCall):
				t.Fatalf("removed assistant with content or function_call: %+v", e)
			case e.Call == -1 && m.Role != "assistant" && m.Role != "tool" && m.Role != "function":
				t.Fatalf("removed a %q message: %+v", m.Role, e)
			}
		}
		// Applying the removals, by a different route, gives out.
		if rebuilt := applyRemovals(ms, removed); !(len(rebuilt) == 0 && len(out) == 0) && !reflect.DeepEqual(rebuilt, out) {
			t.Fatalf("removals do not describe the output\nrebuilt %+v\nout     %+v", rebuilt, out)
		}
	})
}

func deepClone(ms []Message) []Message {
	out := slices.Clone(ms)
	for i := range out {
		if out[i].Calls != nil {
			out[i].Calls = slices.Clone(out[i].Calls)
		}
	}
	return out
}

func applyRemovals(ms []Message, removed []Removal) []Message {
	type key struct{ i, c int }
	gone := map[key]bool{}
	for _, e := range removed {
		gone[key{e.Index, e.Call}] = true
	}
	var out []Message
	for i, m := range ms {
		if gone[key{i, -1}] {
			continue
		}
		lost := false
		for j := range m.Calls {
			lost = lost || gone[key{i, j}]
		}
		if lost {
			calls := []Call{}
			for j, c := range m.Calls {
				if !gone[key{i, j}] {
					calls = append(calls, c)
				}
			}
			m.Calls = calls
		}
		out = append(out, m)
	}
	return out
}

// benchConversation is 10,000 messages with 3,000 tool calls: blocks of
// user, assistant with three parallel calls, their results in another
// order, then text turns.
func benchConversation() []Message {
	ms := make([]Message, 0, 10000)
	for b := 0; b < 1000; b++ {
		id := func(k int) string { return fmt.Sprintf("call_%d_%d", b, k) }
		ms = append(ms, user(), asst(id(0), id(1), id(2)), tool(id(2)), tool(id(0)), tool(id(1)),
			text(), user(), text(), user(), text())
	}
	return ms
}

func BenchmarkCheck(b *testing.B) {
	ms := benchConversation()
	if vs := Check(ms); vs != nil {
		b.Fatalf("bench conversation invalid: %+v", vs)
	}
	b.Run("check", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if Check(ms) != nil {
				b.Fatal("violation")
			}
		}
	})
	// Baseline: one plain pass that reads the same fields Check reads.
	b.Run("baseline-loop", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			n := 0
			for i := range ms {
				if ms[i].Role == "tool" && ms[i].HasToolCallID {
					n++
				} else if ms[i].Role == "assistant" {
					n += len(ms[i].Calls)
				}
			}
			if n != 6000 {
				b.Fatal(n)
			}
		}
	})
	// Baseline: the unavoidable part of any id-uniqueness check, a set of
	// the 3,000 call ids.
	b.Run("baseline-idset", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			set := make(map[string]struct{}, 3000)
			for i := range ms {
				for _, c := range ms[i].Calls {
					set[c.ID] = struct{}{}
				}
			}
			if len(set) != 3000 {
				b.Fatal(len(set))
			}
		}
	})
}

func BenchmarkRepair(b *testing.B) {
	ms := benchConversation()
	b.ReportAllocs()
	for b.Loop() {
		if _, removed := Repair(ms); removed != nil {
			b.Fatal("removed")
		}
	}
}
