package ops

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// ruleFile is a Prometheus rule file.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type rule struct {
	Record      string            `yaml:"record"`
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func rulesPath(root string) string {
	return filepath.Join(root, "deploy", "prometheus", "compactproxy.rules.yaml")
}

func loadRules(t *testing.T, root string) []rule {
	t.Helper()
	b, err := os.ReadFile(rulesPath(root))
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	if err := yaml.Unmarshal(b, &rf); err != nil {
		t.Fatal(err)
	}
	var out []rule
	for _, g := range rf.Groups {
		out = append(out, g.Rules...)
	}
	return out
}

// TestPromtoolRules runs promtool's own checks on the rule file and its unit
// tests, and checks that every alert is tested both ways (a case where it
// fires and one where it stays silent), has a severity and runbook text, and
// is explained in docs/operating.md's "Alerts" section.
func TestPromtoolRules(t *testing.T) {
	promtool := needTool(t, "promtool")
	root := repoRoot(t)
	testFile := filepath.Join(root, "deploy", "prometheus", "tests", "compactproxy.test.yaml")
	if out, err := run(t, root, promtool, "check", "rules", rulesPath(root)); err != nil {
		t.Fatalf("%v\n%s", err, out)
	} else {
		t.Log(strings.TrimSpace(out))
	}
	if out, err := run(t, root, promtool, "test", "rules", testFile); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}

	var tf struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	b, err := os.ReadFile(testFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &tf); err != nil {
		t.Fatal(err)
	}
	fires, silent := map[string]int{}, map[string]int{}
	for _, c := range tf.Tests {
		for _, a := range c.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname]++
			} else {
				silent[a.Alertname]++
			}
		}
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "operating.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, ops, found := strings.Cut(string(doc), "\n## Alerts\n")
	if !found {
		t.Error(`docs/operating.md has no "## Alerts" section`)
	}
	ops, _, _ = strings.Cut(ops, "\n## ")
	alerts := 0
	for _, r := range loadRules(t, root) {
		if r.Alert == "" {
			continue
		}
		alerts++
		if fires[r.Alert] == 0 || silent[r.Alert] == 0 {
			t.Errorf("alert %s: %d firing and %d silent unit-test cases; want both", r.Alert, fires[r.Alert], silent[r.Alert])
		}
		if r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["runbook"] == "" {
			t.Errorf("alert %s: needs a severity label and summary and runbook annotations", r.Alert)
		}
		if !strings.Contains(ops, r.Alert) {
			t.Errorf("alert %s is not explained in docs/operating.md's Alerts section", r.Alert)
		}
	}
	t.Logf("%d alerts, each with firing and silent promtool cases", alerts)
}
