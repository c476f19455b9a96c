package proxy

import (
	"encoding/json"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"net/http"
	"regexp"

	"github.com/go-chi/chi/v5"
)

// previewResponse is the body of POST /v1/compactproxy/preview.
type previewResponse struct {
	Messages        []json.RawMessage `json:"messages"`
	Action          string            `json:"action"`
	ContextTokens   int               `json:"context_tokens"`
	ContextSource   string            `json:"context_source"`
	ForwardedTokens int               `json:"forwarded_tokens"`
	Window          int               `json:"window"`
	Budget          int               `json:"budget"`
}

// handlePreview is a dry run of the chat path: what would be forwarded, and
// why. No upstream call and no state change, unless ?summarize=true, which
// runs (and stores) a summary as a real request would.
func (s *Server) handlePreview(w http.ResponseWriter, r *http.Request) {
	// The chat path's first stages, then a decision that is not sent.
	cr, err := s.readChat(w, r)
	if err == nil {
		defer cr.release()
		err = s.pair(r, cr)
	}
	if err != nil {
		s.answer(w, r, cr, err)
		return
	}
	cv := s.identify(r, cr)
	// A dry run changes nothing and counts nothing; ?summarize=true is a
	// real summarize, stored and counted like one made by a chat request.
	summarize := r.URL.Query().Get("summarize") == "true"
	out, _ := s.compact(r.Context(), r, cr, cv, compactOptions{pass: compaction.PassForward,
		enabled: s.cfg.Compaction.Enabled, summarize: summarize, commit: summarize})
	req := cr.req
	window := s.windows.Get(req.Model)
	resp := previewResponse{
		Action:          string(out.Action),
		ContextTokens:   out.Context.Tokens,
		ContextSource:   out.Context.Source,
		ForwardedTokens: out.Forwarded,
		Window:          window,
		Budget:          out.Budget,
	}
	if resp.Action == "" {
		resp.Action = "none"
	}
	// The view in the client's own API: the messages or items the
	// request would carry.
	var body map[string]json.RawMessage
	resp.Messages = nil
	if json.Unmarshal(req.Build(out.Messages, nil), &body) == nil {
		_ = json.Unmarshal(body[cr.api.HistoryKey], &resp.Messages)
	}
	cr.info.action = resp.Action
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Compactproxy-Conversation-Id", cv.id)
	_ = json.NewEncoder(w).Encode(resp)
}

var convIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// handleForget is DELETE /v1/compactproxy/conversations/{id}: it forgets the
// conversation's stored state (a bad summary, a latch) for the caller's
// tenant only; another tenant's id of the same value is a different key.
func (s *Server) handleForget(w http.ResponseWriter, r *http.Request) {
	if !s.auth.allow(r.Header) {
		writeUnauthorized(w)
		return
	}
	id := chi.URLParam(r, "id")
	if !convIDPattern.MatchString(id) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "conversation_not_found", "id", "compactproxy: no such conversation")
		return
	}
	key := storeKey(tenantOf(s.tenantSecret, r.Header), id)
	if _, ok, _ := s.store.Load(r.Context(), key); !ok {
		writeError(w, http.StatusNotFound, "invalid_request_error", "conversation_not_found", "id", "compactproxy: no such conversation")
		return
	}
	if err := s.store.Delete(r.Context(), key); err != nil {
		writeError(w, http.StatusInternalServerError, "server_error", "", "", "compactproxy: could not forget the conversation")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "object": "compactproxy.conversation.deleted", "deleted": true})
}
