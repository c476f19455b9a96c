package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// readerPool recycles the stream readers: one per streamed response would
// otherwise be an allocation per request. 16 KiB holds any ordinary event
// (longer lines are assembled by readLine); at 64 KiB, the 1,000 concurrent
// streams of make soak would hold 64 MiB in readers alone. An idlePool (one
// class): at most readerPoolBytes of idle readers (1,024), none after
// bodyPoolIdle without a stream ending.
var readerPool = newIdlePool[*bufio.Reader](1, readerPoolBytes, bodyPoolIdle)

const (
	streamReaderSize = 16 << 10
	readerPoolBytes  = 1024 * streamReaderSize
)

func isEventStream(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

// readLine returns the next line including its terminator. Lines of any
// length are supported: bufio.Reader.ReadSlice serves the common case
// without copying, and long lines (a whole file in one delta) are assembled
// in buf. A bufio.Scanner would fail past its 64 KiB token limit.
func readLine(br *bufio.Reader, buf []byte) ([]byte, []byte, error) {
	line, err := br.ReadSlice('\n')
	if err != bufio.ErrBufferFull {
		return line, buf, err
	}
	buf = append(buf[:0], line...)
	for {
		line, err = br.ReadSlice('\n')
		buf = append(buf, line...)
		if err != bufio.ErrBufferFull {
			return buf, buf, err
		}
	}
}

func isBlank(line []byte) bool {
	return len(bytes.TrimRight(line, "\r\n")) == 0
}

// eventData returns the concatenated data fields of one SSE event.
func eventData(ev []byte) []byte {
	var data []byte
	n := 0
	for len(ev) > 0 {
		i := bytes.IndexByte(ev, '\n')
		var line []byte
		if i < 0 {
			line, ev = ev, nil
		} else {
			line, ev = ev[:i], ev[i+1:]
		}
		line = bytes.TrimRight(line, "\r")
		if !bytes.HasPrefix(line, []byte("data:")) {
			continue
		}
		v := line[5:]
		if len(v) > 0 && v[0] == ' ' {
			v = v[1:]
		}
		if n == 0 {
			data = v
		} else {
			data = append(append(append([]byte(nil), data...), '\n'), v...)
		}
		n++
	}
	return data
}

var (
	doneData      = []byte("[DONE]")
	usageKey      = []byte(`"usage"`)
	timingsKey    = []byte(`"timings"`)
	errClientGone = errors.New("proxy: client write failed")
)

// streamBroken wraps the read error of an upstream stream that ended without
// a clean end of body (a reset, a cut chunked encoding, a timeout).
type streamBroken struct{ error }

func (e streamBroken) Unwrap() error { return e.error }

// cutTopLevelKey returns the JSON object data without its top-level member
// key (the other members keep their bytes and order); ok is false when data
// is not an object or has no such member.
func cutTopLevelKey(data []byte, key string) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, false
	}
	first := true
	prevEnd := int(dec.InputOffset()) // just after '{' or after the previous value
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, false
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, false
		}
		end := int(dec.InputOffset())
		if k != key {
			prevEnd, first = end, false
			continue
		}
		// Not the first member: [prevEnd, end) is `, "key": value`. The
		// first: it is `"key": value`, and the comma after it goes too.
		rest := data[end:]
		if first {
			trimmed := bytes.TrimLeft(rest, " \t\r\n")
			if len(trimmed) > 0 && trimmed[0] == ',' {
				rest = trimmed[1:]
			}
		}
		return append(append([]byte(nil), data[:prevEnd]...), rest...), true
	}
	return nil, false
}

// rebuildEvent replaces the data lines of one SSE event with a single data
// line carrying data; other lines (id:, event:, comments) are kept.
func rebuildEvent(ev, data []byte) []byte {
	var out []byte
	wrote := false
	for len(ev) > 0 {
		i := bytes.IndexByte(ev, '\n')
		var line []byte
		if i < 0 {
			line, ev = ev, nil
		} else {
			line, ev = ev[:i+1], ev[i+1:]
		}
		if bytes.HasPrefix(line, []byte("data:")) {
			if !wrote {
				wrote = true
				out = append(append(append(out, "data: "...), data...), '\n')
			}
			continue
		}
		out = append(out, line...)
	}
	return out
}

// usageOnly reports whether a chunk is the usage-only chunk that
// include_usage adds: usage with no choices (an empty array, as OpenAI
// sends it; null or no choices key at all, as some gateways do). Cut of
// its usage, such a chunk would reach the client as an empty chunk.
func usageOnly(data []byte) bool {
	var c struct {
		Choices json.RawMessage `json:"choices"`
		Usage   json.RawMessage `json:"usage"`
	}
	if json.Unmarshal(data, &c) != nil {
		return false
	}
	if len(c.Usage) == 0 || bytes.Equal(c.Usage, []byte("null")) {
		return false
	}
	choices := bytes.ReplaceAll(bytes.TrimSpace(c.Choices), []byte(" "), nil)
	return len(choices) == 0 || bytes.Equal(choices, []byte("null")) || bytes.Equal(choices, []byte("[]"))
}

