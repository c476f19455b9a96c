package wire

import (
	"bufio"
	"bytes"
	"encoding/json"
)

// ReadLine returns the next line including its terminator. Lines of any
// length are supported: bufio.Reader.ReadSlice serves the common case
// without copying, and long lines (a whole file in one delta) are assembled
// in buf. A bufio.Scanner would fail past its 64 KiB token limit.
func ReadLine(br *bufio.Reader, buf []byte) ([]byte, []byte, error) {
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

// IsBlank reports whether line ends an SSE event.
func IsBlank(line []byte) bool {
	return len(bytes.TrimRight(line, "\r\n")) == 0
}

// nextLine splits the first line off ev, its newline included; rest is
// what follows it (nil after the last line).
func nextLine(ev []byte) (line, rest []byte) {
	if i := bytes.IndexByte(ev, '\n'); i >= 0 {
		return ev[:i+1], ev[i+1:]
	}
	return ev, nil
}

// EventData returns the concatenated data fields of one SSE event.
func EventData(ev []byte) []byte {
	var data []byte
	n := 0
	for len(ev) > 0 {
		var line []byte
		line, ev = nextLine(ev)
		line = bytes.TrimRight(line, "\r\n")
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

// rebuildEvent replaces the data lines of one SSE event with a single data
// line carrying data; other lines (id:, event:, comments) are kept.
func rebuildEvent(ev, data []byte) []byte {
	var out []byte
	wrote := false
	for len(ev) > 0 {
		var line []byte
		line, ev = nextLine(ev)
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

// CutTopLevelKey returns the JSON object data without its top-level member
// key (the other members keep their bytes and order); ok is false when data
// is not an object or has no such member.
func CutTopLevelKey(data []byte, key string) ([]byte, bool) {
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

// eventType is an event's top-level "type" member, wherever the upstream
// put it among the members (an encoder that sorts keys writes it last).
func eventType(data []byte) string {
	var ev struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(data, &ev) != nil {
		return ""
	}
	return ev.Type
}

var usageKey = []byte(`"usage"`)
