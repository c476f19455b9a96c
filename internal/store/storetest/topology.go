package storetest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Reply sends one command and returns its whole reply, flattened: a
// bulk string is one element, an array its elements in order (nested
// arrays flattened), a nil "".
func (r *Redis) Reply(args ...string) ([]string, error) {
	c, err := net.DialTimeout("tcp", r.Addr, time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return nil, err
	}
	var out []string
	err = readReply(bufio.NewReader(c), &out)
	return out, err
}

func readReply(br *bufio.Reader, out *[]string) error {
	line, err := br.ReadString('\n')
	if err != nil {
		return err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return fmt.Errorf("redis: empty reply line")
	}
	switch line[0] {
	case '-':
		return fmt.Errorf("redis: %s", line[1:])
	case '+', ':':
		*out = append(*out, line[1:])
	case '$':
		n, _ := strconv.Atoi(line[1:])
		if n < 0 {
			*out = append(*out, "")
			return nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(br, buf); err != nil {
			return err
		}
		*out = append(*out, string(buf[:n]))
	case '*':
		n, _ := strconv.Atoi(line[1:])
		for range max(n, 0) {
			if err := readReply(br, out); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("redis: unexpected reply %q", line)
	}
	return nil
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("storetest: %s: not within %v", what, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Cluster is a running Redis Cluster of masters only, every one on a
// free loopback port, stopped when the test ends.
type Cluster struct {
	Nodes []*Redis
}

// StartCluster starts masters cluster-enabled redis-servers and joins
// them (redis-cli --cluster create), waiting until every node reports
// cluster_state:ok and knows every slot's owner.
func StartCluster(t testing.TB, masters int) *Cluster {
	t.Helper()
	needRedis(t)
	if _, err := exec.LookPath("redis-cli"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-cli is not on PATH (scripts/redis-deps.sh installs it; CI must not skip)")
		}
		t.Skip("redis-cli is not on PATH: run scripts/redis-deps.sh (make test does) to run the cluster tests")
	}
	dir := t.TempDir()
	c := &Cluster{}
	addrs := []string{}
	for i := range masters {
		n := startRedis(t, "", "--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(dir, "nodes-"+strconv.Itoa(i)+".conf"),
			"--cluster-node-timeout", "3000")
		c.Nodes = append(c.Nodes, n)
		addrs = append(addrs, n.Addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	waitFor(t, "cluster_state:ok on every node", 30*time.Second, func() bool {
		for _, n := range c.Nodes {
			info, err := n.Reply("CLUSTER", "INFO")
			if err != nil || len(info) == 0 || !strings.Contains(info[0], "cluster_state:ok") ||
				!strings.Contains(info[0], "cluster_known_nodes:"+strconv.Itoa(masters)) {
				return false
			}
		}
		return true
	})
	return c
}

// URL is the cluster's redis+cluster:// URL, every node a seed.
func (c *Cluster) URL() string {
	var a []string
	for _, n := range c.Nodes {
		a = append(a, n.Addr)
	}
	return "redis+cluster://" + strings.Join(a, ",")
}

// Sentinel is a master, its replica and sentinels monitoring them under
// the name MasterName, all on free loopback ports, stopped when the test
// ends.
type Sentinel struct {
	MasterName string
	Master     *Redis // the master at start
	Replica    *Redis // its replica at start
	Sentinels  []*Redis
}

// StartSentinel starts a master, a replica of it and n sentinels (quorum
// 1, a master down after 1 s), and waits until every sentinel knows the
// replica and the other sentinels.
func StartSentinel(t testing.TB, n int) *Sentinel {
	t.Helper()
	needRedis(t)
	s := &Sentinel{MasterName: "mymaster"}
	s.Master = startRedis(t, "")
	s.Replica = startRedis(t, "", "--replicaof", "127.0.0.1", strconv.Itoa(s.Master.port))
	waitFor(t, "the replica in sync", 20*time.Second, func() bool {
		info, err := s.Replica.Reply("INFO", "replication")
		return err == nil && len(info) > 0 && strings.Contains(info[0], "master_link_status:up")
	})
	dir := t.TempDir()
	for i := range n {
		conf := filepath.Join(dir, "sentinel-"+strconv.Itoa(i)+".conf")
		body := fmt.Sprintf("sentinel monitor %[1]s 127.0.0.1 %[2]d 1\n"+
			"sentinel down-after-milliseconds %[1]s 1000\n"+
			"sentinel failover-timeout %[1]s 4000\n"+
			"sentinel parallel-syncs %[1]s 1\n", s.MasterName, s.Master.port)
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		s.Sentinels = append(s.Sentinels, startRedis(t, conf, "--sentinel"))
	}
	waitFor(t, "the sentinels know the replica and each other", 30*time.Second, func() bool {
		for _, sn := range s.Sentinels {
			reps, err := sn.Reply("SENTINEL", "REPLICAS", s.MasterName)
			if err != nil || !contains(reps, strconv.Itoa(s.Replica.port)) {
				return false
			}
			if n > 1 {
				others, err := sn.Reply("SENTINEL", "SENTINELS", s.MasterName)
				if err != nil || strings.Count(strings.Join(others, "\n"), "\nport\n") < n-1 {
					return false
				}
			}
		}
		return true
	})
	return s
}

func contains(ss []string, v string) bool {
	for _, s := range ss {
		if s == v {
			return true
		}
	}
	return false
}

// URL is the redis+sentinel:// URL naming every sentinel.
func (s *Sentinel) URL() string {
	var a []string
	for _, sn := range s.Sentinels {
		a = append(a, sn.Addr)
	}
	return "redis+sentinel://" + strings.Join(a, ",") + "/" + s.MasterName + "/0"
}

// MasterAddr is the master's address as the first sentinel answers it.
func (s *Sentinel) MasterAddr() (string, error) {
	r, err := s.Sentinels[0].Reply("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.MasterName)
	if err != nil {
		return "", err
	}
	if len(r) != 2 {
		return "", fmt.Errorf("sentinel: master address %q", r)
	}
	return net.JoinHostPort(r[0], r[1]), nil
}

// KillMaster kills the master at start (as a crash would) and waits,
// generously, until every sentinel names the replica as the master and
// the replica accepts writes.
func (s *Sentinel) KillMaster(t testing.TB) {
	t.Helper()
	s.Master.Stop()
	s.waitPromoted(t)
}

// Failover forces a failover (SENTINEL FAILOVER: the old master stays up
// and becomes a replica) and waits, generously, until every sentinel
// names the replica as the master and it accepts writes.
func (s *Sentinel) Failover(t testing.TB) {
	t.Helper()
	if _, err := s.Sentinels[0].Reply("SENTINEL", "FAILOVER", s.MasterName); err != nil {
		t.Fatalf("SENTINEL FAILOVER: %v", err)
	}
	s.waitPromoted(t)
}

func (s *Sentinel) waitPromoted(t testing.TB) {
	t.Helper()
	waitFor(t, "the sentinels promote the replica", 45*time.Second, s.Promoted)
}

// Promoted tells whether every sentinel names the replica at start as the
// master and it accepts writes.
func (s *Sentinel) Promoted() bool {
	for _, sn := range s.Sentinels {
		r, err := sn.Reply("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.MasterName)
		if err != nil || len(r) != 2 || r[1] != strconv.Itoa(s.Replica.port) {
			return false
		}
	}
	role, err := s.Replica.Reply("ROLE")
	return err == nil && len(role) > 0 && role[0] == "master"
}
