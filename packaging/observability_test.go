package packaging

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// agentMetrics are the metric names the agent defines (its source), so that
// the rules and the dashboard cannot name a metric that does not exist.
func agentMetrics(t *testing.T) []string {
	b, err := os.ReadFile("../internal/dataplane/userwall/metrics.go")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range regexp.MustCompile(`NewDesc\("(palisade_[a-z_]+)"`).FindAllStringSubmatch(string(b), -1) {
		names = append(names, m[1])
	}
	if len(names) < 5 {
		t.Fatalf("metric names found in metrics.go: %v", names)
	}
	return names
}

func checkNames(t *testing.T, what, text string, known []string) {
	t.Helper()
	used := regexp.MustCompile(`palisade_[a-z_]+`).FindAllString(text, -1)
	if len(used) == 0 && !strings.Contains(text, `job="palisade"`) {
		t.Errorf("%s uses no palisade metric", what)
	}
	for _, u := range used {
		if !slices.Contains(known, u) {
			t.Errorf("%s uses %s, which the agent does not export", what, u)
		}
	}
}

// TestAlertRules: promtool validates the rules and runs their unit tests
// (each alert fires on its condition and stays silent otherwise).
func TestAlertRules(t *testing.T) {
	if _, err := exec.LookPath("promtool"); err != nil {
		t.Fatal("promtool not installed (Debian package prometheus, .ci/deps)")
	}
	for _, args := range [][]string{{"check", "rules", "palisade-alerts.yml"}, {"test", "rules", "palisade-alerts_test.yml"}} {
		cmd := exec.Command("promtool", args...)
		cmd.Dir = "prometheus"
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "SUCCESS") {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
	b, _ := os.ReadFile("prometheus/palisade-alerts.yml")
	var exprs []string
	for _, m := range regexp.MustCompile(`(?m)^\s+expr: (.*)$`).FindAllStringSubmatch(string(b), -1) {
		exprs = append(exprs, m[1])
	}
	checkNames(t, "alert rules", strings.Join(exprs, "\n"), agentMetrics(t))
}

// TestDashboard: the Grafana dashboard is valid JSON, every panel has a
// query, and every query names metrics the agent exports.
func TestDashboard(t *testing.T) {
	b, err := os.ReadFile("grafana/palisade.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || len(d.Panels) < 5 {
		t.Fatalf("dashboard: uid %q, %d panels", d.UID, len(d.Panels))
	}
	known := agentMetrics(t)
	for _, p := range d.Panels {
		if len(p.Targets) == 0 || p.Targets[0].Expr == "" {
			t.Errorf("panel %q has no query", p.Title)
			continue
		}
		checkNames(t, "panel "+p.Title, p.Targets[0].Expr, known)
	}
}
