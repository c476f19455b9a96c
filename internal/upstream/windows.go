package upstream

import (
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Windows resolves a model's context window in DESIGN's order: the models
// table; else the smaller of upstream.context_window and an n_ctx learned
// from an overflow answer (the upstream's own word beats a stale setting);
// else discovery (llama.cpp /props n_ctx, vLLM /v1/models max_model_len),
// lowered by a learned n_ctx too; else the learned n_ctx alone.
//
// A learned n_ctx is evidence the upstream gave about itself (DESIGN §
// Window; CRAFT habit 25): it comes only from a recognized overflow answer
// (wire.RecognizeOverflow), it is never below the largest prompt the upstream
// already accepted in the same scope, and it expires after
// upstream.discovery_interval. Both are per Scope: the tenant, the
// model and the window-shaping headers. One model name may have several
// windows (Anthropic's context-1m beta: 1M with it, 200k without; an
// account's own limits), so one tenant's accepted prompt never stops
// another's learning, and what one tenant learned never lowers another's
// window.
type Windows struct {
	mu         sync.RWMutex
	table      map[string]int
	configured int
	discovered map[string]int // per model (vLLM)
	discDef    int            // whole upstream (llama.cpp /props)
	learned    map[Scope]learnedWindow
	accepted   map[Scope]learnedWindow // the largest prompt accepted, per scope
	warned     map[string]bool
	now        func() time.Time // nil: time.Now
}

// learnedWindow is a size with the time it stops counting.
type learnedWindow struct {
	n   int
	exp time.Time
}

// Scope is what a learned window and an accepted prompt apply to:
// the tenant, the requested model (the upstream is one, so the model names
// the model identity) and the request headers that change the window.
type Scope struct {
	Tenant, Model, Shape string
}

// WindowShape is the part of a request's headers that selects a window:
// Anthropic's context-window betas (context-1m-2025-08-07), sorted. Other
// betas (tool streaming, thinking) leave the window as it is.
func WindowShape(h http.Header) string {
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

// maxLearned bounds the per-scope maps (model names come from clients).
const maxLearned = 4096

// NewWindows returns the windows of a models table and
// upstream.context_window (0: not configured).
func NewWindows(table map[string]int, configured int) *Windows {
	return &Windows{table: table, configured: configured, discovered: map[string]int{},
		learned: map[Scope]learnedWindow{}, accepted: map[Scope]learnedWindow{}, warned: map[string]bool{}}
}

func (w *Windows) clock() time.Time {
	if w.now != nil {
		return w.now()
	}
	return time.Now()
}

// GetFor returns the window in scope sc, 0 when unknown.
func (w *Windows) GetFor(sc Scope) int {
	model := sc.Model
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

// NeedsDiscovery tells whether any model may lack a configured window
// (discovery runs only then: a configured upstream.context_window covers
// every model).
func (w *Windows) NeedsDiscovery() bool { return w.configured == 0 }

// Learn records an n_ctx reported by a recognized overflow answer in scope
// sc, for ttl (upstream.discovery_interval; 0: not kept). It is refused
// when it is below a prompt the upstream accepted in the same scope within
// ttl: the upstream's own answers disagree, and the larger proves more. It
// reports whether n was kept.
func (w *Windows) Learn(sc Scope, n int, ttl time.Duration) bool {
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

// Accept records a prompt of input tokens the upstream accepted in scope
// sc (a successful answer's reported input), kept for ttl: a learned n_ctx
// in that scope is never below it.
func (w *Windows) Accept(sc Scope, input int, ttl time.Duration) {
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
func prune(m map[Scope]learnedWindow, now time.Time) {
	for k, v := range m {
		if !now.Before(v.exp) {
			delete(m, k)
		}
	}
}

// WarnOnce reports whether model's unknown window has not been warned yet.
func (w *Windows) WarnOnce(model string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.warned[model] || len(w.warned) > 1024 {
		return false
	}
	w.warned[model] = true
	return true
}

// Listed is the window the models table gives model (0 = not listed): the
// window of a summarizer model that is not the chat upstream's, whose
// discovered and learned windows say nothing about it.
func (w *Windows) Listed(model string) int { return w.table[model] }

// setDiscovered records what discovery found: the whole upstream's n_ctx
// (0: none) and per-model windows.
func (w *Windows) setDiscovered(def int, per map[string]int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if def > 0 {
		w.discDef = def
	}
	for k, v := range per {
		w.discovered[k] = v
	}
}
