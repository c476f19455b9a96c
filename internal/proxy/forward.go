package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"go.uber.org/zap"
)

// maxErrorBody bounds how much of an upstream error answer is read to
// classify it (stream_options rejection, context overflow).
const maxErrorBody = 1 << 20

// maxJSONBody bounds a non-streamed completion read to find its usage.
const maxJSONBody = 256 << 20

// send is the send stage: the chat request upstream, with retries
// (retry.*) and the stream_options fallback (an upstream that rejects the
// injected stream_options gets the request again as the client wrote it;
// only when that succeeds is the model identity remembered as not
// supporting it). It returns the upstream's successful response (its body
// still to relay), or the error that ends the request: *upstreamAnswer
// for the upstream's own error answer, *upstreamError when there was no
// usable answer, errClientGone when the client left.
func (s *Server) send(ctx context.Context, cr *chatRequest) (*http.Response, error) {
	ri := infoFrom(ctx)
	if !cr.sent {
		cr.inject = cr.dialect == chat.DialectChat && s.injectUsage(cr.req)
	}
	streamOptionsResend := false
	for {
		body := cr.body()
		if !cr.sent { // a resend (recovery) is not overhead of the request path
			cr.sent = true
			s.metrics.Overhead.Observe((time.Since(cr.start) - cr.spent).Seconds())
		}
		upStart := time.Now()
		// Counted under the route served (op = chat, responses, messages).
		resp, err := s.retrier.do(ctx, cr.dialect.String(), func() (*http.Request, error) {
			target := s.dialectURLs[cr.dialect]
			if cr.query != "" {
				target += "?" + cr.query
			}
			req, err := http.NewRequest(http.MethodPost, target, cr.pb.reader(body))
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
				return nil, errClientGone
			}
			return nil, &upstreamError{failure: classifyUpstream(err), err: err}
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
				s.metrics.UpstreamRetries.WithLabelValues(cr.dialect.String(), "stream_options").Inc()
				cr.inject = false
				streamOptionsResend = true
				continue
			}
			return nil, &upstreamAnswer{status: resp.StatusCode, header: resp.Header, body: errBody}
		}
		if cr.dialect == chat.DialectResponses && isEventStream(resp.Header.Get("Content-Type")) {
			// An overflow may come as response.failed inside a 200 stream:
			// held until the answer has begun, it is an error answer like
			// a 400, and recovery can still retry.
			replay, failed, errBody := earlyFailure(resp.Body)
			resp.Body = replay
			if failed {
				all, _ := io.ReadAll(replay)
				ri.upstream = time.Since(upStart)
				return nil, &upstreamAnswer{status: resp.StatusCode, header: resp.Header, body: all, failure: errBody}
			}
		}
		if streamOptionsResend {
			s.noStreamOptions.learn(s.modelIdentity(cr.req.Model))
			s.log.Info("upstream rejects stream_options for this model; usage injection paused",
				zap.String("request_id", ri.id), zap.Duration("for", s.cfg.Upstream.DiscoveryInterval))
		}
		cr.upStart = upStart
		return resp, nil
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

// relay is the relay stage: the successful upstream answer to the
// client, SSE event by event or a JSON body whole, handing the usage it
// reports to record before the last byte is sent.
func (s *Server) relay(w http.ResponseWriter, r *http.Request, cr *chatRequest, resp *http.Response, record func(anchor.Usage)) {
	upStart := cr.upStart
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
		err := relayDialectEvents(w, resp.Body, &streamRules{d: cr.dialect}, cr.inject, record)
		var broken streamBroken
		switch {
		case err == nil:
		case r.Context().Err() != nil || errors.Is(err, errClientGone):
			ri.status = 499
		case errors.As(err, &broken):
			s.abortStream(w, ri, cr.dialect, classifyUpstream(broken.error))
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
			zap.String("upstream", s.dialectLogURLs[cr.dialect]), zap.String("error_class", f.code))
		writeErrorIn(cr.dialect, w, http.StatusBadGateway, "upstream_error", f.code, "", "compactproxy: the upstream answer was cut off ("+f.text+")")
		return
	}
	if u, ok := anchor.UsageFromJSON(body); ok {
		record(u)
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(body)
}

// streamErrorEvent is the SSE event a client gets when the upstream broke
// off a stream; the abort that follows makes the stream end uncleanly too.
func streamErrorEvent(d chat.Dialect, f upstreamFailure) []byte {
	msg := "compactproxy: the upstream broke off the stream (" + f.text + ")"
	switch d {
	case chat.DialectResponses:
		// The Responses stream's own error event.
		body, _ := json.Marshal(struct {
			Type    string `json:"type"`
			Code    string `json:"code"`
			Message string `json:"message"`
		}{"error", f.code, msg})
		return append(append([]byte("event: error\ndata: "), body...), '\n', '\n')
	case chat.DialectMessages:
		return append(append([]byte("event: error\ndata: "), anthropicError("api_error", msg)...), '\n', '\n')
	}
	body, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{apiError{Message: msg, Type: "upstream_error", Code: &f.code}})
	return append(append([]byte("data: "), body...), '\n', '\n')
}

// abortStream ends a stream the upstream broke off: the error event, then
// http.ErrAbortHandler, so the client sees an incomplete response rather
// than a clean end with half an answer (httputil's Issue 23643; CRAFT
// habit 15). The usage that arrived was already recorded by relayEvents.
func (s *Server) abortStream(w http.ResponseWriter, ri *reqInfo, d chat.Dialect, f upstreamFailure) {
	s.metrics.StreamAborts.Inc()
	s.log.Warn("upstream stream broken off", zap.String("request_id", ri.id),
		zap.String("upstream", s.dialectLogURLs[d]), zap.String("error_class", f.code))
	ri.aborted = true
	if _, err := w.Write(streamErrorEvent(d, f)); err == nil {
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
	panic(http.ErrAbortHandler)
}
