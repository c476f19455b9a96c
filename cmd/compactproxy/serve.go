package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/proxy"
	"github.com/compactproxy/compactproxy/internal/store/redisurl"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// readHeaderTimeout bounds how long a client may take to send its request
// headers (slowloris). There is deliberately no ReadTimeout (agent bodies
// can be large and slow to upload) and no WriteTimeout: it would cut long
// generations and streams.
const readHeaderTimeout = 10 * time.Second

// maxHeaderBytes bounds request headers (DESIGN § Request bodies and abuse).
// It is net/http's default, stated so that it is a decision, not an accident.
const maxHeaderBytes = 1 << 20

// idleTimeout closes keep-alive connections that sit unused.
const idleTimeout = 120 * time.Second

func runServe(ctx context.Context, fset *pflag.FlagSet, stderr io.Writer) int {
	if err := checkEnv(os.Environ()); err != nil {
		printValidation(stderr, err)
		return exitUsage
	}
	cfg, file, err := loadConfig(fset, defaultConfigFile)
	if err != nil {
		fmt.Fprintf(stderr, "compactproxy: %v\n", err)
		return exitUsage
	}
	if err := cfg.Validate(); err != nil {
		printValidation(stderr, err)
		return exitUsage
	}
	log, err := newLogger(cfg.Log, zapcore.AddSync(stderr))
	if err != nil {
		fmt.Fprintf(stderr, "compactproxy: %v\n", err)
		return exitUsage
	}
	defer func() { _ = log.Sync() }()

	if err := serve(ctx, cfg, file, log); err != nil {
		log.Error("server failed", zap.Error(err))
		return exitFail
	}
	return exitOK
}

// newLogger builds the root logger, named "compactproxy", writing to w.
func newLogger(c config.Log, w zapcore.WriteSyncer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(c.Level)
	if err != nil {
		return nil, fmt.Errorf("log.level: %w", err)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.TimeKey = "ts"
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	enc.EncodeDuration = zapcore.StringDurationEncoder
	var encoder zapcore.Encoder
	switch c.Format {
	case "json":
		encoder = zapcore.NewJSONEncoder(enc)
	case "console":
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	default:
		return nil, fmt.Errorf("log.format: unknown %q", c.Format)
	}
	core := zapcore.NewCore(encoder, zapcore.Lock(w), level)
	return zap.New(core, zap.ErrorOutput(zapcore.Lock(w))).Named("compactproxy"), nil
}

// serve runs the proxy until ctx ends, then shuts down gracefully.
func serve(ctx context.Context, cfg config.Config, file string, log *zap.Logger) error {
	reg := prometheus.NewRegistry()
	p, err := proxy.New(cfg, log, reg)
	if err != nil {
		return fmt.Errorf("proxy: %w", err)
	}
	defer func() {
		if err := p.Close(); err != nil {
			log.Warn("proxy close failed", zap.Error(err))
		}
	}()

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	log.Info("starting", startFields(cfg, file, ln.Addr().String())...)

	if to, ok := unversionedUpstream(cfg.Upstream.URL); ok {
		// Allowed (llama-server also serves un-prefixed paths), but most
		// upstreams want /v1: say where requests will go.
		log.Warn("upstream.url has no version path",
			zap.String("chat_completions", to),
			zap.String("hint", "upstream.url is the base URL incl. its version path, e.g. http://127.0.0.1:8080/v1"))
	}

	// Background work (context-window discovery) stops with the signal:
	// draining requests do not need it.
	p.Start(ctx)

	return serveHTTP(ctx, newHTTPServer(p.Handler(), log), ln, cfg.ShutdownTimeout, log)
}

// newHTTPServer is the server compactproxy listens with, with the limits
// above (tests build it through here, so they test these).
func newHTTPServer(h http.Handler, log *zap.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: readHeaderTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		IdleTimeout:       idleTimeout,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
}

// serveHTTP serves on ln until ctx ends, then stops accepting and lets
// in-flight requests (streams included) finish for up to timeout before
// closing what is left. Request contexts derive from context.Background,
// not ctx, so a signal does not cancel in-flight upstream calls.
func serveHTTP(ctx context.Context, hs *http.Server, ln net.Listener, timeout time.Duration, log *zap.Logger) error {
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()

	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}

	log.Info("shutting down", zap.Duration("timeout", timeout))
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		log.Warn("shutdown timeout reached, closing remaining connections", zap.Error(err))
		_ = hs.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("stopped")
	return nil
}

// startFields are the start-up log's fields: what this process serves
// and how, never a secret.
func startFields(cfg config.Config, file, listen string) []zap.Field {
	fields := []zap.Field{
		zap.String("version", version),
		zap.String("listen", listen),
		zap.String("upstream", redactURL(cfg.Upstream.URL)),
		zap.Bool("upstream_default", cfg.Upstream.URL == config.DefaultUpstreamURL),
		zap.String("config_file", file),
		zap.Bool("upstream_api_key_set", cfg.Upstream.APIKey != ""),
		zap.Int("client_keys", len(cfg.Auth.ClientKeys)),
		zap.String("compaction_mode", compactionMode(cfg.Compaction)),
		zap.String("pairing_mode", cfg.Pairing.Mode),
		zap.String("store_backend", cfg.Store.Backend),
	}
	if cfg.Store.Backend == "redis" {
		// Which deployment: a single node, Sentinel or Cluster (a URL
		// validation accepted parses; its password is never logged).
		if u, err := redisurl.Parse(cfg.Store.Redis.URL.Reveal()); err == nil {
			fields = append(fields, zap.String("store_redis_mode", u.Mode.String()))
		}
	}
	return fields
}

// redactURL is how a URL appears in logs: scheme, host and path only
// (userinfo may hold credentials, a query string a key).
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "[unparseable]"
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path}).String()
}

// unversionedUpstream reports whether raw has no path at all (no /v1), and
// then where chat completions go (scheme, host and path only, as logged).
func unversionedUpstream(raw string) (string, bool) {
	u, err := url.Parse(raw)
	if err != nil || strings.Trim(u.Path, "/") != "" {
		return "", false
	}
	return redactURL(strings.TrimRight(raw, "/") + "/chat/completions"), true
}

func compactionMode(c config.Compaction) string {
	if !c.Enabled {
		return "disabled"
	}
	return c.Mode
}
