// Package uvn is the uvn data plane's lab adapter: its testbed mode (per-user
// VRFs configured on every node), its check expectation and its bench driver
// wiring live here; the data plane itself is internal/dataplane/uvn.
package uvn

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/spank"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// ModeName is the testbed mode of the uvn data plane.
const ModeName = "uvn"

// UVNMode configures uvn on every node of a testbed: the [uvn] section of
// each node's palisade.toml (eth0 net: multicast; ib0 net: unicast peers),
// the PAM line in sshd's session stack (UsePAM yes) and the SPANK plugin in
// plugstack.conf. It runs inside the VM (the host kernel has no VRF); on
// the host side of `testbed up --vm` it does nothing.
type UVNMode struct{}

// VXLAN ports of the testbed's underlays.
const (
	TestbedPortEth = 4789
	TestbedPortIB  = 4790
)

// NodeConfig is the [uvn] section for node n of tb.
func NodeConfig(tb *testbed.Testbed, n testbed.Node) string {
	var peers []string
	for _, m := range tb.Nodes {
		peers = append(peers, `"`+m.IBV4.String()+`"`)
	}
	return fmt.Sprintf(`
# uvn (written by the uvn testbed mode)
[uvn]
enable = true
state_dir = %q
[[uvn.underlay]]   # eth0 network: peers found by multicast (one group per uid)
prefixes = ["198.18.0.0/24", "2001:2::/64"]
port = %d
group = "239.192.0.0/16"
[[uvn.underlay]]   # ib0 network: no multicast, unicast forwarding entries to every node
prefixes = ["198.19.0.0/24", "2001:2:0:1::/64"]
port = %d
peers = [%s]
`, filepath.Join(tb.RunDir(), n.Name, "uvn"), TestbedPortEth, TestbedPortIB, strings.Join(peers, ", "))
}

// PAMLine is the session line added to sshd's PAM stack: pam_exec's
// stdout reaches the user (a refused login says why); the helper keeps its
// own log (pam_exec's log= would swallow stdout).
func PAMLine(binary, config, log string) string {
	l := "session required pam_exec.so stdout " + binary + " --config " + config + " uvn pam"
	if log != "" {
		l += " --log " + log
	}
	return l
}

// Up configures the nodes (inside the VM).
func (UVNMode) Up(ctx context.Context, tb *testbed.Testbed) error {
	if tb.VM {
		return nil // the guest runs this mode inside the VM
	}
	so := os.Getenv("PALISADE_UVN_SPANK")
	if so == "" {
		so = filepath.Join(tb.Dir, "lib", spank.PluginName)
		if err := os.MkdirAll(filepath.Dir(so), 0o755); err != nil {
			return err
		}
		if err := spank.Build(ctx, so); err != nil {
			return err
		}
	}
	// timeout=120: under emulation on a loaded host a setup has taken more
	// than the default 30 s (a real node takes seconds).
	conf := fmt.Sprintf("# uvn SPANK plugin (written by the uvn testbed mode)\nrequired %s palisade=%s config=/etc/palisade/palisade.toml timeout=120\n", so, tb.Binary)
	if err := os.WriteFile(filepath.Join(tb.SlurmConfDir(), "plugstack.conf.d", "uvn.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	for _, n := range tb.Nodes {
		etc := tb.NodeEtc(n.Name)
		if err := os.MkdirAll(filepath.Join(tb.RunDir(), n.Name), 0o755); err != nil {
			return err
		}
		f, err := os.OpenFile(filepath.Join(etc, "palisade", "palisade.toml"), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = f.WriteString(NodeConfig(tb, n))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// PAMSession is the uvn line of sshd's PAM stack on node (the testbed runs
// sshd with UsePAM yes and a per-node /etc/pam.d for it).
//
// With Slurm's pam_slurm_adopt installed, the account stack also adopts an
// ssh session into the user's job on the node (before the session line
// puts it in the user's VRF: account runs before session). Sessions of
// users without a job there are let in (action_no_jobs=ignore), so ssh and
// mpirun keep working outside jobs.
func (UVNMode) PAMSession(tb *testbed.Testbed, node string) []string {
	lines := []string{PAMLine(tb.Binary, "/etc/palisade/palisade.toml", filepath.Join(tb.LogDir(), "uvn-pam-"+node+".log"))}
	if _, err := os.Stat(AdoptModule); err == nil {
		lines = append(lines, "account required "+AdoptModule+" action_no_jobs=ignore")
	}
	return lines
}

// SlurmConf gives every job an extern step on each of its nodes
// (PrologFlags=Contain): pam_slurm_adopt adopts ssh sessions into it, and
// its slurmstepd holds the user's network on the node for the job's life.
func (UVNMode) SlurmConf(tb *testbed.Testbed) []string {
	return []string{"PrologFlags=Contain"}
}

// AdoptModule is Debian's pam_slurm_adopt (package libpam-slurm-adopt).
const AdoptModule = "/lib/security/pam_slurm_adopt.so"

// Down removes every user's network on every node.
func (UVNMode) Down(ctx context.Context, tb *testbed.Testbed) error {
	if tb.VM {
		return nil
	}
	var errs []error
	for _, n := range tb.Nodes {
		out, err := tb.Command(ctx, n.Name, "", tb.Binary, "uvn", "teardown", "--all").CombinedOutput()
		if err != nil && !strings.Contains(string(out), "no [[uvn.underlay]]") {
			errs = append(errs, fmt.Errorf("uvn teardown on %s: %w: %s", n.Name, err, out))
		}
	}
	os.Remove(filepath.Join(tb.SlurmConfDir(), "plugstack.conf.d", "uvn.conf"))
	return errors.Join(errs...)
}

// LoginPrefix makes a testbed login-like command a login: it runs in the
// user's VRF, as an ssh session does through PAM and a job step through
// SPANK. `palisade uvn login` runs as root just before the testbed drops to
// the user, moves itself into the VRF and execs the rest.
func (UVNMode) LoginPrefix(tb *testbed.Testbed, node, user string) []string {
	return []string{tb.Binary, "uvn", "login", "--uid", user, "--"}
}
