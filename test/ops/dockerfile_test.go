package ops

import (
	"bufio"
	"debug/elf"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// dockerfile is what the test reads of ../../Dockerfile.
type dockerfile struct {
	args        map[string]string // ARG defaults
	buildRun    string            // the RUN line that runs go build
	artifact    string            // COPY --from=<build> SRC DST: SRC
	installed   string            // ... DST
	finalEnv    []string          // ENV of the final stage
	user        string            // USER of the final stage
	entrypoint  []string          // exec form
	healthcheck []string          // HEALTHCHECK CMD, exec form
}

// parseDockerfile reads instructions (with line continuations); the final
// stage is what follows the last FROM.
func parseDockerfile(t *testing.T, path string) dockerfile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []string
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(l, "#") || (l == "" && cur.Len() == 0) {
			continue
		}
		if strings.HasSuffix(l, "\\") {
			cur.WriteString(strings.TrimSuffix(l, "\\") + " ")
			continue
		}
		cur.WriteString(l)
		lines = append(lines, cur.String())
		cur.Reset()
	}
	d := dockerfile{args: map[string]string{}}
	final := false
	execForm := func(s string) []string {
		var v []string
		if err := json.Unmarshal([]byte(s), &v); err != nil {
			t.Fatalf("Dockerfile: %q is not exec form (distroless has no shell): %v", s, err)
		}
		return v
	}
	for i, l := range lines {
		instr, rest, _ := strings.Cut(l, " ")
		rest = strings.TrimSpace(rest)
		switch strings.ToUpper(instr) {
		case "FROM":
			final = noLater(lines[i+1:], "FROM")
		case "ARG":
			k, v, _ := strings.Cut(rest, "=")
			d.args[k] = v
		case "RUN":
			if strings.Contains(rest, "go build") {
				d.buildRun = rest
			}
		case "COPY":
			// The final stage's first COPY --from is the binary (later
			// ones bring data directories, e.g. /data for bolt).
			if final && strings.HasPrefix(rest, "--from=") && d.artifact == "" {
				var f []string
				for _, w := range strings.Fields(rest) {
					if !strings.HasPrefix(w, "--") {
						f = append(f, w)
					}
				}
				d.artifact, d.installed = f[0], f[1]
			}
		case "ENV":
			if final {
				d.finalEnv = append(d.finalEnv, strings.Fields(rest)...)
			}
		case "USER":
			if final {
				d.user = rest
			}
		case "ENTRYPOINT":
			d.entrypoint = execForm(rest)
		case "HEALTHCHECK":
			_, cmd, ok := strings.Cut(rest, "CMD ")
			if !ok {
				t.Fatalf("Dockerfile: HEALTHCHECK without CMD: %q", rest)
			}
			d.healthcheck = execForm(strings.TrimSpace(cmd))
		}
	}
	return d
}

// noLater reports whether no later line starts with instr.
func noLater(lines []string, instr string) bool {
	for _, l := range lines {
		if strings.HasPrefix(strings.ToUpper(l), instr+" ") {
			return false
		}
	}
	return true
}

// dockerBuilt is the binary built once per test run with the Dockerfile's
// own build command (the Prometheus test runs the same binary).
var dockerBuilt struct {
	once    sync.Once
	bin     string
	cmdline string
	err     error
	out     []byte
}

// dockerBuild builds cmd/compactproxy with the Dockerfile's RUN go build
// line, the ARG defaults substituted and its output directory mapped into
// a temp dir (removed by TestMain).
func dockerBuild(t *testing.T) (bin, cmdline string) {
	t.Helper()
	root := repoRoot(t)
	d := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	b := &dockerBuilt
	b.once.Do(func() {
		out, err := os.MkdirTemp("", "compactproxy-ops-")
		if err != nil {
			b.err = err
			return
		}
		buildDir = out
		cmdline := d.buildRun
		for k, v := range d.args {
			cmdline = strings.ReplaceAll(cmdline, "${"+k+"}", v)
			cmdline = strings.ReplaceAll(cmdline, "$"+k, v)
		}
		cmdline = strings.ReplaceAll(cmdline, filepath.Dir(d.artifact)+"/", out+"/")
		b.cmdline = cmdline
		b.bin = filepath.Join(out, filepath.Base(d.artifact))
		cmd := exec.Command("sh", "-c", cmdline)
		cmd.Dir = root
		b.out, b.err = cmd.CombinedOutput()
	})
	if b.err != nil {
		t.Fatalf("the Dockerfile's build %q: %v\n%s", b.cmdline, b.err, b.out)
	}
	return b.bin, b.cmdline
}

