package anchor

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// ErrInvalidJSON is wrapped by every error MessageHash
// return: the input is not one valid JSON value.
var ErrInvalidJSON = errors.New("anchor: invalid JSON")

// ProxyOnlyKeys are message keys that belong to compactproxy's clients, not
// to the provider: they are removed from the top level of a message object
// before it is canonicalized (and stripped before forwarding by the parser),
// so adding or removing them never changes a digest.
var ProxyOnlyKeys = []string{"ui_only"}

// maxDepth mirrors encoding/json's scanner limit (10000 nested arrays or
// objects), so MessageHash rejects exactly what json.Valid rejects.
const maxDepth = 10000

// MessageHash is the SHA-256 of the canonical form of one message raw:
//   - objects have their members sorted by the decoded key bytes (Go string
//     order, like encoding/json sorts map keys); when a key repeats, the last
//     occurrence wins, as in every mainstream JSON parser (and the dropped
//     member never reaches a digest);
//   - no insignificant whitespace;
//   - strings are decoded and re-encoded one way: only '"', '\\' and control
//     characters are escaped, with the short forms \b \f \n \r \t and
//     lowercase \u00xx otherwise; everything else (including '/', '<', '&',
//     U+2028 and non-ASCII) is written as UTF-8. So "\u00e9" and "é", "\/"
//     and "/", "\ud83d\ude00" and "😀" agree. Invalid UTF-8 and lone
//     surrogate escapes become U+FFFD, as encoding/json decodes them;
//   - numbers keep their literal (1.0 and 1 differ: the provider sees the
//     literal, and reformatting would be slower and lossy);
//   - the ProxyOnlyKeys are removed from the top-level object (raw is meant
//     to be one message; nested objects keep every key).
//
// The canonical form is made in one pass over raw, in a pooled buffer, so
// hashing allocates nothing in the steady state. Invalid JSON (anything
// json.Valid rejects) is an error wrapping ErrInvalidJSON.
func MessageHash(raw []byte) (Digest, error) {
	c := canonPool.Get().(*canonicalizer)
	out, err := c.run(c.buf[:0], raw, true)
	var d Digest
	if err == nil {
		d = sha256.Sum256(out)
	}
	if cap(out) <= maxPooledBuf {
		c.buf = out[:0]
	} else {
		c.buf = nil
	}
	c.release()
	return d, err
}

// maxPooledBuf bounds the canonical buffer kept in the pool: one huge
// message must not pin its size in memory forever.
const maxPooledBuf = 4 << 20

var canonPool = sync.Pool{New: func() any { return new(canonicalizer) }}

// member is one object member already written to dst, by offsets (dst may
// be reallocated while the object is being written).
type member struct {
	keyStart, keyEnd int // the canonical key's content, quotes excluded
	start, end       int // the member: opening quote of the key .. end of value
}

type canonicalizer struct {
	src     []byte
	pos     int
	dst     []byte
	members []member // a stack shared by nested objects
	tmp     []byte   // scratch for reordering
	buf     []byte   // MessageHash's output buffer
	// Objects whose members are not in order are reordered once, at the
	// end (final), not each when it closes: that moved every byte once
	// per enclosing object, quadratic in the nesting (4 s for a 2 MB
	// message nesting 2,000 deep).
	fixups     []fixup
	fixMembers []member // the fixups' members, sorted, duplicates dropped
	fixKids    []int    // the fixups' direct nested fixups, in document order
	pending    []int    // fixups no enclosing fixup has adopted yet
	// moved counts the bytes reordering copied: the work its tests bound
	// (linear in the output), which no clock measures reliably.
	moved int
}

// fixup is an object written in the client's member order, to be
// reordered by final.
type fixup struct {
	start, end int    // the object in dst: '{' .. after '}'
	members    [2]int // c.fixMembers[members[0]:members[1]]
	kids       [2]int // c.fixKids[kids[0]:kids[1]]
}

func (c *canonicalizer) release() {
	c.src, c.dst = nil, nil
	c.members = c.members[:0]
	c.fixups, c.fixMembers, c.fixKids, c.pending = c.fixups[:0], c.fixMembers[:0], c.fixKids[:0], c.pending[:0]
	if cap(c.tmp) > maxPooledBuf {
		c.tmp = nil
	}
	canonPool.Put(c)
}

func (c *canonicalizer) run(dst, raw []byte, message bool) ([]byte, error) {
	c.src, c.pos, c.dst = raw, 0, dst
	c.fixups, c.fixMembers, c.fixKids, c.pending = c.fixups[:0], c.fixMembers[:0], c.fixKids[:0], c.pending[:0]
	n0 := len(dst)
	err := c.value(0, message)
	if err == nil {
		c.skipSpace()
		if c.pos != len(c.src) {
			err = c.errorf("data after the top-level value")
		}
	}
	out := c.dst
	if err != nil {
		return out[:n0], err
	}
	return c.final(n0), nil
}

