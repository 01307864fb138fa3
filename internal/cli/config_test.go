package cli

import (
	"bytes"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func init() {
	// The test host is in no cluster subnet of these tests: pretend it is
	// in 198.18.0.0/24 (TestConfigCheckAddresses checks the finding).
	localAddrs = func() []netip.Addr { return []netip.Addr{netip.MustParseAddr("198.18.0.9")} }
}

// runConfigCheck runs `palisade config check --config path` in-process.
func runConfigCheck(t *testing.T, path string, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	root := New()
	root.SetOut(&out)
	if len(args) == 0 {
		args = []string{"--slurm-conf", ""}
	}
	root.SetArgs(append([]string{"config", "check", "--config", path}, args...))
	err := root.Execute()
	return out.String(), err
}

func TestConfigCheck(t *testing.T) {
	dir := t.TempDir()
	key := writeKey(t, dir)
	good := filepath.Join(dir, "good.toml")
	writeConfigFile(t, good, "[policy]\nexempt_connectors = [\"root\", 4242]\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n[offcluster]\nallow_ports = [\"9000-9100\"]\n")
	out, err := runConfigCheck(t, good)
	if err != nil {
		t.Fatalf("good config: %v", err)
	}
	for _, w := range []string{"system_port_max   = 1023", "exempt_connectors = [0, 4242]", `subnets = ["198.18.0.0/24"]`, `allow_ports = ["9000-9100"]`, good + ": OK"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}

	bad := filepath.Join(dir, "bad.toml")
	writeConfigFile(t, bad, "[policy]\nexempt_connectors = [\"pal-no-such-user\"]\n")
	out, err = runConfigCheck(t, bad)
	ee, ok := err.(*ExitError)
	if !ok || ee.ExitCode() != 1 || !strings.Contains(out, bad+`:2: policy.exempt_connectors: unknown user "pal-no-such-user"`) {
		t.Errorf("bad config: err %v, output %q", err, out)
	}
	if _, err := runConfigCheck(t, filepath.Join(dir, "missing.toml")); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("missing config: %v", err)
	}
}

