package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// writeUnauthorized answers a client without a key this proxy accepts.
func writeUnauthorized(w http.ResponseWriter) {
	writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "",
		"compactproxy: a valid API key for this proxy is required (Authorization: Bearer <key>)")
}

// readChatRequest authorizes, reads and parses a chat-completions body
// (chat and preview). It answers the client itself and returns false on
// any problem: 401, 413, 400 in OpenAI's envelope, or 499 for a client that
// went away mid-upload.
//
// The body is parsed after the tenant's most similar recent body when one
// shares leading messages with it (parseCache): those are not scanned,
// hashed or chained again. The returned parsed says which.
//
// The body buffer may be pooled: the caller calls the returned pooledBody's
// release (nil-safe) when the request is over.
func (s *Server) readChatRequest(w http.ResponseWriter, r *http.Request) (*chat.Request, *pooledBody, parsed, bool) {
	if !s.auth.allow(r.Header) {
		writeUnauthorized(w)
		return nil, nil, parsed{}, false
	}
	pb, err := readBodyWithin(w, r, s.cfg.Limits.MaxBodyBytes, s.cfg.Limits.BodyReadTimeout)
	if err != nil {
		s.answerBodyError(w, r, err)
		return nil, nil, parsed{}, false
	}
	ps := parsed{tenant: tenantOf(s.tenantSecret, r.Header)}
	ps.key = s.parses.key(ps.tenant, conversationHeader(r, s.cfg.Compaction.ConversationHeaders), pb.buf)
	ps.from = s.parses.lookup(ps.key, pb.buf)
	var snap *chat.Snapshot
	if ps.from != nil {
		snap = ps.from.snap
	}
	req, reused, err := chat.ParseAfter(pb.buf, snap)
	if err != nil {
		pb.release()
		var pe *chat.ParseError
		if errors.As(err, &pe) {
			writeInvalid(w, pe.Param, pe.Message)
		} else {
			writeInvalid(w, "", err.Error())
		}
		return nil, nil, parsed{}, false
	}
	ps.reused = reused
	if reused == 0 {
		ps.from = nil
	}
	return req, pb, ps, true
}

// parsed is how a request's body was parsed: the tenant, its parse cache
// key, and the entry whose first reused messages it took (nil: none).
type parsed struct {
	tenant string
	key    parseKey
	from   *parseEntry
	reused int
}

// hopHeaders are not forwarded (RFC 9110 § 7.6.1) plus the ones we set.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
	"Content-Length", "Host",
	// The transport negotiates compression itself and decodes it, so the
	// proxy can read SSE events and usage; the client gets identity.
	"Accept-Encoding",
	"X-Compactproxy-Conversation", "X-Compactproxy-Bypass",
}