// buildDir holds the binary dockerBuild made; TestMain removes it.
var buildDir string

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// TestDockerfileBuildAndHealthcheck builds the binary with the Dockerfile's
// own build command and runs it as its ENTRYPOINT and HEALTHCHECK would,
// without a Docker engine: a change to the image's build, entrypoint or
// healthcheck that breaks them fails here.
func TestDockerfileBuildAndHealthcheck(t *testing.T) {
	root := repoRoot(t)
	d := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	if d.buildRun == "" || d.artifact == "" || len(d.entrypoint) == 0 || len(d.healthcheck) == 0 {
		t.Fatalf("Dockerfile: build %q, artifact %q, entrypoint %v, healthcheck %v: something is missing", d.buildRun, d.artifact, d.entrypoint, d.healthcheck)
	}
	if d.user == "" || strings.HasPrefix(d.user, "root") || strings.HasPrefix(d.user, "0") {
		t.Errorf("Dockerfile: final stage USER %q, want non-root", d.user)
	}
	if d.entrypoint[0] != d.installed || d.healthcheck[0] != d.installed {
		t.Errorf("ENTRYPOINT %v and HEALTHCHECK %v must run the installed binary %s", d.entrypoint, d.healthcheck, d.installed)
	}

	bin, cmdline := dockerBuild(t)
	t.Logf("built with the Dockerfile's command: %s", cmdline)
	out := filepath.Dir(bin)

	// Static: distroless/static has no libc, so no interpreter.
	ef, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary is dynamically linked (PT_INTERP); the distroless/static image cannot run it")
		}
	}
	ef.Close()

	if v, err := run(t, out, bin, "version"); err != nil || !strings.Contains(v, d.args["VERSION"]) {
		t.Errorf("version: %q, %v; want the VERSION build arg %q", v, err, d.args["VERSION"])
	}

	// Run it as the image does: the ENTRYPOINT's argv, the final stage's
	// ENV, an empty working directory (no config file in the image), only
	// COMPACTPROXY_UPSTREAM_URL added (the documented minimum) and the
	// listen port moved to a free one.
	addr := freeAddr(t)
	_, port, _ := strings.Cut(addr, ":")
	var env []string
	for _, kv := range d.finalEnv {
		if k, v, _ := strings.Cut(kv, "="); k == "COMPACTPROXY_LISTEN" {
			host, _, _ := strings.Cut(v, ":")
			kv = k + "=" + host + ":" + port
		}
		env = append(env, kv)
	}
	env = append(env, "COMPACTPROXY_UPSTREAM_URL=http://127.0.0.1:9/v1")
	wd := t.TempDir()
	healthcheck := func() error {
		c := exec.Command(bin, d.healthcheck[1:]...)
		c.Dir = wd
		c.Env = env
		b, err := c.CombinedOutput()
		if err != nil {
			t.Logf("healthcheck: %s", strings.TrimSpace(string(b)))
		}
		return err
	}
	if err := healthcheck(); err == nil {
		t.Fatal("healthcheck succeeded with nothing listening: it cannot tell a dead container")
	}
	p := start(t, "compactproxy (entrypoint)", wd, env, bin, d.entrypoint[1:]...)
	p.WaitHTTP(t, "http://"+addr+"/healthz", 15e9)
	if err := healthcheck(); err != nil {
		t.Fatalf("HEALTHCHECK %v against the running ENTRYPOINT: %v\n%s", d.healthcheck, err, p.Tail(4000))
	}
}
