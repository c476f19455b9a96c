// Command compactproxy is a reverse proxy that compacts LLM requests in
// flight: OpenAI chat completions, the Responses API and Anthropic Messages,
// on their way to one upstream.
//
// Usage:
//
//	compactproxy [flags]              serve (the default)
//	compactproxy version              print version and Go version (also --version)
//	compactproxy config [flags]       print the effective config as YAML, secrets [redacted]
//	compactproxy healthcheck [flags]  exit 0 when /healthz answers 200, else 1
//	compactproxy help                 print the usage
//
// Configuration precedence: flags > COMPACTPROXY_* environment > config file
// (--config, else ./configs/compactproxy.yaml if present) > defaults.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"
)

// version is set at build time: -ldflags "-X main.version=v1.2.3".
var version = "dev"

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // runtime failure (server error, unhealthy)
	exitUsage = 2 // bad flags, bad configuration
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	go func() {
		// After the first signal starts a graceful shutdown, restore the
		// default handling so a second Ctrl-C ends the process at once.
		<-ctx.Done()
		stop()
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

const usageText = `compactproxy: a reverse proxy that compacts LLM requests in flight, keeping an
agent's conversation inside the model's context window. It serves three APIs:
  OpenAI chat completions  POST /v1/chat/completions
  the Responses API        POST /v1/responses
  Anthropic Messages       POST /v1/messages
and forwards to one upstream (llama-server, vLLM, OpenAI, Anthropic, ...);
other /v1 paths pass through.

Usage:
  compactproxy [flags]              serve (default)
  compactproxy version              print the version (also --version)
  compactproxy config [flags]       print the effective configuration (secrets [redacted])
  compactproxy healthcheck [flags]  GET /healthz; exit 0 on 200, else 1
  compactproxy help                 print this help

Configuration: flags > COMPACTPROXY_<KEY_PATH> environment variables
(e.g. COMPACTPROXY_UPSTREAM_URL, COMPACTPROXY_COMPACTION_TRIGGER_RATIO;
a variable that names no setting is an error)
> config file (--config, else ./configs/compactproxy.yaml if present) > defaults.
It serves on 127.0.0.1:8081 unless --listen or COMPACTPROXY_LISTEN says otherwise.

Flags:
`

// newFlagSet defines every flag of every subcommand; run rejects the
// healthcheck-only ones elsewhere.
func newFlagSet(stderr io.Writer) *pflag.FlagSet {
	d := config.Default()
	fset := pflag.NewFlagSet("compactproxy", pflag.ContinueOnError)
	fset.SetOutput(stderr)
	fset.SortFlags = false
	fset.StringP("config", "c", "", "config file (YAML); default ./"+defaultConfigFile+" if present")
	fset.String("listen", d.Listen, "address to serve on (listen)")
	fset.String("upstream-url", "", "upstream base URL incl. version path, e.g. http://127.0.0.1:8080/v1 (upstream.url)")
	fset.String("log-level", d.Log.Level, "debug, info, warn or error (log.level)")
	fset.String("log-format", d.Log.Format, "json or console (log.format)")
	fset.String("url", "", "healthcheck only: URL to GET instead of http://<listen>/healthz")
	fset.Duration("timeout", 3*time.Second, "healthcheck only: request timeout")
	fset.Bool("version", false, "print the version and exit")
	fset.Usage = func() { printUsage(stderr, fset) }
	return fset
}

// printUsage writes the help text and every flag to w.
func printUsage(w io.Writer, fset *pflag.FlagSet) {
	fmt.Fprint(w, usageText)
	fmt.Fprint(w, fset.FlagUsages())
}

// run is the whole program minus os.Exit, so tests drive it directly.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fset := newFlagSet(stderr)
	if err := fset.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return exitOK
		}
		fmt.Fprintf(stderr, "compactproxy: %v\n", err)
		return exitUsage
	}
	if v, _ := fset.GetBool("version"); v {
		fmt.Fprintln(stdout, versionString())
		return exitOK
	}
	cmd := fset.Arg(0)
	if fset.NArg() > 1 {
		fmt.Fprintf(stderr, "compactproxy: unexpected arguments %q\n", fset.Args()[1:])
		return exitUsage
	}
	if cmd != "healthcheck" {
		for _, name := range []string{"url", "timeout"} {
			if fset.Changed(name) {
				fmt.Fprintf(stderr, "compactproxy: --%s applies to healthcheck only\n", name)
				return exitUsage
			}
		}
	}

	switch cmd {
	case "help":
		printUsage(stdout, fset)
		return exitOK
	case "version":
		fmt.Fprintln(stdout, versionString())
		return exitOK
	case "config":
		return runConfig(fset, stdout, stderr)
	case "healthcheck":
		return runHealthcheck(ctx, fset, stderr)
	case "", "serve":
		return runServe(ctx, fset, stderr)
	default:
		fmt.Fprintf(stderr, "compactproxy: unknown command %q\n\n", cmd)
		fset.Usage()
		return exitUsage
	}
}

// versionString is `compactproxy <version> (<vcs revision>, go1.x, os/arch)`.
func versionString() string {
	rev := ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				rev = s.Value[:12] + ", "
			}
		}
	}
	return fmt.Sprintf("compactproxy %s (%s%s, %s/%s)", version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

// runConfig prints the effective configuration as YAML. Secrets print as
// [redacted] (config.Secret implements encoding.TextMarshaler, which the
// YAML encoder honours). Validation problems go to stderr with exit 2, so
// `compactproxy config` doubles as a configuration check.
func runConfig(fset *pflag.FlagSet, stdout, stderr io.Writer) int {
	if err := checkEnv(os.Environ()); err != nil {
		printValidation(stderr, err)
		return exitUsage
	}
	cfg, _, err := loadConfig(fset, defaultConfigFile)
	if err != nil {
		fmt.Fprintf(stderr, "compactproxy: %v\n", err)
		return exitUsage
	}
	if err := writeYAML(stdout, cfg); err != nil {
		fmt.Fprintf(stderr, "compactproxy: %v\n", err)
		return exitFail
	}
	if err := cfg.Validate(); err != nil {
		printValidation(stderr, err)
		return exitUsage
	}
	return exitOK
}

func writeYAML(w io.Writer, cfg config.Config) error {
	enc := yaml.NewEncoder(w)
	enc.SetIndent(2)
	if err := enc.Encode(cfg); err != nil {
		return fmt.Errorf("encode config: %w", err)
	}
	return enc.Close()
}

// printValidation lists one problem per line.
func printValidation(w io.Writer, err error) {
	var ve *config.ValidationError
	if errors.As(err, &ve) {
		fmt.Fprintln(w, "compactproxy: invalid configuration:")
		for _, p := range ve.Problems {
			fmt.Fprintf(w, "  %s\n", p.Error())
		}
		return
	}
	fmt.Fprintf(w, "compactproxy: %v\n", err)
}