// upstreamHeaders builds the headers of a request to the upstream from the
// client's: hop-by-hop and proxy-only headers removed, credentials replaced
// when upstream.api_key is set.
func (s *Server) upstreamHeaders(in http.Header) http.Header {
	h := in.Clone()
	if c := in.Get("Connection"); c != "" {
		for _, f := range strings.Split(c, ",") {
			h.Del(strings.TrimSpace(f))
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
	if hs := s.cfg.Compaction.ConversationHeaders; len(hs) > 0 {
		h.Del(hs[0]) // the proxy's own conversation header (DESIGN § Compaction)
	}
	if key := s.cfg.Upstream.APIKey.Reveal(); key != "" {
		h.Del("X-Api-Key")
		h.Del("Api-Key")
		h.Set("Authorization", "Bearer "+key)
	}
	return h
}

// copyResponseHeaders copies the upstream's response headers to the client,
// without hop-by-hop headers and Content-Length (the body may change).
func copyResponseHeaders(dst, src http.Header) {
	for k, vv := range src {
		switch http.CanonicalHeaderKey(k) {
		case "Connection", "Keep-Alive", "Transfer-Encoding", "Trailer", "Content-Length", "Upgrade", "Proxy-Connection":
			continue
		}
		dst[k] = append([]string(nil), vv...)
	}
}

// chatRequest is one client request on its way through the proxy.
type chatRequest struct {
	start   time.Time
	req     *chat.Request
	headers http.Header // upstream headers
	tenant  string
	parsed  parsed
	seedIn  seedInput // set by openConversation
	// pairingClean: the parsed messages passed the pairing check with no
	// violation (remembered by the parse cache entry of this body).
	pairingClean bool
	// forward is the view that will be sent; unchanged reports whether it
	// is byte-for-byte the client's body (the fast path).
	forward   []chat.Message
	client    []chat.Message // the client's provider-visible view (after pairing repair)
	unchanged bool
	// inject is set when the proxy injected include_usage, so the
	// usage-only chunk must not reach the client.
	inject bool
	// spent is time spent in summarize calls, excluded from overhead.
	spent time.Duration
	// onUsage is called with the normalized usage of a successful response,
	// before its last byte is written to the client.
	onUsage func(u anchor.Usage)
	// recompact compacts again after an overflow answer; true when the
	// view changed and the request should be sent again.
	recompact func(ctx context.Context, info overflowInfo) bool
	// pb is the pooled buffer the client's body was read into (nil when
	// not pooled); outgoing bodies that point into it are tracked.
	pb *pooledBody
	// respHeaders are extra headers for the client (X-Compactproxy-*).
	respHeaders http.Header
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	ri := infoFrom(r.Context())
	start := time.Now()
	req, pb, ps, ok := s.readChatRequest(w, r)
	if !ok {
		return
	}
	defer pb.release()
	ci := &chatInfo{model: req.Model, stream: req.Stream, messages: len(req.Messages), action: "none"}
	ri.chat = ci
	if req.UIOnlyRemoved > 0 {
		s.metrics.UIOnlyRemoved.Add(float64(req.UIOnlyRemoved))
	}
	cr := &chatRequest{
		start:       start,
		req:         req,
		pb:          pb,
		headers:     s.upstreamHeaders(r.Header),
		tenant:      ps.tenant,
		parsed:      ps,
		forward:     req.Messages,
		unchanged:   req.Unchanged(req.Messages),
		respHeaders: http.Header{},
	}
	cr.respHeaders.Set("X-Compactproxy-Compaction", "none")
	if s.prepare != nil {
		if done := s.prepare(w, r, cr, ci); done {
			return
		}
	}
	s.forwardChat(w, r, cr)
}

// injectUsage reports whether include_usage should be injected.
func (s *Server) injectUsage(req *chat.Request) bool {
	if !req.Stream || req.IncludeUsage {
		return false
	}
	switch s.cfg.Upstream.StreamUsage {
	case "never":
		return false
	case "always":
		return true
	}
	return !s.noStreamOptions.unsupported(s.modelIdentity(req.Model))
}

// streamOptions returns the client's stream_options with include_usage set.
func streamOptions(req *chat.Request) []byte {
	for _, f := range req.Fields {
		if f.Key != "stream_options" {
			continue
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(f.Value, &m) == nil && m != nil {
			m["include_usage"] = json.RawMessage("true")
			if b, err := json.Marshal(m); err == nil {
				return b
			}
		}
	}
	return []byte(`{"include_usage":true}`)
}

// body builds the upstream body for the current view.
func (cr *chatRequest) body() []byte {
	var set []chat.Field
	if cr.inject {
		set = []chat.Field{{Key: "stream_options", Value: streamOptions(cr.req)}}
	}
	if cr.unchanged && set == nil {
		return cr.req.Body
	}
	return cr.req.Build(cr.forward, set)
}

// mentionsStreamOptions recognizes an upstream that rejects stream_options.
func mentionsStreamOptions(status int, body []byte) bool {
	return (status == http.StatusBadRequest || status == http.StatusUnprocessableEntity) &&
		bytes.Contains(body, []byte("stream_options"))
}
