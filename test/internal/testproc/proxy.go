package testproc

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Buffer collects a process's output; exec writes to it from a goroutine
// while the test may read it.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Tail is the last n bytes of s, marked when cut.
func Tail(s string, n int) string {
	if len(s) > n {
		return "...\n" + s[len(s)-n:]
	}
	return s
}

// Proxy is a running compactproxy binary.
type Proxy struct {
	URL string // http://host:port

	cmd      *exec.Cmd
	done     chan error // receives Wait's result once
	log      *Buffer
	stopOnce sync.Once
	stopErr  error
}

// Log is the process's whole output so far.
func (p *Proxy) Log() string { return p.log.String() }

// LogTail is the end of the process's output.
func (p *Proxy) LogTail() string { return Tail(p.log.String(), 8000) }

// Stop sends SIGTERM and waits up to d for a clean exit (status 0).
func (p *Proxy) Stop(d time.Duration) error {
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

// StartProxy runs the binary configured by environment alone, in an empty
// working directory (so no ./configs/compactproxy.yaml is picked up), and
// waits for /healthz. extra env entries (KEY=value) come last and win; the
// process is stopped when the test ends.
func StartProxy(t *testing.T, bin, upstream string, extra ...string) *Proxy {
	t.Helper()
	addr := FreeAddr(t)
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
	p := &Proxy{URL: "http://" + addr, log: &Buffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin)
	p.cmd.Dir = t.TempDir()
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if err := p.Stop(10 * time.Second); err != nil {
			t.Logf("compactproxy stop: %v", err)
		}
	})

	deadline := time.Now().Add(15 * time.Second)
	hc := &http.Client{Timeout: time.Second}
	for {
		select {
		case err := <-p.done:
			p.done <- err // let Stop see it
			t.Fatalf("compactproxy exited before serving: %v\n%s", err, p.LogTail())
		default:
		}
		resp, err := hc.Get(p.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			last := "no answer"
			if err != nil {
				last = err.Error()
			} else {
				last = resp.Status
			}
			t.Fatalf("compactproxy did not answer /healthz 200 within 15s (last: %s)\n%s", last, p.LogTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
