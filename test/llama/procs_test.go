package llama

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/test/internal/testproc"
)

// Shared with the other end-to-end packages (test/internal/testproc).
var (
	repoRoot    = testproc.RepoRoot
	buildBinary = testproc.BuildBinary
	freeAddr    = testproc.FreeAddr
	startProxy  = testproc.StartProxy
)

// lockedBuffer collects a process's output or a response body.
type lockedBuffer = testproc.Buffer

// llamaServer is a running llama-server.
type llamaServer struct {
	*testproc.Process
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
	model := env.model
	if cfg.real != "" {
		model = env.realModels[cfg.real]
		if model == "" {
			t.Fatalf("no %s real-tokenizer model in LLAMA_MODELS_DIR", cfg.real)
		}
	}
	args := []string{"-m", model, "--host", host, "--port", port,
		"-c", strconv.Itoa(cfg.ctx), "-np", "1"}
	switch {
	case cfg.real != "":
		// The real-tokenizer models embed their family's chat template
		// and accept contexts up to 32k without overrides.
		args = append(args, "--jinja")
	case cfg.ctx > 2048:
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
	// Its log is verbose (every request): keep the end of it.
	p := testproc.Start(t, "llama-server", cmd, &lockedBuffer{Max: 64 << 10})
	s := &llamaServer{Process: p, url: "http://" + addr}
	p.WaitHTTP(t, s.url+"/health", 60*time.Second)

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
	toks, err := s.promptTokens(body)
	return len(toks), err
}

// promptTokens is the prompt llama-server would evaluate for a chat body,
// as token ids (one JSON number each).
func (s *llamaServer) promptTokens(body []byte) ([]json.RawMessage, error) {
	var tmpl struct {
		Prompt string `json:"prompt"`
	}
	if err := postJSON(s.url+"/apply-template", body, &tmpl); err != nil {
		return nil, fmt.Errorf("apply-template: %w", err)
	}
	req, _ := json.Marshal(map[string]any{"content": tmpl.Prompt, "add_special": true})
	var tok struct {
		Tokens []json.RawMessage `json:"tokens"`
	}
	if err := postJSON(s.url+"/tokenize", req, &tok); err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	return tok.Tokens, nil
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
