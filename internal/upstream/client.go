package upstream

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/wire"
	"go.uber.org/zap"
)

// Client is the upstream as the proxy uses it: where it is, the transport
// and retry policy every call goes through, its context windows and what
// it was found not to support. Safe for concurrent use.
type Client struct {
	Target    Target
	Transport *http.Transport
	Retrier   *Retrier
	Windows   *Windows
	// NoStreamOptions: model identities whose upstream rejected
	// stream_options (upstream.stream_usage auto), for discovery_interval.
	NoStreamOptions *StreamOptions
	// Name is how metrics and logs name the upstream: upstream.name, else
	// the URL's host.
	Name string

	cfg config.Upstream
	log *zap.Logger
}

// New builds the client of cfg.URL. models is the models table (a
// window per model name); onRetry counts retries (nil: not counted).
func New(cfg config.Upstream, retry config.Retry, models []config.Model, log *zap.Logger, onRetry func(op, reason string)) (*Client, error) {
	t, err := ParseTarget(cfg.URL)
	if err != nil || t.Base.Scheme == "" || t.Base.Host == "" {
		return nil, fmt.Errorf("upstream: upstream.url %q is not an absolute URL", cfg.URL)
	}
	if log == nil {
		log = zap.NewNop()
	}
	table := map[string]int{}
	for _, m := range models {
		table[m.Name] = m.ContextWindow
	}
	tr := NewTransport()
	name := cfg.Name
	if name == "" {
		name = t.Base.Host
	}
	return &Client{
		Name:            name,
		Target:          t,
		Transport:       tr,
		Retrier:         &Retrier{Policy: retry, RT: tr, OnRetry: onRetry},
		Windows:         NewWindows(table, cfg.ContextWindow),
		NoStreamOptions: NewStreamOptions(cfg.DiscoveryInterval),
		cfg:             cfg,
		log:             log,
	}, nil
}

// URL is the upstream URL of path under upstream.url, and as logs may
// show it.
func (c *Client) URL(path string) (url, logURL string) {
	u := Join(c.Target.Base, path)
	return u.String(), LogURL(u)
}

// LearnOverflow recognizes the upstream's context-overflow answer to a
// request in scope sc (in upstream.dialect's words) and learns the n_ctx
// it reports for that scope, logging (under reqID) a window it lowered. An
// overflow without sizes (OpenAI's "Your input exceeds the context window
// of this model") still proves the forwarded input is over the window: its
// prompt is the window plus one token, so recovery compacts below it
// instead of rebuilding the same view.
func (c *Client) LearnOverflow(reqID string, sc Scope, status int, body []byte) (wire.Overflow, bool) {
	info, ok := wire.RecognizeOverflow(c.cfg.Dialect, status, body)
	if !ok {
		return info, false
	}
	if info.NCtx > 0 {
		old := c.Windows.GetFor(sc)
		if c.Windows.Learn(sc, info.NCtx, c.cfg.DiscoveryInterval) && (old == 0 || info.NCtx < old) {
			// Model identity and sizes only: the tenant is a keyed hash,
			// and never logged.
			c.log.Info("context window lowered by an overflow answer", zap.String("request_id", reqID),
				zap.String("upstream", c.Name), zap.String("model", sc.Model),
				zap.Int("old_window", old), zap.Int("new_window", info.NCtx), zap.Duration("for", c.cfg.DiscoveryInterval))
		}
	}
	if info.Prompt == 0 {
		if w := c.Windows.GetFor(sc); w > 0 {
			info.Prompt = w + 1
		}
	}
	return info, true
}

// Accept records a prompt of input tokens the upstream accepted in scope
// sc: no learned window in that scope goes below it.
func (c *Client) Accept(sc Scope, input int) {
	c.Windows.Accept(sc, input, c.cfg.DiscoveryInterval)
}

