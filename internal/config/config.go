// Package config holds compactproxy's typed, validated configuration. Only
// cmd/compactproxy reads viper; everything else receives a Config.
package config

import (
	"time"
)

// Secret is a string that never prints: String and MarshalText give
// "[redacted]" when it is set, so a Secret cannot leak through logs or the
// `compactproxy config` output by accident.
type Secret string

// String implements fmt.Stringer.
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return "[redacted]"
}

// MarshalText implements encoding.TextMarshaler (used by yaml/json output).
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Reveal returns the secret value; call it only where the value is sent.
func (s Secret) Reveal() string { return string(s) }

// Config is the whole configuration. Keys and defaults are the contract of
// DESIGN.md's table; the mapstructure tags are the config key names.
type Config struct {
	Listen          string        `mapstructure:"listen" yaml:"listen"`                     // default "127.0.0.1:8081" (loopback; containers set ":8081")
	ShutdownTimeout time.Duration `mapstructure:"shutdown_timeout" yaml:"shutdown_timeout"` // default 30s
	Upstream        Upstream      `mapstructure:"upstream" yaml:"upstream"`
	Models          []Model       `mapstructure:"models" yaml:"models"` // per-model overrides, win over upstream.context_window
	Auth            Auth          `mapstructure:"auth" yaml:"auth"`
	Compaction      Compaction    `mapstructure:"compaction" yaml:"compaction"`
	Pairing         Pairing       `mapstructure:"pairing" yaml:"pairing"`
	Retry           Retry         `mapstructure:"retry" yaml:"retry"`
	Store           Store         `mapstructure:"store" yaml:"store"`
	Limits          Limits        `mapstructure:"limits" yaml:"limits"`
	Log             Log           `mapstructure:"log" yaml:"log"`
}

// Upstream describes the one upstream every request goes to.
type Upstream struct {
	URL               string        `mapstructure:"url" yaml:"url"`                               // base URL incl. version path; default DefaultUpstreamURL
	Name              string        `mapstructure:"name" yaml:"name"`                             // default: host of URL
	APIKey            Secret        `mapstructure:"api_key" yaml:"api_key"`                       // "" = pass the client's credentials
	Dialect           string        `mapstructure:"dialect" yaml:"dialect"`                       // auto|openai|llamacpp|vllm|deepseek|anthropic
	ContextWindow     int           `mapstructure:"context_window" yaml:"context_window"`         // 0 = discover
	StreamUsage       string        `mapstructure:"stream_usage" yaml:"stream_usage"`             // auto|always|never
	NativeCompaction  string        `mapstructure:"native_compaction" yaml:"native_compaction"`   // auto|passthrough|emulate; see NativeCompactions
	DiscoveryInterval time.Duration `mapstructure:"discovery_interval" yaml:"discovery_interval"` // default 5m
}

// Model is a per-model override.
type Model struct {
	Name          string `mapstructure:"name" yaml:"name"`
	ContextWindow int    `mapstructure:"context_window" yaml:"context_window"`
}

// Auth controls who may use the proxy when it holds the upstream key.
type Auth struct {
	ClientKeys     []Secret `mapstructure:"client_keys" yaml:"client_keys"`
	AllowAnonymous bool     `mapstructure:"allow_anonymous" yaml:"allow_anonymous"`
}

