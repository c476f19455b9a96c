package proxy

import (
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httputil"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
)

// passthrough serves every path that is not compacted: other /v1/ endpoints
// go to the upstream URL (its version path replacing /v1), llama.cpp's root
// endpoints to the upstream root. Bodies and answers are untouched.
func (s *Server) passthrough() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			p := pr.In.URL.Path
			target := s.up.Target.Root
			if rest, ok := strings.CutPrefix(p, "/v1/"); ok {
				target = s.up.Target.Base
				p = rest
			}
			u := upstream.Join(target, p)
			u.RawQuery = pr.In.URL.RawQuery
			pr.Out.URL = u
			pr.Out.Host = ""
			// As on chat: the proxy's own headers and the first configured
			// conversation header stop here; agents' own ones pass.
			for _, k := range s.ownHeaders() {
				pr.Out.Header.Del(k)
			}
			// The proxy's upstream key in the upstream's own header, as on
			// the chat routes (Anthropic's X-Api-Key for dialect anthropic:
			// count_tokens and models carried a Bearer token it ignores).
			upstream.SetKey(pr.Out.Header, s.cfg.Upstream.APIKey.Reveal(), s.cfg.Upstream.Dialect)
		},
		ModifyResponse: func(resp *http.Response) error {
			// The proxy's X-Request-Id stays (observe set it on the
			// response); ReverseProxy would replace it with the upstream's.
			if up := resp.Header.Values("X-Request-Id"); len(up) > 0 {
				resp.Header.Del("X-Request-Id")
				for _, v := range up {
					resp.Header.Add("X-Upstream-Request-Id", v)
				}
			}
			return nil
		},
		Transport:     s.up.Transport,
		FlushInterval: -1,
		// ReverseProxy logs body-copy errors with the Go error string
		// (internal addresses); the access log says aborted instead.
		ErrorLog: log.New(io.Discard, "", 0),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if infoFrom(r.Context()).bodyTimedOut.Load() {
				// The client's body, not the upstream, was too slow.
				s.answerBodyError(w, r, os.ErrDeadlineExceeded)
				return
			}
			if r.Context().Err() != nil {
				infoFrom(r.Context()).status = 499
				return
			}
			f := upstream.Classify(err)
			s.log.Warn("pass-through upstream request failed", zap.String("request_id", infoFrom(r.Context()).id),
				zap.String("upstream", upstream.LogURL(r.URL)), zap.String("error_class", f.Code))
			writeUpstreamFailure(w, f)
		},
	}
}

// authorized wraps pass-through with the same client auth as chat, and
// bounds the upload of its body by limits.body_read_timeout, as on chat: a
// body is streamed to the upstream (a file upload may be large), so the
// connection's read deadline is set for it and cleared once it has arrived.
func (s *Server) authorized(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.auth.allow(r.Header) {
			writeUnauthorized(w)
			return
		}
		if t := s.cfg.Limits.BodyReadTimeout; t > 0 && r.Body != nil && r.Body != http.NoBody {
			rc := http.NewResponseController(w)
			if rc.SetReadDeadline(time.Now().Add(t)) == nil {
				r.Body = &deadlineBody{ReadCloser: r.Body, rc: rc, timedOut: &infoFrom(r.Context()).bodyTimedOut}
			}
		}
		h.ServeHTTP(w, r)
	})
}

// deadlineBody is a pass-through request body read under the connection's
// read deadline: the deadline is cleared at its end (a long streamed answer
// is not cut), and a read that hit it is remembered in the request's
// reqInfo (ReverseProxy hands its error handler its own wrapper of the
// body), so the error handler answers 408 rather than blaming the upstream. A body never read to its
// end keeps the deadline: what net/http then drains of it is bounded too.
type deadlineBody struct {
	io.ReadCloser
	rc       *http.ResponseController
	once     sync.Once
	timedOut *atomic.Bool // the request's reqInfo.bodyTimedOut
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case errors.Is(err, os.ErrDeadlineExceeded):
		b.timedOut.Store(true)
	default: // the end (io.EOF), or the client gone: nothing more to bound
		b.clear()
	}
	return n, err
}

func (b *deadlineBody) clear() {
	b.once.Do(func() { _ = b.rc.SetReadDeadline(time.Time{}) })
}
