package chat

import (
	"bytes"
	"encoding/binary"
	"math/bits"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth is the deepest nesting of objects and arrays accepted. It is the
// same limit as encoding/json's scanner, so a body json.Valid accepts is
// never rejected for depth here (and the fuzz oracle can be encoding/json).
const maxDepth = 10000

// scanner is a validating single-pass JSON scanner over one byte slice.
//
// Its methods take the index of a value's first byte and return the index
// just past the value, or -1 after recording the first syntax error in err.
// Returning ints rather than (int, error) keeps the hot loops free of
// interface values; the error is built only when something is wrong.
type scanner struct {
	data []byte
	err  *ParseError // first syntax error; nil while the input is valid JSON
	// strict: strings must be UTF-8 (no raw byte that is not, no lone
	// surrogate escape), as the parsers of a client's body require; the
	// helpers that read the proxy's own JSON leave it off.
	strict bool
	// badText: err is text that is not UTF-8, not a syntax error.
	badText bool

	// esc is set by str: the raw length minus the (approximate) decoded
	// length of the escapes in the last string scanned; 0 = no escapes.
	esc int

	stack []byte // container kinds of skip, reused between calls

	// Per-parse scratch, reused between messages.
	calls   []ToolCall // backing array shared by all messages' ToolCalls
	members []span     // member spans of the message being decoded
}

// span is a half-open byte range [from, to).
type span struct{ from, to int }

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// special flags, in the high bit of each byte, the bytes of x that end the
// fast path of a string: '"', '\\', control characters (< 0x20) and bytes of
// multi-byte UTF-8 (≥ 0x80, validated one rune at a time). The lowest
// flagged byte is always a real one (borrows only propagate upwards), which
// is all str needs.
func special(x uint64) uint64 {
	q := x ^ (lsb * '"')
	b := x ^ (lsb * '\\')
	return ((x - lsb*0x20) | (q - lsb) | (b - lsb) | x) & msb
}

// stringStop marks the bytes special flags, for the tail of a string.
var stringStop = func() (t [256]bool) {
	for c := 0; c < 0x20; c++ {
		t[c] = true
	}
	t['"'] = true
	t['\\'] = true
	for c := utf8.RuneSelf; c < 256; c++ {
		t[c] = true
	}
	return t
}()

func isSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\r' || c == '\t' }

// ws returns the index of the first non-whitespace byte at or after i.
func (s *scanner) ws(i int) int {
	for i < len(s.data) && isSpace(s.data[i]) {
		i++
	}
	return i
}

// fail records a syntax error at byte i (the first one wins) and returns -1.
func (s *scanner) fail(i int, what string) int {
	if s.err == nil {
		s.err = &ParseError{Message: "invalid JSON at byte " + strconv.Itoa(i) + ": " + what}
	}
	return -1
}

// badUTF8 records, as fail does, text at byte i that is not UTF-8: an
// upstream refuses it (llama-server answers 500), so it is the client's 400.
func (s *scanner) badUTF8(i int, what string) int {
	if s.err == nil {
		s.err = &ParseError{Message: "invalid UTF-8 at byte " + strconv.Itoa(i) + ": " + what}
		s.badText = true
	}
	return -1
}

// unexpected reports the byte at i, or the end of the input.
func (s *scanner) unexpected(i int, context string) int {
	if i >= len(s.data) {
		return s.fail(i, "unexpected end of input "+context)
	}
	return s.fail(i, "unexpected "+quoteByte(s.data[i])+" "+context)
}

func quoteByte(c byte) string {
	if c >= 0x20 && c < 0x7f {
		return strconv.QuoteRune(rune(c))
	}
	return "byte 0x" + strconv.FormatUint(uint64(c), 16)
}

// str scans the string whose opening quote is at i and returns the index
// after its closing quote. It validates escapes, rejects control
// characters, and rejects text that is not UTF-8: raw bytes that are not
// and surrogate escapes that are not a pair (encoding/json accepts both and
// decodes them to U+FFFD; an upstream refuses them). s.esc receives the
// escape overhead.
func (s *scanner) str(i int) int {
	data := s.data
	n := len(data)
	j := i + 1
	esc := 0
	for {
		// Fast path: eight bytes at a time until a quote, a backslash or a
		// control character.
		for j+8 <= n {
			if m := special(binary.LittleEndian.Uint64(data[j : j+8])); m != 0 {
				j += bits.TrailingZeros64(m) >> 3
				goto stop
			}
			j += 8
		}
		for j < n && !stringStop[data[j]] {
			j++
		}
		if j >= n {
			return s.fail(n, "unexpected end of input in string starting at byte "+strconv.Itoa(i))
		}
	stop:
		switch c := data[j]; {
		case c == '"':
			s.esc = esc
			return j + 1
		case c < 0x20:
			return s.fail(j, "control character "+quoteByte(c)+" in string")
		case c >= utf8.RuneSelf:
			for j < n && data[j] >= utf8.RuneSelf {
				r, size := utf8.DecodeRune(data[j:])
				if r == utf8.RuneError && size == 1 && s.strict {
					return s.badUTF8(j, quoteByte(data[j])+" is not UTF-8")
				}
				j += size
			}
			continue
		}
		// Backslash.
		if j+1 >= n {
			return s.fail(n, "unexpected end of input in string escape")
		}
		switch data[j+1] {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			j += 2
			esc++
		case 'u':
			if j+6 > n {
				return s.fail(n, "unexpected end of input in \\u escape")
			}
			r, bad := parseHex4(data, j+2)
			if bad >= 0 {
				return s.fail(bad, "invalid hex digit "+quoteByte(data[bad])+" in \\u escape")
			}
			j += 6
			// Decoded size: 1-3 bytes; a surrogate pair decodes to 4.
			switch {
			case r < 0x80:
				esc += 5
			case r < 0x800:
				esc += 4
			case r >= 0xd800 && r < 0xe000 && !s.strict:
				esc += 4
			case r >= 0xd800 && r < 0xdc00:
				if j+6 > n || data[j] != '\\' || data[j+1] != 'u' {
					return s.badUTF8(j-6, "lone surrogate escape "+string(data[j-6:j]))
				}
				lo, bad := parseHex4(data, j+2)
				if bad >= 0 {
					return s.fail(bad, "invalid hex digit "+quoteByte(data[bad])+" in \\u escape")
				}
				if lo < 0xdc00 || lo >= 0xe000 {
					return s.badUTF8(j-6, "lone surrogate escape "+string(data[j-6:j]))
				}
				j += 6
				esc += 8
			case r >= 0xdc00 && r < 0xe000:
				return s.badUTF8(j-6, "lone surrogate escape "+string(data[j-6:j]))
			default:
				esc += 3
			}
		default:
			return s.fail(j+1, "invalid escape "+quoteByte(data[j+1])+" in string")
		}
	}
}

// parseHex4 decodes the four hex digits at data[at:at+4] (the scanner's
// checked form of hex4); bad is the index of the first that is not one,
// else -1.
func parseHex4(data []byte, at int) (r, bad int) {
	for k := at; k < at+4; k++ {
		h := hexVal(data[k])
		if h < 0 {
			return 0, k
		}
		r = r<<4 | h
	}
	return r, -1
}

func hexVal(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// num scans a number per the JSON grammar:
// -? (0 | [1-9][0-9]*) (\.[0-9]+)? ([eE][+-]?[0-9]+)?
// What follows it is checked by the caller (so "01" fails there).
func (s *scanner) num(i int) int {
	data := s.data
	n := len(data)
	j := i
	if data[j] == '-' {
		j++
	}
	switch {
	case j < n && data[j] == '0':
		j++
	case j < n && data[j] >= '1' && data[j] <= '9':
		j++
		for j < n && isDigit(data[j]) {
			j++
		}
	default:
		return s.unexpected(j, "in number")
	}
	if j < n && data[j] == '.' {
		j++
		if j >= n || !isDigit(data[j]) {
			return s.unexpected(j, "after decimal point in number")
		}
		for j < n && isDigit(data[j]) {
			j++
		}
	}
	if j < n && (data[j] == 'e' || data[j] == 'E') {
		j++
		if j < n && (data[j] == '+' || data[j] == '-') {
			j++
		}
		if j >= n || !isDigit(data[j]) {
			return s.unexpected(j, "in number exponent")
		}
		for j < n && isDigit(data[j]) {
			j++
		}
	}
	return j
}

// lit scans the literal word (true, false or null) expected at i.
func (s *scanner) lit(i int, word string) int {
	data := s.data
	for k := 0; k < len(word); k++ {
		if i+k >= len(data) || data[i+k] != word[k] {
			return s.unexpected(i+k, "in literal "+word)
		}
	}
	return i + len(word)
}

// key scans an object key at i (after whitespace) and the colon after it, and
// returns the index of the value (whitespace skipped). The member loops that
// need the key's bytes (members, message, part, object) scan it inline: a
// method returning the key and the value's index measured 10–20% slower on
// BenchmarkParse (16 KB and 1 MiB requests), and this is every request's path.
func (s *scanner) key(i int) int {
	if i >= len(s.data) || s.data[i] != '"' {
		return s.unexpected(i, "where an object key was expected")
	}
	i = s.str(i)
	if i < 0 {
		return -1
	}
	return s.colon(i)
}

// colon expects optional whitespace, ':' and optional whitespace, and
// returns the index of the value, which is always inside data (callers look
// at data[v] to dispatch on the value's type).
func (s *scanner) colon(i int) int {
	i = s.ws(i)
	if i >= len(s.data) || s.data[i] != ':' {
		return s.unexpected(i, "after object key")
	}
	if i = s.ws(i + 1); i >= len(s.data) {
		return s.unexpected(i, "where a value was expected")
	}
	return i
}

// skip validates the value at i (its first byte; whitespace already skipped)
// nested inside depth containers, and returns the index after it. It is
// iterative: its only stack is s.stack, so deep nesting costs no Go stack.
func (s *scanner) skip(i, depth int) int {
	data := s.data
	n := len(data)
	stack := s.stack[:0]
	defer func() { s.stack = stack[:0] }()
	for {
		// A value starts at i.
		if i >= n {
			return s.unexpected(i, "where a value was expected")
		}
		switch c := data[i]; c {
		case '{', '[':
			depth++
			if depth > maxDepth {
				return s.fail(i, "nesting deeper than "+strconv.Itoa(maxDepth))
			}
			i = s.ws(i + 1)
			closer := byte('}')
			if c == '[' {
				closer = ']'
			}
			if i < n && data[i] == closer {
				i++
				depth--
				break
			}
			stack = append(stack, c)
			if c == '{' {
				if i = s.key(i); i < 0 {
					return -1
				}
			}
			continue
		case '"':
			i = s.str(i)
		case 't':
			i = s.lit(i, "true")
		case 'f':
			i = s.lit(i, "false")
		case 'n':
			i = s.lit(i, "null")
		default:
			if c != '-' && !isDigit(c) {
				return s.unexpected(i, "where a value was expected")
			}
			i = s.num(i)
		}
		if i < 0 {
			return -1
		}
		// After a value: close containers until a comma starts the next one.
	after:
		for {
			if len(stack) == 0 {
				return i
			}
			i = s.ws(i)
			if i >= n {
				return s.unexpected(i, "inside object or array")
			}
			top := stack[len(stack)-1]
			switch data[i] {
			case ',':
				i = s.ws(i + 1)
				if top == '{' {
					if i = s.key(i); i < 0 {
						return -1
					}
				}
				break after
			case '}', ']':
				if (data[i] == '}') != (top == '{') {
					return s.unexpected(i, "inside "+containerName(top))
				}
				stack = stack[:len(stack)-1]
				depth--
				i++
			default:
				return s.unexpected(i, "after value inside "+containerName(top))
			}
		}
	}
}

func containerName(c byte) string {
	if c == '{' {
		return "object"
	}
	return "array"
}

// next expects, after the member or element that ended at i, either a comma
// (returns the index of what follows it, whitespace skipped, and true) or the
// closer (returns the index after it, and false).
func (s *scanner) next(i int, closer byte) (int, bool) {
	i = s.ws(i)
	if i < len(s.data) {
		switch s.data[i] {
		case ',':
			return s.ws(i + 1), true
		case closer:
			return i + 1, false
		}
	}
	what := "object"
	if closer == ']' {
		what = "array"
	}
	return s.unexpected(i, "after value inside "+what), false
}

// text returns the string value whose raw span (quotes included) is
// data[from:to], decoded as encoding/json does (invalid UTF-8 and lone
// surrogates become U+FFFD). escaped tells whether str saw escapes.
func text(raw []byte, escaped bool) string {
	body := raw[1 : len(raw)-1]
	if !escaped && utf8.Valid(body) {
		return string(body)
	}
	return string(appendUnescaped(make([]byte, 0, len(body)), body))
}

// Unescape decodes the body of a valid JSON string literal (without its
// quotes) as encoding/json does: a lone surrogate becomes U+FFFD. The one
// JSON-string decoder of the project (the compaction excerpts and the
// canonical form's key order use it too).
func Unescape(body []byte) string {
	if bytes.IndexByte(body, '\\') < 0 && utf8.Valid(body) {
		return string(body)
	}
	return string(appendUnescaped(make([]byte, 0, len(body)), body))
}

// AppendUnescaped appends the decoded form of a valid JSON string body (no
// quotes) to dst.
func AppendUnescaped(dst, body []byte) []byte { return appendUnescaped(dst, body) }

// appendUnescaped appends the decoded form of a validated string body (no
// quotes) to dst.
func appendUnescaped(dst, body []byte) []byte {
	for i := 0; i < len(body); {
		c := body[i]
		if c == '\\' {
			switch body[i+1] {
			case 'b':
				dst = append(dst, '\b')
			case 'f':
				dst = append(dst, '\f')
			case 'n':
				dst = append(dst, '\n')
			case 'r':
				dst = append(dst, '\r')
			case 't':
				dst = append(dst, '\t')
			case 'u':
				r := hex4(body[i+2:])
				i += 6
				if utf16.IsSurrogate(r) {
					r2 := utf8.RuneError
					if i+6 <= len(body) && body[i] == '\\' && body[i+1] == 'u' {
						r2 = utf16.DecodeRune(r, hex4(body[i+2:]))
						if r2 != utf8.RuneError {
							i += 6
						}
					}
					r = r2
				}
				dst = utf8.AppendRune(dst, r)
				continue
			default: // '"', '\\', '/'
				dst = append(dst, body[i+1])
			}
			i += 2
			continue
		}
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		r, size := utf8.DecodeRune(body[i:])
		if r == utf8.RuneError && size == 1 {
			dst = utf8.AppendRune(dst, utf8.RuneError)
		} else {
			dst = append(dst, body[i:i+size]...)
		}
		i += size
	}
	return dst
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		r = r<<4 | rune(hexVal(c))
	}
	return r
}

// appendString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD
// (strict upstreams reject it); '<', '>' and '&' are kept as they are.
func appendString(dst []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
