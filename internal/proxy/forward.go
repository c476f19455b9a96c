package proxy

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"go.uber.org/zap"
)

// maxErrorBody bounds how much of an upstream error answer is read to
// classify it (stream_options rejection, context overflow).
const maxErrorBody = 1 << 20

// maxJSONBody bounds a non-streamed completion read to find its usage.
const maxJSONBody = 256 << 20

// forwardChat sends the chat request upstream (with retries and the
// request-changing recoveries) and relays the answer.
func (s *Server) forwardChat(w http.ResponseWriter, r *http.Request, cr *chatRequest) {
	ctx := r.Context()
	ri := infoFrom(ctx)
	cr.inject = s.injectUsage(cr.req)
	recovered, streamOptionsResend := false, false
	for first := true; ; first = false {
		body := cr.body()
		if first { // the recoveries' resends are not overhead of the request path
			s.metrics.Overhead.Observe((time.Since(cr.start) - cr.spent).Seconds())
		}
		upStart := time.Now()
		resp, err := s.retrier.do(ctx, "chat", func() (*http.Request, error) {
			req, err := http.NewRequest(http.MethodPost, s.chatURL, cr.pb.reader(body))
			if err != nil {
				return nil, err
			}
			req.Header = cr.headers.Clone()
			req.Header.Set("Content-Type", "application/json")
			req.ContentLength = int64(len(body))
			return req, nil
		})
		if err != nil {
			ri.upstream = time.Since(upStart)
			if ctx.Err() != nil {
				ri.status = 499
				return
			}
			f := classifyUpstream(err)
			s.log.Warn("upstream request failed", zap.String("request_id", ri.id),
				zap.String("upstream", s.chatLogURL), zap.String("error_class", f.code))
			writeUpstreamFailure(w, f)
			return
		}
		if resp.StatusCode >= 400 {
			errBody, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
			resp.Body.Close()
			ri.upstream = time.Since(upStart)
			if cr.inject && s.cfg.Upstream.StreamUsage == "auto" && mentionsStreamOptions(resp.StatusCode, errBody) {
				// Maybe an upstream that does not know stream_options, maybe
				// the client's own bad stream_options: send the request
				// again as the client wrote it, and learn only if that
				// succeeds (below).
				s.metrics.UpstreamRetries.WithLabelValues("chat", "stream_options").Inc()
				cr.inject = false
				streamOptionsResend = true
				continue
			}
			if !recovered && s.recoverOverflow != nil {
				if s.recoverOverflow(ctx, cr, resp.StatusCode, errBody) {
					recovered = true
					s.metrics.UpstreamRetries.WithLabelValues("chat", "context_overflow").Inc()
					continue
				}
			}
			s.writeHeaders(w, cr, resp.Header)
			w.WriteHeader(resp.StatusCode)
			_, _ = w.Write(errBody)
			return
		}
		if streamOptionsResend {
			s.noStreamOptions.learn(s.modelIdentity(cr.req.Model))
			s.log.Info("upstream rejects stream_options for this model; usage injection paused",
				zap.String("request_id", ri.id), zap.Duration("for", s.cfg.Upstream.DiscoveryInterval))
		}
		s.relay(w, r, cr, resp, upStart)
		return
	}
}

func (s *Server) writeHeaders(w http.ResponseWriter, cr *chatRequest, up http.Header) {
	h := w.Header()
	own := h.Get("X-Request-Id")
	copyResponseHeaders(h, up)
	keepRequestID(h, own)
	for k, vv := range cr.respHeaders {
		h[k] = vv
	}
}

// keepRequestID restores the proxy's X-Request-Id (the one in its logs)
// over the upstream's, which the client gets as X-Upstream-Request-Id.
func keepRequestID(h http.Header, own string) {
	up := h.Values("X-Request-Id")
	h.Del("X-Request-Id")
	for _, v := range up {
		if v != own {
			h.Add("X-Upstream-Request-Id", v)
		}
	}
	if own != "" {
		h.Set("X-Request-Id", own)
	}
}

// relay copies a successful upstream answer to the client: SSE event by
// event, or a JSON body whole, reading usage before the last byte is sent.
func (s *Server) relay(w http.ResponseWriter, r *http.Request, cr *chatRequest, resp *http.Response, upStart time.Time) {
	ri := infoFrom(r.Context())
	defer resp.Body.Close()
	defer func() { ri.upstream = time.Since(upStart); s.metrics.UpstreamDuration.Observe(ri.upstream.Seconds()) }()
	s.writeHeaders(w, cr, resp.Header)
	if isEventStream(resp.Header.Get("Content-Type")) {
		w.Header().Del("Content-Length")
		w.WriteHeader(resp.StatusCode)
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		err := relayEvents(w, resp.Body, cr.inject, func(u anchor.Usage) { s.usage(cr, u) })
		var broken streamBroken
		switch {
		case err == nil:
		case r.Context().Err() != nil || errors.Is(err, errClientGone):
			ri.status = 499
		case errors.As(err, &broken):
			s.abortStream(w, ri, classifyUpstream(broken.error))
		}
		return
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxJSONBody))
	if err != nil {
		if r.Context().Err() != nil {
			ri.status = 499
			return
		}
		f := classifyUpstream(err)
		s.log.Warn("upstream body read failed", zap.String("request_id", ri.id),
			zap.String("upstream", s.chatLogURL), zap.String("error_class", f.code))
		writeError(w, http.StatusBadGateway, "upstream_error", f.code, "", "compactproxy: the upstream answer was cut off ("+f.text+")")
		return
	}
	if u, ok := anchor.UsageFromJSON(body); ok {
		s.usage(cr, u)
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(body)
}

// streamErrorEvent is the SSE event a client gets when the upstream broke
// off a stream; the abort that follows makes the stream end uncleanly too.
func streamErrorEvent(f upstreamFailure) []byte {
	body, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{apiError{Message: "compactproxy: the upstream broke off the stream (" + f.text + ")", Type: "upstream_error", Code: &f.code}})
	return append(append([]byte("data: "), body...), '\n', '\n')
}

// abortStream ends a stream the upstream broke off: the error event, then
// http.ErrAbortHandler, so the client sees an incomplete response rather
// than a clean end with half an answer (httputil's Issue 23643; CRAFT
// habit 15). The usage that arrived was already recorded by relayEvents.
func (s *Server) abortStream(w http.ResponseWriter, ri *reqInfo, f upstreamFailure) {
	s.metrics.StreamAborts.Inc()
	s.log.Warn("upstream stream broken off", zap.String("request_id", ri.id),
		zap.String("upstream", s.chatLogURL), zap.String("error_class", f.code))
	ri.aborted = true
	if _, err := w.Write(streamErrorEvent(f)); err == nil {
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
	panic(http.ErrAbortHandler)
}

// usage counts reported usage and hands it to the anchor hook.
func (s *Server) usage(cr *chatRequest, u anchor.Usage) {
	if u.HasInput {
		// A prompt the upstream accepted: no learned window goes below it.
		s.windows.accept(cr.req.Model, u.Input, s.cfg.Upstream.DiscoveryInterval)
		s.metrics.UsageInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
		s.metrics.UsageInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
		s.metrics.UsageInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
	}
	if cr.onUsage != nil {
		cr.onUsage(u)
	}
}