// Compaction configures the compaction planner.
type Compaction struct {
	Enabled       bool    `mapstructure:"enabled" yaml:"enabled"`               // default true
	Mode          string  `mapstructure:"mode" yaml:"mode"`                     // enforce|shadow
	TriggerRatio  float64 `mapstructure:"trigger_ratio" yaml:"trigger_ratio"`   // 0.80
	TargetRatio   float64 `mapstructure:"target_ratio" yaml:"target_ratio"`     // 0.60
	ReserveTokens int     `mapstructure:"reserve_tokens" yaml:"reserve_tokens"` // 4096
	KeepTail      int     `mapstructure:"keep_tail" yaml:"keep_tail"`           // 3
	// TailRatio: the verbatim tail extends by whole turns up to this share
	// of the room (budget − fixed part); 0 = keep_tail only.
	TailRatio float64 `mapstructure:"tail_ratio" yaml:"tail_ratio"` // 0.1
	// SummaryMinTokens: a summary is attempted only when at least this much
	// room is left for it.
	SummaryMinTokens int `mapstructure:"summary_min_tokens" yaml:"summary_min_tokens"` // 256
	// PresummarizeRatio: after a response whose next request would be over
	// this share of the room but under the trigger, the head is summarized
	// in the background and stored; 0 = off.
	PresummarizeRatio float64       `mapstructure:"presummarize_ratio" yaml:"presummarize_ratio"` // 0.7
	MinInterval       time.Duration `mapstructure:"min_interval" yaml:"min_interval"`             // 60s; 0 disables the throttle
	LatchGrowth       int           `mapstructure:"latch_growth" yaml:"latch_growth"`             // 20
	// Dedupe: over the trigger, a tool result that a later one repeats is
	// forwarded as a pointer to the later call (no model call, lossless).
	Dedupe bool `mapstructure:"dedupe" yaml:"dedupe"` // false
	// Mask: over the trigger, old tool results outside the tail are
	// forwarded as a placeholder naming their call, before any summary.
	Mask       bool       `mapstructure:"mask" yaml:"mask"` // false
	Trim       Trim       `mapstructure:"trim" yaml:"trim"`
	Summarizer Summarizer `mapstructure:"summarizer" yaml:"summarizer"`
	// ConversationHeaders name a conversation, first match wins (default
	// X-Compactproxy-Conversation, X-Session-Id, Session-Id, session_id,
	// X-Claude-Code-Session-Id); the first is stripped before forwarding,
	// the others (agents' own) pass unchanged. A name is matched as written
	// too: Codex's session_id keeps its underscore. Empty: conversations
	// are always derived from their opening messages.
	ConversationHeaders []string `mapstructure:"conversation_headers" yaml:"conversation_headers"`
}

// Trim configures the no-model-call trim step.
type Trim struct {
	ToolResultTokens int `mapstructure:"tool_result_tokens" yaml:"tool_result_tokens"` // 1024
}

// Summarizer configures the model call that summarizes a conversation head.
type Summarizer struct {
	Enabled       bool          `mapstructure:"enabled" yaml:"enabled"`               // true
	URL           string        `mapstructure:"url" yaml:"url"`                       // "" = upstream.url
	APIKey        Secret        `mapstructure:"api_key" yaml:"api_key"`               // ""
	Model         string        `mapstructure:"model" yaml:"model"`                   // "" = the request's model
	MaxTokens     int           `mapstructure:"max_tokens" yaml:"max_tokens"`         // 1024
	Timeout       time.Duration `mapstructure:"timeout" yaml:"timeout"`               // 60s
	MaxConcurrent int           `mapstructure:"max_concurrent" yaml:"max_concurrent"` // 4
}

// Pairing configures tool-call pairing validation.
type Pairing struct {
	Mode string `mapstructure:"mode" yaml:"mode"` // strict|repair|off
}

// Retry configures upstream retries. Attempts counts total tries.
type Retry struct {
	Attempts   int           `mapstructure:"attempts" yaml:"attempts"`       // 3 (1 = no retry)
	Backoff    time.Duration `mapstructure:"backoff" yaml:"backoff"`         // 200ms
	MaxBackoff time.Duration `mapstructure:"max_backoff" yaml:"max_backoff"` // 5s
	MaxElapsed time.Duration `mapstructure:"max_elapsed" yaml:"max_elapsed"` // 30s
}

// Store configures conversation state storage.
type Store struct {
	Backend      string        `mapstructure:"backend" yaml:"backend"`             // memory
	MaxEntries   int           `mapstructure:"max_entries" yaml:"max_entries"`     // 100000
	TTL          time.Duration `mapstructure:"ttl" yaml:"ttl"`                     // 24h
	TenantSecret Secret        `mapstructure:"tenant_secret" yaml:"tenant_secret"` // "" = random per process
	Timeout      time.Duration `mapstructure:"timeout" yaml:"timeout"`             // 200ms per operation (bolt, redis)
	Bolt         Bolt          `mapstructure:"bolt" yaml:"bolt"`
	Redis        Redis         `mapstructure:"redis" yaml:"redis"`
}

