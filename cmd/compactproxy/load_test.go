package main

import (
	"io"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"
)

// load parses args like the binary does and loads the config with
// defaultFile as the implicit file.
func load(t *testing.T, args []string, defaultFile string) (config.Config, error) {
	t.Helper()
	fset := newFlagSet(io.Discard)
	if err := fset.Parse(args); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	cfg, _, err := loadConfig(fset, defaultFile)
	return cfg, err
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "compactproxy.yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// clearEnv unsets every COMPACTPROXY_ variable for the test (the developer's
// shell may have some).
func clearEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, envPrefix+"_") {
			t.Setenv(k, "") // restores the value after the test
			os.Unsetenv(k)
		}
	}
}

const precedenceFile = `
listen: ":7001"
upstream:
  url: http://file.example/v1
compaction:
  min_interval: 2m
  summarizer:
    max_tokens: 111
log:
  level: warn
`

func TestPrecedence(t *testing.T) {
	type want struct {
		listen      string
		url         string
		maxTokens   int
		minInterval time.Duration
		level       string
	}
	d := config.Default()
	tests := []struct {
		name  string
		file  bool
		env   map[string]string
		flags []string
		want  want
	}{
		{
			name: "defaults",
			want: want{d.Listen, d.Upstream.URL, d.Compaction.Summarizer.MaxTokens, d.Compaction.MinInterval, d.Log.Level},
		},
		{
			name: "file over defaults",
			file: true,
			want: want{":7001", "http://file.example/v1", 111, 2 * time.Minute, "warn"},
		},
		{
			name: "env over file",
			file: true,
			env: map[string]string{
				"COMPACTPROXY_LISTEN":                           ":7002",
				"COMPACTPROXY_UPSTREAM_URL":                     "http://env.example/v1",
				"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS": "222",
				"COMPACTPROXY_COMPACTION_MIN_INTERVAL":          "90s",
				"COMPACTPROXY_LOG_LEVEL":                        "error",
			},
			want: want{":7002", "http://env.example/v1", 222, 90 * time.Second, "error"},
		},
		{
			name: "env alone over defaults",
			env: map[string]string{
				"COMPACTPROXY_UPSTREAM_URL":                     "http://env.example/v1",
				"COMPACTPROXY_COMPACTION_SUMMARIZER_MAX_TOKENS": "333",
				"COMPACTPROXY_COMPACTION_MIN_INTERVAL":          "0s",
			},
			want: want{d.Listen, "http://env.example/v1", 333, 0, d.Log.Level},
		},
		{
			name: "flags over env over file",
			file: true,
			env: map[string]string{
				"COMPACTPROXY_LISTEN":       ":7002",
				"COMPACTPROXY_UPSTREAM_URL": "http://env.example/v1",
				"COMPACTPROXY_LOG_LEVEL":    "error",
			},
			flags: []string{"--listen", ":7003", "--upstream-url", "http://flag.example/v1", "--log-level", "debug"},
			want:  want{":7003", "http://flag.example/v1", 111, 2 * time.Minute, "debug"},
		},
		{
			name:  "unchanged flag does not override env",
			env:   map[string]string{"COMPACTPROXY_LISTEN": ":7002"},
			flags: []string{"--log-level", "debug"},
			want:  want{":7002", d.Upstream.URL, d.Compaction.Summarizer.MaxTokens, d.Compaction.MinInterval, "debug"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clearEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			args := tc.flags
			if tc.file {
				args = append([]string{"--config", writeFile(t, precedenceFile)}, args...)
			}
			cfg, err := load(t, args, "")
			if err != nil {
				t.Fatal(err)
			}
			got := want{cfg.Listen, cfg.Upstream.URL, cfg.Compaction.Summarizer.MaxTokens, cfg.Compaction.MinInterval, cfg.Log.Level}
			if got != tc.want {
				t.Errorf("got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestImplicitConfigFile(t *testing.T) {
	clearEnv(t)
	p := writeFile(t, precedenceFile)
	cfg, err := load(t, nil, p)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != ":7001" {
		t.Errorf("implicit file not read: listen = %q", cfg.Listen)
	}
	// A missing implicit file is fine; a missing --config is an error.
	if _, err := load(t, nil, filepath.Join(t.TempDir(), "absent.yaml")); err != nil {
		t.Errorf("missing implicit file: %v", err)
	}
	if _, err := load(t, []string{"--config", filepath.Join(t.TempDir(), "absent.yaml")}, ""); err == nil {
		t.Error("missing --config file: want error")
	}
}

func TestEnvListsAndModels(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		file    string
		check   func(t *testing.T, c config.Config)
		wantErr string
	}{
		{
			name: "client keys from env, comma separated",
			env:  map[string]string{"COMPACTPROXY_AUTH_CLIENT_KEYS": "a, b,"},
			check: func(t *testing.T, c config.Config) {
				if !slices.Equal(c.Auth.ClientKeys, []config.Secret{"a", "b"}) {
					t.Errorf("client_keys: got %d keys, want [a b]", len(c.Auth.ClientKeys))
				}
			},
		},
		{
			name: "bools and floats from env",
			env: map[string]string{
				"COMPACTPROXY_AUTH_ALLOW_ANONYMOUS":               "true",
				"COMPACTPROXY_COMPACTION_ENABLED":                 "false",
				"COMPACTPROXY_COMPACTION_TRIGGER_RATIO":           "0.9",
				"COMPACTPROXY_LIMITS_MAX_BODY_BYTES":              "1024",
				"COMPACTPROXY_COMPACTION_TRIM_TOOL_RESULT_TOKENS": "7",
			},
			check: func(t *testing.T, c config.Config) {
				if !c.Auth.AllowAnonymous || c.Compaction.Enabled || c.Compaction.TriggerRatio != 0.9 ||
					c.Limits.MaxBodyBytes != 1024 || c.Compaction.Trim.ToolResultTokens != 7 {
					t.Errorf("got %+v %+v %+v", c.Auth, c.Compaction, c.Limits)
				}
			},
		},
		{
			name: "models from env as JSON",
			env:  map[string]string{"COMPACTPROXY_MODELS": `[{"name":"qwen3","context_window":32768},{"name":"gpt-x","context_window":128000}]`},
			check: func(t *testing.T, c config.Config) {
				want := []config.Model{{Name: "qwen3", ContextWindow: 32768}, {Name: "gpt-x", ContextWindow: 128000}}
				if !slices.Equal(c.Models, want) {
					t.Errorf("models = %+v", c.Models)
				}
			},
		},
		{
			name:    "models env not JSON",
			env:     map[string]string{"COMPACTPROXY_MODELS": "qwen3=32768"},
			wantErr: "models",
		},
		{
			name: "models from file",
			file: "models:\n  - name: qwen3\n    context_window: 32768\n",
			check: func(t *testing.T, c config.Config) {
				if !slices.Equal(c.Models, []config.Model{{Name: "qwen3", ContextWindow: 32768}}) {
					t.Errorf("models = %+v", c.Models)
				}
			},
		},
		{
			name:    "misspelt key in file",
			file:    "compaction:\n  trigger_ration: 0.5\n",
			wantErr: "trigger_ration",
		},
		{
			name:    "bad duration in env",
			env:     map[string]string{"COMPACTPROXY_RETRY_BACKOFF": "soon"},
			wantErr: "backoff",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clearEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var args []string
			if tc.file != "" {
				args = []string{"--config", writeFile(t, tc.file)}
			}
			cfg, err := load(t, args, "")
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one naming %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, cfg)
		})
	}
}

// TestEveryKeyFromEnv sets each registered key from the environment alone
// and checks it changes the loaded config: no key is unreachable by env.
func TestEveryKeyFromEnv(t *testing.T) {
	v := viper.New()
	registerDefaults(v, "", reflect.ValueOf(config.Default()))
	values := map[reflect.Kind]string{
		reflect.String: "x", reflect.Int: "7", reflect.Int64: "7", reflect.Float64: "0.25",
		reflect.Bool: "", reflect.Slice: "k1,k2",
	}
	for _, key := range v.AllKeys() {
		t.Run(key, func(t *testing.T) {
			clearEnv(t)
			def := v.Get(key)
			val := values[reflect.TypeOf(def).Kind()]
			switch def := def.(type) {
			case bool:
				val = map[bool]string{true: "false", false: "true"}[def]
			case time.Duration:
				val = "17s"
			case []config.Model:
				val = `[{"name":"m","context_window":5}]`
			}
			env := envPrefix + "_" + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
			t.Setenv(env, val)
			cfg, err := load(t, nil, "")
			if err != nil {
				t.Fatal(err)
			}
			if reflect.DeepEqual(cfg, normalized(config.Default())) {
				t.Errorf("%s=%q did not change the config", env, val)
			}
		})
	}
}

// normalized turns nil slices into empty ones, as loading does.
func normalized(c config.Config) config.Config {
	if c.Models == nil {
		c.Models = []config.Model{}
	}
	if c.Auth.ClientKeys == nil {
		c.Auth.ClientKeys = []config.Secret{}
	}
	return c
}

const shippedFile = "../../configs/compactproxy.yaml"

// TestShippedFileMatchesDefaults keeps configs/compactproxy.yaml and
// config.Default() in step.
func TestShippedFileMatchesDefaults(t *testing.T) {
	clearEnv(t)
	cfg, err := load(t, []string{"--config", shippedFile}, "")
	if err != nil {
		t.Fatal(err)
	}
	want := normalized(config.Default())
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("shipped file differs from config.Default():\n got %+v\nwant %+v", cfg, want)
	}
	if err := cfg.Validate(); err != nil {
		t.Errorf("shipped file does not validate with nothing set: %v", err)
	}
}

// TestShippedFileHasEveryKey: the file documents every key, not just the
// ones whose defaults happen to be non-zero.
func TestShippedFileHasEveryKey(t *testing.T) {
	raw, err := os.ReadFile(shippedFile)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	inFile := map[string]bool{}
	var flatten func(prefix string, m map[string]any)
	flatten = func(prefix string, m map[string]any) {
		for k, val := range m {
			if prefix != "" {
				k = prefix + "." + k
			}
			if sub, ok := val.(map[string]any); ok {
				flatten(k, sub)
				continue
			}
			inFile[k] = true
		}
	}
	flatten("", doc)

	v := viper.New()
	registerDefaults(v, "", reflect.ValueOf(config.Default()))
	keys := v.AllKeys()
	for _, k := range keys {
		if !inFile[k] {
			t.Errorf("%s: missing from %s", k, shippedFile)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(inFile)) {
		if !slices.Contains(keys, k) {
			t.Errorf("%s: in %s but not a config key", k, shippedFile)
		}
	}
}
