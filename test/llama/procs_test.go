package llama

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/compactproxy/compactproxy/test/internal/testproc"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Shared with the other end-to-end packages (test/internal/testproc).
var (
	repoRoot    = testproc.RepoRoot
	buildBinary = testproc.BuildBinary
	freeAddr    = testproc.FreeAddr
)

// The process type below differs from test/e2e's proxy on purpose: it also
// runs llama-server, with a parent-death signal so that none outlives go
// test.

// lockedBuffer collects a process's output (or a response body); one
// goroutine writes while the test may read.
type lockedBuffer struct {
	mu  sync.Mutex
	b   bytes.Buffer
	max int // > 0: keep only about the last max bytes
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, err := l.b.Write(p)
	if l.max > 0 && l.b.Len() > 2*l.max {
		keep := append([]byte(nil), l.b.Bytes()[l.b.Len()-l.max:]...)
		l.b.Reset()
		l.b.Write(keep)
	}
	return n, err
}

func (l *lockedBuffer) Bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]byte(nil), l.b.Bytes()...)
}

func (l *lockedBuffer) tail(n int) string {
	b := l.Bytes()
	if len(b) > n {
		return "...\n" + string(b[len(b)-n:])
	}
	return string(b)
}

// process is a started child process, stopped with SIGTERM at cleanup.
type process struct {
	name string
	cmd  *exec.Cmd
	done chan error
	log  *lockedBuffer

	stopOnce sync.Once
	stopErr  error
}

func startProcess(t *testing.T, name string, cmd *exec.Cmd) *process {
	t.Helper()
	p := &process{name: name, cmd: cmd, done: make(chan error, 1), log: &lockedBuffer{max: 64 << 10}}
	cmd.Stdout, cmd.Stderr = p.log, p.log
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if err := p.stop(10 * time.Second); err != nil {
			t.Logf("%s stop: %v", name, err)
		}
	})
	return p
}

// stop sends SIGTERM and waits up to d for the exit, then kills.
func (p *process) stop(d time.Duration) error {
	p.stopOnce.Do(func() {
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			p.stopErr = fmt.Errorf("signal: %w", err)
		}
		select {
		case err := <-p.done:
			if err != nil {
				p.stopErr = fmt.Errorf("exit: %w", err)
			}
		case <-time.After(d):
			p.cmd.Process.Kill()
			<-p.done
			p.stopErr = fmt.Errorf("did not exit within %v of SIGTERM", d)
		}
	})
	return p.stopErr
}

// waitHTTP polls url until it answers 200, the process exits or the
// deadline passes.
func (p *process) waitHTTP(t *testing.T, url string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	hc := &http.Client{Timeout: time.Second}
	last := "no answer"
	for {
		select {
		case err := <-p.done:
			p.done <- err // let stop see it
			t.Fatalf("%s exited before serving: %v\n%s", p.name, err, p.log.tail(4000))
		default:
		}
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s did not answer 200 within %v (last: %s)\n%s", p.name, url, within, last, p.log.tail(4000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// llamaServer is a running llama-server.
type llamaServer struct {
	*process
	url  string // http://127.0.0.1:port (root, no /v1)
	nCtx int    // /props default_generation_settings.n_ctx
}

// startLlama starts llama-server for cfg on a free loopback port with one
// slot (-np 1, so the conversation keeps its KV cache between requests) and
// waits for /health 200.
func startLlama(t *testing.T, env llamaEnv, cfg llamaConfig) *llamaServer {
	t.Helper()
	addr := freeAddr(t)
	host, port, _ := net.SplitHostPort(addr)
	args := []string{"-m", env.model, "--host", host, "--port", port,
		"-c", strconv.Itoa(cfg.ctx), "-np", "1"}
	if cfg.ctx > 2048 {
		// stories260K's training context is 2048: a larger -c is capped
		// unless the model's context length is overridden.
		args = append(args, "--override-kv", "llama.context_length=int:"+strconv.Itoa(2*cfg.ctx))
	}
	if cfg.template != "" {
		args = append(args, "--chat-template-file", cfg.template)
	}
	// One thread by default: on a busy 2-core machine (the test suite runs
	// packages in parallel) it evaluated prompts 1.5–2x faster than two.
	threads := os.Getenv("LLAMA_THREADS")
	if threads == "" {
		threads = "2"
	}
	args = append(args, "-t", threads)
	cmd := exec.Command(env.server, args...)
	cmd.Dir = t.TempDir()
	p := startProcess(t, "llama-server", cmd)
	s := &llamaServer{process: p, url: "http://" + addr}
	p.waitHTTP(t, s.url+"/health", 60*time.Second)

	var props struct {
		Settings struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
	}
	if err := getJSON(s.url+"/props", &props); err != nil {
		t.Fatalf("llama-server /props: %v", err)
	}
	s.nCtx = props.Settings.NCtx
	if s.nCtx != cfg.ctx {
		t.Fatalf("llama-server n_ctx = %d with -c %d: the test's window is wrong (args %v)", s.nCtx, cfg.ctx, args)
	}
	return s
}

// countTokens is the exact prompt size of a chat body, without touching a
// slot: /apply-template, then /tokenize with the special tokens.
func (s *llamaServer) countTokens(body []byte) (int, error) {
	var tmpl struct {
		Prompt string `json:"prompt"`
	}
	if err := postJSON(s.url+"/apply-template", body, &tmpl); err != nil {
		return 0, fmt.Errorf("apply-template: %w", err)
	}
	req, _ := json.Marshal(map[string]any{"content": tmpl.Prompt, "add_special": true})
	var tok struct {
		Tokens []json.RawMessage `json:"tokens"`
	}
	if err := postJSON(s.url+"/tokenize", req, &tok); err != nil {
		return 0, fmt.Errorf("tokenize: %w", err)
	}
	return len(tok.Tokens), nil
}

// countText tokenizes plain text without special tokens.
func (s *llamaServer) countText(text string) (int, error) {
	req, _ := json.Marshal(map[string]any{"content": text, "add_special": false})
	var tok struct {
		Tokens []json.RawMessage `json:"tokens"`
	}
	if err := postJSON(s.url+"/tokenize", req, &tok); err != nil {
		return 0, err
	}
	return len(tok.Tokens), nil
}

// startProxy runs the compactproxy binary configured by environment alone,
// in an empty working directory (no ./configs/compactproxy.yaml is picked
// up), and waits for /healthz. extra entries (KEY=value) come last and win.
func startProxy(t *testing.T, bin, upstream string, extra ...string) (*process, string) {
	t.Helper()
	addr := freeAddr(t)
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPACTPROXY_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"COMPACTPROXY_LISTEN="+addr,
		"COMPACTPROXY_UPSTREAM_URL="+upstream,
		"COMPACTPROXY_SHUTDOWN_TIMEOUT=5s",
		"COMPACTPROXY_LOG_LEVEL=info",
	)
	env = append(env, extra...)
	cmd := exec.Command(bin)
	cmd.Dir = t.TempDir()
	cmd.Env = env
	p := startProcess(t, "compactproxy", cmd)
	url := "http://" + addr
	p.waitHTTP(t, url+"/healthz", 15*time.Second)
	return p, url
}

var plainClient = &http.Client{Timeout: 30 * time.Second}

func getJSON(url string, v any) error {
	resp, err := plainClient.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func postJSON(url string, body []byte, v any) error {
	resp, err := plainClient.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}
