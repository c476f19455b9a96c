package ops

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/store/storetest"
	"go.yaml.in/yaml/v3"
)

// The deploy files are started here exactly as their documentation says to
// start them, without a container engine: the variables of the documented
// command are interpolated into the compose file, the Secrets of the
// documented `kubectl create secret` commands are made, and the real binary
// (built by the Dockerfile's own command) runs with the environment its
// container would get: the image's ENV, then the compose `environment` or
// the manifests' envFrom and env. Only addresses are moved: the listen port
// to a free loopback one, and the names of the other containers (redis,
// llama, the hosted API) to a real redis-server and a mock upstream.

// llamaMock plays the upstream (llama-server, or a hosted API): it answers
// chat completions, llama.cpp's /health and /v1/models, and, like
// llama-server started with --api-key, refuses any other key than key.
type llamaMock struct {
	key  string
	mu   sync.Mutex
	auth []string // Authorization of each chat request
}

func (m *llamaMock) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	if m.key != "" && r.URL.Path != "/health" && r.Header.Get("Authorization") != "Bearer "+m.key {
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}`)
		return
	}
	switch r.URL.Path {
	case "/health":
		io.WriteString(w, `{"status":"ok"}`)
	case "/v1/models":
		io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	case "/v1/chat/completions":
		m.mu.Lock()
		m.auth = append(m.auth, r.Header.Get("Authorization"))
		m.mu.Unlock()
		io.WriteString(w, `{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}`)
	default:
		http.NotFound(w, r)
	}
}

func (m *llamaMock) lastAuth() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.auth) == 0 {
		return ""
	}
	return m.auth[len(m.auth)-1]
}

// imageEnv is the environment the image gives its container: the final
// stage's ENV.
func imageEnv(t *testing.T, root string) map[string]string {
	t.Helper()
	d := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	env := map[string]string{}
	for _, kv := range d.finalEnv {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	return env
}

// allInterfaces reports whether a listen address serves beyond the
// container's loopback (a container listening on 127.0.0.1 is unreachable
// through its published port or Service).
func allInterfaces(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	return err == nil && (host == "" || host == "0.0.0.0" || host == "::")
}

// runContainer starts the Dockerfile's binary as the image would with env,
// after checking the container listens on all interfaces on wantPort and
// moving it to a free loopback port. It returns the proxy's base URL.
func runContainer(t *testing.T, name string, env map[string]string, wantPort string) string {
	t.Helper()
	root := repoRoot(t)
	d := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	listen := env["COMPACTPROXY_LISTEN"]
	if !allInterfaces(listen) {
		t.Fatalf("%s: COMPACTPROXY_LISTEN %q: a container must listen on all interfaces (:%s), or nothing outside it reaches the proxy", name, listen, wantPort)
	}
	if _, port, _ := net.SplitHostPort(listen); port != wantPort {
		t.Fatalf("%s: listens on port %s, but its port/Service/load balancer sends to %s", name, port, wantPort)
	}
	bin, _ := dockerBuild(t)
	addr := freeAddr(t)
	var kv []string
	for k, v := range env {
		if k == "COMPACTPROXY_LISTEN" {
			v = addr
		}
		kv = append(kv, k+"="+v)
	}
	sort.Strings(kv)
	p := start(t, name, t.TempDir(), kv, bin, d.entrypoint[1:]...)
	base := "http://" + addr
	p.WaitHTTP(t, base+"/healthz", 20*time.Second)
	return base
}

// chat sends one chat completion with the client's key and returns the
// status and body.
func chat(t *testing.T, base, key string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"Say hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("chat: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// serves checks a started container: /healthz and /readyz 200, a chat
// request with clientKey through to the mock, which sees upstreamAuth.
func serves(t *testing.T, name, base string, up *llamaMock, clientKey, upstreamAuth string) {
	t.Helper()
	for _, path := range []string{"/healthz", "/readyz"} {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatalf("%s %s: %v", name, path, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("%s %s: %d, want 200", name, path, resp.StatusCode)
		}
	}
	code, body := chat(t, base, clientKey)
	if code != http.StatusOK {
		t.Fatalf("%s: chat with the client key %q: %d %s", name, clientKey, code, body)
	}
	if got := up.lastAuth(); got != upstreamAuth {
		t.Errorf("%s: the upstream saw Authorization %q, want %q", name, got, upstreamAuth)
	}
}

// shellCommand returns the documented command whose text contains marker
// in text (a README code block or a comment block, "# " prefixes removed),
// its continuation lines joined, as shell words.
func shellCommand(t *testing.T, text, marker string) []string {
	t.Helper()
	lines := strings.Split(text, "\n")
	for i := range lines {
		l := strings.TrimSpace(lines[i])
		l = strings.TrimSpace(strings.TrimPrefix(l, "#"))
		lines[i] = l
	}
	at := -1
	for i, l := range lines {
		if strings.Contains(l, marker) {
			at = i
			break
		}
	}
	if at < 0 {
		t.Fatalf("no documented command with %q", marker)
	}
	first := at
	for first > 0 && strings.HasSuffix(lines[first-1], `\`) {
		first--
	}
	last := at
	for last < len(lines)-1 && strings.HasSuffix(lines[last], `\`) {
		last++
	}
	var b strings.Builder
	for _, l := range lines[first : last+1] {
		b.WriteString(strings.TrimSuffix(l, `\`) + " ")
	}
	return shellWords(b.String())
}

// shellWords splits a command line into words (quotes and $(...) kept as
// one word; a word's quotes removed).
func shellWords(s string) []string {
	var words []string
	var cur strings.Builder
	in := false
	depth := 0
	var quote rune
	for i, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
				continue
			}
		case r == '\'' || r == '"':
			quote = r
			in = true
			continue
		case r == '(' && i > 0 && s[i-1] == '$':
			depth++
		case r == ')' && depth > 0:
			depth--
		case (r == ' ' || r == '\t') && depth == 0:
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
			continue
		}
		cur.WriteRune(r)
		in = true
	}
	if in {
		words = append(words, cur.String())
	}
	return words
}

var shellVarRE = regexp.MustCompile(`\$\(([^)]*)\)|\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?`)

// shellValue is what a documented value stands for: $(...) is generated
// (a tenant secret), $VAR is the user's own value of VAR.
func shellValue(s string) string {
	return shellVarRE.ReplaceAllStringFunc(s, func(m string) string {
		sm := shellVarRE.FindStringSubmatch(m)
		if sm[1] != "" {
			return "generated-0123456789abcdef"
		}
		return "value-of-" + sm[2]
	})
}

// commandEnv is the leading NAME=value assignments of a documented command.
func commandEnv(words []string) (map[string]string, []string) {
	env := map[string]string{}
	assign := regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)
	i := 0
	for ; i < len(words) && assign.MatchString(words[i]); i++ {
		k, v, _ := strings.Cut(words[i], "=")
		env[k] = shellValue(v)
	}
	return env, words[i:]
}

var composeVarRE = regexp.MustCompile(`\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)`)

// interpolate does Compose's variable interpolation with vars as the shell
// environment: ${V}, $V, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}.
func interpolate(s string, vars map[string]string) (string, error) {
	var err error
	out := composeVarRE.ReplaceAllStringFunc(s, func(m string) string {
		if m == "$$" {
			return "$"
		}
		sm := composeVarRE.FindStringSubmatch(m)
		name, op, arg := sm[1], sm[2], sm[3]
		if name == "" {
			name = sm[4]
		}
		v, set := vars[name]
		switch op {
		case ":-":
			if v == "" {
				return arg
			}
		case "-":
			if !set {
				return arg
			}
		case ":?":
			if v == "" && err == nil {
				err = fmt.Errorf("required variable %s is missing a value: %s", name, arg)
			}
		case "?":
			if !set && err == nil {
				err = fmt.Errorf("required variable %s is missing: %s", name, arg)
			}
		}
		return v
	})
	return out, err
}

// composeFile is what the test reads of a compose file.
type composeFile struct {
	Services map[string]struct {
		Build       any               `yaml:"build"`
		Image       string            `yaml:"image"`
		Environment map[string]string `yaml:"environment"`
		Command     []string          `yaml:"command"`
	} `yaml:"services"`
}

// composeProxies returns, per compactproxy service of the compose file (the
// ones built from the repository's Dockerfile), the environment its
// container gets: the image's ENV, then the service's interpolated
// environment.
func composeProxies(t *testing.T, root, file string, vars map[string]string) map[string]map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "deploy", file))
	if err != nil {
		t.Fatal(err)
	}
	var cf composeFile
	if err := yaml.Unmarshal(b, &cf); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	out := map[string]map[string]string{}
	for name, svc := range cf.Services {
		if svc.Build == nil {
			continue
		}
		if len(svc.Command) > 0 {
			t.Errorf("%s: service %s overrides the command; this test runs the image's ENTRYPOINT only", file, name)
		}
		env := imageEnv(t, root)
		for k, v := range svc.Environment {
			iv, err := interpolate(v, vars)
			if err != nil {
				t.Fatalf("%s: service %s, %s: %v (docker compose refuses to start)", file, name, k, err)
			}
			env[k] = iv
		}
		out[name] = env
	}
	if len(out) == 0 {
		t.Fatalf("%s: no service built from the Dockerfile", file)
	}
	return out
}

// moveHosts points the addresses of other containers at where this test
// runs them.
func moveHosts(env map[string]string, hosts map[string]string) {
	for k, v := range env {
		for from, to := range hosts {
			v = strings.ReplaceAll(v, "//"+from, "//"+to)
		}
		env[k] = v
	}
}

// TestComposeReplicasStartAsDocumented runs docker-compose.replicas.yaml's
// two replicas with the variables of the command its header and
// docs/operating.md give, a real Redis for the redis service and a mock for
// UPSTREAM_URL: each serves, and the nginx in front sends to the port they
// listen on.
func TestComposeReplicasStartAsDocumented(t *testing.T) {
	root := repoRoot(t)
	const file = "docker-compose.replicas.yaml"
	header, err := os.ReadFile(filepath.Join(root, "deploy", file))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "operating.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, replicas, _ := strings.Cut(string(doc), "\n### Replicas\n")
	replicas, _, _ = strings.Cut(replicas, "\n## ")
	nginx, err := os.ReadFile(filepath.Join(root, "deploy", "nginx.replicas.conf"))
	if err != nil {
		t.Fatal(err)
	}
	rd := storetest.StartRedis(t)
	for source, text := range map[string]string{"the compose file's header": string(header), "docs/operating.md": replicas} {
		t.Run(source, func(t *testing.T) {
			vars, rest := commandEnv(shellCommand(t, text, "docker compose -f deploy/"+file))
			if strings.Join(rest[:min(4, len(rest))], " ") != "docker compose -f deploy/"+file {
				t.Fatalf("documented command %q", rest)
			}
			if vars["UPSTREAM_URL"] == "" {
				t.Fatalf("the documented command sets no UPSTREAM_URL: %v", vars)
			}
			t.Logf("documented variables: %v", vars)
			// The user's upstream: a hosted API, here the mock. A key the
			// proxy holds must be the one the upstream gets.
			up := &llamaMock{key: vars["OPENAI_API_KEY"]}
			srv := httptest.NewServer(up)
			defer srv.Close()
			vars["UPSTREAM_URL"] = srv.URL + "/v1"

			proxies := composeProxies(t, root, file, vars)
			if len(proxies) < 2 {
				t.Fatalf("%d replicas", len(proxies))
			}
			names := make([]string, 0, len(proxies))
			for name := range proxies {
				names = append(names, name)
			}
			sort.Strings(names)
			for _, name := range names {
				env := proxies[name]
				port := nginxPort(t, string(nginx), name)
				moveHosts(env, map[string]string{"redis:6379": rd.Addr})
				base := runContainer(t, name, env, port)
				clientKey, upstreamAuth := "", ""
				if vars["OPENAI_API_KEY"] != "" {
					keys := strings.Split(env["COMPACTPROXY_AUTH_CLIENT_KEYS"], ",")
					clientKey, upstreamAuth = strings.TrimSpace(keys[0]), "Bearer "+vars["OPENAI_API_KEY"]
					if code, _ := chat(t, base, "not-a-client-key"); code != http.StatusUnauthorized {
						t.Errorf("%s: a client without a listed key got %d, want 401 (an open relay for the upstream key)", name, code)
					}
				}
				serves(t, name, base, up, clientKey, upstreamAuth)
			}
		})
	}
}

// nginxPort is the port nginx.replicas.conf sends to for service name.
func nginxPort(t *testing.T, conf, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\s*server\s+` + regexp.QuoteMeta(name) + `:(\d+)`).FindStringSubmatch(conf)
	if m == nil {
		t.Fatalf("nginx.replicas.conf does not send to %s", name)
	}
	return m[1]
}

