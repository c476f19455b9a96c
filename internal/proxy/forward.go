package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
	"go.uber.org/zap"
)

// maxJSONBody bounds a non-streamed completion read to find its usage.
const maxJSONBody = 256 << 20

// send is the send stage: at upstream, with retries (retry.*) and the
// stream_options fallback (an upstream that rejects the injected
// stream_options gets the request again as the client wrote it; only when
// that succeeds is the model identity remembered as not supporting it).
// Each send is one upstream.Attempt built from at. It returns the reply
// (the attempt as sent, and the upstream's successful response, its body
// still to relay), or with it the error that ends the request:
// *upstream.Answer for the upstream's own error answer, *upstream.Error
// when there was no usable answer, errClientGone when the client left.
func (s *Server) send(ctx context.Context, ar *apiRequest, at attempt) (reply, error) {
	ri := infoFrom(ctx)
	streamOptionsResend := false
	for {
		out := s.upstreamAttempt(ar, at)
		if at.first { // a resend (recovery) is not overhead of the request path
			at.first = false
			s.metrics.Overhead.Observe((time.Since(ar.start) - at.dec.spent).Seconds())
		}
		start := time.Now()
		resp, err := s.up.Retrier.Send(ctx, out)
		var ua *upstream.Answer
		switch {
		case err == nil:
		case errors.As(err, &ua):
			ri.upstream = time.Since(start)
			if at.inject != nil && s.cfg.Upstream.StreamUsage == "auto" && ar.api.RefusesUsageOption(ua.Status, ua.Body) {
				// Maybe an upstream that does not know stream_options, maybe
				// the client's own bad stream_options: send the request
				// again as the client wrote it, and learn only if that
				// succeeds (below).
				s.metrics.UpstreamRetries.WithLabelValues(ar.api.Dialect.String(), "stream_options").Inc()
				at.inject = nil
				streamOptionsResend = true
				continue
			}
			return reply{at: at}, err
		case ctx.Err() != nil:
			ri.upstream = time.Since(start)
			return reply{at: at}, errClientGone
		default:
			ri.upstream = time.Since(start)
			return reply{at: at}, err
		}
		if isEventStream(resp.Header.Get("Content-Type")) {
			// An overflow may come as a failure event inside a 200 stream
			// (Responses): held until the answer has begun, it is an error
			// answer like a 400, and recovery can still retry.
			replay, failure := ar.api.HoldEarly(resp.Body)
			resp.Body = replay
			if failure != nil {
				all, _ := io.ReadAll(replay)
				ri.upstream = time.Since(start)
				return reply{at: at}, &upstream.Answer{Status: resp.StatusCode, Header: resp.Header, Body: all, Failure: failure}
			}
		}
		if streamOptionsResend {
			s.up.NoStreamOptions.Learn(s.ids.ModelIdentity(ar.req.Model))
			s.log.Info("upstream rejects stream_options for this model; usage injection paused",
				zap.String("request_id", ri.id), zap.Duration("for", s.cfg.Upstream.DiscoveryInterval))
		}
		return reply{at: at, resp: resp, start: start}, nil
	}
}

// upstreamAttempt is the outgoing request for at: the request's URL and
// headers, at's body.
func (s *Server) upstreamAttempt(ar *apiRequest, at attempt) upstream.Attempt {
	body := ar.body(at)
	target := s.apiURLs[ar.api.Dialect].url
	if ar.query != "" {
		target += "?" + ar.query
	}
	return upstream.Attempt{
		Op:     ar.api.Dialect.String(), // retries are counted under the route served
		URL:    target,
		Header: ar.headers,
		Body:   func() io.ReadCloser { return ar.pb.Reader(body) },
		Length: int64(len(body)),
	}
}

func (s *Server) writeHeaders(w http.ResponseWriter, ar *apiRequest, up http.Header) {
	h := w.Header()
	own := h.Get("X-Request-Id")
	upstream.CopyResponseHeader(h, up)
	keepRequestID(h, own)
	for k, vv := range ar.respHeaders {
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

// relay is the relay stage: the successful upstream answer to the
// client, SSE event by event or a JSON body whole, handing the usage it
// reports to onUsage (the record stage) before the last byte is sent.
func (s *Server) relay(w http.ResponseWriter, r *http.Request, ar *apiRequest, rp reply, onUsage func(anchor.Usage)) {
	resp, upStart := rp.resp, rp.start
	ri := infoFrom(r.Context())
	defer resp.Body.Close()
	defer func() { ri.upstream = time.Since(upStart); s.metrics.UpstreamDuration.Observe(ri.upstream.Seconds()) }()
	s.writeHeaders(w, ar, resp.Header)
	if isEventStream(resp.Header.Get("Content-Type")) {
		w.Header().Del("Content-Length")
		w.WriteHeader(resp.StatusCode)
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		err := relayEvents(w, resp.Body, ar.api.NewStream(rp.at.inject != nil), onUsage)
		var broken streamBroken
		switch {
		case err == nil:
		case r.Context().Err() != nil || errors.Is(err, errClientGone):
			ri.status = 499
		case errors.As(err, &broken):
			s.abortStream(w, ri, ar.api, upstream.Classify(broken.error))
		}
		return
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxJSONBody))
	if err != nil {
		if r.Context().Err() != nil {
			ri.status = 499
			return
		}
		f := upstream.Classify(err)
		s.log.Warn("upstream body read failed", zap.String("request_id", ri.id),
			zap.String("upstream", s.apiURLs[ar.api.Dialect].log), zap.String("error_class", f.Code))
		writeErrorIn(ar.api, w, http.StatusBadGateway, "upstream_error", f.Code, "", "compactproxy: the upstream answer was cut off ("+f.Text+")")
		return
	}
	if u, ok := anchor.UsageFromJSON(body); ok {
		onUsage(u)
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(body)
}

// abortStream ends a stream the upstream broke off: the error event, then
// http.ErrAbortHandler, so the client sees an incomplete response rather
// than a clean end with half an answer (httputil's Issue 23643; CRAFT
// habit 15). The usage that arrived was already recorded by relayEvents.
func (s *Server) abortStream(w http.ResponseWriter, ri *reqInfo, api *wire.API, f upstream.Failure) {
	s.metrics.StreamAborts.Inc()
	s.log.Warn("upstream stream broken off", zap.String("request_id", ri.id),
		zap.String("upstream", s.apiURLs[api.Dialect].log), zap.String("error_class", f.Code))
	ri.aborted = true
	if _, err := w.Write(streamErrorEvent(api, f)); err == nil {
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
	panic(http.ErrAbortHandler)
}

// streamErrorEvent is the SSE event a client gets when the upstream broke
// off a stream; the abort that follows makes the stream end uncleanly too.
func streamErrorEvent(api *wire.API, f upstream.Failure) []byte {
	return api.StreamError(f.Code, "compactproxy: the upstream broke off the stream ("+f.Text+")")
}
