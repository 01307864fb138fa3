package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestUVNUser: who gets a VRF comes from configuration (exempt_users,
// slurm.conf's SlurmUser/SlurmdUser, root), never from a uid threshold;
// an account that cannot get a VRF and is not exempt is refused.
func TestUVNUser(t *testing.T) {
	dir := t.TempDir()
	slurmConf := filepath.Join(dir, "slurm.conf")
	os.WriteFile(slurmConf, []byte("SlurmUser=slurm\nSlurmdUser=root\nSrunPortRange=61000-62999\n"), 0o644)
	conf := filepath.Join(dir, "palisade.toml")
	write := func(extra string) {
		os.WriteFile(conf, []byte(`[uvn]
enable = true
state_dir = "`+dir+`/state"
slurm_conf = "`+slurmConf+`"
`+extra+`
[[uvn.underlay]]
prefixes = ["198.18.0.0/24"]
port = 4789
group = "239.192.0.0/16"
`), 0o644)
	}
	old := configPath
	configPath = conf
	defer func() { configPath = old }()
	cmd := &cobra.Command{}
	cmd.Flags().Bool("verbose", false, "")

	write(`exempt_users = ["nobody"]`)
	for _, u := range []string{"root", "slurm", "nobody"} {
		m, _, err := uvnUser(cmd, u)
		if err != nil || m != nil {
			t.Errorf("%s: want exempt, got manager %v, err %v", u, m != nil, err)
		}
	}
	// daemon (uid 1) is below min_uid and not exempt: refused, with advice.
	if _, _, err := uvnUser(cmd, "daemon"); err == nil || !strings.Contains(err.Error(), "exempt_users") {
		t.Errorf("daemon: want a refusal naming exempt_users, got %v", err)
	}
	// Without the exemption, nobody (65534) is an ordinary user: served, and
	// the manager knows slurm.conf's SrunPortRange.
	write("")
	m, uid, err := uvnUser(cmd, "nobody")
	if err != nil || m == nil || uid != 65534 || m.Srun.First != 61000 || m.Srun.Last != 62999 {
		t.Errorf("nobody: want served with srun ports 61000-62999, got %v %d %v", m, uid, err)
	}
	// A broken configuration: users are refused, root never.
	os.WriteFile(conf, []byte("[uvn\n"), 0o644)
	if _, _, err := uvnUser(cmd, "nobody"); err == nil || !strings.Contains(err.Error(), "configuration") {
		t.Errorf("broken config: nobody must be refused, got %v", err)
	}
	if m, _, err := uvnUser(cmd, "root"); err != nil || m != nil {
		t.Errorf("broken config: root refused: %v", err)
	}
	// srun ports overlapping underlay_ports are rejected.
	write(`srun_ports = "6000-6900"`)
	if _, _, err := uvnUser(cmd, "nobody"); err == nil || !strings.Contains(err.Error(), "underlay_ports") {
		t.Errorf("srun_ports overlapping underlay_ports: got %v", err)
	}
}