// TestComposeSidecarStarts runs docker-compose.yaml's compactproxy with
// the mock in llama-server's place.
func TestComposeSidecarStarts(t *testing.T) {
	root := repoRoot(t)
	header, err := os.ReadFile(filepath.Join(root, "deploy", "docker-compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	vars, _ := commandEnv(shellCommand(t, string(header), "docker compose -f deploy/docker-compose.yaml"))
	up := &llamaMock{}
	srv := httptest.NewServer(up)
	defer srv.Close()
	for name, env := range composeProxies(t, root, "docker-compose.yaml", vars) {
		moveHosts(env, map[string]string{"llama:8080": strings.TrimPrefix(srv.URL, "http://")})
		base := runContainer(t, name, env, "8081")
		serves(t, name, base, up, "sk-the-clients-own", "Bearer sk-the-clients-own")
	}
}

// secretCommands makes the Secrets the `kubectl create secret generic`
// commands in text create: name → key → value.
func secretCommands(t *testing.T, text string) map[string]map[string]string {
	t.Helper()
	secrets := map[string]map[string]string{}
	rest := text
	for {
		i := strings.Index(rest, "kubectl create secret generic")
		if i < 0 {
			return secrets
		}
		words := shellCommand(t, rest[i:], "kubectl create secret generic")
		rest = rest[i+len("kubectl create secret generic"):]
		if len(words) < 5 {
			t.Fatalf("kubectl create secret generic without a name: %q", words)
		}
		data := map[string]string{}
		for _, w := range words[4:] {
			lit, ok := strings.CutPrefix(w, "--from-literal=")
			if !ok {
				continue
			}
			k, v, _ := strings.Cut(lit, "=")
			data[k] = shellValue(v)
		}
		secrets[words[4]] = data
	}
}

// podEnv is the environment of a rendered container: the image's ENV, the
// ConfigMaps of envFrom, then env (values and secretKeyRefs). A reference
// to a missing Secret that is not optional keeps the pod from starting.
func podEnv(t *testing.T, root string, objs []obj, ctr map[string]any, secrets map[string]map[string]string) map[string]string {
	t.Helper()
	env := imageEnv(t, root)
	for _, ef := range list(ctr, "envFrom") {
		cm := find(objs, "ConfigMap", str(ef, "configMapRef", "name"))
		if cm == nil {
			t.Fatalf("envFrom names a ConfigMap the kustomization does not make")
		}
		for k, v := range cm["data"].(map[string]any) {
			env[k] = v.(string)
		}
	}
	for _, e := range list(ctr, "env") {
		name := str(e, "name")
		ref := get(e, "valueFrom", "secretKeyRef")
		if ref == nil {
			env[name] = str(e, "value")
			continue
		}
		v, ok := secrets[str(ref, "name")][str(ref, "key")]
		if !ok {
			if get(ref, "optional") == true {
				continue
			}
			t.Fatalf("env %s: Secret %s key %s does not exist (CreateContainerConfigError: the pod never starts)", name, str(ref, "name"), str(ref, "key"))
		}
		env[name] = v
	}
	return env
}

// TestKubernetesStartsAsDocumented renders each overlay, creates the
// Secrets its kustomization.yaml says to create (the sidecar's both without
// and with the optional one), and runs the compactproxy container with the
// environment the pod gives it: it serves, and holds the upstream key when
// a Secret gives one.
func TestKubernetesStartsAsDocumented(t *testing.T) {
	root := repoRoot(t)
	rd := storetest.StartRedis(t)
	for _, variant := range []string{"sidecar", "hosted"} {
		dir := filepath.Join(root, "deploy", "k8s", variant)
		kust, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		documented := secretCommands(t, string(kust))
		cases := map[string]map[string]map[string]string{"with the documented Secrets": documented}
		if variant == "sidecar" {
			// A local llama-server without --api-key needs no Secret.
			cases["without a Secret"] = nil
		}
		for name, secrets := range cases {
			t.Run(variant+"/"+name, func(t *testing.T) {
				if name != "without a Secret" && len(secrets) == 0 {
					t.Fatalf("%s/kustomization.yaml documents no kubectl create secret", variant)
				}
				t.Logf("Secrets: %v", secrets)
				objs := render(t, dir)
				dep := find(objs, "Deployment", "compactproxy")
				ctr := container(get(dep, "spec", "template", "spec"), "compactproxy")
				env := podEnv(t, root, objs, ctr, secrets)
				upKey := env["COMPACTPROXY_UPSTREAM_API_KEY"]
				up := &llamaMock{key: upKey}
				srv := httptest.NewServer(up)
				defer srv.Close()
				mock := strings.TrimPrefix(srv.URL, "http://")
				// llama-server beside it in the pod, the hosted API, the
				// Redis Service: where this test runs them.
				moveHosts(env, map[string]string{"127.0.0.1:8080": mock, "api.openai.com": mock, "compactproxy-redis:6379": rd.Addr})
				env["COMPACTPROXY_UPSTREAM_URL"] = strings.Replace(env["COMPACTPROXY_UPSTREAM_URL"], "https://", "http://", 1)
				var port string
				for _, p := range list(ctr, "ports") {
					port = itoa(get(p, "containerPort").(int))
				}
				base := runContainer(t, "compactproxy ("+variant+")", env, port)
				clientKey, upstreamAuth := "sk-the-clients-own", "Bearer sk-the-clients-own"
				if upKey != "" {
					keys := strings.Split(env["COMPACTPROXY_AUTH_CLIENT_KEYS"], ",")
					clientKey, upstreamAuth = strings.TrimSpace(keys[0]), "Bearer "+upKey
				}
				serves(t, variant, base, up, clientKey, upstreamAuth)
			})
		}
	}
}

// TestDeployFilesListenOnAllInterfaces: the binary listens on loopback by
// default, so every container configuration says :8081 itself (the image's
// ENV, each compose service, the manifests' ConfigMap), not by relying on
// another file.
func TestDeployFilesListenOnAllInterfaces(t *testing.T) {
	root := repoRoot(t)
	if l := imageEnv(t, root)["COMPACTPROXY_LISTEN"]; !allInterfaces(l) {
		t.Errorf("Dockerfile: ENV COMPACTPROXY_LISTEN %q, want :8081", l)
	}
	for _, file := range []string{"docker-compose.yaml", "docker-compose.replicas.yaml"} {
		b, err := os.ReadFile(filepath.Join(root, "deploy", file))
		if err != nil {
			t.Fatal(err)
		}
		var cf composeFile
		if err := yaml.Unmarshal(b, &cf); err != nil {
			t.Fatal(err)
		}
		for name, svc := range cf.Services {
			if svc.Build == nil {
				continue
			}
			if l := svc.Environment["COMPACTPROXY_LISTEN"]; !allInterfaces(l) {
				t.Errorf("%s: service %s sets COMPACTPROXY_LISTEN %q, want \":8081\" (the default is loopback only)", file, name, l)
			}
		}
	}
	for _, variant := range []string{"sidecar", "hosted"} {
		objs := render(t, filepath.Join(root, "deploy", "k8s", variant))
		ctr := container(get(find(objs, "Deployment", "compactproxy"), "spec", "template", "spec"), "compactproxy")
		manifests := map[string]string{}
		for _, ef := range list(ctr, "envFrom") {
			for k, v := range find(objs, "ConfigMap", str(ef, "configMapRef", "name"))["data"].(map[string]any) {
				manifests[k] = v.(string)
			}
		}
		for _, e := range list(ctr, "env") {
			manifests[str(e, "name")] = str(e, "value")
		}
		if l := manifests["COMPACTPROXY_LISTEN"]; !allInterfaces(l) {
			t.Errorf("k8s %s: COMPACTPROXY_LISTEN %q in the manifests, want \":8081\"", variant, l)
		}
	}
}
