package testbed

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// mpiHelloC is the MPI test program built at up time: every rank reports
// itself, and an Allreduce proves the ranks really talked to each other.
const mpiHelloC = `/* Built by palisade-lab testbed up: prints one line per rank. */
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int rank, size, sum = 0, one = 1;
    char host[256];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gethostname(host, sizeof host);
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d of %d on %s sum %d\n", rank, size, host, sum);
    MPI_Finalize();
    return 0;
}
`

func writeFile(path, content string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		return err
	}
	return os.Chmod(path, mode)
}

func mkdirOwned(path string, mode os.FileMode, uid, gid int) error {
	if err := os.MkdirAll(path, mode); err != nil {
		return err
	}
	if err := os.Chmod(path, mode); err != nil {
		return err
	}
	return os.Chown(path, uid, gid)
}

func lookupIDs(name string) (int, int, error) {
	a, err := lookupAccount(name)
	if err != nil {
		return 0, 0, err
	}
	return int(a.uid), int(a.gid), nil
}

// hostsFile maps every node (v4 and v6 on eth0 under the node name, the
// IPoIB addresses under nodeN-ib) and the outside host.
func (tb *Testbed) hostsFile() string {
	var b strings.Builder
	b.WriteString("# testbed " + tb.Name + " (written by palisade-lab testbed up)\n")
	b.WriteString("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
	for _, n := range tb.Nodes {
		fmt.Fprintf(&b, "%s\t%s\n%s\t%s\n", n.Eth0V4, n.Name, n.Eth0V6, n.Name)
		fmt.Fprintf(&b, "%s\t%s-ib\n%s\t%s-ib\n", n.IBV4, n.Name, n.IBV6, n.Name)
	}
	fmt.Fprintf(&b, "%s\toutside\n%s\toutside\n", tb.Outside.Eth0V4, tb.Outside.Eth0V6)
	fmt.Fprintf(&b, "%s\trouter\n%s\trouter\n", RouterEth0V4, RouterEth0V6)
	return b.String()
}

func (tb *Testbed) pathEnv() string {
	return filepath.Join(tb.Dir, "bin") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}

func (tb *Testbed) slurmConf() string {
	d := tb.Dir
	var b strings.Builder
	w := func(k, v string) { fmt.Fprintf(&b, "%s=%s\n", k, v) }
	b.WriteString("# Slurm for testbed " + tb.Name + " (written by palisade-lab testbed up)\n")
	w("ClusterName", tb.Name)
	w("SlurmctldHost", fmt.Sprintf("node1(%s)", tb.Nodes[0].Eth0V4))
	w("SlurmUser", "slurm")
	w("SlurmdUser", "root")
	w("SlurmctldPort", "6817")
	w("SlurmdPort", "6818")
	w("AuthType", "auth/munge")
	w("CredType", "cred/munge")
	w("AuthInfo", "socket="+tb.MungeSocket())
	w("StateSaveLocation", d+"/state/ctld")
	w("SlurmdSpoolDir", d+"/state/%n")
	w("SlurmctldPidFile", d+"/run/slurmctld.pid")
	w("SlurmdPidFile", d+"/run/slurmd-%n.pid")
	w("SlurmctldLogFile", d+"/log/slurmctld.log")
	w("SlurmdLogFile", d+"/log/slurmd-%n.log")
	w("ProctrackType", "proctrack/linuxproc")
	w("TaskPlugin", "task/none")
	w("JobAcctGatherType", "jobacct_gather/none")
	w("AccountingStorageType", "accounting_storage/none")
	w("JobCompType", "jobcomp/none")
	w("SwitchType", "switch/none")
	w("MpiDefault", "none")
	w("SchedulerType", "sched/backfill")
	w("SelectType", "select/cons_tres")
	w("SelectTypeParameters", "CR_Core")
	w("ReturnToService", "2")
	w("SlurmctldTimeout", "30")
	w("SlurmdTimeout", "30")
	w("InactiveLimit", "0")
	w("KillWait", "5")
	w("MinJobAge", "60")
	w("Waittime", "0")
	w("PlugStackConfig", "/etc/slurm/plugstack.conf")
	// srun and salloc listen on these ports for Slurm's callbacks (outside
	// the ephemeral range 32768-60999): uvn lets Slurm's daemons reach them
	// in a user's VRF (docs/uvn.md).
	w("SrunPortRange", "61000-62999")
	// Nodes share /tmp; PMIx's per-job directories would collide (pitfall 4).
	w("TmpFS", d+"/nodetmp/%n")
	if m, ok := lookupMode(tb.Mode); ok {
		if c, ok := m.(SlurmConfer); ok {
			for _, l := range c.SlurmConf(tb) {
				b.WriteString(l + "\n")
			}
		}
	}
	for _, n := range tb.Nodes {
		// Never more than the real machine: a node claiming more is drained.
		fmt.Fprintf(&b, "NodeName=%s NodeAddr=%s CPUs=2 RealMemory=1000 State=UNKNOWN\n", n.Name, n.Eth0V4)
	}
	fmt.Fprintf(&b, "PartitionName=debug Nodes=node[1-%d] Default=YES MaxTime=INFINITE State=UP\n", len(tb.Nodes))
	return b.String()
}

func (tb *Testbed) sshdConfig(n Node) string {
	ssh := tb.SSHDir(n.Name)
	return fmt.Sprintf(`# sshd for %[1]s of testbed %[2]s (written by palisade-lab testbed up)
ListenAddress 0.0.0.0
ListenAddress ::
HostKey %[3]s/ssh_host_ed25519_key
PidFile %[4]s/sshd-%[1]s.pid
UsePAM %[7]s
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthenticationMethods publickey
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes yes
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 200:30:400
MaxSessions 100
SetEnv PATH=%[5]s
AuthorizedKeysFile .ssh/authorized_keys
Subsystem sftp internal-sftp
# root logs in with the testbed's own key, never with /root/.ssh.
Match User root
	AuthorizedKeysFile %[6]s/ssh/root_authorized_keys
`, n.Name, tb.Name, ssh, tb.RunDir(), tb.pathEnv(), tb.Dir, map[bool]string{true: "yes", false: "no"}[tb.pamLines(n.Name) != nil])
}

// pamLines returns the mode's PAM session lines for sshd on node, nil if
// the mode has none (then sshd runs without PAM, as verified in the recipe).
func (tb *Testbed) pamLines(node string) []string {
	m, ok := lookupMode(tb.Mode)
	if !ok {
		return nil
	}
	p, ok := m.(PAMSessioner)
	if !ok {
		return nil
	}
	return p.PAMSession(tb, node)
}

// pamSSHD is sshd's PAM stack on a node whose mode hooks sessions: minimal
// on purpose (the host's stack runs pam_loginuid, pam_motd writing the
// shared /run, ...). Keys are checked by sshd itself; PAM does account
// and session only.
func pamSSHD(tbName string, lines []string) string {
	return "# sshd in testbed " + tbName + " (written by palisade-lab testbed up)\n" +
		"auth     required pam_deny.so\n" +
		"account  required pam_unix.so\n" +
		"password required pam_deny.so\n" +
		"session  required pam_unix.so\n" +
		strings.Join(lines, "\n") + "\n"
}

// writePAM gives node its own /etc/pam.d: the host's files (su, runuser,
// ... keep working) with sshd's stack replaced.
func (tb *Testbed) writePAM(node string, lines []string) error {
	dir := filepath.Join(tb.NodeEtc(node), "pam.d")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir("/etc/pam.d")
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() || e.Name() == "sshd" {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/etc/pam.d", e.Name()))
		if err != nil {
			return err
		}
		if err := writeFile(filepath.Join(dir, e.Name()), string(b), 0o644); err != nil {
			return err
		}
	}
	return writeFile(filepath.Join(dir, "sshd"), pamSSHD(tb.Name, lines), 0o644)
}

func (tb *Testbed) sshConfig() string {
	return fmt.Sprintf(`# ssh client for testbed %[1]s (written by palisade-lab testbed up)
Match localuser root
	IdentityFile %[2]s
	IdentitiesOnly yes
Host *
	StrictHostKeyChecking yes
	BatchMode yes
	GlobalKnownHostsFile /etc/ssh/ssh_known_hosts
	UserKnownHostsFile /dev/null
	ConnectTimeout 5
	LogLevel ERROR
`, tb.Name, tb.RootKey())
}

func (tb *Testbed) policyConfig(n Node) string {
	q := func(ss []string) string { return `["` + strings.Join(ss, `", "`) + `"]` }
	var subnets, nodes []string
	for _, p := range ClusterSubnets {
		subnets = append(subnets, p.String())
	}
	for _, m := range tb.Nodes {
		// Every address a node sends from (site rules' from_nodes); the
		// first is the one tools use.
		addrs := []string{m.Eth0V4.String()}
		for _, a := range []netip.Addr{m.Eth0V6, m.IBV4, m.IBV6} {
			if a.IsValid() {
				addrs = append(addrs, a.String())
			}
		}
		nodes = append(nodes, m.Name+"="+strings.Join(addrs, ","))
	}
	return fmt.Sprintf(`# Palisade policy for %s of testbed %s (written by palisade-lab testbed up)
[policy]
system_port_max = 1023
# slurmctld (SlurmUser) connects to srun's ephemeral listeners: it must be
# an exempt connector on any site, or interactive jobs die.
exempt_connectors = ["root", "slurm", "svc"%[10]s]
exempt_listeners = ["root", "slurm", "svc"]

[cluster]
subnets = %[3]s
nodes = %[4]s
# One key for the whole testbed, as munge's (generated by testbed up).
key_file = "%[7]s"
%[8]s%[11]s
# Web portals (docs/portals.md): the portal's proxy account opens connections
# as the users it authenticated; it is not an exempt connector.
[portal]
socket = "%[5]s/%[1]s/portal.sock"
proxies = ["`+PortalProxy+`"]

# /run and /var/log are shared by all nodes of the testbed: per-node paths.
[agent]
pid_file = "%[5]s/%[1]s/agent.pid"
ident_socket = "%[5]s/%[1]s/ident.sock"
event_log = "%[6]s/%[1]s-userwall.jsonl"
%[9]s`, n.Name, tb.Name, q(subnets), q(nodes), tb.RunDir(), tb.LogDir(), tb.ClusterKeyPath(), tb.unenforcedConfig(), tb.auditConfig(), tb.directoryExempt(), policyTests) + tb.directoryPolicy()
}

// PortalProxy is the testbed's [portal] proxy account: Debian's web server
// account, which the portal test's Apache runs as.
const PortalProxy = "www-data"

// policyTests are the testbed policy's [[test]] entries, one per rule it
// uses (the agent refuses the policy if one fails; docs/policy.md), on
// identities the lab's tests do not change (they drop slurm's exemption and
// make carol exempt to test other things). They
// come before [agent]: the file ends with that table, which tests append
// keys to.
const policyTests = `
# Policy tests: palisade policy test (the agent refuses a policy that fails one).
# Local connections (no from_node): they hold whatever [cluster] says.
[[test]]
name = "system ports from anywhere"
from = "carol"
source = "198.18.200.1"
to = "alice"
port = 22
expect = "allow"
rule = "system-port"

[[test]]
name = "a user's own listener"
from = "alice"
to = "alice"
port = 29101
expect = "allow"
rule = "same-user"

[[test]]
name = "a listener started under sg proj1"
from = "bob"
to = "alice"
to_group = "proj1"
port = 29105
expect = "allow"
rule = "shared-group"

[[test]]
name = "a private listener"
from = "bob"
to = "alice"
port = 29101
expect = "deny"
rule = "default-deny"

[[test]]
name = "root reaches users' services"
from = "root"
to = "carol"
port = 29103
expect = "allow"
rule = "exempt-connector"

[[test]]
name = "svc's services are open to the cluster"
from = "bob"
to = "svc"
port = 29104
expect = "allow"
rule = "exempt-listener"

[[test]]
name = "nothing of a user from off-cluster"
from = "alice"
source = "198.18.200.1"
to = "alice"
port = 29101
expect = "deny"
rule = "off-cluster-denied"
`

// auditConfig is testbed up --audit's part of [agent].
func (tb *Testbed) auditConfig() string {
	if !tb.Audit {
		return ""
	}
	// check --mode audit looks for an event per would-be refusal: no rate
	// limit may drop one.
	return "# testbed up --audit\naudit = true\nevent_rate = 100000\n"
}

// unenforcedConfig is testbed up --agents's part of [cluster]: every
// address of the nodes without an agent.
func (tb *Testbed) unenforcedConfig() string {
	var unenforced []string
	for _, m := range tb.Nodes {
		if !tb.Enforcing(m.Name) {
			for _, a := range []netip.Addr{m.Eth0V4, m.Eth0V6, m.IBV4, m.IBV6} {
				if a.IsValid() {
					unenforced = append(unenforced, netip.PrefixFrom(a, a.BitLen()).String())
				}
			}
		}
	}
	if len(unenforced) == 0 {
		return ""
	}
	return fmt.Sprintf("# testbed up --agents %s: the other nodes do not enforce yet\nunenforced_nodes = [\"%s\"]\n",
		strings.Join(tb.Agents, ","), strings.Join(unenforced, `", "`))
}

// ClusterKeyPath is the testbed's Palisade cluster key (every node's).
func (tb *Testbed) ClusterKeyPath() string { return filepath.Join(tb.Dir, "palisade-cluster.key") }

// writeConfig writes every file of the instance except keys (see genKeys).
func (tb *Testbed) writeConfig() error {
	d := tb.Dir
	slurmUID, slurmGID, err := lookupIDs("slurm")
	if err != nil {
		return err
	}
	for _, p := range []string{"bin", "run", "log", "ns", "src", "ssh", "state", "nodetmp", "etc/slurm/plugstack.conf.d", "etc/profile.d"} {
		if err := os.MkdirAll(filepath.Join(d, p), 0o755); err != nil {
			return err
		}
	}
	if err := mkdirOwned(filepath.Join(d, "state", "ctld"), 0o700, slurmUID, slurmGID); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(d, "log", "slurmctld.log"), "", 0o644); err != nil {
		return err
	}
	if err := os.Chown(filepath.Join(d, "log", "slurmctld.log"), slurmUID, slurmGID); err != nil {
		return err
	}
	files := map[string]string{
		"etc/slurm/slurm.conf":  tb.slurmConf(),
		"etc/slurm/cgroup.conf": "# Never used with proctrack/linuxproc + task/none, but Slurm 22.05 loads it;\n# autodetect fails under ip netns exec's fresh /sys.\nCgroupPlugin=cgroup/v1\n",
		"etc/slurm/plugstack.conf": "# SPANK plugins: drop a *.conf into plugstack.conf.d\ninclude " +
			filepath.Join(tb.SlurmConfDir(), "plugstack.conf.d") + "/*.conf\n",
		"etc/profile.d/palisade-testbed.sh": fmt.Sprintf("# testbed %s: the palisade binary on PATH\ncase \":$PATH:\" in *\":%[2]s:\"*) ;; *) PATH=\"%[2]s:$PATH\"; export PATH ;; esac\n",
			tb.Name, filepath.Join(d, "bin")),
		"src/mpi-hello.c": mpiHelloC,
	}
	// Keep what the host has in /etc/profile.d: the overlay replaces the directory.
	if ents, err := os.ReadDir("/etc/profile.d"); err == nil {
		for _, e := range ents {
			if e.Type().IsRegular() {
				if b, err := os.ReadFile(filepath.Join("/etc/profile.d", e.Name())); err == nil {
					files["etc/profile.d/"+e.Name()] = string(b)
				}
			}
		}
	}
	for p, c := range files {
		if err := writeFile(filepath.Join(d, p), c, 0o644); err != nil {
			return err
		}
	}
	hosts := tb.hostsFile()
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		etc := tb.NodeEtc(n.Name)
		if err := os.MkdirAll(filepath.Join(etc, "ssh"), 0o755); err != nil {
			return err
		}
		nf := map[string]string{
			"hosts": hosts,
			// The host's resolver is unreachable from the testbed (and
			// must not be sent to): names beyond /etc/hosts fail at once
			// on loopback instead of timing out.
			"resolv.conf":    "# testbed " + tb.Name + ": no DNS beyond /etc/hosts unless an extension provides one\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
			"hostname":       n.Name + "\n",
			"ssh/ssh_config": tb.sshConfig(),
		}
		if n.Name != "outside" {
			nf["ssh/sshd_config"] = tb.sshdConfig(n)
			nf["palisade/palisade.toml"] = tb.policyConfig(n)
			if err := mkdirOwned(filepath.Join(d, "state", n.Name), 0o755, 0, 0); err != nil {
				return err
			}
			if err := os.MkdirAll(filepath.Join(tb.RunDir(), n.Name), 0o755); err != nil {
				return err
			}
			if err := mkdirOwned(filepath.Join(d, "nodetmp", n.Name), 0o1777, 0, 0); err != nil {
				return err
			}
			if err := os.Symlink(tb.SlurmConfDir(), filepath.Join(etc, "slurm")); err != nil {
				return err
			}
			if lines := tb.pamLines(n.Name); lines != nil {
				if err := tb.writePAM(n.Name, lines); err != nil {
					return err
				}
			}
		}
		for p, c := range nf {
			if err := writeFile(filepath.Join(etc, p), c, 0o644); err != nil {
				return err
			}
		}
		if err := os.Symlink(filepath.Join(d, "etc", "profile.d"), filepath.Join(etc, "profile.d")); err != nil {
			return err
		}
		if err := writeFile(n.UTS, "", 0o644); err != nil {
			return err
		}
	}
	if tb.Directory != "" {
		return tb.writeDirectoryConfig()
	}
	return nil
}

