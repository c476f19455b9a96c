package ops

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/config"
	"go.yaml.in/yaml/v3"
)

// pendingKeys are DESIGN.md config keys the manifests use before
// internal/config has them (the redis store is built by another issue).
// The test accepts them and says so; once config.Config has the key, the
// entry is reported as obsolete.
var pendingKeys = map[string]string{}

// configKeys returns every leaf key of config.Config by its mapstructure
// tags (the walk cmd/compactproxy's registerDefaults does, so a key added to
// the struct is known here too).
func configKeys() map[string]bool {
	keys := map[string]bool{}
	var walk func(prefix string, t reflect.Type)
	walk = func(prefix string, t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			tag, _, _ := strings.Cut(f.Tag.Get("mapstructure"), ",")
			key := tag
			if prefix != "" {
				key = prefix + "." + tag
			}
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[config.Secret]() {
				walk(key, f.Type)
				continue
			}
			keys[key] = true
		}
	}
	walk("", reflect.TypeFor[config.Config]())
	return keys
}

// envKey maps COMPACTPROXY_UPSTREAM_URL back to upstream.url, given the
// known keys (an underscore may be a dot or part of a key name).
func envKey(name string, keys map[string]bool) (string, bool) {
	for k := range keys {
		if "COMPACTPROXY_"+strings.ToUpper(strings.ReplaceAll(k, ".", "_")) == name {
			return k, true
		}
	}
	return "", false
}

// obj is one Kubernetes object, decoded loosely.
type obj map[string]any

func (o obj) kind() string { s, _ := o["kind"].(string); return s }
func (o obj) name() string { return str(o, "metadata", "name") }

// get walks maps and lists ("0" indexes a list).
func get(v any, path ...string) any {
	for _, p := range path {
		switch x := v.(type) {
		case map[string]any:
			v = x[p]
		case obj:
			v = x[p]
		default:
			return nil
		}
	}
	return v
}

func str(v any, path ...string) string { s, _ := get(v, path...).(string); return s }
func list(v any, path ...string) []any { l, _ := get(v, path...).([]any); return l }

// kustomization is the part of kustomization.yaml the manifests use.
type kustomization struct {
	Resources          []string `yaml:"resources"`
	ConfigMapGenerator []struct {
		Name     string   `yaml:"name"`
		Behavior string   `yaml:"behavior"`
		Literals []string `yaml:"literals"`
	} `yaml:"configMapGenerator"`
	Labels []struct {
		Pairs map[string]string `yaml:"pairs"`
	} `yaml:"labels"`
}

// render is a small kustomize for what these manifests use: resources
// (files and directories), configMapGenerator literals (create or merge),
// labels. kustomize itself is not packaged by Debian; a field the
// manifests start using that this does not know fails the test
// (KnownFields), so it cannot silently be ignored.
func render(t *testing.T, dir string) []obj {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	var full struct {
		APIVersion    string `yaml:"apiVersion"`
		Kind          string `yaml:"kind"`
		kustomization `yaml:",inline"`
	}
	if err := dec.Decode(&full); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", dir, err)
	}
	k = full.kustomization
	var out []obj
	for _, r := range k.Resources {
		p := filepath.Join(dir, r)
		if st, err := os.Stat(p); err != nil {
			t.Fatalf("%s: resource %s: %v", dir, r, err)
		} else if st.IsDir() {
			out = append(out, render(t, p)...)
			continue
		}
		out = append(out, readObjects(t, p)...)
	}
	for _, g := range k.ConfigMapGenerator {
		data := map[string]any{}
		for _, l := range g.Literals {
			kk, v, ok := strings.Cut(l, "=")
			if !ok {
				t.Fatalf("%s: configMapGenerator %s: literal %q is not KEY=VALUE", dir, g.Name, l)
			}
			data[kk] = v
		}
		i := slices.IndexFunc(out, func(o obj) bool { return o.kind() == "ConfigMap" && o.name() == g.Name })
		switch g.Behavior {
		case "", "create":
			if i >= 0 {
				t.Fatalf("%s: ConfigMap %s created twice", dir, g.Name)
			}
			out = append(out, obj{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": g.Name}, "data": data})
		case "merge":
			if i < 0 {
				t.Fatalf("%s: ConfigMap %s merged but not created by a base", dir, g.Name)
			}
			for kk, v := range data {
				out[i]["data"].(map[string]any)[kk] = v
			}
		default:
			t.Fatalf("%s: configMapGenerator behavior %q", dir, g.Behavior)
		}
	}
	for _, l := range k.Labels {
		for _, o := range out {
			md := o["metadata"].(map[string]any)
			labels, _ := md["labels"].(map[string]any)
			if labels == nil {
				labels = map[string]any{}
				md["labels"] = labels
			}
			for kk, v := range l.Pairs {
				labels[kk] = v
			}
		}
	}
	return out
}

func readObjects(t *testing.T, path string) []obj {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := yaml.NewDecoder(f)
	var out []obj
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if o == nil {
			continue
		}
		if o["kind"] == nil || get(o, "metadata", "name") == nil {
			t.Fatalf("%s: an object without kind or metadata.name", path)
		}
		out = append(out, obj(o))
	}
	return out
}

