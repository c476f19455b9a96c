package identity

import (
	"net/http"
	"testing"
)

// A conversation header is found however the header map spells it:
// canonicalized by Go's server (Session_id) or as the client wrote it
// (Codex's session_id).
func TestConversationHeaderSpellings(t *testing.T) {
	headers := []string{"X-Compactproxy-Conversation", "Session-Id", "session_id"}
	for _, h := range []http.Header{{"Session_id": {"codex"}}, {"session_id": {"codex"}}} {
		if got := Header(h, headers); got != "codex" {
			t.Errorf("header map %v: conversation header %q, want codex", h, got)
		}
	}
	if got := Header(http.Header{"Session-Id": {"hyphen"}}, []string{"session_id"}); got != "" {
		t.Errorf("Session-Id matched the name session_id: %q", got)
	}
}
