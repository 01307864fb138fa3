package packaging

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
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

// TestAgentUnitFailsSafe: the agent's unit cannot end "failed for good"
// (no start limit, always restarted); slurmd is ordered after it, and the
// shipped slurmd drop-in starts slurmd only on an enforcing node and
// retries; sshd never depends on the agent (root must always log in).
// systemd-analyze verify accepts the units (no unknown or misplaced key).
func TestAgentUnitFailsSafe(t *testing.T) {
	unit, err := os.ReadFile("systemd/palisade-agent.service")
	if err != nil {
		t.Fatal(err)
	}
	dropin, err := os.ReadFile("systemd/slurmd-palisade.conf")
	if err != nil {
		t.Fatal(err)
	}
	has := func(text []byte, section, line string) bool {
		sec := ""
		for _, l := range strings.Split(string(text), "\n") {
			l = strings.TrimSpace(l)
			if strings.HasPrefix(l, "[") {
				sec = l
			} else if sec == section && l == line {
				return true
			}
		}
		return false
	}
	for _, want := range []struct{ sec, line string }{
		{"[Unit]", "StartLimitIntervalSec=0"},
		{"[Unit]", "Before=slurmd.service slurmctld.service ssh.service sshd.service"},
		{"[Service]", "Restart=always"},
		{"[Service]", "Type=notify"},
	} {
		if !has(unit, want.sec, want.line) {
			t.Errorf("palisade-agent.service lacks %s %s", want.sec, want.line)
		}
	}
	if regexp.MustCompile(`(?m)^(Requires|BindsTo|RequiredBy|Requisite)=.*ssh`).Match(unit) {
		t.Errorf("palisade-agent.service makes sshd depend on the agent: root could be locked out")
	}
	for _, want := range []struct{ sec, line string }{
		{"[Unit]", "After=palisade-agent.service"},
		{"[Unit]", "Wants=palisade-agent.service"},
		{"[Unit]", "StartLimitIntervalSec=0"},
		{"[Service]", "ExecStartPre=" + BinPath + " status --enforcing"},
		{"[Service]", "Restart=on-failure"},
	} {
		if !has(dropin, want.sec, want.line) {
			t.Errorf("slurmd-palisade.conf lacks %s %s", want.sec, want.line)
		}
	}
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Log("systemd-analyze not installed: units not verified by systemd")
		return
	}
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "slurmd.service.d"), 0o755)
	os.WriteFile(filepath.Join(dir, "palisade-agent.service"), unit, 0o644)
	os.WriteFile(filepath.Join(dir, "slurmd.service.d", "palisade.conf"), dropin, 0o644)
	os.WriteFile(filepath.Join(dir, "slurmd.service"), []byte("[Unit]\nDescription=slurmd stand-in\n[Service]\nExecStart=/bin/true\n"), 0o644)
	cmd := exec.Command("systemd-analyze", "verify", "--man=no", "palisade-agent.service", "slurmd.service")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+dir+":")
	out, _ := cmd.CombinedOutput()
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		// The binary is not installed on the test host.
		if l != "" && !strings.Contains(l, BinPath+" is not executable") {
			t.Errorf("systemd-analyze verify: %s", l)
		}
	}
}
