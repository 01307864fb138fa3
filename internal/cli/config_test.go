package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// runConfigCheck runs `palisade config check --config path` in-process.
func runConfigCheck(t *testing.T, path string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	root := New()
	root.SetOut(&out)
	root.SetArgs([]string{"config", "check", "--config", path})
	err := root.Execute()
	return out.String(), err
}

func TestConfigCheck(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	writeConfigFile(t, good, "[policy]\nexempt_connectors = [\"root\", 4242]\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n[offcluster]\nallow_ports = [\"9000-9100\"]\n")
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
	if !ok || ee.ExitCode() != 1 || !strings.Contains(err.Error(), bad+`:2: policy.exempt_connectors: unknown user "pal-no-such-user"`) {
		t.Errorf("bad config: err %v, output %q", err, out)
	}
	if _, err := runConfigCheck(t, filepath.Join(dir, "missing.toml")); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("missing config: %v", err)
	}
}

func writeConfigFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}