// final reorders, in one pass, the objects written out of order: every
// byte after dst[n0] is copied once to c.tmp and once back.
func (c *canonicalizer) final(n0 int) []byte {
	if len(c.pending) == 0 {
		return c.dst
	}
	c.tmp = c.emit(c.tmp[:0], n0, len(c.dst), c.pending)
	c.moved += len(c.tmp)
	c.dst = append(c.dst[:n0], c.tmp...)
	return c.dst
}

// emit appends dst[lo:hi] to out with the fixups kids (those directly
// inside it, in document order) reordered.
func (c *canonicalizer) emit(out []byte, lo, hi int, kids []int) []byte {
	for _, k := range kids {
		f := &c.fixups[k]
		out = append(out, c.dst[lo:f.start]...)
		c.moved += f.start - lo
		out = append(out, '{')
		nested := c.fixKids[f.kids[0]:f.kids[1]]
		for i, m := range c.fixMembers[f.members[0]:f.members[1]] {
			if i > 0 {
				out = append(out, ',')
			}
			a, _ := slices.BinarySearchFunc(nested, m.start, func(k, start int) int { return c.fixups[k].start - start })
			b := a
			for b < len(nested) && c.fixups[nested[b]].start < m.end {
				b++
			}
			out = c.emit(out, m.start, m.end, nested[a:b])
		}
		out = append(out, '}')
		lo = f.end
	}
	c.moved += hi - lo
	return append(out, c.dst[lo:hi]...)
}

type syntaxError struct {
	msg    string
	offset int
}

func (e *syntaxError) Error() string {
	return fmt.Sprintf("anchor: invalid JSON at offset %d: %s", e.offset, e.msg)
}

func (e *syntaxError) Unwrap() error { return ErrInvalidJSON }

func (c *canonicalizer) errorf(msg string) error {
	return &syntaxError{msg: msg, offset: c.pos}
}

func (c *canonicalizer) skipSpace() {
	s, i := c.src, c.pos
	for i < len(s) {
		switch s[i] {
		case ' ', '\t', '\n', '\r':
			i++
			continue
		}
		break
	}
	c.pos = i
}

func (c *canonicalizer) value(depth int, top bool) error {
	c.skipSpace()
	if c.pos >= len(c.src) {
		return c.errorf("unexpected end of input")
	}
	switch b := c.src[c.pos]; {
	case b == '{':
		return c.object(depth+1, top)
	case b == '[':
		return c.array(depth + 1)
	case b == '"':
		return c.str()
	case b == '-' || (b >= '0' && b <= '9'):
		return c.number()
	case b == 't':
		return c.literal("true")
	case b == 'f':
		return c.literal("false")
	case b == 'n':
		return c.literal("null")
	}
	return c.errorf("unexpected character")
}

func (c *canonicalizer) literal(lit string) error {
	if !bytes.HasPrefix(c.src[c.pos:], []byte(lit)) {
		return c.errorf("invalid literal")
	}
	c.dst = append(c.dst, lit...)
	c.pos += len(lit)
	return nil
}

// number validates the JSON number grammar and copies the literal as is.
func (c *canonicalizer) number() error {
	s, i := c.src, c.pos
	start := i
	if s[i] == '-' {
		i++
	}
	switch {
	case i < len(s) && s[i] == '0':
		i++
	case i < len(s) && s[i] >= '1' && s[i] <= '9':
		i++
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
	default:
		c.pos = i
		return c.errorf("invalid number")
	}
	if i < len(s) && s[i] == '.' {
		i++
		d := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		if i == d {
			c.pos = i
			return c.errorf("invalid number fraction")
		}
	}
	if i < len(s) && (s[i] == 'e' || s[i] == 'E') {
		i++
		if i < len(s) && (s[i] == '+' || s[i] == '-') {
			i++
		}
		d := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		if i == d {
			c.pos = i
			return c.errorf("invalid number exponent")
		}
	}
	c.dst = append(c.dst, s[start:i]...)
	c.pos = i
	return nil
}

func (c *canonicalizer) array(depth int) error {
	if depth > maxDepth {
		return c.errorf("exceeded max nesting depth")
	}
	c.pos++ // '['
	c.dst = append(c.dst, '[')
	c.skipSpace()
	if c.pos < len(c.src) && c.src[c.pos] == ']' {
		c.pos++
		c.dst = append(c.dst, ']')
		return nil
	}
	for {
		if err := c.value(depth, false); err != nil {
			return err
		}
		c.skipSpace()
		if c.pos >= len(c.src) {
			return c.errorf("unexpected end of input in array")
		}
		switch c.src[c.pos] {
		case ',':
			c.pos++
			c.dst = append(c.dst, ',')
		case ']':
			c.pos++
			c.dst = append(c.dst, ']')
			return nil
		default:
			return c.errorf("expected ',' or ']'")
		}
	}
}

