package proxy

import (
	"io"
	"log"
	"net/http"
	"net/http/httputil"
	"strings"

	"go.uber.org/zap"
)

// passthrough serves every path that is not compacted: other /v1/ endpoints
// go to the upstream URL (its version path replacing /v1), llama.cpp's root
// endpoints to the upstream root. Bodies and answers are untouched.
func (s *Server) passthrough() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			p := pr.In.URL.Path
			target := s.up.root
			if rest, ok := strings.CutPrefix(p, "/v1/"); ok {
				target = s.up.base
				p = rest
			}
			u := join(target, p)
			u.RawQuery = pr.In.URL.RawQuery
			pr.Out.URL = u
			pr.Out.Host = ""
			pr.Out.Header.Del("X-Compactproxy-Conversation")
			pr.Out.Header.Del("X-Compactproxy-Bypass")
			if key := s.cfg.Upstream.APIKey.Reveal(); key != "" {
				pr.Out.Header.Del("X-Api-Key")
				pr.Out.Header.Del("Api-Key")
				pr.Out.Header.Set("Authorization", "Bearer "+key)
			}
		},
		Transport:     s.transport,
		FlushInterval: -1,
		// ReverseProxy logs body-copy errors with the Go error string
		// (internal addresses); the access log says aborted instead.
		ErrorLog: log.New(io.Discard, "", 0),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				infoFrom(r.Context()).status = 499
				return
			}
			f := classifyUpstream(err)
			s.log.Warn("pass-through upstream request failed", zap.String("request_id", infoFrom(r.Context()).id),
				zap.String("upstream", logURL(r.URL)), zap.String("error_class", f.code))
			writeUpstreamFailure(w, f)
		},
	}
}

// authorized wraps pass-through with the same client auth as chat.
func (s *Server) authorized(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.auth.allow(r.Header) {
			writeUnauthorized(w)
			return
		}
		h.ServeHTTP(w, r)
	})
}
