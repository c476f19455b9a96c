package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/config"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Defaults expose nothing: `make run` (no variable, or the shipped file)
// listens on loopback only; the container and deploy files set :8081.
func TestDefaultListenIsLoopback(t *testing.T) {
	for _, args := range [][]string{nil, {"--config", shippedFile}} {
		clearEnv(t)
		cfg, err := load(t, args, "")
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Listen != "127.0.0.1:8081" {
			t.Errorf("%v: listen %q, want 127.0.0.1:8081 (loopback unless told otherwise)", args, cfg.Listen)
		}
	}
}

// A misspelt COMPACTPROXY_* variable is an error at start-up, named, as a
// misspelt file key is; so is a value that does not parse, with its
// variable and value (never a raw Go error).
func TestEnvironmentProblemsNamed(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		want []string
		not  []string
	}{
		{"misspelt name", map[string]string{"COMPACTPROXY_UPSTREM_URL": "http://x/v1"},
			[]string{"COMPACTPROXY_UPSTREM_URL", "COMPACTPROXY_UPSTREAM_URL"}, nil},
		{"unknown name, empty value", map[string]string{"COMPACTPROXY_LISTEN_ADDR": ""},
			[]string{"COMPACTPROXY_LISTEN_ADDR"}, nil},
		{"integer", map[string]string{"COMPACTPROXY_RETRY_ATTEMPTS": "three"},
			[]string{`COMPACTPROXY_RETRY_ATTEMPTS="three"`, "whole number"}, []string{"strconv", "cannot parse", "decoding"}},
		{"number", map[string]string{"COMPACTPROXY_COMPACTION_TRIGGER_RATIO": "80%"},
			[]string{`COMPACTPROXY_COMPACTION_TRIGGER_RATIO="80%"`, "number"}, []string{"strconv"}},
		{"bool", map[string]string{"COMPACTPROXY_AUTH_ALLOW_ANONYMOUS": "yes please"},
			[]string{`COMPACTPROXY_AUTH_ALLOW_ANONYMOUS="yes please"`, "true or false"}, []string{"strconv"}},
		{"duration", map[string]string{"COMPACTPROXY_COMPACTION_MIN_INTERVAL": "60"},
			[]string{`COMPACTPROXY_COMPACTION_MIN_INTERVAL="60"`, "duration"}, []string{"time: missing unit"}},
		{"models", map[string]string{"COMPACTPROXY_MODELS": `{"name":"m"}`},
			[]string{"COMPACTPROXY_MODELS", "JSON array"}, nil},
		{"two problems at once", map[string]string{"COMPACTPROXY_RETRY_ATTEMPTS": "x", "COMPACTPROXY_LOGLEVEL": "debug"},
			[]string{"COMPACTPROXY_RETRY_ATTEMPTS", "COMPACTPROXY_LOGLEVEL"}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, cmd := range []string{"serve", "config"} {
				clearEnv(t)
				// Should it start after all, it stops at once, on loopback.
				t.Setenv("COMPACTPROXY_LISTEN", "127.0.0.1:0")
				for k, v := range tc.env {
					t.Setenv(k, v)
				}
				code, _, errOut := runStopped(t, cmd)
				if code != exitUsage {
					t.Errorf("%s: exit %d, want %d; stderr:\n%s", cmd, code, exitUsage, errOut)
				}
				for _, w := range tc.want {
					if !strings.Contains(errOut, w) {
						t.Errorf("%s: stderr lacks %q:\n%s", cmd, w, errOut)
					}
				}
				for _, n := range tc.not {
					if strings.Contains(errOut, n) {
						t.Errorf("%s: stderr has the raw error %q:\n%s", cmd, n, errOut)
					}
				}
			}
		})
	}
}

// runStopped is runCmd with a context already cancelled: a serve that
// starts returns at once instead of serving until the test times out.
func runStopped(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var stdout bytes.Buffer
	stderr := &lockedBuffer{}
	code := run(ctx, args, &stdout, stderr)
	return code, stdout.String(), stderr.String()
}

// A secret's value never appears in an environment problem.
func TestEnvironmentProblemHidesSecrets(t *testing.T) {
	clearEnv(t)
	t.Setenv("COMPACTPROXY_UPSTREAM_APIKEY", "sk-RAW-secret")
	code, _, errOut := runCmd(t, "config")
	if code != exitUsage || !strings.Contains(errOut, "COMPACTPROXY_UPSTREAM_APIKEY") {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if strings.Contains(errOut, "RAW") {
		t.Errorf("stderr shows the value of an unknown variable: %s", errOut)
	}
}

func TestVersionFlagAndHelpCommand(t *testing.T) {
	clearEnv(t)
	code, out, errOut := runCmd(t, "--version")
	if code != exitOK || !strings.Contains(out, "compactproxy "+version) {
		t.Errorf("--version: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = runCmd(t, "help")
	if code != exitOK {
		t.Errorf("help: exit %d: %s", code, errOut)
	}
	_, _, helpOut := runCmd(t, "--help")
	for name, text := range map[string]string{"help": out, "--help": helpOut} {
		for _, want := range []string{"chat completions", "Responses", "Anthropic Messages", "--listen", "healthcheck"} {
			if !strings.Contains(text, want) {
				t.Errorf("%s output lacks %q:\n%s", name, want, text)
			}
		}
	}
}

// An upstream.url without a version path is allowed (llama-server serves
// un-prefixed paths too) but said at start-up, with where requests go.
func TestUpstreamWithoutVersionPathWarns(t *testing.T) {
	for _, tc := range []struct {
		url  string
		warn bool
	}{{"http://127.0.0.1:9", true}, {"http://127.0.0.1:9/", true}, {"http://127.0.0.1:9/v1", false}, {"https://api.example.com/api/paas/v4", false}} {
		cfg := config.Default()
		cfg.Listen = "127.0.0.1:0"
		cfg.Upstream.URL = tc.url
		core, logs := observer.New(zapcore.DebugLevel)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := serve(ctx, cfg, "", zap.New(core)); err != nil {
			t.Fatal(err)
		}
		w := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("version path").All()
		if !tc.warn {
			if len(w) != 0 {
				t.Errorf("%s: warned %v", tc.url, w)
			}
			continue
		}
		if len(w) != 1 {
			t.Errorf("%s: %d version-path warnings, want 1 (logs %v)", tc.url, len(w), logs.All())
			continue
		}
		if got := w[0].ContextMap()["chat_completions"]; got != "http://127.0.0.1:9/chat/completions" {
			t.Errorf("%s: the warning says requests go to %v", tc.url, got)
		}
	}
}
