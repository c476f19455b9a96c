package proxy

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"
)

func (s *Server) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// readiness caches the upstream probe for at most one second, so a busy
// orchestrator cannot turn /readyz into load on the upstream.
type readiness struct {
	s     *Server
	mu    sync.Mutex
	at    time.Time
	ok    bool
	cause string
}

func newReadiness(s *Server) *readiness { return &readiness{s: s} }

func (rd *readiness) check(ctx context.Context) (bool, string) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if !rd.at.IsZero() && time.Since(rd.at) < time.Second {
		return rd.ok, rd.cause
	}
	rd.ok, rd.cause = rd.probe(ctx)
	rd.at = time.Now()
	return rd.ok, rd.cause
}

// probe: dialect llamacpp → GET {root}/health must be 200 (503 while the
// model loads); otherwise any answer below 500 to GET {url}/models proves
// the upstream reachable (a 401 without a key included).
func (rd *readiness) probe(ctx context.Context) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s := rd.s
	target := join(s.up.base, "models").String()
	llama := s.cfg.Upstream.Dialect == "llamacpp"
	if llama {
		target = join(s.up.root, "health").String()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return false, "upstream URL invalid"
	}
	if key := s.cfg.Upstream.APIKey.Reveal(); key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	// RoundTrip, not http.Client: a redirect is an answer, not a hop to
	// follow, and its errors do not quote the URL (*url.Error does).
	resp, err := s.transport.RoundTrip(req)
	if err != nil {
		return false, classifyUpstream(err).text
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if llama && resp.StatusCode != http.StatusOK {
		return false, "upstream health: " + resp.Status
	}
	if resp.StatusCode >= 500 {
		return false, "upstream answered " + resp.Status
	}
	return true, ""
}

func (s *Server) handleReadyz(w http.ResponseWriter, r *http.Request) {
	ok, cause := s.ready.check(r.Context())
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, "not ready: "+cause+"\n")
		return
	}
	_, _ = io.WriteString(w, "ready\n")
}