// genKeys makes the munge key, the node host keys, root's key and the
// global known_hosts.
func (tb *Testbed) genKeys(ctx context.Context) error {
	d := tb.Dir
	mungeUID, mungeGID, err := lookupIDs("munge")
	if err != nil {
		return err
	}
	// munged insists on private directories; clients need to traverse to
	// the socket (0711 parent, 0755 socket dir).
	if err := mkdirOwned(filepath.Join(d, "munge"), 0o711, 0, 0); err != nil {
		return err
	}
	for _, p := range []string{"etc", "lib", "log"} {
		if err := mkdirOwned(filepath.Join(d, "munge", p), 0o700, mungeUID, mungeGID); err != nil {
			return err
		}
	}
	if err := mkdirOwned(filepath.Join(d, "munge", "run"), 0o755, mungeUID, mungeGID); err != nil {
		return err
	}
	key := make([]byte, 1024)
	if _, err := rand.Read(key); err != nil {
		return err
	}
	ck := make([]byte, 16)
	if _, err := rand.Read(ck); err != nil {
		return err
	}
	if err := os.WriteFile(tb.ClusterKeyPath(), []byte(hex.EncodeToString(ck)+"\n"), 0o600); err != nil {
		return err
	}
	kp := filepath.Join(d, "munge", "etc", "munge.key")
	if err := os.WriteFile(kp, key, 0o400); err != nil {
		return err
	}
	if err := os.Chown(kp, mungeUID, mungeGID); err != nil {
		return err
	}

	keygen := func(path, comment string) func() error {
		return func() error {
			_, err := run(ctx, "", "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path)
			return err
		}
	}
	var jobs []func() error
	jobs = append(jobs, keygen(tb.RootKey(), "root@testbed-"+tb.Name))
	for _, n := range tb.Nodes {
		jobs = append(jobs, keygen(filepath.Join(tb.SSHDir(n.Name), "ssh_host_ed25519_key"), "host "+n.Name))
	}
	if err := parallel(jobs...); err != nil {
		return err
	}
	pub, err := os.ReadFile(tb.RootKey() + ".pub")
	if err != nil {
		return err
	}
	if err := writeFile(filepath.Join(d, "ssh", "root_authorized_keys"), string(pub), 0o600); err != nil {
		return err
	}
	var kh strings.Builder
	for _, n := range tb.Nodes {
		pub, err := os.ReadFile(filepath.Join(tb.SSHDir(n.Name), "ssh_host_ed25519_key.pub"))
		if err != nil {
			return err
		}
		f := strings.Fields(string(pub))
		names := []string{n.Name, n.Eth0V4.String(), n.Eth0V6.String(), n.Name + "-ib", n.IBV4.String(), n.IBV6.String()}
		fmt.Fprintf(&kh, "%s %s %s\n", strings.Join(names, ","), f[0], f[1])
	}
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		if err := writeFile(filepath.Join(tb.SSHDir(n.Name), "ssh_known_hosts"), kh.String(), 0o644); err != nil {
			return err
		}
	}
	return nil
}
