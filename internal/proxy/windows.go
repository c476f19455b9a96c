package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// windows resolves a model's context window in DESIGN's order: the models
// table; else the smaller of upstream.context_window and an n_ctx learned
// from an overflow answer (the upstream's own word beats a stale setting);
// else discovery (llama.cpp /props n_ctx, vLLM /v1/models max_model_len),
// lowered by a learned n_ctx too; else the learned n_ctx alone.
//
// A learned n_ctx is evidence the upstream gave about itself (DESIGN §
// Window; CRAFT habit 25): it comes only from a recognized overflow answer
// (recognizeOverflow), it is never below the largest prompt the upstream
// already accepted in the same scope, and it expires after
// upstream.discovery_interval. Both are per windowScope: the tenant, the
// model and the window-shaping headers. One model name may have several
// windows (Anthropic's context-1m beta: 1M with it, 200k without; an
// account's own limits), so one tenant's accepted prompt never stops
// another's learning, and what one tenant learned never lowers another's
// window.
type windows struct {
	mu         sync.RWMutex
	table      map[string]int
	configured int
	discovered map[string]int // per model (vLLM)
	discDef    int            // whole upstream (llama.cpp /props)
	learned    map[windowScope]learnedWindow
	accepted   map[windowScope]learnedWindow // the largest prompt accepted, per scope
	warned     map[string]bool
	now        func() time.Time // nil: time.Now
}

// learnedWindow is a size with the time it stops counting.
type learnedWindow struct {
	n   int
	exp time.Time
}

// windowScope is what a learned window and an accepted prompt apply to:
// the tenant, the requested model (the upstream is one, so the model names
// the model identity) and the request headers that change the window.
type windowScope struct {
	tenant, model, shape string
}

// windowShape is the part of a request's headers that selects a window:
// Anthropic's context-window betas (context-1m-2025-08-07), sorted. Other
// betas (tool streaming, thinking) leave the window as it is.
func windowShape(h http.Header) string {
	var betas []string
	for _, v := range h.Values("Anthropic-Beta") {
		for _, b := range strings.Split(v, ",") {
			b = strings.TrimSpace(b)
			if len(b) > len("context-") && strings.HasPrefix(b, "context-") && b[len("context-")] >= '0' && b[len("context-")] <= '9' {
				betas = append(betas, b)
			}
		}
	}
	if len(betas) == 0 {
		return ""
	}
	slices.Sort(betas)
	return strings.Join(slices.Compact(betas), ",")
}

// windowScope is the scope of cr's window.
func (cr *chatRequest) windowScope() windowScope {
	return windowScope{tenant: cr.tenant, model: cr.req.Model, shape: windowShape(cr.headers)}
}

// maxLearned bounds the per-scope maps (model names come from clients).
const maxLearned = 4096

func newWindows(table map[string]int, configured int) *windows {
	return &windows{table: table, configured: configured, discovered: map[string]int{},
		learned: map[windowScope]learnedWindow{}, accepted: map[windowScope]learnedWindow{}, warned: map[string]bool{}}
}

func (w *windows) clock() time.Time {
	if w.now != nil {
		return w.now()
	}
	return time.Now()
}

// get returns the window for model, 0 when unknown, without what any
// tenant learned.
func (w *windows) get(model string) int { return w.getFor(windowScope{model: model}) }