// object writes the members in the client's order while checking whether
// the keys are already strictly increasing (the common case for
// re-serialized histories: nothing more to do). Otherwise it reorders the
// members it wrote, by their offsets in dst, once at the end.
func (c *canonicalizer) object(depth int, top bool) error {
	if depth > maxDepth {
		return c.errorf("exceeded max nesting depth")
	}
	c.pos++ // '{'
	objStart := len(c.dst)
	c.dst = append(c.dst, '{')
	base := len(c.members)
	defer func() { c.members = c.members[:base] }()
	pendBase := len(c.pending)
	sorted := true
	c.skipSpace()
	if c.pos < len(c.src) && c.src[c.pos] == '}' {
		c.pos++
		c.dst = append(c.dst, '}')
		return nil
	}
	for {
		c.skipSpace()
		if c.pos >= len(c.src) || c.src[c.pos] != '"' {
			return c.errorf("expected an object key")
		}
		commaAt := len(c.dst)
		if len(c.members) > base {
			c.dst = append(c.dst, ',')
		}
		start := len(c.dst)
		if err := c.str(); err != nil {
			return err
		}
		m := member{keyStart: start + 1, keyEnd: len(c.dst) - 1, start: start}
		c.skipSpace()
		if c.pos >= len(c.src) || c.src[c.pos] != ':' {
			return c.errorf("expected ':' after an object key")
		}
		c.pos++
		c.dst = append(c.dst, ':')
		pendValue := len(c.pending)
		if err := c.value(depth, false); err != nil {
			return err
		}
		m.end = len(c.dst)
		if top && isProxyOnlyKey(c.dst[m.keyStart:m.keyEnd]) {
			c.dst = c.dst[:commaAt]
			c.pending = c.pending[:pendValue]
		} else {
			if sorted && len(c.members) > base {
				prev := c.members[len(c.members)-1]
				if compareKeys(c.dst[prev.keyStart:prev.keyEnd], c.dst[m.keyStart:m.keyEnd]) >= 0 {
					sorted = false
				}
			}
			c.members = append(c.members, m)
		}
		c.skipSpace()
		if c.pos >= len(c.src) {
			return c.errorf("unexpected end of input in object")
		}
		switch c.src[c.pos] {
		case ',':
			c.pos++
			continue
		case '}':
			c.pos++
		default:
			return c.errorf("expected ',' or '}'")
		}
		break
	}
	c.dst = append(c.dst, '}')
	if !sorted {
		c.deferReorder(objStart, c.members[base:], pendBase)
	}
	return nil
}

// deferReorder records the object at dst[objStart:] (just closed) for
// final: its members sorted by decoded key (of equal keys the last one
// written wins) and the fixups inside it not yet adopted.
func (c *canonicalizer) deferReorder(objStart int, ms []member, pendBase int) {
	dst := c.dst
	key := func(m member) []byte { return dst[m.keyStart:m.keyEnd] }
	// Stable: among equal keys the client's order is kept, so the last
	// occurrence is the last of its run.
	slices.SortStableFunc(ms, func(a, b member) int { return compareKeys(key(a), key(b)) })
	m0 := len(c.fixMembers)
	for i, m := range ms {
		if i+1 < len(ms) && compareKeys(key(m), key(ms[i+1])) == 0 {
			continue // a later duplicate wins
		}
		c.fixMembers = append(c.fixMembers, m)
	}
	k0 := len(c.fixKids)
	c.fixKids = append(c.fixKids, c.pending[pendBase:]...)
	c.pending = append(c.pending[:pendBase], len(c.fixups))
	c.fixups = append(c.fixups, fixup{start: objStart, end: len(c.dst), members: [2]int{m0, len(c.fixMembers)}, kids: [2]int{k0, len(c.fixKids)}})
}

func isProxyOnlyKey(k []byte) bool {
	for _, p := range ProxyOnlyKeys {
		if string(k) == p {
			return true
		}
	}
	return false
}

