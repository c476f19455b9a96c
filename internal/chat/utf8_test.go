package chat

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

// TestInvalidUTF8Refused: raw bytes that are not UTF-8 and lone surrogate
// escapes are a ParseError naming the byte, in every dialect; a valid
// surrogate pair, an escaped backslash before "u", and raw multi-byte text
// are accepted.
func TestInvalidUTF8Refused(t *testing.T) {
	wrap := map[Dialect]func(s string) string{
		DialectChat:      func(s string) string { return `{"model":"m","messages":[{"role":"user","content":"` + s + `"}]}` },
		DialectResponses: func(s string) string { return `{"model":"m","input":[{"role":"user","content":"` + s + `"}]}` },
		DialectMessages: func(s string) string {
			return `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"` + s + `"}]}`
		},
	}
	for _, tc := range []struct {
		name, text string
		bad        bool
	}{
		{"raw ff fe", "ab\xff\xfecd", true},
		{"truncated rune", "ab\xe2\x82", true},
		{"overlong", "\xc0\xaf", true},
		{"encoded surrogate", "\xed\xa0\x80", true},
		{"lone high surrogate", `ab\ud800cd`, true},
		{"lone low surrogate", `\udc00`, true},
		{"high then not low", `\ud800\u0041`, true},
		{"high at end", `x\uD83D`, true},
		{"pair", `\ud83d\ude42`, false},
		{"pair upper", `\uD83D\uDE42`, false},
		{"escaped backslash", `\\ud800`, false},
		{"raw text", "h\u00e9llo \u4e16\u754c \U0001F642", false},
		{"raw replacement char", "\uFFFD", false},
	} {
		for d, w := range wrap {
			body := w(tc.text)
			_, err := ParseDialect(d, []byte(body))
			var pe *ParseError
			switch {
			case !tc.bad && err != nil:
				t.Errorf("%s, %s: refused: %v", tc.name, d, err)
			case tc.bad && (!errors.As(err, &pe) || !strings.HasPrefix(pe.Message, "invalid UTF-8 at byte ")):
				t.Errorf("%s, %s: err %v, want an invalid UTF-8 ParseError", tc.name, d, err)
			case tc.bad:
				// The byte named is inside the client's text.
				at := strings.Index(body, tc.text)
				num, _, _ := strings.Cut(strings.TrimPrefix(pe.Message, "invalid UTF-8 at byte "), ":")
				if n, err := strconv.Atoi(num); err != nil || n < at || n >= at+len(tc.text) {
					t.Errorf("%s, %s: %q does not name a byte of the text (%d..%d)", tc.name, d, pe.Message, at, at+len(tc.text)-1)
				}
			}
		}
	}
}
