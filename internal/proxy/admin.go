package proxy

import (
	"encoding/json"
	"net/http"
	"regexp"

	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"
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
	ri := infoFrom(r.Context())
	req, pb, ok := s.readChatRequest(w, r)
	if !ok {
		return
	}
	defer pb.release()
	ci := &chatInfo{model: req.Model, messages: len(req.Messages), action: "none"}
	ri.chat = ci
	cr := &chatRequest{req: req, forward: req.Messages, respHeaders: http.Header{}, tenant: tenantOf(s.tenantSecret, r.Header)}
	if !s.checkPairing(w, r, cr, ci) {
		return
	}
	summarize := r.URL.Query().Get("summarize") == "true"
	ctx := r.Context()
	identity := s.modelIdentity(req.Model)
	seed := s.seed(req)
	_ = s.digests.hash(cr.tenant, cr.forward)
	convID := conversationID(r, cr.forward)
	key := storeKey(cr.tenant, convID)
	window := s.windows.get(req.Model)
	memo := &chainMemo{s: s, seed: seed}

	var out compaction.Output
	if s.engine != nil && window > 0 {
		unlock := s.convLocks.lock(key)
		st, _, _ := s.store.Load(ctx, key)
		est := s.estimator(memo, st.Anchors, identity)
		chain, _, cerr := memo.chain(cr.forward)
		if cerr == nil {
			out = s.engine.Compact(s.summarizeContext(ctx, r, req.Model), compaction.Input{
				Messages: cr.forward, Chain: chain, State: st, Window: window,
				MaxTokens: req.MaxTokens, Estimate: est, Summarize: summarize,
			})
			s.countCompaction(ri.id, out)
			if summarize && out.StateChanged {
				if err := s.store.Save(ctx, key, out.State); err != nil {
					s.log.Warn("state save failed", zap.String("request_id", ri.id), zap.Error(err))
				}
			}
		}
		unlock()
	}
	if out.Messages == nil {
		st, _, _ := s.store.Load(ctx, key)
		e := s.estimator(memo, st.Anchors, identity)(cr.forward)
		out = compaction.Output{Messages: cr.forward, Action: compaction.ActionNone, Context: e, Forwarded: e.Tokens}
		if window > 0 {
			out.Budget = window - max(s.cfg.Compaction.ReserveTokens, req.MaxTokens)
		}
	}
	resp := previewResponse{
		Messages:        make([]json.RawMessage, len(out.Messages)),
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
	for i, m := range out.Messages {
		resp.Messages[i] = json.RawMessage(m.Raw)
	}
	ci.action = resp.Action
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Compactproxy-Conversation-Id", convID)
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
