package wire

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// The table is indexed by chat.Dialect and every API is found by its name
// and has a route of its own.
func TestAPIsTable(t *testing.T) {
	routes := map[string]bool{}
	for i, api := range APIs {
		if int(api.Dialect) != i || For(api.Dialect) != api {
			t.Errorf("APIs[%d] is %s", i, api.Dialect)
		}
		if got, ok := Named(api.Dialect.String()); !ok || got != api {
			t.Errorf("Named(%q) = %v, %v", api.Dialect, got, ok)
		}
		if routes[api.Route] {
			t.Errorf("route %s twice", api.Route)
		}
		routes[api.Route] = true
		var env map[string]json.RawMessage
		if json.Unmarshal(api.ErrorBody(400, "invalid_request_error", "c", "p", "m"), &env) != nil || env["error"] == nil {
			t.Errorf("%s: error body is not an error envelope", api.Dialect)
		}
	}
}

// streamSeeds are real streams of each API: chat completions with usage
// on a content chunk, a usage-only chunk and llama.cpp's timings;
// Responses' full-size events; Messages' start, delta and stop.
var streamSeeds = []string{
	"data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"a\":1},\"usage\":{\"b\":2}}\n\n",
	"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
	"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"timings\":{\"prompt_n\":7,\"cache_n\":3,\"predicted_n\":2}}\n\n",
	"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"instructions\":\"" + strings.Repeat("x", 5000) + "\"}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":4}}}}\n\n",
	"event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"Your input exceeds the context window of this model.\"}}}\n\n",
	"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":20,\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
	": ping\n\ndata: {\"id\":1}\r\n\r\n",
}

// events splits a stream into its SSE events as the proxy's relay does.
func events(stream []byte) [][]byte {
	var out [][]byte
	var ev []byte
	for len(stream) > 0 {
		i := bytes.IndexByte(stream, '\n')
		line := stream
		if i >= 0 {
			line = stream[:i+1]
		}
		stream = stream[len(line):]
		ev = append(ev, line...)
		if IsBlank(line) {
			out = append(out, ev)
			ev = nil
		}
	}
	if len(ev) > 0 {
		out = append(out, ev)
	}
	return out
}

// FuzzEvents feeds any event stream to every API's stream rules and checks
// what the relay relies on: the Responses and Messages events pass
// byte-for-byte; an answer completes at most once there, and usage is
// reported when it does; a chat stream that hides the usage the proxy
// asked for relays no top-level usage member it could cut, and never
// rewrites an event it does not cut.
func FuzzEvents(f *testing.F) {
	for _, s := range streamSeeds {
		f.Add([]byte(s), uint8(0), true)
	}
	f.Fuzz(func(t *testing.T, stream []byte, which uint8, hide bool) {
		api := APIs[int(which)%len(APIs)]
		st := api.NewStream(hide)
		completes := 0
		for _, ev := range events(stream) {
			step := st.Event(ev)
			if step.Complete {
				completes++
			}
			if api.Dialect != chat.DialectChat {
				if !bytes.Equal(step.Relay, ev) {
					t.Fatalf("%s rewrote %q to %q", api.Dialect, ev, step.Relay)
				}
				if step.Complete != step.Report {
					t.Fatalf("%s: complete %v but report %v at %q", api.Dialect, step.Complete, step.Report, ev)
				}
				continue
			}
			if !hide {
				if !bytes.Equal(step.Relay, ev) {
					t.Fatalf("chat rewrote %q to %q without hiding usage", ev, step.Relay)
				}
				continue
			}
			if step.Relay == nil || bytes.Equal(step.Relay, ev) || !json.Valid(EventData(ev)) {
				continue // (an invalid object is cut as far as it reads)
			}
			// Rewritten: one usage member cut (the first: an upstream
			// that repeats the key is not served better), the rest kept.
			before, after := members(t, EventData(ev)), members(t, EventData(step.Relay))
			if len(after) != len(before)-1 {
				t.Fatalf("rewritten %q to %q: members %v, then %v", ev, step.Relay, before, after)
			}
			cut := false
			for i, k := range before {
				switch {
				case !cut && k == "usage":
					cut = true
				case after[i-b2i(cut)] != k:
					t.Fatalf("rewritten %q to %q: members %v, then %v", ev, step.Relay, before, after)
				}
			}
		}
		if api.Dialect != chat.DialectChat && completes > 1 {
			t.Fatalf("%s completed %d times", api.Dialect, completes)
		}
	})
}

// FuzzHoldEarly: what the Responses early-failure reader holds is never
// lost: without a failure the replay is the stream as it came; with one,
// the failure is an error envelope and the replay starts with the stream.
func FuzzHoldEarly(f *testing.F) {
	for _, s := range streamSeeds {
		f.Add([]byte(s), uint16(0))
	}
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint16) {
		var r io.Reader = bytes.NewReader(stream)
		if chunk%7 == 1 {
			r = iotest.OneByteReader(r)
		}
		replay, failure := ResponsesAPI.HoldEarly(io.NopCloser(r))
		got, err := io.ReadAll(replay)
		if err != nil {
			t.Fatal(err)
		}
		if failure == nil {
			if !bytes.Equal(got, stream) {
				t.Fatalf("replay %q, want %q", got, stream)
			}
			return
		}
		var env struct {
			Error json.RawMessage `json:"error"`
		}
		if json.Unmarshal(failure, &env) != nil || len(env.Error) == 0 {
			t.Fatalf("failure %q is not an error envelope", failure)
		}
		if !bytes.HasPrefix(stream, got) {
			t.Fatalf("replay %q is not the stream's start", got)
		}
	})
}

// members lists the top-level member names of a JSON object, in order.
func members(t *testing.T, data []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("not an object: %q", data)
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("not an object: %q", data)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("not an object: %q", data)
		}
		keys = append(keys, tok.(string))
	}
	return keys
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// FuzzSummaryText: any answer body, under every API, gives a trimmed text
// or an error, and an answer that carries text gives it back.
func FuzzSummaryText(f *testing.F) {
	f.Add([]byte(`{"choices":[{"message":{"content":"## Goal\nx"},"finish_reason":"stop"}]}`), "## Goal\nx")
	f.Add([]byte(`{"output":[{"type":"message","content":[{"type":"output_text","text":"s"}]}],"status":"completed"}`), "s")
	f.Add([]byte(`{"content":[{"type":"text","text":"s"}],"stop_reason":"end_turn"}`), " s ")
	f.Fuzz(func(t *testing.T, body []byte, text string) {
		q, _ := json.Marshal(text)
		answers := map[chat.Dialect]string{
			chat.DialectChat:      `{"choices":[{"message":{"content":` + string(q) + `},"finish_reason":"stop"}]}`,
			chat.DialectResponses: `{"output":[{"type":"message","content":[{"type":"output_text","text":` + string(q) + `}]}],"status":"completed"}`,
			chat.DialectMessages:  `{"content":[{"type":"text","text":` + string(q) + `}],"stop_reason":"end_turn"}`,
		}
		for _, api := range APIs {
			got, why, err := api.SummaryText(body)
			if err == nil && (got != strings.TrimSpace(got) || (got == "" && why == "")) {
				t.Fatalf("%s: text %q, why %q", api.Dialect, got, why)
			}
			var sent string // the text as JSON carries it (invalid UTF-8 replaced)
			_ = json.Unmarshal(q, &sent)
			want := strings.TrimSpace(sent)
			if got, _, err := api.SummaryText([]byte(answers[api.Dialect])); err != nil || got != want {
				t.Fatalf("%s: text %q (%v), want %q", api.Dialect, got, err, want)
			}
		}
	})
}
