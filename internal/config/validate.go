package config

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/store/redisurl"
)

// Allowed values of the enumerated keys. They are exported so that help text,
// the README and tests can name the same sets Validate checks.
var (
	Dialects      = []string{"auto", "openai", "llamacpp", "vllm", "deepseek", "anthropic"}
	StreamUsages  = []string{"auto", "always", "never"}
	PairingModes  = []string{"strict", "repair", "off"}
	CompactModes  = []string{"enforce", "shadow"}
	StoreBackends = []string{"memory", "bolt", "redis"}
	LogLevels     = []string{"debug", "info", "warn", "error"}
	LogFormats    = []string{"json", "console"}
)

// NativeCompactions are upstream.native_compaction's values. Until the proxy
// emulates the providers' compaction APIs, every value passes them through
// unchanged (docs/configuration.md says so).
var NativeCompactions = []string{"auto", "passthrough", "emulate"}

// implementedBackends are the store backends that exist today; the others in
// StoreBackends are part of the contract but rejected until they land, so a
// config written for them fails at start instead of silently using memory.
var implementedBackends = []string{"memory", "bolt", "redis"}

// FieldError is one configuration problem, named by its config key
// ("upstream.url", "models[2].name").
type FieldError struct {
	Key string
	Msg string
}

func (e FieldError) Error() string { return e.Key + ": " + e.Msg }

// ValidationError lists every problem Validate found, in key order of the
// contract table, so an operator fixes a config in one pass.
type ValidationError struct {
	Problems []FieldError
}

func (e *ValidationError) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = p.Error()
	}
	return "invalid configuration: " + strings.Join(lines, "; ")
}

// validator accumulates problems; its helpers keep each rule to one line.
type validator struct{ problems []FieldError }

func (v *validator) add(key, format string, args ...any) {
	v.problems = append(v.problems, FieldError{Key: key, Msg: fmt.Sprintf(format, args...)})
}

func (v *validator) oneOf(key, val string, allowed []string) {
	if !slices.Contains(allowed, val) {
		v.add(key, "must be one of %s, got %q", strings.Join(allowed, ", "), val)
	}
}

func (v *validator) positiveDuration(key string, d time.Duration) {
	if d <= 0 {
		v.add(key, "must be > 0, got %s", d)
	}
}

func (v *validator) nonNegativeDuration(key string, d time.Duration) {
	if d < 0 {
		v.add(key, "must be >= 0, got %s", d)
	}
}

func (v *validator) atLeast(key string, n, lo int64) {
	if n < lo {
		v.add(key, "must be >= %d, got %d", lo, n)
	}
}

// baseURL checks an absolute http(s) URL with a host. Error messages never
// echo the value: a URL may carry credentials in its userinfo.
func (v *validator) baseURL(key, raw string) {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		v.add(key, "not a valid URL")
	case u.Scheme != "http" && u.Scheme != "https":
		v.add(key, "must be an absolute http:// or https:// URL")
	case u.Host == "":
		v.add(key, "must have a host")
	case u.RawQuery != "" || u.Fragment != "":
		v.add(key, "must not have a query or fragment (base URL incl. version path, e.g. http://127.0.0.1:8080/v1)")
	}
}

