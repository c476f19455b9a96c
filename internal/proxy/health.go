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

// readiness caches the upstream probe (upstream.Client.Probe) for at most
// one second, so a busy orchestrator cannot turn /readyz into load on the
// upstream.
type readiness struct {
	probe func(context.Context) (bool, string)
	mu    sync.Mutex
	at    time.Time
	ok    bool
	cause string
}

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

// Start begins background work (context-window discovery when no window
// is configured); it returns at once. ctx ends it.
func (s *Server) Start(ctx context.Context) {
	s.up.Start(ctx, len(s.cfg.Models) == 0)
}