// finishReasonKey marks a chunk that may end the answer.
var (
	finishReasonKey  = []byte(`"finish_reason"`)
	finishReasonNull = []byte(`"finish_reason":null`)
)

// finished reports whether a chunk carries a finish reason (a choice with a
// non-null finish_reason): the answer is complete even if no [DONE] follows
// (llama.cpp and some gateways end there).
func finished(data []byte) bool {
	// Most chunks carry "finish_reason":null: no decode for those (one
	// per streamed token).
	if bytes.Count(data, finishReasonKey) == bytes.Count(data, finishReasonNull) {
		return false
	}
	var c struct {
		Choices []struct {
			FinishReason json.RawMessage `json:"finish_reason"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &c) != nil {
		return false
	}
	for _, ch := range c.Choices {
		if len(ch.FinishReason) > 0 && !bytes.Equal(ch.FinishReason, []byte("null")) {
			return true
		}
	}
	return false
}

// errEndedEarly is the upstream's stream ending on a clean EOF before its
// answer did: no [DONE] and no finish reason (a closed connection without a
// Content-Length or chunked terminator looks like a normal end to a
// reader). DESIGN: the client gets the error event and an aborted response.
// It wraps io.ErrUnexpectedEOF: classified as a closed connection.
var errEndedEarly = fmt.Errorf("proxy: upstream stream ended early: %w", io.ErrUnexpectedEOF)

// relayEvents copies an SSE stream to w, one flush per event, never
// coalescing events. Usage found in a chunk (OpenAI usage, llama.cpp
// timings) is reported through onUsage before the event that ends the
// stream ([DONE]) is written, so the client's next request sees the anchor.
// With hideUsage, the usage-only chunk the proxy asked for is not relayed.
func relayEvents(w io.Writer, body io.Reader, hideUsage bool, onUsage func(anchor.Usage)) error {
	return relayDialectEvents(w, body, &streamRules{d: chat.DialectChat}, hideUsage, onUsage)
}

// relayDialectEvents is relayEvents for a dialect's stream: sr says where
// its usage is and which event ends it (a Responses stream ends with
// response.completed, a Messages stream with message_stop; usage is
// reported before that event is written).
func relayDialectEvents(w io.Writer, body io.Reader, sr *streamRules, hideUsage bool, onUsage func(anchor.Usage)) error {
	br, ok := readerPool.get(0)
	if !ok {
		br = bufio.NewReaderSize(nil, streamReaderSize)
	}
	br.Reset(body)
	defer func() { br.Reset(nil); readerPool.put(0, br, streamReaderSize) }()
	flusher, _ := w.(http.Flusher)
	var (
		ev, long []byte
		last     anchor.Usage
		have     bool
		reported bool
		complete bool // [DONE] or a finish reason arrived
	)
	report := func() {
		if have && !reported {
			reported = true
			onUsage(last)
		}
	}
	emit := func(ev []byte) error {
		if len(ev) == 0 {
			return nil
		}
		data := eventData(ev)
		skip := false
		switch {
		case sr.d != chat.DialectChat:
			if len(data) > 0 && bytes.Contains(data, usageKey) {
				if u, ok := sr.usage(data, last); ok {
					last, have = u, true
				}
			}
			if !complete && sr.ends(data) {
				complete = true
				report()
			}
		case bytes.Equal(data, doneData):
			complete = true
			report()
		case len(data) > 0 && (bytes.Contains(data, usageKey) || bytes.Contains(data, timingsKey)):
			if u, ok := anchor.UsageFromJSON(data); ok {
				last, have = u, true
			}
			if hideUsage && usageOnly(data) {
				skip = true
				report()
			} else if hideUsage && bytes.Contains(data, usageKey) {
				// Some upstreams put the usage the proxy asked for on a
				// content chunk (or "usage":null on every chunk): the
				// client did not ask for it, so the field is cut and the
				// rest of the chunk relayed.
				if cut, ok := cutTopLevelKey(data, "usage"); ok {
					ev = rebuildEvent(ev, cut)
				}
			}
		}
		if !complete && sr.d == chat.DialectChat && bytes.Contains(data, finishReasonKey) && finished(data) {
			complete = true
		}
		if skip {
			return nil
		}
		if _, err := w.Write(ev); err != nil {
			return errClientGone
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	for {
		var line []byte
		var err error
		line, long, err = readLine(br, long)
		if len(line) > 0 {
			ev = append(ev, line...)
			if isBlank(line) {
				if werr := emit(ev); werr != nil {
					return werr
				}
				ev = ev[:0]
			}
		}
		if err != nil {
			// End of stream, clean or not: relay what is left and report
			// usage if any arrived. A read error, or an EOF before [DONE]
			// or a finish reason, is returned as streamBroken: the caller
			// must not end the client's stream as if it were complete
			// (CRAFT habit 15: any io.EOF is not a normal end).
			if werr := emit(ev); werr != nil {
				return werr
			}
			report()
			if err == io.EOF {
				if complete {
					return nil
				}
				return streamBroken{errEndedEarly}
			}
			return streamBroken{err}
		}
	}
}
