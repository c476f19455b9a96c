// Package proxy is compactproxy's HTTP side: routing, the compacted
// routes' pipeline (parse, pairing, compaction, send, relay, usage
// capture), the pass-through reverse proxy, auth, the access log, health
// and admin endpoints. The upstream client is internal/upstream; what
// differs per API is internal/wire.
package proxy

import (
	"crypto/rand"
	"fmt"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/driver"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/metrics"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// Server is the proxy. Build it with New, serve Handler, call Start to begin
// background work (context-window discovery) and Close when done.
type Server struct {
	cfg     config.Config
	log     *zap.Logger
	metrics *metrics.Metrics
	handler http.Handler
	// up is the upstream client: transport, retries, windows.
	up *upstream.Client
	// apiURLs are the upstream URLs of the compacted routes, by
	// chat.Dialect (wire.APIs), and as logs may show them.
	apiURLs      []apiURL
	auth         *clientAuth
	tenantSecret []byte
	ready        *readiness
	windows      *upstream.Windows // up.Windows
	upstreamName string
	store        store.Backend
	storeHealth  storeHealth
	calibration  *anchor.Calibration
	impossible   onceSet // conversations warned about a fixed part over the budget
	local        anchor.LocalEstimator
	driver       *driver.Driver
	// ids derives conversations' identities (tenant, id, key, chains).
	ids *identity.Identifier
	// summarizerIsUpstream: the summarizer is the chat upstream itself, so
	// the client's own credentials may be used for it.
	summarizerIsUpstream bool
}

// apiURL is where one API's requests go upstream, and how logs show it.
type apiURL struct{ url, log string }

// New builds a Server from a validated configuration. reg is the registry the
// proxy's metrics are registered on (and that /metrics serves).
func New(cfg config.Config, log *zap.Logger, reg *prometheus.Registry) (*Server, error) {
	if log == nil {
		log = zap.NewNop()
	}
	s := &Server{
		cfg:     cfg,
		log:     log.Named("proxy"),
		metrics: metrics.New(reg),
	}
	up, err := upstream.New(cfg.Upstream, cfg.Retry, cfg.Models, s.log, func(op, reason string) {
		s.metrics.UpstreamRetries.WithLabelValues(op, reason).Inc()
	})
	if err != nil {
		return nil, fmt.Errorf("proxy: upstream.url %q is not an absolute URL", cfg.Upstream.URL)
	}
	s.up, s.windows = up, up.Windows
	for _, api := range wire.APIs {
		u, l := up.URL(api.UpstreamPath)
		s.apiURLs = append(s.apiURLs, apiURL{u, l})
	}
	s.auth = &clientAuth{required: cfg.Upstream.APIKey != "", allowAnonymous: cfg.Auth.AllowAnonymous}
	for _, k := range cfg.Auth.ClientKeys {
		s.auth.keys = append(s.auth.keys, []byte(k.Reveal()))
	}
	s.tenantSecret = []byte(cfg.Store.TenantSecret.Reveal())
	if len(s.tenantSecret) == 0 {
		s.tenantSecret = make([]byte, 32)
		_, _ = rand.Read(s.tenantSecret)
	}
	s.ready = &readiness{probe: up.Probe}
	s.upstreamName = up.Name
	if s.store, err = openStore(cfg.Store); err != nil {
		return nil, err
	}
	s.calibration = anchor.NewCalibration(1024)
	s.local = anchor.NewLocalEstimator()
	s.ids = identity.New(s.upstreamName, s.local, identity.ParseCacheBytes)
	dc := driver.Config{
		ReserveTokens:     cfg.Compaction.ReserveTokens,
		Store:             s.store,
		MaxConcurrent:     cfg.Compaction.Summarizer.MaxConcurrent,
		Timeout:           cfg.Compaction.Summarizer.Timeout,
		PresummarizeRatio: cfg.Compaction.PresummarizeRatio,
		Shadow:            cfg.Compaction.Mode == "shadow",
		Observer:          driverObserver{s},
	}
	if cfg.Compaction.Enabled {
		cc := s.compactionConfig()
		if sum := s.newSummarizer(); sum != nil {
			dc.Summarizer = sum
		} else {
			cc.SummarizerEnabled = false
		}
		dc.Planner = compaction.NewPlanner(cc)
	}
	s.driver = driver.New(dc)
	s.handler = s.routes(reg)
	return s, nil
}

func (s *Server) routes(reg *prometheus.Registry) http.Handler {
	r := chi.NewRouter()
	wrap := func(route string, h http.HandlerFunc) http.Handler {
		return observe(route, s.log.Named("access"), s.metrics, h)
	}
	// Chat completions, the Responses API and Anthropic Messages go
	// through the same pipeline (DESIGN § Other APIs); their other paths
	// (a stored response, count_tokens, /v1/responses/compact) pass
	// through.
	for _, api := range wire.APIs {
		r.Method(http.MethodPost, api.Route, wrap(api.Dialect.String(), s.handleAPI))
	}
	r.Method(http.MethodPost, "/v1/compactproxy/preview", wrap("preview", s.handlePreview))
	r.Method(http.MethodGet, "/v1/compactproxy/conversations/{id}", wrap("admin", s.handleConversation))
	r.Method(http.MethodDelete, "/v1/compactproxy/conversations/{id}", wrap("admin", s.handleForget))
	// Every other path under /v1/compactproxy/ is the proxy's own too.
	r.Handle("/v1/compactproxy", wrap("admin", handleOwnPath))
	r.Handle("/v1/compactproxy/*", wrap("admin", handleOwnPath))
	r.Method(http.MethodGet, "/healthz", wrap("health", s.handleHealthz))
	r.Method(http.MethodGet, "/readyz", wrap("health", s.handleReadyz))
	r.Method(http.MethodGet, "/metrics", wrap("metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}).ServeHTTP))
	pt := s.authorized(s.passthrough())
	r.Handle("/v1/*", wrap("passthrough", pt.ServeHTTP))
	for _, p := range []string{"/props", "/tokenize", "/detokenize", "/apply-template", "/slots", "/slots/*"} {
		r.Handle(p, wrap("passthrough", pt.ServeHTTP))
	}
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "not_found", "", "compactproxy: unknown path")
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "", "compactproxy: method not allowed on this path")
	})
	return r
}

// Handler returns the root HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// Close releases resources.
func (s *Server) Close() error {
	s.up.Transport.CloseIdleConnections()
	return s.store.Close()
}
