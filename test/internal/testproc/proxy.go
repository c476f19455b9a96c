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

// Buffer collects a process's output (or a response body); exec writes to
// it from a goroutine while the test may read it. Max > 0 keeps only about
// the last Max bytes.
type Buffer struct {
	Max int

	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, err := l.b.Write(p)
	if l.Max > 0 && l.b.Len() > 2*l.Max {
		keep := append([]byte(nil), l.b.Bytes()[l.b.Len()-l.Max:]...)
		l.b.Reset()
		l.b.Write(keep)
	}
	return n, err
}

// Bytes is a copy of what the buffer holds.
func (l *Buffer) Bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]byte(nil), l.b.Bytes()...)
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

// Process is a started child process (compactproxy, llama-server, ...),
// stopped with SIGTERM when the test ends. On Linux it also gets SIGKILL
// when the test process dies: a test timeout panics without running
// cleanups, which would leave it running.
type Process struct {
	Name string

	cmd      *exec.Cmd
	done     chan error // receives Wait's result once
	log      *Buffer
	stopOnce sync.Once
	stopErr  error
}

// Start starts cmd with its output collected in log (a new unbounded
// Buffer when nil).
func Start(t *testing.T, name string, cmd *exec.Cmd, log *Buffer) *Process {
	t.Helper()
	if log == nil {
		log = &Buffer{}
	}
	p := &Process{Name: name, cmd: cmd, done: make(chan error, 1), log: log}
	cmd.Stdout, cmd.Stderr = log, log
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if err := p.Stop(10 * time.Second); err != nil {
			t.Logf("%s stop: %v", name, err)
		}
	})
	return p
}

// Log is the process's output so far.
func (p *Process) Log() string { return p.log.String() }

// Tail is the last n bytes of the process's output.
func (p *Process) Tail(n int) string { return Tail(p.log.String(), n) }

// Stop sends SIGTERM and waits up to d for a clean exit (status 0), then
// kills.
func (p *Process) Stop(d time.Duration) error {
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

// WaitHTTP polls url until it answers 200, and fails the test when the
// process exits first or the deadline passes.
func (p *Process) WaitHTTP(t *testing.T, url string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	hc := &http.Client{Timeout: time.Second}
	last := "no answer"
	for {
		select {
		case err := <-p.done:
			p.done <- err // let Stop see it
			t.Fatalf("%s exited before serving: %v\n%s", p.Name, err, p.Tail(4000))
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
			t.Fatalf("%s: %s did not answer 200 within %v (last: %s)\n%s", p.Name, url, within, last, p.Tail(4000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Proxy is a running compactproxy binary.
type Proxy struct {
	*Process
	URL string // http://host:port
}

// LogTail is the end of the proxy's output.
func (p *Proxy) LogTail() string { return p.Tail(8000) }

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
	cmd := exec.Command(bin)
	cmd.Dir = t.TempDir()
	cmd.Env = append(env, extra...)
	p := &Proxy{Process: Start(t, "compactproxy", cmd, nil), URL: "http://" + addr}
	p.WaitHTTP(t, p.URL+"/healthz", 15*time.Second)
	return p
}
