package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
)

// windows resolves a model's context window in DESIGN's order: the models
// table, upstream.context_window, discovery (llama.cpp /props n_ctx, vLLM
// /v1/models max_model_len), then what an overflow error taught.
type windows struct {
	mu         sync.RWMutex
	table      map[string]int
	configured int
	discovered map[string]int // per model (vLLM)
	discDef    int            // whole upstream (llama.cpp /props)
	learned    map[string]int
	warned     map[string]bool
}

func newWindows(table map[string]int, configured int) *windows {
	return &windows{table: table, configured: configured, discovered: map[string]int{}, learned: map[string]int{}, warned: map[string]bool{}}
}

// get returns the window for model, 0 when unknown.
func (w *windows) get(model string) int {
	if n := w.table[model]; n > 0 {
		return n
	}
	if w.configured > 0 {
		return w.configured
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	if n := w.discovered[model]; n > 0 {
		return n
	}
	if w.discDef > 0 {
		return w.discDef
	}
	return w.learned[model]
}

// learn records an n_ctx reported by an overflow error.
func (w *windows) learn(model string, n int) {
	if n <= 0 {
		return
	}
	w.mu.Lock()
	if len(w.learned) < 1024 {
		w.learned[model] = n
	}
	w.mu.Unlock()
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
// OpenAI-style /models list (vLLM's max_model_len). Never on a request path.
func (s *Server) discover(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	get := func(u string, v any) bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return false
		}
		if key := s.cfg.Upstream.APIKey.Reveal(); key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := (&http.Client{Transport: s.transport}).Do(req)
		if err != nil {
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
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	per := map[string]int{}
	if get(join(s.up.base, "models").String(), &models) {
		for _, m := range models.Data {
			if m.MaxModelLen > 0 && len(per) < 1024 {
				per[m.ID] = m.MaxModelLen
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
	}
}

// Start begins background work; it returns at once. ctx ends it.
func (s *Server) Start(ctx context.Context) {
	go func() {
		s.discover(ctx)
		if s.windows.configured == 0 && s.windows.discDefault() == 0 && len(s.cfg.Models) == 0 {
			s.log.Warn("context window unknown: chat requests are forwarded without compaction until it is known (set upstream.context_window or models)")
		}
		iv := s.cfg.Upstream.DiscoveryInterval
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

func (w *windows) discDefault() int {
	w.mu.RLock()
	defer w.mu.RUnlock()
	return w.discDef
}
