package proxy

import (
	"bytes"
	"errors"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
	"go.uber.org/zap"
)

// handleChat is POST /v1/chat/completions, one stage per line (DESIGN §
// Request path): read and parse the body, check tool pairing, identify the
// conversation, compact, report the decision, send it upstream, recover
// once from an overflow answer, relay the answer while recording the
// usage it reports. A stage that ends the request returns an error; answer
// writes it, whatever its kind, in one place.
func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	cr, err := s.readChat(w, r) // read → parse
	if err != nil {
		s.answer(w, r, nil, err)
		return
	}
	defer cr.release()
	if err := s.pair(r, cr); err != nil {
		s.answer(w, r, cr, err)
		return
	}
	cv := s.identify(r, cr)
	s.compactChat(ctx, r, cr, cv, compaction.PassForward)
	s.report(cr, cv, compaction.PassForward)
	resp, err := s.send(ctx, cr)
	if s.recoverOnce(ctx, r, cr, cv, err) {
		resp, err = s.send(ctx, cr)
	}
	if err != nil {
		s.answer(w, r, cr, err)
		return
	}
	s.relay(w, r, cr, resp, func(u anchor.Usage) { s.record(ctx, r, cr, cv, u) })
}

// writeUnauthorized answers a client without a key this proxy accepts.
func writeUnauthorized(w http.ResponseWriter) {
	writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "",
		"compactproxy: a valid API key for this proxy is required (Authorization: Bearer <key>)")
}

// The errors a stage ends a request with; answer writes each.
type (
	// clientError is the client's own fault (bad JSON, a pairing
	// violation), answered in OpenAI's envelope.
	clientError struct {
		status                   int
		typ, code, param, detail string
	}
	// bodyError: the body could not be read (answerBodyError says how).
	bodyError struct{ error }
	// The upstream's failures are upstream.Error (no usable answer: a
	// fixed text per class) and upstream.Answer (its own error answer,
	// relayed as it came).
)

func (e *clientError) Error() string { return e.detail }

// answer ends a request with err: the one place where a stage's error
// becomes an answer. cr is nil before the request was parsed.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, cr *chatRequest, err error) {
	ri := infoFrom(r.Context())
	api := apiOf(r)
	var (
		ce *clientError
		be bodyError
		ue *upstream.Error
		ua *upstream.Answer
	)
	switch {
	case errors.As(err, &ce):
		writeErrorIn(api, w, ce.status, ce.typ, ce.code, ce.param, ce.detail)
	case errors.As(err, &be):
		s.answerBodyError(w, r, be.error)
	case errors.As(err, &ua):
		s.writeHeaders(w, cr, ua.Header)
		w.WriteHeader(ua.Status)
		_, _ = w.Write(ua.Body)
	case errors.Is(err, errClientGone) || r.Context().Err() != nil:
		ri.status = 499
	case errors.As(err, &ue):
		s.log.Warn("upstream request failed", zap.String("request_id", ri.id),
			zap.String("upstream", s.apiURLs[api.Dialect].log), zap.String("error_class", ue.Failure.Code))
		writeErrorIn(api, w, ue.Failure.Status, "upstream_error", ue.Failure.Code, "", "compactproxy: "+ue.Failure.Text)
	default:
		writeErrorIn(api, w, http.StatusInternalServerError, "server_error", "", "", "compactproxy: internal error")
	}
}

// chatRequest is one client request on its way through the proxy: data
// only, filled by the stages in order.
type chatRequest struct {
	api *wire.API // the API the client speaks (the route)
	// query is the client's query string, forwarded with the request
	// (Claude Code's ?beta=true, Azure's ?api-version=).
	query   string
	start   time.Time
	reqID   string // the proxy's request id (logs, X-Request-Id)
	req     *chat.Request
	info    *chatInfo   // the access log's chat fields
	headers http.Header // upstream headers
	tenant  string
	parsed  parsed
	seedIn  seedInput // set by identify
	// pairingClean: the parsed messages passed the pairing check with no
	// violation (remembered by the parse cache entry of this body).
	pairingClean bool
	// forward is the view that will be sent; unchanged reports whether it
	// is byte-for-byte the client's body (the fast path).
	forward   []chat.Message
	client    []chat.Message // the client's provider-visible view (after pairing repair)
	unchanged bool
	// compact: compaction applies to this request (enabled, no bypass).
	compact bool
	// opaque: the upstream holds the history (a Responses request with
	// previous_response_id): no pairing check, compaction or anchor, the
	// body passes as it came.
	opaque bool
	// selfCompaction: the agent's own compaction request, forwarded whole
	// while it fits the window (selfCompaction).
	selfCompaction bool
	// decision is the compaction decision forward carries (compactChat);
	// decisionSpent the time that decision waited for a summary.
	decision      compaction.Output
	decisionSpent time.Duration
	// inject is the field the proxy added to ask the stream for its
	// usage (usageOption; nil: none), so the usage must not reach the
	// client.
	inject []chat.Field
	// sent: the request went upstream once (a resend is recovery);
	// upStart is when the answer being relayed was asked for.
	sent    bool
	upStart time.Time
	// spent is time spent in summarize calls, excluded from overhead.
	spent time.Duration
	// pb is the pooled buffer the client's body was read into (nil when
	// not pooled); outgoing bodies that point into it are tracked.
	pb *pooledBody
	// respHeaders are extra headers for the client (X-Compactproxy-*).
	respHeaders http.Header
}

