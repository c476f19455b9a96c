package proxy

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"regexp"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/driver"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/wire"
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
	if q := r.URL.Query(); q.Has("dialect") && s.auth.allow(r.Header) {
		if _, ok := wire.Named(q.Get("dialect")); !ok {
			s.answer(w, r, nil, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", param: "dialect",
				detail: "compactproxy: dialect must be chat, responses or messages"})
			return
		}
	}
	// The chat path's first stages, then a decision that is not sent.
	ar, err := s.read(w, r)
	var view checked
	if err == nil {
		defer ar.release()
		view, err = s.pair(r, ar)
	}
	if err != nil {
		s.answer(w, r, ar, err)
		return
	}
	ident := s.identify(r, ar, view)
	// A dry run changes nothing and counts nothing; ?summarize=true is a
	// real summarize, stored and counted like one made by a chat request.
	summarize := r.URL.Query().Get("summarize") == "true"
	out, _ := s.driver.Decide(r.Context(), s.driverRequest(r, ar, ident, compaction.PassForward),
		driver.Mode{Enabled: s.cfg.Compaction.Enabled, Summarize: summarize, Commit: summarize})
	req := ar.req
	window := s.windows.GetFor(ar.windowScope())
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
		_ = json.Unmarshal(body[ar.api.HistoryKey], &resp.Messages)
	}
	ar.info.action = resp.Action
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Compactproxy-Conversation-Id", ident.ID)
	_ = json.NewEncoder(w).Encode(resp)
}

var convIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// errNoConversation: the caller's tenant has no conversation by that id.
var errNoConversation = errors.New("no such conversation")

// findConversation resolves {id} for the caller's tenant: the opaque id
// the response header gives, else the client's own conversation header
// value (the id it names). Another tenant's conversation is not found,
// exactly like an unknown one: its existence is never revealed.
func (s *Server) findConversation(r *http.Request) (id, key string, conv store.Conversation, err error) {
	ref := chi.URLParam(r, "id")
	tenant := identity.Tenant(s.tenantSecret, r.Header)
	var ids []string
	if convIDPattern.MatchString(ref) {
		ids = append(ids, ref)
	}
	if ref != "" {
		ids = append(ids, identity.HeaderID(ref))
	}
	for _, id := range ids {
		key := identity.Key(tenant, id)
		conv, ok, err := s.store.Load(r.Context(), key)
		if err != nil {
			return "", "", conv, err
		}
		if ok {
			return id, key, conv, nil
		}
	}
	return "", "", store.Conversation{}, errNoConversation
}

// writeNoConversation answers an id the caller's tenant does not have.
func writeNoConversation(w http.ResponseWriter, err error) {
	if errors.Is(err, errNoConversation) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "conversation_not_found", "id", "compactproxy: no such conversation")
		return
	}
	writeError(w, http.StatusServiceUnavailable, "server_error", "store_unavailable", "", "compactproxy: the conversation state could not be read")
}

// handleForget is DELETE /v1/compactproxy/conversations/{id}: it forgets the
// conversation's stored state (a bad summary, a latch) for the caller's
// tenant only; another tenant's id of the same value is a different key.
func (s *Server) handleForget(w http.ResponseWriter, r *http.Request) {
	if !s.auth.allow(r.Header) {
		writeUnauthorized(w)
		return
	}
	id, key, _, err := s.findConversation(r)
	if err != nil {
		writeNoConversation(w, err)
		return
	}
	if err := s.store.Delete(r.Context(), key); err != nil {
		writeError(w, http.StatusInternalServerError, "server_error", "", "", "compactproxy: could not forget the conversation")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "object": "compactproxy.conversation.deleted", "deleted": true})
}

// conversationState is the body of GET /v1/compactproxy/conversations/{id}:
// what the proxy stored for the conversation, never the client's content
// (the summary text is the proxy's own).
type conversationState struct {
	ID       string         `json:"id"`
	Object   string         `json:"object"`
	Lineages []lineageState `json:"lineages"`
	Anchors  []anchorState  `json:"anchors"`
}

// lineageState is one lineage: the records re-applied to every request of
// that history, its latch and its summarize throttle.
type lineageState struct {
	ID       string `json:"id"`
	Messages int    `json:"messages"` // the client's message count at the last save
	Updated  int64  `json:"updated_at"`
	// Cut is the first client message after the summarized or dropped
	// head (0: nothing folded).
	Cut            int           `json:"cut"`
	Summary        *summaryState `json:"summary,omitempty"`
	PendingSummary *summaryState `json:"pending_summary,omitempty"`
	Trims          []trimState   `json:"trims"`
	// Masks are the tool results forwarded as a placeholder naming their
	// call; Dedupes those forwarded as a pointer to a later result.
	Masks      []int         `json:"masks"`
	Dedupes    []dedupeState `json:"dedupes"`
	Drops      []dropState   `json:"drops"`
	Latched    bool          `json:"latched"`
	LatchCount int           `json:"latch_count,omitempty"`
	// The summarize throttle: the last attempt's time and message count.
	LastSummarizeAt       int64 `json:"last_summarize_at,omitempty"`
	LastSummarizeMessages int   `json:"last_summarize_messages,omitempty"`
}

