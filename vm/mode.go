package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/slurm"
	"github.com/palisade-hpc/palisade/testbed"
)

// ModeName is the testbed mode of the uvn data plane.
const ModeName = "uvn"

func init() { testbed.RegisterMode(ModeName, UVNMode{}) }

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

// PAMLine is the session line added to sshd's PAM stack.
func PAMLine(binary, config, log string) string {
	l := "session required pam_exec.so"
	if log != "" {
		l += " log=" + log
	}
	return l + " " + binary + " --config " + config + " uvn pam"
}

// Up configures the nodes (inside the VM).
func (UVNMode) Up(ctx context.Context, tb *testbed.Testbed) error {
	if tb.VM {
		return nil // the guest runs this mode inside the VM
	}
	if _, err := os.Stat("/proc/sys/net/ipv4/tcp_l3mdev_accept"); err != nil {
		return errors.New("uvn needs a kernel with VRF: use `testbed up --vm --mode uvn`")
	}
	so := os.Getenv("PALISADE_UVN_SPANK")
	if so == "" {
		so = filepath.Join(tb.Dir, "lib", slurm.PluginName)
		if err := os.MkdirAll(filepath.Dir(so), 0o755); err != nil {
			return err
		}
		if err := slurm.Build(ctx, so); err != nil {
			return err
		}
	}
	conf := fmt.Sprintf("# uvn SPANK plugin (written by the uvn testbed mode)\nrequired %s palisade=%s config=/etc/palisade/palisade.toml\n", so, tb.Binary)
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
		if err := writePAM(tb, n); err != nil {
			return err
		}
		if err := restartSSHD(ctx, tb, n); err != nil {
			return err
		}
	}
	return nil
}

// writePAM gives node n its own /etc/pam.d (bound over /etc/pam.d by ip
// netns exec): the system's files plus the uvn line in sshd's stack.
func writePAM(tb *testbed.Testbed, n testbed.Node) error {
	dst := filepath.Join(tb.NodeEtc(n.Name), "pam.d")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir("/etc/pam.d")
	if err != nil {
		return err
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/etc/pam.d", e.Name()))
		if err != nil {
			continue
		}
		if e.Name() == "sshd" {
			b = append(b, []byte("\n# Palisade uvn: the session moves into the user's VRF; fails closed.\n"+
				PAMLine(tb.Binary, "/etc/palisade/palisade.toml", filepath.Join(tb.LogDir(), "uvn-pam-"+n.Name+".log"))+"\n")...)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// restartSSHD restarts node n's sshd with UsePAM yes (and the node's new
// pam.d, which ip netns exec binds only for processes it starts).
func restartSSHD(ctx context.Context, tb *testbed.Testbed, n testbed.Node) error {
	cfg := filepath.Join(tb.SSHDir(n.Name), "sshd_config")
	b, err := os.ReadFile(cfg)
	if err != nil {
		return err
	}
	s := strings.Replace(string(b), "UsePAM no", "UsePAM yes", 1)
	if err := os.WriteFile(cfg, []byte(s), 0o644); err != nil {
		return err
	}
	pidf := filepath.Join(tb.RunDir(), "sshd-"+n.Name+".pid")
	if b, err := os.ReadFile(pidf); err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
			syscall.Kill(pid, syscall.SIGTERM)
			for i := 0; i < 100; i++ {
				if _, alive := procState(pid); !alive {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	out, err := tb.Command(ctx, n.Name, "", "/usr/sbin/sshd", "-E", filepath.Join(tb.LogDir(), "sshd-"+n.Name+".log")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("restart sshd on %s: %w: %s", n.Name, err, out)
	}
	return nil
}

func procState(pid int) (byte, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || len(b) < i+3 {
		return 0, false
	}
	st := b[i+2]
	return st, st != 'Z' && st != 'X'
}

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