// TestConfigCheckFindings: warnings keep exit 0 (1 with --strict); Slurm's
// accounts missing from the exemptions are an error (exit 1).
func TestConfigCheckFindings(t *testing.T) {
	dir := t.TempDir()
	key := writeKey(t, dir)
	risky := filepath.Join(dir, "risky.toml")
	writeConfigFile(t, risky, "[policy]\nsystem_port_max = 65535\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n")
	out, err := runConfigCheck(t, risky)
	if err != nil || !strings.Contains(out, "# WARNING: "+risky+":2: policy.system_port_max: 65535 makes every port a system port") ||
		!strings.Contains(out, risky+": OK, 1 warning(s)") || !strings.Contains(out, "# config sha256 ") {
		t.Errorf("risky config: %v\n%s", err, out)
	}
	if _, err := runConfigCheck(t, risky, "--slurm-conf", "", "--strict"); err == nil || !strings.Contains(err.Error(), "1 warning(s) (--strict)") {
		t.Errorf("--strict: %v", err)
	}
	slurm := filepath.Join(dir, "slurm.conf")
	writeConfigFile(t, slurm, "SlurmUser=root\nSlurmdUser=root\n")
	good := filepath.Join(dir, "good.toml")
	writeConfigFile(t, good, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n")
	if out, err := runConfigCheck(t, good, "--slurm-conf", slurm); err != nil || !strings.Contains(out, good+": OK\n") {
		t.Errorf("root as SlurmUser: %v\n%s", err, out)
	}
	writeConfigFile(t, good, "[policy]\nexempt_connectors = []\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n")
	out, err = runConfigCheck(t, good, "--slurm-conf", slurm)
	if ee, ok := err.(*ExitError); !ok || ee.Code != 1 || !strings.Contains(out, `# ERROR: `+good+`:2: policy.exempt_connectors: SlurmUser "root"`) {
		t.Errorf("Slurm account not exempt: %v\n%s", err, out)
	}
}

// TestConfigCheckClusterKey: with cluster subnets, a missing or
// world-readable cluster key is an error (cross-node traffic would fail).
func TestConfigCheckClusterKey(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "c.toml")
	key := filepath.Join(dir, "none.key")
	writeConfigFile(t, conf, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n")
	if out, err := runConfigCheck(t, conf); err == nil || !strings.Contains(out, "# ERROR: "+conf+":3: cluster.key_file: open "+key) {
		t.Errorf("missing key: %v\n%s", err, out)
	}
	os.WriteFile(key, []byte("00112233445566778899aabbccddeeff\n"), 0o644)
	os.Chmod(key, 0o644)
	if out, err := runConfigCheck(t, conf); err == nil || !strings.Contains(out, "chmod 600") {
		t.Errorf("world-readable key: %v\n%s", err, out)
	}
	os.Chmod(key, 0o600)
	if out, err := runConfigCheck(t, conf); err != nil || strings.Contains(out, "ERROR") {
		t.Errorf("good key: %v\n%s", err, out)
	}
}

func writeKey(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "cluster.key")
	if err := os.WriteFile(p, []byte("00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func writeConfigFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestConfigCheckAddresses: a subnet typo that leaves this node outside
// every cluster subnet is an ERROR (exit 1); --remote (a configuration
// management host) checks neither addresses nor names, which it reports as
// warnings, and exits 0.
func TestConfigCheckAddresses(t *testing.T) {
	dir := t.TempDir()
	key := writeKey(t, dir)
	typo := filepath.Join(dir, "typo.toml")
	writeConfigFile(t, typo, "[policy]\nexempt_listeners = [\"root\", \"pal-no-such-user\"]\n[cluster]\nsubnets = [\"198.81.0.0/24\"]\nkey_file = \""+key+"\"\n")
	out, err := runConfigCheck(t, typo)
	if ee, ok := err.(*ExitError); !ok || ee.Code != 1 ||
		!strings.Contains(out, "# ERROR: "+typo+":4: cluster.subnets: none of this node's addresses (198.18.0.9) is in the cluster subnets (198.81.0.0/24)") ||
		!strings.Contains(out, "# ERROR: "+typo+":2: policy.exempt_listeners: unknown user \"pal-no-such-user\"") {
		t.Errorf("typo: %v\n%s", err, out)
	}
	out, err = runConfigCheck(t, typo, "--slurm-conf", "", "--remote")
	if err != nil || strings.Contains(out, "# ERROR") || !strings.Contains(out, "# WARNING: "+typo+":2: policy.exempt_listeners: unknown user \"pal-no-such-user\"") {
		t.Errorf("--remote: %v\n%s", err, out)
	}
}

// TestKeyCheckHonoursConfig: `palisade --config X key check` checks X's
// [cluster] key_file (it used to check /etc/palisade/cluster.key whatever X
// said), and a key readable by others is refused.
func TestKeyCheckHonoursConfig(t *testing.T) {
	dir := t.TempDir()
	key := writeKey(t, dir)
	cfg := filepath.Join(dir, "c.toml")
	writeConfigFile(t, cfg, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n")
	run := func() (string, error) {
		var out bytes.Buffer
		root := New()
		root.SetOut(&out)
		root.SetArgs([]string{"--config", cfg, "key", "check"})
		err := root.Execute()
		return out.String(), err
	}
	out, err := run()
	if err != nil || !strings.HasPrefix(out, key+":\n") || !strings.Contains(out, "key 1: id ") {
		t.Errorf("key check --config: %v\n%s", err, out)
	}
	if err := os.Chmod(key, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := run(); err == nil || !strings.Contains(err.Error(), key) {
		t.Errorf("key mode 0644: %v\n%s", err, out)
	}
}