type summaryState struct {
	Text   string `json:"text"`
	Tokens int    `json:"tokens"`
	Cut    int    `json:"cut"`
	Lead   int    `json:"lead"`
}

type trimState struct {
	Index     int `json:"index"`
	KeepBytes int `json:"keep_bytes"`
}

type dedupeState struct {
	Index    int `json:"index"`
	PointsTo int `json:"points_to"`
}

type dropState struct {
	From int `json:"from"`
	To   int `json:"to"`
}

type anchorState struct {
	Messages     int    `json:"messages"`
	Digest       string `json:"digest"`
	InputTokens  int    `json:"input_tokens"`
	OutputTokens int    `json:"output_tokens"`
	At           int64  `json:"at"`
}

// handleConversation is GET /v1/compactproxy/conversations/{id}: the
// caller's conversation as stored (lineages and the newest anchors).
func (s *Server) handleConversation(w http.ResponseWriter, r *http.Request) {
	if !s.auth.allow(r.Header) {
		writeUnauthorized(w)
		return
	}
	id, _, conv, err := s.findConversation(r)
	if err != nil {
		writeNoConversation(w, err)
		return
	}
	out := conversationState{ID: id, Object: "compactproxy.conversation", Lineages: []lineageState{}, Anchors: []anchorState{}}
	summary := func(sm *compaction.Summary) *summaryState {
		if sm == nil {
			return nil
		}
		n := sm.Tokens
		if n <= 0 {
			n = anchor.TextTokens(anchor.Fit{}, len(sm.Text))
		}
		return &summaryState{Text: sm.Text, Tokens: n, Cut: sm.Cut, Lead: sm.Lead}
	}
	for _, l := range conv.Lineages {
		st := l.State
		ls := lineageState{ID: strconv.FormatUint(l.ID, 16), Messages: l.TipLen, Updated: l.Used, Cut: stateCut(st),
			Summary: summary(st.Summary), PendingSummary: summary(st.Pending), Trims: []trimState{}, Masks: []int{}, Dedupes: []dedupeState{}, Drops: []dropState{},
			Latched: st.Latched, LastSummarizeMessages: st.LastAttemptCount}
		if st.Latched {
			ls.LatchCount = st.LatchCount
		}
		if !st.LastAttempt.IsZero() {
			ls.LastSummarizeAt = st.LastAttempt.Unix()
		}
		for _, t := range st.Trims {
			if later, ok := t.PointsTo(); ok {
				ls.Dedupes = append(ls.Dedupes, dedupeState{Index: t.Index, PointsTo: later})
			} else if t.Masked() {
				ls.Masks = append(ls.Masks, t.Index)
			} else {
				ls.Trims = append(ls.Trims, trimState{Index: t.Index, KeepBytes: t.Keep})
			}
		}
		for _, d := range st.Drops {
			ls.Drops = append(ls.Drops, dropState{From: d.From, To: d.To})
		}
		out.Lineages = append(out.Lineages, ls)
	}
	for _, a := range conv.Anchors {
		out.Anchors = append(out.Anchors, anchorState{Messages: a.PrefixLen, Digest: hex.EncodeToString(a.Prefix[:]),
			InputTokens: a.Input, OutputTokens: a.Output, At: a.At})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// stateCut is the first client message after what a lineage's state folds
// away (its summary's cut or its last drop's end), 0 when nothing is.
func stateCut(st compaction.State) int {
	cut := 0
	if st.Summary != nil {
		cut = st.Summary.Cut
	}
	for _, d := range st.Drops {
		cut = max(cut, d.To)
	}
	return cut
}

// handleOwnPath answers every other path under /v1/compactproxy/: the
// proxy's own, never forwarded (with the client's credentials) to the
// upstream. A known path asked with another method is a 405.
func handleOwnPath(w http.ResponseWriter, r *http.Request) {
	allow := ""
	switch p := r.URL.Path; {
	case p == "/v1/compactproxy/preview":
		allow = "POST"
	case strings.HasPrefix(p, "/v1/compactproxy/conversations/"):
		if id := strings.TrimPrefix(p, "/v1/compactproxy/conversations/"); id != "" && !strings.Contains(id, "/") {
			allow = "GET, DELETE"
		}
	}
	if allow != "" {
		w.Header().Set("Allow", allow)
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "", "compactproxy: method not allowed on this path")
		return
	}
	writeError(w, http.StatusNotFound, "invalid_request_error", "not_found", "", "compactproxy: unknown path")
}
