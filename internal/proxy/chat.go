package proxy

import (
	"bytes"
	"errors"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/bufpool"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
	"go.uber.org/zap"
)

// handleAPI is POST on a compacted route (Chat Completions, Responses,
// Messages), one stage per line (DESIGN § Request path), each taking what
// the one before returned: read and parse the body, check tool pairing
// (the checked view), identify the conversation, compact (the decision),
// report it, send it upstream, recover once from an overflow answer (a
// second decision, sent once more), relay the answer while recording the
// usage it reports. A stage that ends the request returns an error; answer
// writes it, whatever its kind, in one place.
func (s *Server) handleAPI(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	ar, err := s.read(w, r) // read → parse
	if err != nil {
		s.answer(w, r, nil, err)
		return
	}
	defer ar.release()
	view, err := s.pair(r, ar)
	if err != nil {
		s.answer(w, r, ar, err)
		return
	}
	ident := s.identify(r, ar, view)
	dec := s.compact(ctx, r, ar, ident, compaction.PassForward)
	s.report(ar, ident, dec, compaction.PassForward)
	rp, err := s.send(ctx, ar, attempt{dec: dec, inject: s.usageOption(ar.api, ar.req), first: true})
	if again, ok := s.recoverOnce(ctx, r, ar, ident, rp.at, err); ok {
		rp, err = s.send(ctx, ar, attempt{dec: again, inject: rp.at.inject})
	}
	if err != nil {
		s.answer(w, r, ar, err)
		return
	}
	s.relay(w, r, ar, rp, func(u anchor.Usage) { s.recordUsage(ctx, r, ar, ident, rp.at.dec, u) })
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
// becomes an answer. ar is nil before the request was parsed.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, ar *apiRequest, err error) {
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
		s.writeHeaders(w, ar, ua.Header)
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

// apiRequest is one client request of a compacted route on its way
// through the proxy, as read: data only, set by read and not changed after
// (the stages pass what they make as values: checked, identified,
// decision, attempt, reply).
type apiRequest struct {
	api *wire.API // the API the client speaks (the route)
	// query is the client's query string, forwarded with the request
	// (Claude Code's ?beta=true, Azure's ?api-version=).
	query   string
	start   time.Time
	reqID   string // the proxy's request id (logs, X-Request-Id)
	req     *chat.Request
	info    *apiInfo    // the access log's request fields
	headers http.Header // upstream headers
	parse   identity.Parse
	// opaque: the upstream holds the history (a Responses request with
	// previous_response_id): no pairing check, compaction or anchor, the
	// body passes as it came.
	opaque bool
	// pb is the pooled buffer the client's body was read into (nil when
	// not pooled); outgoing bodies that point into it are tracked.
	pb *bufpool.Body
	// respHeaders are extra headers for the client (X-Compactproxy-*).
	respHeaders http.Header
}

// checked is the pair stage's result: the client's view after the
// pairing check (repaired in repair mode).
type checked struct {
	msgs []chat.Message
	// clean: msgs are the parsed messages and passed the check with no
	// violation (remembered with the parse for the tenant's next body).
	clean bool
	// unchanged: msgs are byte-for-byte the client's body (the fast path).
	unchanged bool
}

// identified is the identify stage's result: the request's conversation,
// the checked view, and whether compaction applies.
type identified struct {
	*identity.Conversation
	view checked
	// compacting: compaction applies to this request (enabled, no bypass,
	// not opaque).
	compacting bool
	// selfCompaction: the agent's own compaction request, forwarded whole
	// while it fits the window (selfCompaction).
	selfCompaction bool
}

// decision is the compact stage's result: the planner's output, the view
// to forward and the time it waited for a summary.
type decision struct {
	out     compaction.Output
	forward []chat.Message
	// unchanged: forward is byte-for-byte the client's body.
	unchanged bool
	spent     time.Duration
}

// attempt is one send: what differs between the first send and the
// recovery's resend (the decided view, the usage field the proxy injects
// to ask the stream for its usage, nil: none, so the usage must not reach
// the client).
type attempt struct {
	dec    decision
	inject []chat.Field
	// first: the request path's first send (its overhead is measured).
	first bool
}

// reply is a send's result: the attempt as sent (the stream_options
// fallback drops inject), the upstream's successful response (nil after
// an error) and when it was asked for.
type reply struct {
	at    attempt
	resp  *http.Response
	start time.Time
}

// windowScope is the scope of ar's window: its tenant, model and
// window-shaping headers (upstream.Scope).
func (ar *apiRequest) windowScope() upstream.Scope {
	return upstream.Scope{Tenant: ar.parse.Tenant, Model: ar.req.Model, Shape: upstream.WindowShape(ar.headers)}
}

// release returns the request's body buffer to its pool (the request is
// over).
func (ar *apiRequest) release() { ar.pb.Release() }

// read authorizes, reads and parses the body of a compacted route (and
// of the preview): 401, 413, 408, 400 in the API's envelope, or 499 for a
// client that went away mid-upload, as the error.
//
// A chat-completions body is parsed after the tenant's most similar
// recent body when one shares leading messages with it
// (identity.ParseChat): those are not scanned, hashed or chained again.
//
// The body buffer may be pooled: the caller calls release when the request
// is over.
func (s *Server) read(w http.ResponseWriter, r *http.Request) (*apiRequest, error) {
	start := time.Now()
	if !s.auth.allow(r.Header) {
		return nil, &clientError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "invalid_api_key",
			detail: "compactproxy: a valid API key for this proxy is required (Authorization: Bearer <key>)"}
	}
	pb, err := readBodyWithin(w, r, s.cfg.Limits.MaxBodyBytes, s.cfg.Limits.BodyReadTimeout)
	if err != nil {
		return nil, bodyError{err}
	}
	tenant := identity.Tenant(s.tenantSecret, r.Header)
	api := apiOf(r)
	var (
		req *chat.Request
		ps  = identity.Parse{Tenant: tenant}
	)
	if api.Dialect == chat.DialectChat {
		req, ps, err = s.ids.ParseChat(tenant, identity.Header(r.Header, s.cfg.Compaction.ConversationHeaders), pb.Buf)
	} else {
		// A Responses or Messages body is mapped to the chat model; its
		// items' bytes are its own (a background summary renders them
		// after this request is over), so the pooled buffer goes back now.
		own := bytes.Clone(pb.Buf)
		pb.Release()
		pb = nil
		req, err = chat.ParseDialect(api.Dialect, own)
	}
	if err != nil {
		pb.Release()
		var pe *chat.ParseError
		if errors.As(err, &pe) {
			return nil, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", param: pe.Param, detail: pe.Message}
		}
		return nil, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", detail: err.Error()}
	}
	ci := &apiInfo{model: req.Model, stream: req.Stream, messages: len(req.Messages), action: "none"}
	infoFrom(r.Context()).api = ci
	if req.UIOnlyRemoved > 0 {
		s.metrics.UIOnlyRemoved.Add(float64(req.UIOnlyRemoved))
	}
	ar := &apiRequest{
		api:         api,
		query:       r.URL.RawQuery,
		start:       start,
		reqID:       infoFrom(r.Context()).id,
		req:         req,
		info:        ci,
		pb:          pb,
		headers:     s.up.Header(r.Header, s.ownHeaders()...),
		parse:       ps,
		opaque:      api.HistoryUpstream(req),
		respHeaders: http.Header{},
	}
	ar.respHeaders.Set("X-Compactproxy-Compaction", "none")
	return ar, nil
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
	if s.cfg.Upstream.StreamUsage != "always" && s.up.NoStreamOptions.Unsupported(s.ids.ModelIdentity(req.Model)) {
		return nil
	}
	return []chat.Field{f}
}

// body is the upstream body of at: the client's own bytes when nothing
// changed, else the decided view rendered in the client's API.
func (ar *apiRequest) body(at attempt) []byte {
	if at.dec.unchanged && at.inject == nil {
		return ar.req.Body
	}
	return ar.req.Build(at.dec.forward, at.inject)
}
