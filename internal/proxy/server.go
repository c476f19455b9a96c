// Package proxy is compactproxy's HTTP side: routing, the chat-completions
// path (parse, pairing, compaction, forward, stream, usage capture), the
// pass-through reverse proxy, retries and health endpoints.
package proxy

import (
	"crypto/rand"
	"fmt"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/metrics"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/summarizer"
	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// digestCacheEntries bounds the message-digest cache (about 100 bytes an
// entry: ~20 MB at most).
const digestCacheEntries = 200000

// Server is the proxy. Build it with New, serve Handler, call Start to begin
// background work (context-window discovery) and Close when done.
type Server struct {
	cfg     config.Config
	log     *zap.Logger
	metrics *metrics.Metrics
	handler http.Handler
	up      upstreamURLs
	// dialectURLs are the upstream URLs of the compacted routes, by
	// chat.Dialect (chat completions, responses, messages).
	dialectURLs [3]string
	// dialectLogURLs are dialectURLs as logs may show them.
	dialectLogURLs [3]string
	transport      *http.Transport
	retrier        *retrier
	auth           *clientAuth
	tenantSecret   []byte
	ready          *readiness
	windows        *windows
	upstreamName   string
	store          store.Backend
	storeHealth    storeHealth
	flights        flights
	calibration    *anchor.Calibration
	impossible     onceSet // conversations warned about a fixed part over the budget
	local          anchor.LocalEstimator
	planner        *compaction.Planner // nil when compaction is off
	sum            *summarizer.Client  // nil when the summarizer is off
	digests        *digestCache
	parses         *parseCache
	// summarizerIsUpstream: the summarizer is the chat upstream itself, so
	// the client's own credentials may be used for it.
	summarizerIsUpstream bool
	sumSem               chan struct{}

	// noStreamOptions: model identities whose upstream rejected
	// stream_options (upstream.stream_usage auto), for discovery_interval.
	noStreamOptions *streamOptionsMemo
}

// New builds a Server from a validated configuration. reg is the registry the
// proxy's metrics are registered on (and that /metrics serves).
func New(cfg config.Config, log *zap.Logger, reg *prometheus.Registry) (*Server, error) {
	up, err := parseUpstream(cfg.Upstream.URL)
	if err != nil || up.base.Scheme == "" || up.base.Host == "" {
		return nil, fmt.Errorf("proxy: upstream.url %q is not an absolute URL", cfg.Upstream.URL)
	}
	if log == nil {
		log = zap.NewNop()
	}
	s := &Server{
		cfg:             cfg,
		log:             log.Named("proxy"),
		metrics:         metrics.New(reg),
		up:              up,
		noStreamOptions: newStreamOptionsMemo(cfg.Upstream.DiscoveryInterval),
		transport:       newTransport(),
	}
	for d := range s.dialectURLs {
		s.dialectURLs[d] = join(up.base, upstreamPath(chat.Dialect(d))).String()
		s.dialectLogURLs[d] = logURL(join(up.base, upstreamPath(chat.Dialect(d))))
	}
	s.retrier = &retrier{policy: cfg.Retry, rt: s.transport, metrics: s.metrics}
	s.auth = &clientAuth{required: cfg.Upstream.APIKey != "", allowAnonymous: cfg.Auth.AllowAnonymous}
	for _, k := range cfg.Auth.ClientKeys {
		s.auth.keys = append(s.auth.keys, []byte(k.Reveal()))
	}
	s.tenantSecret = []byte(cfg.Store.TenantSecret.Reveal())
	if len(s.tenantSecret) == 0 {
		s.tenantSecret = make([]byte, 32)
		_, _ = rand.Read(s.tenantSecret)
	}
	s.ready = newReadiness(s)
	table := map[string]int{}
	for _, m := range cfg.Models {
		table[m.Name] = m.ContextWindow
	}
	s.windows = newWindows(table, cfg.Upstream.ContextWindow)
	s.upstreamName = cfg.Upstream.Name
	if s.upstreamName == "" {
		s.upstreamName = up.base.Host
	}
	if s.store, err = openStore(cfg.Store); err != nil {
		return nil, err
	}
	s.calibration = anchor.NewCalibration(1024)
	s.local = anchor.NewLocalEstimator()
	s.digests = newDigestCache(digestCacheEntries)
	s.parses = newParseCache(parseCacheBytes)
	if cfg.Compaction.Enabled {
		cc := s.compactionConfig()
		if s.sum = s.newSummarizer(); s.sum == nil {
			cc.SummarizerEnabled = false
		}
		s.planner = compaction.NewPlanner(cc)
	}
	s.handler = s.routes(reg)
	return s, nil
}

func (s *Server) routes(reg *prometheus.Registry) http.Handler {
	r := chi.NewRouter()
	wrap := func(route string, h http.HandlerFunc) http.Handler {
		return observe(route, s.log.Named("access"), s.metrics, h)
	}
	r.Method(http.MethodPost, "/v1/chat/completions", wrap("chat", s.handleChat))
	// The Responses API and Anthropic Messages go through the same
	// pipeline (DESIGN § Other APIs); their other paths (a stored
	// response, count_tokens, /v1/responses/compact) pass through.
	r.Method(http.MethodPost, "/v1/responses", wrap("responses", s.handleChat))
	r.Method(http.MethodPost, "/v1/messages", wrap("messages", s.handleChat))
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
	s.transport.CloseIdleConnections()
	return s.store.Close()
}
