package compaction

import (
	"bytes"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// Texts of the messages compactproxy synthesizes. The summary is labelled
// as such so the model does not take it for something the user wrote.
const (
	// Short: at a 2k-token window every token of it is taken from the
	// summary's own room.
	summaryLabel = "[Summary of the earlier conversation (compactproxy); the latest messages follow verbatim.]\n\n"
	askLabel     = "\n\n[The user's latest request, verbatim:]\n"
	ackText      = "Understood."
)

// bytesPerToken converts the token thresholds of the configuration into
// text bytes for the decisions made per message (which tool result is long,
// how much of it an excerpt keeps). It matches the anchor package's text
// rate; the view as a whole is always measured with the Estimator.
const bytesPerToken = 4

// isToolRole tells whether a message answers a call (it must stay right
// after its assistant message, so a cut never lands on it).
func isToolRole(role string) bool { return role == "tool" || role == "function" }

// isSystemRole tells whether a message belongs to the leading instructions.
func isSystemRole(role string) bool { return role == "system" || role == "developer" }

// localTextTokens is the local size of a message's text, for the per-message
// "long tool result" test.
func localTextTokens(m *chat.Message) int {
	return (max(m.TextBytes, 0) + bytesPerToken - 1) / bytesPerToken
}

// trimmable tells whether m is a tool result whose text can be excerpted:
// string content, or an array of text parts only. Messages with image,
// audio or file parts are never touched (an excerpt cannot be made inside
// them, and rewriting the array around them would change their bytes).
func trimmable(m *chat.Message) bool {
	return m.Role == "tool" && m.MediaParts == 0 && m.TextBytes > 0 && len(m.Content) > 0 &&
		(m.ContentIsString || m.Content[0] == '[')
}

// excerpt returns text cut to about keep bytes: two thirds from the head,
// one third from the tail, the cut points moved back to a line break when
// one is near (and always to a rune boundary), joined by a marker saying
// how many characters were elided. ok is false when the excerpt would not
// be shorter than text. It is a pure function of (text, keep), so a
// stored trim is re-applied byte-identically.
func excerpt(text string, keep int) (string, bool) {
	if keep < 16 {
		keep = 16
	}
	if len(text) <= keep+len(markerFor(len(text))) {
		return text, false
	}
	headWant := keep * 2 / 3
	tailWant := keep - headWant
	h := headWant
	for h > 0 && !utf8.RuneStart(text[h]) {
		h--
	}
	if nl := strings.LastIndexByte(text[:h], '\n'); nl >= headWant*3/4 {
		h = nl + 1
	}
	t := len(text) - tailWant
	for t < len(text) && !utf8.RuneStart(text[t]) {
		t++
	}
	if nl := strings.IndexByte(text[t:], '\n'); nl >= 0 && nl < tailWant/4 {
		t += nl + 1
	}
	if t <= h {
		return text, false
	}
	marker := markerFor(utf8.RuneCountInString(text[h:t]))
	var b strings.Builder
	b.Grow(h + len(marker) + len(text) - t)
	b.WriteString(text[:h])
	b.WriteString(marker)
	b.WriteString(text[t:])
	out := b.String()
	if len(out) >= len(text) {
		return text, false
	}
	return out, true
}

// Excerpt returns text cut to about keep bytes, two thirds from the head
// and one third from the tail with a marker saying how much was elided
// (text itself when that would not be shorter): the one head/tail excerpt
// of the project (trims, and the summarizer's transcript).
func Excerpt(text string, keep int) string {
	out, _ := excerpt(text, keep)
	return out
}

// markerFor is the line that replaces n elided characters.
func markerFor(n int) string {
	return "\n[... " + groupThousands(n) + " characters elided by compactproxy ...]\n"
}

// groupThousands formats n with commas: 12345 → "12,345".
func groupThousands(n int) string {
	s := strconv.Itoa(n)
	if n < 0 || len(s) <= 3 {
		return s
	}
	var b strings.Builder
	pre := len(s) % 3
	if pre > 0 {
		b.WriteString(s[:pre])
	}
	for i := pre; i < len(s); i += 3 {
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(s[i : i+3])
	}
	return b.String()
}

// trimmed returns m with its text replaced by an excerpt keeping keep
// bytes (a content-part array becomes an array of one text part); ok is
// false when m cannot or need not be excerpted.
func trimmed(m chat.Message, keep int) (chat.Message, bool) {
	if !trimmable(&m) {
		return m, false
	}
	var text string
	var ok bool
	if m.ContentIsString {
		text, ok = excerptJSON(m.Content, keep)
	} else {
		text, ok = excerpt(chat.Text(m), keep)
	}
	if !ok {
		return m, false
	}
	if !m.ContentIsString {
		return chat.WithContentTextPart(m, text), true // the array keeps its shape
	}
	return chat.WithContentText(m, text), true
}

// excerptJSON is excerpt for a JSON string literal (the raw content of a
// tool message) without decoding all of it: on the trim path a stored trim
// is re-applied to every later request, so the cost is per request, and
// the elided middle is only scanned (to count its characters), never
// decoded. Positions are measured in the literal's bytes (escapes counted
// as written), cuts never split an escape sequence, a surrogate pair or a
// UTF-8 sequence. It is a pure function of (lit, keep).
func excerptJSON(lit []byte, keep int) (string, bool) {
	if len(lit) < 2 || lit[0] != '"' || lit[len(lit)-1] != '"' {
		return "", false
	}
	body := lit[1 : len(lit)-1]
	if keep < 16 {
		keep = 16
	}
	if len(body) <= keep+len(markerFor(len(body))) {
		return "", false
	}
	headWant := keep * 2 / 3
	tailWant := len(body) - (keep - headWant)
	// h: the last character start at or before headWant.
	h := 0
	for p := 0; p <= headWant && p < len(body); p += unitLen(body, p) {
		h = p
	}
	// t: the first character start at or after tailWant; elided counts the
	// characters in [h, t). Plain runs are counted with utf8.RuneCount,
	// escapes one by one.
	t, elided := -1, 0
	for p := h; p < len(body); {
		e := len(body)
		if j := bytes.IndexByte(body[p:], '\\'); j >= 0 {
			e = p + j
		}
		if e > tailWant {
			q := max(tailWant, p)
			for q < e && !utf8.RuneStart(body[q]) {
				q++
			}
			if q < e || e == len(body) {
				t = q
				elided += utf8.RuneCount(body[p:q])
				break
			}
		}
		elided += utf8.RuneCount(body[p:e])
		if e == len(body) {
			break
		}
		if e >= tailWant {
			t = e
			break
		}
		elided++
		p = e + unitLen(body, e)
	}
	if h < 0 || t < 0 || t <= h {
		return "", false
	}
	head, tail := chat.Unescape(body[:h]), chat.Unescape(body[t:])
	// Move the cuts to line breaks when one is near, as excerpt does.
	if nl := strings.LastIndexByte(head, '\n'); nl >= 0 && nl >= len(head)*3/4 {
		elided += utf8.RuneCountInString(head[nl+1:])
		head = head[:nl+1]
	}
	if nl := strings.IndexByte(tail, '\n'); nl >= 0 && nl < len(tail)/4 {
		elided += utf8.RuneCountInString(tail[:nl+1])
		tail = tail[nl+1:]
	}
	out := head + markerFor(elided) + tail
	if len(out) >= len(body) {
		return "", false
	}
	return out, true
}

// unitLen is the length of the character starting at p in a JSON string
// body: an escape (a \uD800-\uDBFF escape followed by a low surrogate
// escape counts as one), else a UTF-8 sequence.
func unitLen(b []byte, p int) int {
	if b[p] == '\\' {
		if p+1 < len(b) && b[p+1] == 'u' && p+6 <= len(b) {
			if isHighSurrogate(b[p+2:p+6]) && p+12 <= len(b) && b[p+6] == '\\' && b[p+7] == 'u' {
				return 12
			}
			return 6
		}
		return min(2, len(b)-p)
	}
	n := 1
	for p+n < len(b) && !utf8.RuneStart(b[p+n]) {
		n++
	}
	return n
}

// isHighSurrogate tells whether four hex digits are in D800–DBFF.
func isHighSurrogate(hex []byte) bool {
	return (hex[0] == 'd' || hex[0] == 'D') && strings.IndexByte("89abAB", hex[1]) >= 0
}

// summaryText is the content of the summary message.
func summaryText(s *Summary, msgs []chat.Message) string {
	var b strings.Builder
	b.WriteString(summaryLabel)
	b.WriteString(s.Text)
	if s.AskInline && s.Ask >= 0 && s.Ask < len(msgs) {
		b.WriteString(askLabel)
		b.WriteString(chat.Text(msgs[s.Ask]))
	}
	return b.String()
}

// summaryBlock is what replaces the client's messages [Lead, Cut): the
// summary as a user message, the acknowledgement, the re-inserted ask.
func summaryBlock(s *Summary, msgs []chat.Message) []chat.Message {
	out := make([]chat.Message, 0, 3)
	out = append(out, chat.NewTextMessage("user", summaryText(s, msgs)))
	if s.Ack {
		out = append(out, chat.NewTextMessage("assistant", ackText))
	}
	if !s.AskInline && s.Ask >= 0 && s.Ask < len(msgs) {
		out = append(out, msgs[s.Ask])
	}
	return out
}

// PairingView converts a view into pairing's minimal view (the planner
// asserts its own output with it; the proxy checks client requests with it).
func PairingView(view []chat.Message) []pairing.Message {
	out := make([]pairing.Message, len(view))
	// One backing array for every message's calls: an agent's view has an
	// assistant turn every other message.
	n := 0
	for i := range view {
		n += len(view[i].ToolCalls)
	}
	calls := make([]pairing.Call, n)
	for i := range view {
		m := &view[i]
		pm := pairing.Message{
			Role:          m.Role,
			ToolCallID:    m.ToolCallID,
			HasToolCallID: m.HasToolCallID,
			FunctionCall:  m.FunctionCall,
			Name:          m.Name,
			HasContent:    m.TextBytes > 0 || m.MediaParts > 0,
		}
		if len(m.ToolCalls) > 0 {
			pm.Calls, calls = calls[:len(m.ToolCalls):len(m.ToolCalls)], calls[len(m.ToolCalls):]
			for k, c := range m.ToolCalls {
				pm.Calls[k] = pairing.Call{ID: c.ID, HasID: c.HasID, Name: c.Name}
			}
		}
		out[i] = pm
	}
	return out
}

// violations counts the strict pairing violations of a view.
func violations(view []chat.Message) int { return len(pairing.Check(PairingView(view))) }
