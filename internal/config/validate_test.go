package config

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

func valid() Config {
	c := Default()
	c.Upstream.URL = "http://127.0.0.1:8080/v1"
	return c
}

func TestDefaultWithURLIsValid(t *testing.T) {
	if err := valid().Validate(); err != nil {
		t.Fatal(err)
	}
}

// problems returns "key: msg" strings of Validate's error (nil when valid).
func problems(t *testing.T, c Config) []string {
	t.Helper()
	err := c.Validate()
	if err == nil {
		return nil
	}
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("Validate error is %T, want *ValidationError", err)
	}
	out := make([]string, len(ve.Problems))
	for i, p := range ve.Problems {
		out[i] = p.Error()
	}
	return out
}

func TestValidateRules(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(c *Config)
		want   string // prefix of the one expected problem; "" = valid
	}{
		{"listen empty", func(c *Config) { c.Listen = "" }, "listen: required"},
		{"listen no port", func(c *Config) { c.Listen = "8081" }, "listen: must be host:port"},
		{"listen host:port", func(c *Config) { c.Listen = "0.0.0.0:9000" }, ""},
		{"shutdown_timeout zero", func(c *Config) { c.ShutdownTimeout = 0 }, "shutdown_timeout: must be > 0"},

		{"upstream.url missing", func(c *Config) { c.Upstream.URL = "" }, "upstream.url: required"},
		{"upstream.url relative", func(c *Config) { c.Upstream.URL = "/v1" }, "upstream.url: must be an absolute"},
		{"upstream.url no scheme", func(c *Config) { c.Upstream.URL = "localhost:8080/v1" }, "upstream.url: must be an absolute"},
		{"upstream.url ftp", func(c *Config) { c.Upstream.URL = "ftp://host/v1" }, "upstream.url: must be an absolute"},
		{"upstream.url no host", func(c *Config) { c.Upstream.URL = "http:///v1" }, "upstream.url: must have a host"},
		{"upstream.url query", func(c *Config) { c.Upstream.URL = "http://h/v1?x=1" }, "upstream.url: must not have a query"},
		{"upstream.url https", func(c *Config) { c.Upstream.URL = "https://api.openai.com/v1" }, ""},
		{"upstream.dialect", func(c *Config) { c.Upstream.Dialect = "ollama" }, "upstream.dialect: must be one of"},
		{"upstream.dialect llamacpp", func(c *Config) { c.Upstream.Dialect = "llamacpp" }, ""},
		{"upstream.context_window negative", func(c *Config) { c.Upstream.ContextWindow = -1 }, "upstream.context_window: must be >= 0"},
		{"upstream.stream_usage", func(c *Config) { c.Upstream.StreamUsage = "sometimes" }, "upstream.stream_usage: must be one of"},
		{"upstream.native_compaction", func(c *Config) { c.Upstream.NativeCompaction = "native" }, "upstream.native_compaction: must be one of"},
		{"upstream.native_compaction empty", func(c *Config) { c.Upstream.NativeCompaction = "" }, "upstream.native_compaction: must be one of"},
		{"upstream.native_compaction emulate", func(c *Config) { c.Upstream.NativeCompaction = "emulate" }, ""},
		{"upstream.discovery_interval", func(c *Config) { c.Upstream.DiscoveryInterval = 0 }, "upstream.discovery_interval: must be > 0"},

		{"models name missing", func(c *Config) { c.Models = []Model{{ContextWindow: 10}} }, "models[0].name: required"},
		{"models window zero", func(c *Config) { c.Models = []Model{{Name: "m"}} }, "models[0].context_window: must be > 0"},
		{"models duplicate", func(c *Config) { c.Models = []Model{{"m", 1}, {"m", 2}} }, "models[1].name: duplicate of models[0]"},

		{"auth empty client key", func(c *Config) { c.Auth.ClientKeys = []Secret{"a", ""} }, "auth.client_keys[1]: must not be empty"},
		{"auth api_key without client keys", func(c *Config) { c.Upstream.APIKey = "sk" }, "auth.client_keys: required when upstream.api_key is set"},
		{"auth api_key with client keys", func(c *Config) { c.Upstream.APIKey = "sk"; c.Auth.ClientKeys = []Secret{"k"} }, ""},
		{"auth api_key anonymous", func(c *Config) { c.Upstream.APIKey = "sk"; c.Auth.AllowAnonymous = true }, ""},

		{"compaction.mode", func(c *Config) { c.Compaction.Mode = "dry-run" }, "compaction.mode: must be one of"},
		{"compaction.mode shadow", func(c *Config) { c.Compaction.Mode = "shadow" }, ""},
		{"trigger_ratio zero", func(c *Config) { c.Compaction.TriggerRatio = 0 }, "compaction.trigger_ratio: must be in (0, 1]"},
		{"trigger_ratio above 1", func(c *Config) { c.Compaction.TriggerRatio = 1.5 }, "compaction.trigger_ratio: must be in (0, 1]"},
		{"target_ratio zero", func(c *Config) { c.Compaction.TargetRatio = 0 }, "compaction.target_ratio: must be in (0, 1)"},
		{"target_ratio equal trigger", func(c *Config) { c.Compaction.TargetRatio = 0.8 }, "compaction.target_ratio: must be < trigger_ratio"},
		{"target_ratio above trigger", func(c *Config) { c.Compaction.TargetRatio = 0.9 }, "compaction.target_ratio: must be < trigger_ratio"},
		{"reserve_tokens negative", func(c *Config) { c.Compaction.ReserveTokens = -1 }, "compaction.reserve_tokens: must be >= 0"},
		{"reserve_tokens zero", func(c *Config) { c.Compaction.ReserveTokens = 0 }, ""},
		{"keep_tail zero", func(c *Config) { c.Compaction.KeepTail = 0 }, "compaction.keep_tail: must be >= 1"},
		{"min_interval negative", func(c *Config) { c.Compaction.MinInterval = -time.Second }, "compaction.min_interval: must be >= 0"},
		{"min_interval zero disables", func(c *Config) { c.Compaction.MinInterval = 0 }, ""},
		{"latch_growth zero", func(c *Config) { c.Compaction.LatchGrowth = 0 }, "compaction.latch_growth: must be >= 1"},
		{"trim tokens zero", func(c *Config) { c.Compaction.Trim.ToolResultTokens = 0 }, "compaction.trim.tool_result_tokens: must be >= 1"},
		{"summarizer.url relative", func(c *Config) { c.Compaction.Summarizer.URL = "v1" }, "compaction.summarizer.url: must be an absolute"},
		{"summarizer.url set", func(c *Config) { c.Compaction.Summarizer.URL = "http://127.0.0.1:8082/v1" }, ""},
		{"summarizer.max_tokens zero", func(c *Config) { c.Compaction.Summarizer.MaxTokens = 0 }, "compaction.summarizer.max_tokens: must be >= 1"},
		{"summarizer.timeout zero", func(c *Config) { c.Compaction.Summarizer.Timeout = 0 }, "compaction.summarizer.timeout: must be > 0"},
		{"summarizer.max_concurrent zero", func(c *Config) { c.Compaction.Summarizer.MaxConcurrent = 0 }, "compaction.summarizer.max_concurrent: must be >= 1"},

		{"pairing.mode", func(c *Config) { c.Pairing.Mode = "lenient" }, "pairing.mode: must be one of"},
		{"pairing.mode repair", func(c *Config) { c.Pairing.Mode = "repair" }, ""},

		{"retry.attempts zero", func(c *Config) { c.Retry.Attempts = 0 }, "retry.attempts: must be >= 1"},
		{"retry.attempts one", func(c *Config) { c.Retry.Attempts = 1 }, ""},
		{"retry.backoff zero", func(c *Config) { c.Retry.Backoff = 0 }, "retry.backoff: must be > 0"},
		{"retry.max_backoff zero", func(c *Config) { c.Retry.MaxBackoff = 0 }, "retry.max_backoff: must be > 0"},
		{"retry.max_backoff below backoff", func(c *Config) { c.Retry.MaxBackoff = 100 * time.Millisecond }, "retry.max_backoff: must be >= retry.backoff"},
		{"retry.max_elapsed zero", func(c *Config) { c.Retry.MaxElapsed = 0 }, "retry.max_elapsed: must be > 0"},

		{"store.backend unknown", func(c *Config) { c.Store.Backend = "sqlite" }, "store.backend: must be one of"},
		{"store.bolt.path empty", func(c *Config) { c.Store.Backend = "bolt"; c.Store.Bolt.Path = "" }, "store.bolt.path: is required"},
		{"store.redis.url empty", func(c *Config) { c.Store.Backend = "redis" }, "store.redis.url: must be redis://"},
		{"store.redis.url http", func(c *Config) { c.Store.Backend = "redis"; c.Store.Redis.URL = "http://:pw@h:6379" }, "store.redis.url: must be redis://"},
		{"store.redis.url sentinel", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2/mymaster/1"
		}, ""},
		{"store.redis.url sentinel without master", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2"
		}, "store.redis.url: names no master"},
		{"store.redis.url sentinel bad port", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:x/m"
		}, "store.redis.url: has a port"},
		{"store.redis.url cluster", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "rediss+cluster://:pw@n1:7000,n2:7001"
		}, ""},
		{"store.redis.url cluster db 2", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis+cluster://n1:7000/2"
		}, "store.redis.url: names a database other than 0"},
		{"store.redis.prefix braces on a cluster", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis+cluster://n1:7000"
			c.Store.Redis.Prefix = "cp{x}:"
		}, "store.redis.prefix: must not contain { or }"},
		{"store.redis.prefix braces on one node", func(c *Config) {
			c.Store.Backend = "redis"
			c.Store.Redis.URL = "redis://n1:6379/0"
			c.Store.Redis.Prefix = "cp{x}:"
		}, ""},
		{"store.timeout zero", func(c *Config) { c.Store.Timeout = 0 }, "store.timeout: must be > 0"},
		{"compaction.conversation_headers blank", func(c *Config) { c.Compaction.ConversationHeaders = []string{"X-A", " "} }, "compaction.conversation_headers[1]: must be a header name"},
		{"store.max_entries zero", func(c *Config) { c.Store.MaxEntries = 0 }, "store.max_entries: must be >= 1"},
		{"store.ttl zero", func(c *Config) { c.Store.TTL = 0 }, "store.ttl: must be > 0"},

		{"limits.max_body_bytes zero", func(c *Config) { c.Limits.MaxBodyBytes = 0 }, "limits.max_body_bytes: must be >= 1"},
		{"limits.body_read_timeout zero", func(c *Config) { c.Limits.BodyReadTimeout = 0 }, "limits.body_read_timeout: must be > 0"},

		{"log.level", func(c *Config) { c.Log.Level = "verbose" }, "log.level: must be one of"},
		{"log.level debug", func(c *Config) { c.Log.Level = "debug" }, ""},
		{"log.format", func(c *Config) { c.Log.Format = "text" }, "log.format: must be one of"},
		{"log.format console", func(c *Config) { c.Log.Format = "console" }, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := valid()
			tc.mutate(&c)
			got := problems(t, c)
			if tc.want == "" {
				if got != nil {
					t.Fatalf("want valid, got %q", got)
				}
				return
			}
			if len(got) != 1 || !strings.HasPrefix(got[0], tc.want) {
				t.Fatalf("got %q, want one problem starting %q", got, tc.want)
			}
		})
	}
}

