// Package storetest starts a real redis-server for tests: each test gets
// its own, on a free loopback port, without persistence, stopped when the
// test ends. A mock would not do: the lease (SET NX PX), the TTLs and the
// compare-and-set scripts are Redis' own behaviour.
package storetest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// Redis is a running redis-server.
type Redis struct {
	Addr  string
	cmd   *exec.Cmd
	port  int
	t     testing.TB
	conf  string   // a config file, first on the command line ("": none)
	dir   string   // working directory (RDB files, cluster and sentinel state)
	extra []string // further arguments
}

// StartRedis starts redis-server on a free 127.0.0.1 port, or skips the
// test with a message when redis-server is not installed
// (scripts/redis-deps.sh installs it; `make test` runs that first).
func StartRedis(t testing.TB) *Redis {
	t.Helper()
	needRedis(t)
	return startRedis(t, "")
}

func needRedis(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server is not on PATH (scripts/redis-deps.sh installs it; CI must not skip)")
		}
		t.Skip("redis-server is not on PATH: run scripts/redis-deps.sh (make test does) to run the redis tests")
	}
}

// startRedis starts a server with its config file (sentinels need one
// they can write) and extra arguments.
func startRedis(t testing.TB, conf string, extra ...string) *Redis {
	t.Helper()
	// Its own directory: a replica writes the master's RDB there.
	r := &Redis{t: t, port: freePort(t), conf: conf, dir: t.TempDir(), extra: extra}
	r.Start()
	t.Cleanup(r.Stop)
	return r
}

// URL is the redis:// URL of the server.
func (r *Redis) URL() string { return "redis://" + r.Addr + "/0" }

// Start (re)starts the server on its port.
func (r *Redis) Start() {
	r.t.Helper()
	r.Addr = "127.0.0.1:" + strconv.Itoa(r.port)
	var args []string
	if r.conf != "" {
		args = append(args, r.conf)
	}
	args = append(args, "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--dir", r.dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
		"--enable-debug-command", "local") // DEBUG SLEEP: a slow Redis
	r.cmd = exec.Command("redis-server", append(args, r.extra...)...)
	if err := r.cmd.Start(); err != nil {
		r.t.Fatalf("redis-server: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if r.Ping() == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.t.Fatalf("redis-server did not answer on %s", r.Addr)
}

// Stop kills the server (as a crash would) and waits for it.
func (r *Redis) Stop() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
	r.cmd = nil
}

// Ping sends PING over a fresh connection.
func (r *Redis) Ping() error {
	_, err := r.Do("PING")
	return err
}

// Do sends one inline command and returns the first reply line.
func (r *Redis) Do(args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", r.Addr, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	cmd := fmt.Sprintf("*%d\r\n", len(args))
	for _, a := range args {
		cmd += fmt.Sprintf("$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(cmd)); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	if len(line) > 0 && line[0] == '-' {
		return "", fmt.Errorf("redis: %s", line[1:])
	}
	return line, nil
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