// Validate reports every problem of c at once, each naming its key, as a
// *ValidationError; nil when c is usable.
func (c Config) Validate() error {
	v := &validator{}

	if c.Listen == "" {
		v.add("listen", "required")
	} else if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		v.add("listen", "must be host:port or :port, got %q", c.Listen)
	}
	v.positiveDuration("shutdown_timeout", c.ShutdownTimeout)

	if c.Upstream.URL == "" {
		v.add("upstream.url", "required")
	} else {
		v.baseURL("upstream.url", c.Upstream.URL)
	}
	v.oneOf("upstream.dialect", c.Upstream.Dialect, Dialects)
	v.atLeast("upstream.context_window", int64(c.Upstream.ContextWindow), 0)
	v.oneOf("upstream.stream_usage", c.Upstream.StreamUsage, StreamUsages)
	v.oneOf("upstream.native_compaction", c.Upstream.NativeCompaction, NativeCompactions)
	v.positiveDuration("upstream.discovery_interval", c.Upstream.DiscoveryInterval)

	seen := map[string]int{}
	for i, m := range c.Models {
		key := fmt.Sprintf("models[%d]", i)
		if m.Name == "" {
			v.add(key+".name", "required")
		} else if j, dup := seen[m.Name]; dup {
			v.add(key+".name", "duplicate of models[%d] (%q)", j, m.Name)
		} else {
			seen[m.Name] = i
		}
		if m.ContextWindow <= 0 {
			v.add(key+".context_window", "must be > 0, got %d", m.ContextWindow)
		}
	}

	for i, k := range c.Auth.ClientKeys {
		if k == "" {
			v.add(fmt.Sprintf("auth.client_keys[%d]", i), "must not be empty")
		}
	}
	if c.Upstream.APIKey != "" && len(c.Auth.ClientKeys) == 0 && !c.Auth.AllowAnonymous {
		// Without this every client would get 401: almost certainly a
		// forgotten key, and the alternative (accept anyone) is an open
		// relay for the upstream key, so make the operator choose.
		v.add("auth.client_keys", "required when upstream.api_key is set (or set auth.allow_anonymous: true)")
	}

	cp := c.Compaction
	v.oneOf("compaction.mode", cp.Mode, CompactModes)
	if cp.TriggerRatio <= 0 || cp.TriggerRatio > 1 {
		v.add("compaction.trigger_ratio", "must be in (0, 1], got %g", cp.TriggerRatio)
	}
	if cp.TargetRatio <= 0 || cp.TargetRatio >= 1 {
		v.add("compaction.target_ratio", "must be in (0, 1), got %g", cp.TargetRatio)
	}
	if cp.TargetRatio > 0 && cp.TargetRatio < 1 && cp.TriggerRatio > 0 && cp.TriggerRatio <= 1 && cp.TargetRatio >= cp.TriggerRatio {
		v.add("compaction.target_ratio", "must be < trigger_ratio (%g), got %g", cp.TriggerRatio, cp.TargetRatio)
	}
	v.atLeast("compaction.reserve_tokens", int64(cp.ReserveTokens), 0)
	v.atLeast("compaction.keep_tail", int64(cp.KeepTail), 1)
	if cp.TailRatio < 0 || cp.TailRatio > 1 {
		v.add("compaction.tail_ratio", "must be in [0, 1], got %g", cp.TailRatio)
	}
	v.atLeast("compaction.summary_min_tokens", int64(cp.SummaryMinTokens), 1)
	if cp.PresummarizeRatio < 0 || cp.PresummarizeRatio >= 1 {
		v.add("compaction.presummarize_ratio", "must be in [0, 1), got %g", cp.PresummarizeRatio)
	}
	v.nonNegativeDuration("compaction.min_interval", cp.MinInterval)
	v.atLeast("compaction.latch_growth", int64(cp.LatchGrowth), 1)
	v.atLeast("compaction.trim.tool_result_tokens", int64(cp.Trim.ToolResultTokens), 1)
	if cp.Summarizer.URL != "" {
		v.baseURL("compaction.summarizer.url", cp.Summarizer.URL)
	}
	v.atLeast("compaction.summarizer.max_tokens", int64(cp.Summarizer.MaxTokens), 1)
	v.positiveDuration("compaction.summarizer.timeout", cp.Summarizer.Timeout)
	v.atLeast("compaction.summarizer.max_concurrent", int64(cp.Summarizer.MaxConcurrent), 1)

	v.oneOf("pairing.mode", c.Pairing.Mode, PairingModes)

	v.atLeast("retry.attempts", int64(c.Retry.Attempts), 1)
	v.positiveDuration("retry.backoff", c.Retry.Backoff)
	v.positiveDuration("retry.max_backoff", c.Retry.MaxBackoff)
	if c.Retry.Backoff > 0 && c.Retry.MaxBackoff > 0 && c.Retry.MaxBackoff < c.Retry.Backoff {
		v.add("retry.max_backoff", "must be >= retry.backoff (%s), got %s", c.Retry.Backoff, c.Retry.MaxBackoff)
	}
	v.positiveDuration("retry.max_elapsed", c.Retry.MaxElapsed)

	switch {
	case !slices.Contains(StoreBackends, c.Store.Backend):
		v.oneOf("store.backend", c.Store.Backend, StoreBackends)
	case !slices.Contains(implementedBackends, c.Store.Backend):
		v.add("store.backend", "%q is not implemented yet (use memory)", c.Store.Backend)
	}
	v.atLeast("store.max_entries", int64(c.Store.MaxEntries), 1)
	v.positiveDuration("store.ttl", c.Store.TTL)
	v.positiveDuration("store.timeout", c.Store.Timeout)
	if c.Store.Backend == "bolt" && c.Store.Bolt.Path == "" {
		v.add("store.bolt.path", "is required with store.backend bolt")
	}
	if c.Store.Backend == "redis" {
		// redisurl's errors are fixed texts: the value may carry a password.
		u, err := redisurl.Parse(c.Store.Redis.URL.Reveal())
		switch {
		case err != nil:
			v.add("store.redis.url", "%s (store.backend redis)", err)
		case u.Mode == redisurl.Cluster && strings.ContainsAny(c.Store.Redis.Prefix, "{}"):
			v.add("store.redis.prefix", "must not contain { or } with a redis+cluster:// URL: each conversation's keys carry a {hash tag} of their own")
		}
	}
	for i, h := range c.Compaction.ConversationHeaders {
		if strings.TrimSpace(h) == "" || strings.ContainsAny(h, " :\t\r\n") {
			v.add(fmt.Sprintf("compaction.conversation_headers[%d]", i), "must be a header name")
		}
	}

	v.atLeast("limits.max_body_bytes", c.Limits.MaxBodyBytes, 1)
	v.positiveDuration("limits.body_read_timeout", c.Limits.BodyReadTimeout)

	v.oneOf("log.level", c.Log.Level, LogLevels)
	v.oneOf("log.format", c.Log.Format, LogFormats)

	if len(v.problems) == 0 {
		return nil
	}
	return &ValidationError{Problems: v.problems}
}