// TestValidateReportsAll: every problem at once, in one error.
func TestValidateReportsAll(t *testing.T) {
	c := Default()
	c.Upstream.URL = ""
	c.Upstream.Dialect = "ollama"
	c.Compaction.TargetRatio = 0.9
	c.Store.Backend = "sqlite"
	c.Retry.Attempts = 0
	c.Log.Format = "text"
	got := problems(t, c)
	wantKeys := []string{"upstream.url", "upstream.dialect", "compaction.target_ratio", "retry.attempts", "store.backend", "log.format"}
	if len(got) != len(wantKeys) {
		t.Fatalf("got %d problems %q, want %d", len(got), got, len(wantKeys))
	}
	for i, k := range wantKeys {
		if !strings.HasPrefix(got[i], k+": ") {
			t.Errorf("problem %d = %q, want key %s", i, got[i], k)
		}
	}
	msg := c.Validate().Error()
	for _, k := range wantKeys {
		if !strings.Contains(msg, k) {
			t.Errorf("Error() %q lacks %s", msg, k)
		}
	}
}

// TestValidateNeverEchoesURLCredentials: a URL problem must not print the URL,
// which may carry a password.
func TestValidateNeverEchoesURLCredentials(t *testing.T) {
	c := valid()
	c.Upstream.URL = "ftp://user:hunter2@host/v1"
	c.Compaction.Summarizer.URL = "ftp://user:hunter3@host/v1"
	c.Store.Backend = "redis"
	c.Store.Redis.URL = "redis+sentinel://user:hunter4@s1:26379/mymaster/x?sentinel_password=hunter5"
	msg := c.Validate().Error()
	if strings.Contains(msg, "hunter") {
		t.Errorf("validation error leaks URL credentials: %s", msg)
	}
	if !strings.Contains(msg, "store.redis.url: has a database") {
		t.Errorf("the bad store.redis.url is not reported: %s", msg)
	}
}

func TestSecretRedacts(t *testing.T) {
	s := Secret("sk-raw")
	if s.String() != "[redacted]" || s.Reveal() != "sk-raw" {
		t.Errorf("String %q Reveal %q", s.String(), s.Reveal())
	}
	if b, _ := s.MarshalText(); string(b) != "[redacted]" {
		t.Errorf("MarshalText %q", b)
	}
	if Secret("").String() != "" {
		t.Error("empty secret should print empty")
	}
	if !slices.Contains(StoreBackends, "memory") {
		t.Error("memory backend missing")
	}
}