// Bolt configures the bolt store backend.
type Bolt struct {
	Path string `mapstructure:"path" yaml:"path"` // compactproxy.db (the image: /data/compactproxy.db)
}

// Redis configures the redis store backend.
type Redis struct {
	// URL names the deployment (package redisurl, docs/configuration.md):
	// redis://[:pw@]host:6379/0 (one node), redis+sentinel://s1,s2/master[/db],
	// redis+cluster://n1:7000,n2:7001; rediss… for TLS. May hold a password.
	URL    Secret `mapstructure:"url" yaml:"url"`
	Prefix string `mapstructure:"prefix" yaml:"prefix"` // compactproxy:
}

// Limits bounds what a client may send.
type Limits struct {
	MaxBodyBytes int64 `mapstructure:"max_body_bytes" yaml:"max_body_bytes"` // 33554432
	// BodyReadTimeout bounds how long a client may take to send its request
	// body (default 60s; must be > 0); past it the client gets 408.
	BodyReadTimeout time.Duration `mapstructure:"body_read_timeout" yaml:"body_read_timeout"`
}

// Log configures logging.
type Log struct {
	Level  string `mapstructure:"level" yaml:"level"`   // info
	Format string `mapstructure:"format" yaml:"format"` // json|console
}

// DefaultUpstreamURL is upstream.url's default: llama-server's own default
// address, so the sidecar case (and `make run` on a fresh clone) needs no
// configuration. The start-up log says which upstream is used and /readyz
// whether it answers.
const DefaultUpstreamURL = "http://127.0.0.1:8080/v1"

// DefaultListen is listen's default: loopback only, nothing exposed unless
// told otherwise (the container image sets COMPACTPROXY_LISTEN=:8081).
const DefaultListen = "127.0.0.1:8081"

// Default returns the configuration with every default of DESIGN.md's table.
func Default() Config {
	return Config{
		// Loopback: a laptop's `make run` must not expose the local
		// llama-server to the network; the image and deploy files set :8081.
		Listen:          DefaultListen,
		ShutdownTimeout: 30 * time.Second,
		Upstream: Upstream{
			URL:               DefaultUpstreamURL,
			Dialect:           "auto",
			StreamUsage:       "auto",
			NativeCompaction:  "auto",
			DiscoveryInterval: 5 * time.Minute,
		},
		Compaction: Compaction{
			Enabled:             true,
			Mode:                "enforce",
			TriggerRatio:        0.80,
			TargetRatio:         0.60,
			ReserveTokens:       4096,
			KeepTail:            3,
			TailRatio:           0.1,
			SummaryMinTokens:    256,
			PresummarizeRatio:   0.7,
			MinInterval:         60 * time.Second,
			LatchGrowth:         20,
			Trim:                Trim{ToolResultTokens: 1024},
			ConversationHeaders: []string{"X-Compactproxy-Conversation", "X-Session-Id", "Session-Id", "session_id", "X-Claude-Code-Session-Id"},
			Summarizer: Summarizer{
				Enabled:       true,
				MaxTokens:     1024,
				Timeout:       60 * time.Second,
				MaxConcurrent: 4,
			},
		},
		Pairing: Pairing{Mode: "strict"},
		Retry: Retry{
			Attempts:   3,
			Backoff:    200 * time.Millisecond,
			MaxBackoff: 5 * time.Second,
			MaxElapsed: 30 * time.Second,
		},
		Store: Store{
			Backend:    "memory",
			MaxEntries: 100000,
			TTL:        24 * time.Hour,
			Timeout:    200 * time.Millisecond,
			Bolt:       Bolt{Path: "compactproxy.db"},
			Redis:      Redis{Prefix: "compactproxy:"},
		},
		Limits: Limits{MaxBodyBytes: 33554432, BodyReadTimeout: 60 * time.Second},
		Log:    Log{Level: "info", Format: "json"},
	}
}