func find(objs []obj, kind, name string) obj {
	for _, o := range objs {
		if o.kind() == kind && (name == "" || o.name() == name) {
			return o
		}
	}
	return nil
}

func container(pod any, name string) map[string]any {
	for _, c := range list(pod, "containers") {
		if str(c, "name") == name {
			return c.(map[string]any)
		}
	}
	return nil
}

// secretEnv are the settings that must come from a Secret, never a literal.
var secretEnv = []string{"COMPACTPROXY_UPSTREAM_API_KEY", "COMPACTPROXY_AUTH_CLIENT_KEYS",
	"COMPACTPROXY_STORE_TENANT_SECRET", "COMPACTPROXY_COMPACTION_SUMMARIZER_API_KEY"}

func TestKubernetesManifests(t *testing.T) {
	root := repoRoot(t)
	keys := configKeys()
	for k, why := range pendingKeys {
		if keys[k] {
			t.Logf("pendingKeys: %s is now a config key; remove it from the list", k)
		} else {
			t.Logf("accepting %s before internal/config has it: %s", k, why)
			keys[k] = true
		}
	}
	for _, variant := range []string{"sidecar", "hosted"} {
		t.Run(variant, func(t *testing.T) {
			objs := render(t, filepath.Join(root, "deploy", "k8s", variant))
			dep := find(objs, "Deployment", "compactproxy")
			if dep == nil {
				t.Fatal("no Deployment compactproxy")
			}
			pod := get(dep, "spec", "template", "spec")
			podLabels, _ := get(dep, "spec", "template", "metadata", "labels").(map[string]any)
			proxy := container(pod, "compactproxy")
			if proxy == nil {
				t.Fatal("no container compactproxy")
			}

			// The image is built locally (make docker) and loaded into the
			// nodes, or pushed and renamed with kustomize images: either
			// way, never pulled when present.
			if p := str(proxy, "imagePullPolicy"); p != "IfNotPresent" {
				t.Errorf("compactproxy container: imagePullPolicy %q, want IfNotPresent (image %s)", p, str(proxy, "image"))
			}

			// The environment: ConfigMap keys (envFrom) and env entries.
			env := map[string]string{} // name -> literal value ("" for valueFrom)
			fromSecret := map[string]bool{}
			for _, ef := range list(proxy, "envFrom") {
				cmName := str(ef, "configMapRef", "name")
				cm := find(objs, "ConfigMap", cmName)
				if cm == nil {
					t.Fatalf("envFrom names ConfigMap %q, which the kustomization does not make", cmName)
				}
				for k, v := range cm["data"].(map[string]any) {
					env[k] = v.(string)
				}
			}
			for _, e := range list(proxy, "env") {
				name := str(e, "name")
				if ref := get(e, "valueFrom", "secretKeyRef"); ref != nil {
					fromSecret[name] = true
					if str(ref, "name") == "" || str(ref, "key") == "" {
						t.Errorf("env %s: secretKeyRef without name or key", name)
					}
				}
				env[name] = str(e, "value")
			}
			names := make([]string, 0, len(env))
			for n := range env {
				names = append(names, n)
			}
			sort.Strings(names)
			for _, n := range names {
				if !strings.HasPrefix(n, "COMPACTPROXY_") {
					t.Errorf("env %s: compactproxy reads only COMPACTPROXY_* variables", n)
					continue
				}
				if _, ok := envKey(n, keys); !ok {
					t.Errorf("env %s is not a config key (internal/config)", n)
				}
			}
			t.Logf("%s: %d settings: %s", variant, len(names), strings.Join(names, " "))
			for _, n := range secretEnv {
				if _, set := env[n]; set && !fromSecret[n] {
					t.Errorf("%s must come from a Secret (secretKeyRef), not a literal or ConfigMap", n)
				}
			}
			if !fromSecret["COMPACTPROXY_UPSTREAM_API_KEY"] {
				t.Error("the upstream key is not read from a Secret")
			}

			// Ports and probes: the contract's /healthz and /readyz on the
			// port compactproxy listens on, which the Service exposes.
			listen := env["COMPACTPROXY_LISTEN"]
			if listen == "" {
				listen = config.Default().Listen
			}
			_, listenPort, _ := strings.Cut(listen, ":")
			var port int
			var portName string
			for _, p := range list(proxy, "ports") {
				port, _ = get(p, "containerPort").(int)
				portName = str(p, "name")
			}
			if len(list(proxy, "ports")) != 1 || listenPort != itoa(port) || port != 8081 {
				t.Errorf("container ports %v, listen %q: want the one port 8081", list(proxy, "ports"), listen)
			}
			for probe, path := range map[string]string{"livenessProbe": "/healthz", "readinessProbe": "/readyz"} {
				if got := str(proxy, probe, "httpGet", "path"); got != path {
					t.Errorf("%s path %q, want %q", probe, got, path)
				}
				if pp := get(proxy, probe, "httpGet", "port"); pp != portName && pp != port {
					t.Errorf("%s port %v, want %s/%d", probe, pp, portName, port)
				}
			}
			svc := find(objs, "Service", "compactproxy")
			if svc == nil {
				t.Fatal("no Service compactproxy")
			}
			sp := list(svc, "spec", "ports")
			if len(sp) != 1 || get(sp[0], "port") != 8081 || (get(sp[0], "targetPort") != portName && get(sp[0], "targetPort") != port) {
				t.Errorf("Service ports %v: want only 8081 to the proxy's port", sp)
			}
			for k, v := range get(svc, "spec", "selector").(map[string]any) {
				if podLabels[k] != v {
					t.Errorf("Service selector %s=%v does not select the pod (labels %v)", k, v, podLabels)
				}
			}
			if grace, _ := get(pod, "terminationGracePeriodSeconds").(int); grace <= 30 {
				t.Errorf("terminationGracePeriodSeconds %d: must exceed shutdown_timeout (30s) so streams can finish", grace)
			}

			// Every container of every Deployment: non-root, read-only root
			// filesystem, no privilege escalation, resources set.
			for _, d := range objs {
				if d.kind() != "Deployment" {
					continue
				}
				ps := get(d, "spec", "template", "spec")
				for _, c := range list(ps, "containers") {
					id := d.name() + "/" + str(c, "name")
					nonRoot := get(c, "securityContext", "runAsNonRoot") == true || get(ps, "securityContext", "runAsNonRoot") == true
					uid := get(c, "securityContext", "runAsUser")
					if uid == nil {
						uid = get(ps, "securityContext", "runAsUser")
					}
					if !nonRoot || uid == 0 || uid == nil {
						t.Errorf("%s: not non-root (runAsNonRoot %v, runAsUser %v)", id, nonRoot, uid)
					}
					if get(c, "securityContext", "readOnlyRootFilesystem") != true {
						t.Errorf("%s: readOnlyRootFilesystem is not true", id)
					}
					if get(c, "securityContext", "allowPrivilegeEscalation") != false {
						t.Errorf("%s: allowPrivilegeEscalation is not false", id)
					}
					if get(c, "resources", "requests", "memory") == nil || get(c, "resources", "limits", "memory") == nil {
						t.Errorf("%s: memory request and limit must be set", id)
					}
					if get(c, "livenessProbe") == nil {
						t.Errorf("%s: no liveness probe", id)
					}
				}
			}

			llama := container(pod, "llama-server")
			replicas, _ := get(dep, "spec", "replicas").(int)
			switch variant {
			case "sidecar":
				if llama == nil {
					t.Fatal("sidecar: no llama-server container in the pod")
				}
				args := strings.Join(toStrings(list(llama, "args")), " ")
				if !strings.Contains(args, "--host 127.0.0.1") || !strings.Contains(args, "--port 8080") {
					t.Errorf("llama-server args %q: want --host 127.0.0.1 --port 8080 (reachable from the pod only)", args)
				}
				if env["COMPACTPROXY_UPSTREAM_URL"] != "http://127.0.0.1:8080/v1" {
					t.Errorf("upstream.url %q: want llama-server in the pod, http://127.0.0.1:8080/v1", env["COMPACTPROXY_UPSTREAM_URL"])
				}
			case "hosted":
				if llama != nil || len(list(pod, "containers")) != 1 {
					t.Error("hosted: the pod must run compactproxy alone")
				}
				if replicas < 2 {
					t.Errorf("hosted: replicas %d, want several", replicas)
				}
				if env["COMPACTPROXY_STORE_BACKEND"] != "redis" {
					t.Errorf("hosted: store.backend %q, want redis (replicas share state)", env["COMPACTPROXY_STORE_BACKEND"])
				}
				redisURL := env["COMPACTPROXY_STORE_REDIS_URL"]
				rsvc := find(objs, "Service", "compactproxy-redis")
				if rsvc == nil || !strings.HasPrefix(redisURL, "redis://compactproxy-redis:6379/") || get(list(rsvc, "spec", "ports")[0], "port") != 6379 {
					t.Errorf("hosted: store.redis.url %q does not name the Redis Service of the manifests", redisURL)
				}
				if !fromSecret["COMPACTPROXY_STORE_TENANT_SECRET"] {
					t.Error("hosted: store.tenant_secret must be set from a Secret (shared state needs one secret on every replica)")
				}
				if !fromSecret["COMPACTPROXY_AUTH_CLIENT_KEYS"] {
					t.Error("hosted: with upstream.api_key set, clients need auth.client_keys (from a Secret)")
				}
				if w := env["COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW"]; w == "" || w == "0" {
					t.Error("hosted: a hosted API reports no window; upstream.context_window must be set")
				}
			}
		})
	}
}

func itoa(n int) string {
	b, _ := yaml.Marshal(n)
	return strings.TrimSpace(string(b))
}

func toStrings(l []any) []string {
	out := make([]string, len(l))
	for i, v := range l {
		out[i], _ = v.(string)
	}
	return out
}
