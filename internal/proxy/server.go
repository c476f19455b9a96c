// Package proxy is compactproxy's HTTP side: routing, the chat-completions
// path (parse, pairing, compaction, forward, stream, usage capture), the
// pass-through reverse proxy, retries and health endpoints.
package proxy

import (
	"context"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Server is the proxy. Build it with New, serve Handler, call Start to begin
// background work (context-window discovery) and Close when done.
type Server struct {
	cfg     config.Config
	log     *zap.Logger
	reg     *prometheus.Registry
	handler http.Handler
}

// New builds a Server from a validated configuration. reg is the registry the
// proxy's metrics are registered on (and that /metrics serves).
func New(cfg config.Config, log *zap.Logger, reg *prometheus.Registry) (*Server, error) {
	s := &Server{cfg: cfg, log: log, reg: reg}
	s.handler = http.NotFoundHandler()
	return s, nil
}

// Handler returns the root HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// Start begins background work; it returns at once. ctx ends it.
func (s *Server) Start(ctx context.Context) {}

// Close releases resources.
func (s *Server) Close() error { return nil }
