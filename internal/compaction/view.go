package compaction

import (
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/pairing"
)

// Texts of the messages compactproxy synthesizes. The summary is labelled
// as such so the model does not take it for something the user wrote.
const (
	summaryLabel = "[Summary of the earlier conversation. To fit the model's context window, " +
		"compactproxy replaced the earlier messages with this summary; the most recent messages follow verbatim.]\n\n"
	askLabel = "\n\n[The user's most recent request, verbatim:]\n"
	ackText  = "Understood. I will continue from this summary of the earlier conversation."
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

// textTokens is the local size of a message's text, for the per-message
// "long tool result" test.
func textTokens(m *chat.Message) int {
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
// recorded trim is re-applied byte-identically.
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
// bytes; ok is false when m cannot or need not be excerpted.
func trimmed(m chat.Message, keep int) (chat.Message, bool) {
	if !trimmable(&m) {
		return m, false
	}
	text, ok := excerpt(chat.Text(m), keep)
	if !ok {
		return m, false
	}
	return chat.WithContentText(m, text), true
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

// toPairing converts a view into pairing's minimal view.
func toPairing(view []chat.Message) []pairing.Message {
	out := make([]pairing.Message, len(view))
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
			pm.Calls = make([]pairing.Call, len(m.ToolCalls))
			for k, c := range m.ToolCalls {
				pm.Calls[k] = pairing.Call{ID: c.ID, HasID: c.HasID, Name: c.Name}
			}
		}
		out[i] = pm
	}
	return out
}

// violations counts the strict pairing violations of a view.
func violations(view []chat.Message) int { return len(pairing.Check(toPairing(view))) }