// getFor returns the window in scope sc, 0 when unknown.
func (w *windows) getFor(sc windowScope) int {
	model := sc.model
	if n := w.table[model]; n > 0 {
		return n
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	learned := 0
	if l, ok := w.learned[sc]; ok && w.clock().Before(l.exp) {
		learned = l.n
	}
	lower := func(n int) int {
		if learned > 0 && learned < n {
			return learned
		}
		return n
	}
	if w.configured > 0 {
		return lower(w.configured)
	}
	if n := w.discovered[model]; n > 0 {
		return lower(n)
	}
	if w.discDef > 0 {
		return lower(w.discDef)
	}
	return learned
}

// needsDiscovery tells whether any model may lack a configured window
// (discovery runs only then: a configured upstream.context_window covers
// every model).
func (w *windows) needsDiscovery() bool { return w.configured == 0 }

// learn records an n_ctx reported by a recognized overflow answer in scope
// sc, for ttl (upstream.discovery_interval; 0: not kept). It is refused
// when it is below a prompt the upstream accepted in the same scope within
// ttl: the upstream's own answers disagree, and the larger proves more. It
// reports whether n was kept.
func (w *windows) learn(sc windowScope, n int, ttl time.Duration) bool {
	if n <= 0 || ttl <= 0 {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.clock()
	if a, ok := w.accepted[sc]; ok && now.Before(a.exp) && n < a.n {
		return false
	}
	if _, ok := w.learned[sc]; !ok && len(w.learned) >= maxLearned {
		prune(w.learned, now)
		if len(w.learned) >= maxLearned {
			return false
		}
	}
	w.learned[sc] = learnedWindow{n: n, exp: now.Add(ttl)}
	return true
}

// accept records a prompt of input tokens the upstream accepted in scope
// sc (a successful answer's reported input), kept for ttl: a learned n_ctx
// in that scope is never below it.
func (w *windows) accept(sc windowScope, input int, ttl time.Duration) {
	if input <= 0 || ttl <= 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.clock()
	a, ok := w.accepted[sc]
	if ok && now.Before(a.exp) && a.n >= input {
		return
	}
	if !ok && len(w.accepted) >= maxLearned {
		prune(w.accepted, now)
		if len(w.accepted) >= maxLearned {
			return
		}
	}
	w.accepted[sc] = learnedWindow{n: input, exp: now.Add(ttl)}
	if l, ok := w.learned[sc]; ok && l.n < input {
		delete(w.learned, sc) // the upstream just accepted more than it
	}
}

// prune drops expired entries.
func prune(m map[windowScope]learnedWindow, now time.Time) {
	for k, v := range m {
		if !now.Before(v.exp) {
			delete(m, k)
		}
	}
}

// warnOnce reports whether model's unknown window has not been warned yet.
func (w *windows) warnOnce(model string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.warned[model] || len(w.warned) > 1024 {
		return false
	}
	w.warned[model] = true
	return true
}

// discover reads the upstream's window: llama.cpp /props and the
// OpenAI-style /models list (vLLM's max_model_len; the context_length,
// context_window or max_context_length other servers and gateways list).
// Never on a request path.
// It reports whether a window was found.
func (s *Server) discover(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	get := func(u string, v any) bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return false
		}
		if key := s.cfg.Upstream.APIKey.Reveal(); key != "" {
			if s.cfg.Upstream.Dialect == "anthropic" {
				req.Header.Set("X-Api-Key", key)
				req.Header.Set("Anthropic-Version", "2023-06-01")
			} else {
				req.Header.Set("Authorization", "Bearer "+key)
			}
		}
		// RoundTrip, never an http.Client: a redirect is not followed.
		resp, err := s.transport.RoundTrip(req)
		if err != nil {
			s.log.Debug("context window discovery failed", zap.String("upstream", logURL(req.URL)),
				zap.String("error", classifyUpstream(err).code))
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
	if get(join(s.up.root, "props").String(), &props) {
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
	if get(join(s.up.base, "models").String(), &models) {
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
	s.windows.mu.Lock()
	if def > 0 {
		s.windows.discDef = def
	}
	for k, v := range per {
		s.windows.discovered[k] = v
	}
	s.windows.mu.Unlock()
	if def > 0 || len(per) > 0 {
		s.log.Info("context window discovered", zap.Int("n_ctx", def), zap.Int("models", len(per)))
		return true
	}
	return false
}

// Start begins background work; it returns at once. ctx ends it.
//
// Discovery runs only when upstream.context_window is not set. At start-up
// it retries with backoff (1 s doubling, up to upstream.discovery_interval)
// until it finds a window — a sidecar often starts before llama-server has
// loaded its model (its /props answers 503 then) — and then re-reads it
// every discovery_interval.
func (s *Server) Start(ctx context.Context) {
	if !s.windows.needsDiscovery() {
		return
	}
	go func() {
		iv := s.cfg.Upstream.DiscoveryInterval
		wait := time.Second
		if iv > 0 && wait > iv {
			wait = iv
		}
		warned := false
		for !s.discover(ctx) {
			if !warned && len(s.cfg.Models) == 0 {
				s.log.Warn("context window unknown: chat requests are forwarded without compaction until it is known (set upstream.context_window or models)")
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
				s.discover(ctx)
			}
		}
	}()
}

// listed is the window the models table gives model (0 = not listed): the
// window of a summarizer model that is not the chat upstream's, whose
// discovered and learned windows say nothing about it.
func (w *windows) listed(model string) int { return w.table[model] }
