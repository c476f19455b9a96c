package ops

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestComposeMonitoring checks deploy/docker-compose.yaml without Docker:
// compactproxy's environment names are config keys, Prometheus gets a config
// that promtool accepts, which scrapes the compactproxy service and loads the
// shipped rules, and Grafana gets the dashboard and a data source pointing
// at that Prometheus. Every published port is bound to loopback.
func TestComposeMonitoring(t *testing.T) {
	root := repoRoot(t)
	dir := filepath.Join(root, "deploy")
	b, err := os.ReadFile(filepath.Join(dir, "docker-compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Environment map[string]string `yaml:"environment"`
			Volumes     []string          `yaml:"volumes"`
			Ports       []string          `yaml:"ports"`
			Command     []string          `yaml:"command"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatalf("docker-compose.yaml: %v", err)
	}
	for _, s := range []string{"llama", "compactproxy", "prometheus", "grafana"} {
		if _, ok := compose.Services[s]; !ok {
			t.Fatalf("docker-compose.yaml: no service %s", s)
		}
	}
	keys := configKeys()
	for name := range compose.Services["compactproxy"].Environment {
		if _, ok := envKey(name, keys); !ok {
			t.Errorf("compactproxy environment %s is not a config key", name)
		}
	}
	for name, s := range compose.Services {
		for _, p := range s.Ports {
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("service %s publishes %q beyond loopback", name, p)
			}
		}
	}
	// mounts maps container paths to host paths (relative to deploy/).
	mounts := func(svc string) map[string]string {
		m := map[string]string{}
		for _, v := range compose.Services[svc].Volumes {
			parts := strings.Split(v, ":")
			if len(parts) >= 2 {
				m[parts[1]] = filepath.Join(dir, parts[0])
			}
		}
		return m
	}

	// Prometheus: --config.file inside a mounted directory.
	var cfgPath string
	for _, a := range compose.Services["prometheus"].Command {
		if v, ok := strings.CutPrefix(a, "--config.file="); ok {
			for ctr, host := range mounts("prometheus") {
				if rel, ok := strings.CutPrefix(v, ctr+"/"); ok {
					cfgPath = filepath.Join(host, rel)
				}
			}
		}
	}
	if cfgPath == "" {
		t.Fatal("prometheus: --config.file is not in a mounted directory")
	}
	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	pb, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(pb, &prom); err != nil {
		t.Fatal(err)
	}
	scrapes := false
	for _, sc := range prom.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			scrapes = scrapes || strings.Contains(strings.Join(st.Targets, " "), "compactproxy:8081")
		}
	}
	if !scrapes {
		t.Error("prometheus config does not scrape compactproxy:8081")
	}
	shipped := false
	for _, rf := range prom.RuleFiles {
		p := filepath.Join(filepath.Dir(cfgPath), rf)
		shipped = shipped || p == rulesPath(root)
	}
	if !shipped {
		t.Errorf("prometheus config rule_files %v do not load %s", prom.RuleFiles, rulesPath(root))
	}
	if promtool, err := lookTool("promtool"); err == nil {
		if out, err := run(t, root, promtool, "check", "config", cfgPath); err != nil {
			t.Errorf("%v\n%s", err, out)
		}
	} else if os.Getenv("CI") == "true" {
		t.Error("CI=true: promtool is not installed")
	}

	// Grafana: the dashboard mounted where the file provider reads, and a
	// data source for the prometheus service.
	gm := mounts("grafana")
	var provider struct {
		Providers []struct {
			Options struct {
				Path string `yaml:"path"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	var ds struct {
		Datasources []struct {
			Type string `yaml:"type"`
			URL  string `yaml:"url"`
		} `yaml:"datasources"`
	}
	prov := gm["/etc/grafana/provisioning"]
	if prov == "" {
		t.Fatal("grafana: /etc/grafana/provisioning is not mounted")
	}
	readYAML(t, filepath.Join(prov, "dashboards", "compactproxy.yaml"), &provider)
	readYAML(t, filepath.Join(prov, "datasources", "prometheus.yaml"), &ds)
	if len(provider.Providers) != 1 {
		t.Fatalf("grafana dashboard providers: %d", len(provider.Providers))
	}
	dash := gm[provider.Providers[0].Options.Path+"/compactproxy.json"]
	if dash != filepath.Join(dir, "grafana", "compactproxy.json") {
		t.Errorf("grafana: the provider reads %s, where deploy/grafana/compactproxy.json is not mounted (mounts %v)", provider.Providers[0].Options.Path, gm)
	}
	if len(ds.Datasources) != 1 || ds.Datasources[0].Type != "prometheus" || ds.Datasources[0].URL != "http://prometheus:9090" {
		t.Errorf("grafana data sources %+v: want the prometheus service", ds.Datasources)
	}
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