// compareKeys orders two canonical key contents by their decoded bytes.
// Canonical escapes ('\\' followed by one of "\\bfnrtu) change the byte
// order ('\\' sorts above most characters it stands for), so keys holding
// one are decoded first; that is rare enough to allocate.
func compareKeys(a, b []byte) int {
	if bytes.IndexByte(a, '\\') < 0 && bytes.IndexByte(b, '\\') < 0 {
		return bytes.Compare(a, b)
	}
	if bytes.IndexByte(a, '\\') < 0 && bytes.IndexByte(b, '\\') < 0 {
		return bytes.Compare(a, b)
	}
	return bytes.Compare(chat.AppendUnescaped(nil, a), chat.AppendUnescaped(nil, b))
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// safeASCII[b] is true for bytes that a canonical string carries as is
// without any check: printable ASCII other than '"' and '\\'.
var safeASCII = func() (t [256]bool) {
	for b := 0x20; b < 0x80; b++ {
		t[b] = b != '"' && b != '\\'
	}
	return t
}()

// scanSafe returns the index of the first byte at or after i that is not
// safeASCII, eight bytes at a time (SWAR). Each test below is exact as a
// boolean and its lowest flagged byte is a true match (borrows only
// propagate upward), so the position is exact too.
func scanSafe(s []byte, i int) int {
	for i+8 <= len(s) {
		w := binary.LittleEndian.Uint64(s[i:])
		q := w ^ (lsb * '"')
		bs := w ^ (lsb * '\\')
		mask := ((w - lsb*0x20) & ^w) | // byte < 0x20
			((q - lsb) & ^q) | // byte == '"'
			((bs - lsb) & ^bs) | // byte == '\\'
			w // byte >= 0x80
		mask &= msb
		if mask != 0 {
			return i + bits.TrailingZeros64(mask)>>3
		}
		i += 8
	}
	for i < len(s) && safeASCII[s[i]] {
		i++
	}
	return i
}

// str re-encodes the string at c.pos. Runs that are already canonical
// (safe ASCII, valid UTF-8, and the short escapes \" \\ \n \r \t \b \f,
// which canonical form keeps) are copied in one append.
func (c *canonicalizer) str() error {
	s := c.src
	i := c.pos + 1
	run := c.pos // include the opening quote in the first run
	for {
		i = scanSafe(s, i)
		if i >= len(s) {
			c.pos = i
			return c.errorf("unterminated string")
		}
		switch b := s[i]; {
		case b == '"':
			c.dst = append(c.dst, s[run:i+1]...)
			c.pos = i + 1
			return nil
		case b >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(s[i:])
			if r == utf8.RuneError && size == 1 {
				c.dst = append(c.dst, s[run:i]...)
				c.dst = append(c.dst, "\uFFFD"...)
				i++
				run = i
				continue
			}
			i += size
		case b == '\\':
			if i+1 >= len(s) {
				c.pos = i
				return c.errorf("unterminated string")
			}
			switch s[i+1] {
			case '"', '\\', 'b', 'f', 'n', 'r', 't':
				i += 2 // already canonical
				continue
			case '/':
				c.dst = append(c.dst, s[run:i]...)
				c.dst = append(c.dst, '/')
				i += 2
				run = i
				continue
			case 'u':
				c.dst = append(c.dst, s[run:i]...)
				n, err := c.unicodeEscape(i)
				if err != nil {
					return err
				}
				i = n
				run = i
				continue
			}
			c.pos = i
			return c.errorf("invalid escape")
		default: // control character
			c.pos = i
			return c.errorf("control character in string")
		}
	}
}

// unicodeEscape decodes the \uXXXX escape at s[i] (and its low surrogate
// when it forms a valid pair, exactly like encoding/json), writes the rune
// canonically and returns the index after what it consumed.
func (c *canonicalizer) unicodeEscape(i int) (int, error) {
	s := c.src
	r := getu4(s[i:])
	if r < 0 {
		c.pos = i
		return 0, c.errorf("invalid \\u escape")
	}
	i += 6
	if utf16.IsSurrogate(r) {
		r2 := getu4(s[i:])
		if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
			r = dec
			i += 6
		} else {
			r = utf8.RuneError
		}
	}
	c.dst = appendRune(c.dst, r)
	return i, nil
}

// appendRune writes r as canonical string content.
func appendRune(dst []byte, r rune) []byte {
	switch r {
	case '"':
		return append(dst, '\\', '"')
	case '\\':
		return append(dst, '\\', '\\')
	case '\b':
		return append(dst, '\\', 'b')
	case '\f':
		return append(dst, '\\', 'f')
	case '\n':
		return append(dst, '\\', 'n')
	case '\r':
		return append(dst, '\\', 'r')
	case '\t':
		return append(dst, '\\', 't')
	}
	if r < 0x20 {
		const hex = "0123456789abcdef"
		return append(dst, '\\', 'u', '0', '0', hex[r>>4], hex[r&0xf])
	}
	return utf8.AppendRune(dst, r)
}

// getu4 decodes the \uXXXX at the start of s, or returns -1.
func getu4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	var r rune
	for _, b := range s[2:6] {
		v := hexVal(b)
		if v < 0 {
			return -1
		}
		r = r<<4 | rune(v)
	}
	return r
}

func hexVal(b byte) int {
	switch {
	case b >= '0' && b <= '9':
		return int(b - '0')
	case b >= 'a' && b <= 'f':
		return int(b - 'a' + 10)
	case b >= 'A' && b <= 'F':
		return int(b - 'A' + 10)
	}
	return -1
}
