package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/identity"
)

func findings(t *testing.T, conf, slurmConf string) []Finding {
	t.Helper()
	c, err := Parse("pal.toml", []byte(conf), users)
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	return c.Findings(CheckOptions{SlurmConf: slurmConf, Resolver: users})
}

// has reports whether a finding of sev for key, at line, contains text.
func has(fs []Finding, sev Severity, key string, line int, text string) bool {
	for _, f := range fs {
		if f.Severity == sev && f.Key == key && (line == 0 || f.Line == line) && strings.Contains(f.Msg, text) {
			return true
		}
	}
	return false
}

const safeConfig = `[policy]
exempt_connectors = ["root", "slurm"]
exempt_listeners = ["root", "slurm"]
[cluster]
subnets = ["198.18.0.0/24"]
`

func TestFindingsSafeConfigHasNone(t *testing.T) {
	dir := t.TempDir()
	sc := filepath.Join(dir, "slurm.conf")
	os.WriteFile(sc, []byte("ClusterName=pal\nSlurmUser=slurm # ctld\nSlurmdUser=root\n"), 0o644)
	if fs := findings(t, safeConfig, sc); len(fs) != 0 {
		t.Errorf("findings for a safe configuration: %+v", fs)
	}
}

func TestFindingsRisky(t *testing.T) {
	cases := []struct {
		conf string
		key  string
		line int
		text string
	}{
		{"[policy]\nsystem_port_max = 65535\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", "policy.system_port_max", 2, "nothing is isolated"},
		{"[policy]\nsystem_port_max = 2048\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", "policy.system_port_max", 2, "ports 1024-2048"},
		{"[policy]\nexempt_connectors = []\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", "policy.exempt_connectors", 2, "not even root"},
		{"[policy]\nexempt_listeners = []\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", "policy.exempt_listeners", 2, "empty"},
		{"[cluster]\nsubnets = []\n", "cluster.subnets", 2, "cross-node"},
		{"[cluster]\nsubnets = [\"0.0.0.0/0\"]\n", "cluster.subnets", 2, "very wide"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[offcluster]\nallow_ports = [\"2000-9000\"]\n", "offcluster.allow_ports", 4, "7001 ports"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nmetrics_address = \"0.0.0.0:9464\"\n", "agent.metrics_address", 4, "every address"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nmetrics_address = \":9464\"\n", "agent.metrics_address", 4, "every address"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nmetrics_address = \"192.0.2.10:9464\"\n", "agent.metrics_address", 4, "public address"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nmetrics_address = \"127.0.0.1:70000\"\n", "agent.metrics_address", 4, "out of range"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nevent_log = \"\"\nsyslog = false\n", "agent.event_log", 4, "logged nowhere"},
		{"[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[agent]\nident_port = 0\n", "agent.ident_port", 4, "explain"},
	}
	for _, c := range cases {
		fs := findings(t, c.conf, "")
		if !has(fs, Warning, c.key, c.line, c.text) {
			t.Errorf("%q: want a warning %s at line %d containing %q, got %+v", c.conf, c.key, c.line, c.text, fs)
		}
	}
}

// TestFindingsSlurm: SlurmUser must be exempt both ways; it is an error
// (config check exits 1) only when slurm.conf exists.
func TestFindingsSlurm(t *testing.T) {
	dir := t.TempDir()
	sc := filepath.Join(dir, "slurm.conf")
	os.WriteFile(sc, []byte("# test\nslurmuser=slurm\n"), 0o644)
	conf := "[policy]\nexempt_connectors = [\"root\", \"slurm\"]\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n"
	fs := findings(t, conf, sc)
	if !has(fs, Problem, "policy.exempt_listeners", 0, `SlurmUser "slurm" (`+sc+`:2) is not in exempt_listeners`) {
		t.Errorf("missing listener exemption not reported: %+v", fs)
	}
	if len(fs) != 1 {
		t.Errorf("want exactly one finding: %+v", fs)
	}
	// Built-in defaults (root only) with Slurm's accounts: both lists.
	fs = findings(t, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", sc)
	if !has(fs, Problem, "policy.exempt_connectors", 0, "exempt_connectors and exempt_listeners") {
		t.Errorf("defaults with Slurm: %+v", fs)
	}
	// SlurmUser absent: Slurm's default, root, which is exempt.
	os.WriteFile(sc, []byte("ClusterName=x\n"), 0o644)
	if fs := findings(t, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", sc); len(fs) != 0 {
		t.Errorf("root SlurmUser: %+v", fs)
	}
	// No slurm.conf: no Slurm on this node.
	if fs := findings(t, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\n", filepath.Join(dir, "none.conf")); len(fs) != 0 {
		t.Errorf("no slurm.conf: %+v", fs)
	}
	// An unknown SlurmUser is an error too.
	os.WriteFile(sc, []byte("SlurmUser=pal-nobody\n"), 0o644)
	if fs := findings(t, safeConfig, sc); !has(fs, Problem, "policy.exempt_listeners", 0, `"pal-nobody"`) {
		t.Errorf("unknown SlurmUser: %+v", fs)
	}
}

func TestConfigSHA256(t *testing.T) {
	c, err := Parse("x", []byte(safeConfig), users)
	if err != nil {
		t.Fatal(err)
	}
	d, _ := Parse("x", []byte(safeConfig+"\n"), users)
	if len(c.SHA256) != 64 || c.SHA256 == d.SHA256 {
		t.Errorf("hashes %q %q", c.SHA256, d.SHA256)
	}
}

func TestPortalProxyExempt(t *testing.T) {
	res, err := identity.ParseTables([]byte("root:x:0:0::/:/bin/sh\nwww-data:x:33:33::/:/bin/sh\n"), []byte("root:x:0:\nwww-data:x:33:\n"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		toml, want string
	}{
		{"[policy]\nexempt_connectors = [\"root\", \"www-data\"]\n[portal]\nproxies = [\"www-data\"]\n", "also an exempt connector"},
		{"[policy]\nexempt_listeners = [\"root\", \"www-data\"]\n[portal]\nproxies = [\"www-data\"]\n", "also an exempt listener"},
		{"[portal]\nproxies = [\"nosuch\"]\n", "nothing can act through it"},
		{"[portal]\nproxies = [\"www-data\"]\n", ""},
	} {
		cfg, err := Parse("t.toml", []byte(c.toml), res)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, f := range cfg.Findings(CheckOptions{Resolver: res, Elsewhere: true}) {
			if f.Key == "portal.proxies" {
				got = append(got, f.Msg)
			}
		}
		if c.want == "" && len(got) > 0 || c.want != "" && (len(got) != 1 || !strings.Contains(got[0], c.want)) {
			t.Errorf("%q: findings %q, want %q", c.toml, got, c.want)
		}
	}
}