// Discover reads the upstream's window: llama.cpp /props and the
// OpenAI-style /models list (vLLM's max_model_len; the context_length,
// context_window or max_context_length other servers and gateways list).
// Never on a request path.
// It reports whether a window was found.
func (c *Client) Discover(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	get := func(u string, v any) bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return false
		}
		if key := c.cfg.APIKey.Reveal(); key != "" {
			SetKey(req.Header, key, c.cfg.Dialect)
			if c.cfg.Dialect == "anthropic" {
				req.Header.Set("Anthropic-Version", "2023-06-01")
			}
		}
		// RoundTrip, never an http.Client: a redirect is not followed.
		resp, err := c.Transport.RoundTrip(req)
		if err != nil {
			c.log.Debug("context window discovery failed", zap.String("upstream", LogURL(req.URL)),
				zap.String("error", Classify(err).Code))
			return false
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false
		}
		return json.NewDecoder(io.LimitReader(resp.Body, 8<<20)).Decode(v) == nil
	}
	var props struct {
		DefaultGenerationSettings struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
	}
	def := 0
	if get(Join(c.Target.Root, "props").String(), &props) {
		def = props.DefaultGenerationSettings.NCtx
	}
	var models struct {
		Data []struct {
			ID               string `json:"id"`
			MaxModelLen      int    `json:"max_model_len"`      // vLLM
			ContextLength    int    `json:"context_length"`     // OpenRouter, LM Studio, Together
			ContextWindow    int    `json:"context_window"`     // Groq
			MaxContextLength int    `json:"max_context_length"` // Mistral, LM Studio
		} `json:"data"`
	}
	per := map[string]int{}
	if get(Join(c.Target.Base, "models").String(), &models) {
		for _, m := range models.Data {
			w := m.MaxModelLen
			for _, v := range []int{m.ContextLength, m.ContextWindow, m.MaxContextLength} {
				if w <= 0 {
					w = v
				}
			}
			if w > 0 && len(per) < 1024 {
				per[m.ID] = w
			}
		}
	}
	c.Windows.setDiscovered(def, per)
	if def > 0 || len(per) > 0 {
		c.log.Info("context window discovered", zap.Int("n_ctx", def), zap.Int("models", len(per)))
		return true
	}
	return false
}

// Start begins discovery in the background; it returns at once. ctx ends
// it.
//
// Discovery runs only when upstream.context_window is not set. At start-up
// it retries with backoff (1 s doubling, up to upstream.discovery_interval)
// until it finds a window — a sidecar often starts before llama-server has
// loaded its model (its /props answers 503 then) — and then re-reads it
// every discovery_interval. warnUnknown: say once that the window is not
// known yet (no models table covers for it).
func (c *Client) Start(ctx context.Context, warnUnknown bool) {
	if !c.Windows.NeedsDiscovery() {
		return
	}
	go func() {
		iv := c.cfg.DiscoveryInterval
		wait := time.Second
		if iv > 0 && wait > iv {
			wait = iv
		}
		warned := false
		for !c.Discover(ctx) {
			if !warned && warnUnknown {
				c.log.Warn("context window unknown: chat requests are forwarded without compaction until it is known (set upstream.context_window or models)")
				warned = true
			}
			if iv <= 0 {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			wait = min(wait*2, iv)
		}
		if iv <= 0 {
			return
		}
		t := time.NewTicker(iv)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				c.Discover(ctx)
			}
		}
	}()
}

// Probe is the readiness probe: dialect llamacpp → GET {root}/health must
// be 200 (503 while the model loads); otherwise any answer below 500 to
// GET {url}/models proves the upstream reachable (a 401 without a key
// included). cause is a fixed text when not ready.
func (c *Client) Probe(ctx context.Context) (ok bool, cause string) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	target := Join(c.Target.Base, "models").String()
	llama := c.cfg.Dialect == "llamacpp"
	if llama {
		target = Join(c.Target.Root, "health").String()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return false, "upstream URL invalid"
	}
	SetKey(req.Header, c.cfg.APIKey.Reveal(), c.cfg.Dialect)
	// RoundTrip, not http.Client: a redirect is an answer, not a hop to
	// follow, and its errors do not quote the URL (*url.Error does).
	resp, err := c.Transport.RoundTrip(req)
	if err != nil {
		return false, Classify(err).Text
	}
	drain(resp.Body, 64<<10)
	if llama && resp.StatusCode != http.StatusOK {
		return false, "upstream health: " + resp.Status
	}
	if resp.StatusCode >= 500 {
		return false, "upstream answered " + resp.Status
	}
	return true, ""
}
