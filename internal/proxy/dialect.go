package proxy

import (
	"net/http"
	"strings"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/wire"
)

// One pipeline (handleAPI), one planner, one state, one set of metrics
// serve every API of wire.APIs (DESIGN § Other APIs). What differs per API
// is internal/wire's; parsing and rendering are internal/chat's
// (ParseDialect, Request.Build). Here: which API a request speaks.

// apiOf is the API of a compacted route (its *wire.API.Route), or of a
// preview.
func apiOf(r *http.Request) *wire.API {
	p := strings.TrimSuffix(r.URL.Path, "/")
	for _, api := range wire.APIs {
		if api.Route == p {
			return api
		}
	}
	if r.URL.Path == "/v1/compactproxy/preview" {
		return previewAPI(r)
	}
	return wire.ChatCompletions
}

// previewAPI is the API a preview body is read in: ?dialect= (chat,
// responses, messages), else Anthropic's version header names Messages,
// else chat completions.
func previewAPI(r *http.Request) *wire.API {
	if api, ok := wire.Named(r.URL.Query().Get("dialect")); ok {
		return api
	}
	if r.Header.Get("Anthropic-Version") != "" {
		return wire.MessagesAPI
	}
	return wire.ChatCompletions
}

// selfCompaction recognizes an agent's own compaction request (DESIGN §
// Other APIs): Codex's checkpoint request, Claude Code's and opencode's
// summary prompts, in the newest user message. Such a request is never
// stripped of the history it asks to summarize while it fits the window.
func selfCompaction(view []chat.Message) bool {
	for i := len(view) - 1; i >= 0; i-- {
		m := &view[i]
		if m.Role != "user" {
			continue
		}
		text := chat.Text(*m)
		for _, marker := range selfCompactionMarkers {
			if strings.Contains(text, marker) {
				return true
			}
		}
		return false
	}
	return false
}

// selfCompactionMarkers are sentences of the agents' own compaction
// prompts.
var selfCompactionMarkers = []string{
	"CONTEXT CHECKPOINT COMPACTION",                             // Codex CLI
	"create a detailed summary of the conversation so far",      // Claude Code
	"Provide a detailed prompt for continuing our conversation", // opencode
}