// windowScope is the scope of cr's window: its tenant, model and
// window-shaping headers (upstream.Scope).
func (cr *chatRequest) windowScope() upstream.Scope {
	return upstream.Scope{Tenant: cr.tenant, Model: cr.req.Model, Shape: upstream.WindowShape(cr.headers)}
}

// release returns the request's body buffer to its pool (the request is
// over).
func (cr *chatRequest) release() { cr.pb.release() }

// readChat authorizes, reads and parses a chat-completions body (chat and
// preview): 401, 413, 408, 400 in OpenAI's envelope, or 499 for a client
// that went away mid-upload, as the error.
//
// The body is parsed after the tenant's most similar recent body when one
// shares leading messages with it (parseCache): those are not scanned,
// hashed or chained again. The request's parsed says which.
//
// The body buffer may be pooled: the caller calls release when the request
// is over.
func (s *Server) readChat(w http.ResponseWriter, r *http.Request) (*chatRequest, error) {
	start := time.Now()
	if !s.auth.allow(r.Header) {
		return nil, &clientError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "invalid_api_key",
			detail: "compactproxy: a valid API key for this proxy is required (Authorization: Bearer <key>)"}
	}
	pb, err := readBodyWithin(w, r, s.cfg.Limits.MaxBodyBytes, s.cfg.Limits.BodyReadTimeout)
	if err != nil {
		return nil, bodyError{err}
	}
	ps := parsed{tenant: tenantOf(s.tenantSecret, r.Header)}
	api := apiOf(r)
	var (
		req    *chat.Request
		reused int
	)
	if api.Dialect == chat.DialectChat {
		ps.key = s.parses.key(ps.tenant, conversationHeader(r, s.cfg.Compaction.ConversationHeaders), pb.buf)
		ps.from = s.parses.lookup(ps.key, pb.buf)
		var snap *chat.Snapshot
		if ps.from != nil {
			snap = ps.from.snap
		}
		req, reused, err = chat.ParseAfter(pb.buf, snap)
	} else {
		// A Responses or Messages body is mapped to the chat model; its
		// items' bytes are its own (a background summary renders them
		// after this request is over), so the pooled buffer goes back now.
		own := bytes.Clone(pb.buf)
		pb.release()
		pb = nil
		req, err = chat.ParseDialect(api.Dialect, own)
	}
	if err != nil {
		pb.release()
		var pe *chat.ParseError
		if errors.As(err, &pe) {
			return nil, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", param: pe.Param, detail: pe.Message}
		}
		return nil, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", detail: err.Error()}
	}
	ps.reused = reused
	if reused == 0 {
		ps.from = nil
	}
	ci := &chatInfo{model: req.Model, stream: req.Stream, messages: len(req.Messages), action: "none"}
	infoFrom(r.Context()).chat = ci
	if req.UIOnlyRemoved > 0 {
		s.metrics.UIOnlyRemoved.Add(float64(req.UIOnlyRemoved))
	}
	cr := &chatRequest{
		api:         api,
		query:       r.URL.RawQuery,
		start:       start,
		reqID:       infoFrom(r.Context()).id,
		req:         req,
		info:        ci,
		pb:          pb,
		headers:     s.up.Header(r.Header, s.ownHeaders()...),
		tenant:      ps.tenant,
		parsed:      ps,
		forward:     req.Messages,
		unchanged:   req.Unchanged(req.Messages),
		respHeaders: http.Header{},
	}
	cr.respHeaders.Set("X-Compactproxy-Compaction", "none")
	cr.opaque = api.HistoryUpstream(req)
	return cr, nil
}

// parsed is how a request's body was parsed: the tenant, its parse cache
// key, and the entry whose first reused messages it took (nil: none).
type parsed struct {
	tenant string
	key    parseKey
	from   *parseEntry
	reused int
}

// ownHeaders are the request headers meant for the proxy alone: its own
// and the first configured conversation header (DESIGN § Compaction).
func (s *Server) ownHeaders() []string {
	own := []string{"X-Compactproxy-Conversation", "X-Compactproxy-Bypass"}
	if hs := s.cfg.Compaction.ConversationHeaders; len(hs) > 0 {
		own = append(own, hs[0])
	}
	return own
}

// usageOption is the field the proxy adds to ask a stream for its usage
// (the API's *wire.API.UsageOption) under upstream.stream_usage: never,
// always, or auto unless the model identity was found not to take it.
// nil: none.
func (s *Server) usageOption(api *wire.API, req *chat.Request) []chat.Field {
	f, ok := api.UsageOption(req)
	if !ok || s.cfg.Upstream.StreamUsage == "never" {
		return nil
	}
	if s.cfg.Upstream.StreamUsage != "always" && s.up.NoStreamOptions.Unsupported(s.modelIdentity(req.Model)) {
		return nil
	}
	return []chat.Field{f}
}

// body builds the upstream body for the current view.
func (cr *chatRequest) body() []byte {
	if cr.unchanged && cr.inject == nil {
		return cr.req.Body
	}
	return cr.req.Build(cr.forward, cr.inject)
}
