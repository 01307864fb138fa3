package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// Instance names of this package's tests: other packages run their own
// testbeds at the same time, and two runs of this package (a developer's
// and `make test`) must not collide.
var (
	tbName   = RunName("tt")
	failName = RunName("tf")
	e2eName  = RunName("te")
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
	binDir  string
)

// palisadeBinary builds the product and the lab binary once for the
// package's tests, side by side, and returns the lab binary's path.
func palisadeBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "paltb-bin-")
		if binErr != nil {
			return
		}
		for name, pkg := range map[string]string{ProductName: "cmd/palisade", LabName: "cmd/palisade-lab"} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(binDir, name), "github.com/palisade-hpc/palisade/"+pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				binErr = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
				return
			}
		}
		binPath = filepath.Join(binDir, LabName)
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		DownOrphans(context.Background())
	}
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the testbed needs root")
	}
	if testing.Short() {
		t.Skip("-short: no testbed")
	}
}

// recMode records its hooks; it is the mode of the main test instance.
type recMode struct{ ups, downs atomic.Int32 }

func (m *recMode) Up(ctx context.Context, tb *Testbed) error {
	m.ups.Add(1)
	// A mode sees a working cluster.
	out, err := tb.Output(ctx, "node1", "", "hostname")
	if err != nil || strings.TrimSpace(out) != "node1" {
		return fmt.Errorf("mode up: hostname on node1 = %q, %v", out, err)
	}
	return nil
}
func (m *recMode) Down(context.Context, *Testbed) error { m.downs.Add(1); return nil }

// PAMSession logs every ssh session opening and closing (pam_exec runs as
// root, with PAM_USER and PAM_TYPE set).
func (m *recMode) PAMSession(tb *Testbed, node string) []string {
	script := filepath.Join(tb.Dir, "tbtest-pam.sh")
	os.WriteFile(script, []byte("#!/bin/sh\necho \"$PAM_TYPE $PAM_USER $(hostname) $(id -u)\" >> "+
		filepath.Join(tb.LogDir(), "tbtest-pam.log")+"\n"), 0o755)
	return []string{"session required pam_exec.so " + script}
}

// LoginPrefix marks users' commands on compute nodes through the
// environment (env execs the rest, as a real wrapper must).
func (m *recMode) LoginPrefix(tb *Testbed, node, user string) []string {
	return []string{"env", "TBTEST_LOGIN=" + node + ":" + user}
}

// failMode fails half-way, to prove that Up rolls back.
type failMode struct{ downs atomic.Int32 }

func (*failMode) Up(context.Context, *Testbed) error     { return errors.New("deliberate failure") }
func (m *failMode) Down(context.Context, *Testbed) error { m.downs.Add(1); return nil }

var (
	rec  = &recMode{}
	fail = &failMode{}
)

func init() {
	RegisterMode("tbtest", rec)
	RegisterMode("tbfail", fail)
}

// snapshot is what Down must restore.
type snapshot struct {
	netns, links, passwd, group string
	others                      []string // other instances registered
}

func takeSnapshot(t *testing.T) snapshot {
	t.Helper()
	var s snapshot
	s.netns = strings.Join(grepLines(mustRun(t, "ip", "netns", "list"), tbName), "\n")
	s.links = strings.Join(grepLines(mustRun(t, "ip", "-o", "link"), tbName), "\n")
	b, _ := os.ReadFile("/etc/passwd")
	s.passwd = string(b)
	b, _ = os.ReadFile("/etc/group")
	s.group = string(b)
	_ = withShared(func(sh *shared) error { s.others = slices.Clone(sh.Instances); return nil })
	return s
}

func grepLines(s, sub string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return out
}

func mustRun(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return string(out)
}

// leftovers lists live processes that mention the instance.
func leftovers(dir, name string) []string {
	var out []string
	for _, pid := range procfs.PIDs() {
		if !procfs.Alive(pid) || pid == os.Getpid() {
			continue
		}
		cl := strings.Join(procfs.Cmdline(pid), " ")
		if strings.Contains(cl, dir) || strings.Contains(cl, name+"-") {
			out = append(out, fmt.Sprintf("%d %s", pid, cl))
		}
	}
	return out
}

func TestBadInput(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	before := mustRun(t, "ip", "netns", "list")
	for _, o := range []Options{
		{Name: failName, Nodes: 99},
		{Name: failName, Nodes: -1},
		{Name: failName, Mode: "no-such-mode"},
		{Name: "Bad_Name"},
		{Name: "waytoolongname"},
	} {
		if _, err := Up(ctx, o); err == nil {
			t.Errorf("Up(%+v) succeeded", o)
			Down(ctx, o.Name)
		} else {
			t.Logf("Up(%+v): %v", o, err)
		}
		if _, err := os.Stat(InstanceDir(o.Name)); err == nil {
			t.Errorf("Up(%+v) created %s", o, InstanceDir(o.Name))
		}
	}
	if after := mustRun(t, "ip", "netns", "list"); len(grepLines(after, failName)) > 0 || len(grepLines(before, failName)) > 0 {
		t.Errorf("namespaces of %s exist: %s", failName, after)
	}
}

// TestRollback: a mode failing after bring-up leaves nothing behind.
func TestRollback(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	_, err := Up(ctx, Options{Name: failName, Nodes: 1, Mode: "tbfail", Binary: "/bin/true"})
	if err == nil || !strings.Contains(err.Error(), "deliberate failure") {
		t.Fatalf("Up with a failing mode: %v", err)
	}
	if fail.downs.Load() == 0 {
		t.Error("the failing mode's Down did not run on rollback")
	}
	if _, err := os.Stat(InstanceDir(failName)); err == nil {
		t.Errorf("%s left behind", InstanceDir(failName))
	}
	if _, err := os.Stat(lockPath(failName)); err == nil {
		t.Errorf("%s left behind", lockPath(failName))
	}
	if l := grepLines(mustRun(t, "ip", "-o", "link"), failName); len(l) > 0 {
		t.Errorf("links left: %v", l)
	}
	if l := grepLines(mustRun(t, "ip", "netns", "list"), failName); len(l) > 0 {
		t.Errorf("namespaces left: %v", l)
	}
	if l := leftovers(InstanceDir(failName), failName); len(l) > 0 {
		t.Errorf("processes left: %v", l)
	}
}

// TestTestbed brings the package's instance up, checks the cluster with
// real traffic, Slurm, ssh and MPI, and takes it down checking that
// nothing is left.
func TestTestbed(t *testing.T) {
	needRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	Down(ctx, tbName) // leftovers of an interrupted run
	before := takeSnapshot(t)
	rootSSH := dirListing("/root/.ssh")

	bin := palisadeBinary(t)
	start := time.Now()
	tb, err := Up(ctx, Options{Name: tbName, Nodes: 3, Mode: "tbtest", LabBinary: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("up in %s", time.Since(start))
	downed := false
	defer func() {
		if !downed {
			Down(context.Background(), tbName)
		}
	}()

	t.Run("Open", func(t *testing.T) {
		o, err := Open(tbName)
		if err != nil {
			t.Fatal(err)
		}
		if o.Mode != "tbtest" || len(o.Nodes) != 3 || o.Nodes[2].Eth0V6.String() != "2001:2::3" || o.Nodes[1].IBV4.String() != "198.19.0.2" {
			t.Errorf("Open: mode %s, nodes %+v", o.Mode, o.Nodes)
		}
		if rec.ups.Load() != 1 {
			t.Errorf("mode Up ran %d times", rec.ups.Load())
		}
	})
	t.Run("UpAgain", func(t *testing.T) {
		again, err := Up(ctx, Options{Name: tbName, Nodes: 3})
		if err != nil || !again.AlreadyUp {
			t.Fatalf("second Up: %v (already up %v)", err, again != nil && again.AlreadyUp)
		}
		if _, err := Up(ctx, Options{Name: tbName, Nodes: 4}); err == nil || !strings.Contains(err.Error(), "already up with 3 nodes") {
			t.Errorf("Up with another node count on a live testbed: %v", err)
		}
		out, err := exec.CommandContext(ctx, tb.LabBinary, "testbed", "up", "--name", tbName).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "testbed "+tbName+" is already up") {
			t.Errorf("palisade-lab testbed up on a live testbed: %v: %s", err, out)
		}
	})
	t.Run("CLIBadInput", func(t *testing.T) {
		for _, args := range [][]string{{"--nodes", "0"}, {"--nodes", "99"}, {"--mode", "nonesuch"}} {
			cmd := exec.CommandContext(ctx, tb.LabBinary, append([]string{"testbed", "up", "--name", failName}, args...)...)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Errorf("testbed up %v succeeded: %s", args, out)
				Down(ctx, failName)
			}
			if _, err := os.Stat(InstanceDir(failName)); err == nil {
				t.Errorf("testbed up %v created %s", args, InstanceDir(failName))
			}
		}
	})
	t.Run("Hostnames", func(t *testing.T) {
		for _, n := range append(tb.NodeNames(), "outside") {
			out, err := tb.Output(ctx, n, "alice", "hostname")
			if err != nil || strings.TrimSpace(out) != n {
				t.Errorf("hostname on %s: %q %v", n, out, err)
			}
		}
	})
	t.Run("Exec", func(t *testing.T) {
		out, err := tb.Output(ctx, "node2", "alice", "sh", "-c", `echo "$USER $HOME $(id -u) $(id -G) $(pwd)"; command -v palisade`)
		want := fmt.Sprintf("alice %s/alice 2001 2001 2100 %s/alice\n%s\n", HomeDir, HomeDir, tb.Binary)
		if err != nil || out != want {
			t.Errorf("login env: got %q want %q (%v)", out, want, err)
		}
		// The mode's login wrapper ran for a user on a compute node only.
		if out, err := tb.Output(ctx, "node3", "bob", "sh", "-c", "echo $TBTEST_LOGIN"); err != nil || out != "node3:bob\n" {
			t.Errorf("login wrapper for bob on node3: %q %v", out, err)
		}
		for _, c := range [][2]string{{"node3", ""}, {"outside", "bob"}} {
			if out, err := tb.Output(ctx, c[0], c[1], "sh", "-c", "echo x$TBTEST_LOGIN"); err != nil || out != "x\n" {
				t.Errorf("login wrapper ran for %q on %s: %q %v", c[1], c[0], out, err)
			}
		}
		err = tb.Command(ctx, "node1", "bob", "sh", "-c", "exit 7").Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Errorf("exit status: %v", err)
		}
		if err := tb.Command(ctx, "node9", "", "true").Run(); err == nil {
			t.Error("unknown node accepted")
		}
		if err := tb.Command(ctx, "node1", "nosuchuser", "true").Run(); err == nil {
			t.Error("unknown user accepted")
		}
		// CLI: stdin passes through, exit status propagates.
		cmd := exec.CommandContext(ctx, tb.LabBinary, "testbed", "exec", "--name", tbName, "node3", "--user", "carol", "--", "sh", "-c", "cat; hostname; exit 3")
		cmd.Stdin = strings.NewReader("from-stdin\n")
		outb, err := cmd.Output()
		if !errors.As(err, &ee) || ee.ExitCode() != 3 || string(outb) != "from-stdin\nnode3\n" {
			t.Errorf("testbed exec: %q %v", outb, err)
		}
	})
	t.Run("Overlay", func(t *testing.T) {
		out, err := tb.Output(ctx, "node2", "", "cat", "/etc/palisade/palisade.toml")
		if err != nil || !strings.Contains(out, `subnets = ["198.18.0.0/24", "198.19.0.0/24", "2001:2::/64", "2001:2:0:1::/64"]`) ||
			!strings.Contains(out, `exempt_listeners = ["root", "slurm", "svc"]`) || !strings.Contains(out, "node2 of testbed "+tbName) {
			t.Errorf("palisade.toml on node2: %v\n%s", err, out)
		}
		// The policy loader accepts the node's config as written.
		out, err = tb.Output(ctx, "node3", "", "palisade", "config", "check")
		if err != nil {
			t.Errorf("palisade config check on node3: %v\n%s", err, out)
		}
		out, err = tb.Output(ctx, "node1", "bob", "getent", "hosts", "node2")
		if err != nil || !strings.Contains(out, "node2") || !strings.Contains(out, "2001:2::2") && !strings.Contains(out, "198.18.0.2") {
			t.Errorf("getent hosts node2: %q %v", out, err)
		}
		// Unknown names fail at once inside the testbed (no query leaves it).
		t0 := time.Now()
		if out, err := tb.Output(ctx, "node1", "alice", "getent", "hosts", "nonesuch.example"); err == nil || time.Since(t0) > 2*time.Second {
			t.Errorf("lookup of an unknown name: %q %v after %s", out, err, time.Since(t0))
		}
		if _, err := os.Stat("/etc/palisade/palisade.toml"); err == nil {
			t.Error("the host's /etc/palisade got the node's config")
		}
	})
	t.Run("Network", func(t *testing.T) { testNetwork(ctx, t, tb) })
	t.Run("Slurm", func(t *testing.T) {
		out, err := tb.Output(ctx, "node1", "alice", "srun", "-N3", "hostname")
		lines := strings.Fields(out)
		sort.Strings(lines)
		if err != nil || strings.Join(lines, " ") != "node1 node2 node3" {
			t.Errorf("srun -N3 hostname: %q %v", out, err)
		}
		jobOut := filepath.Join(HomeDir, "bob", "tbtest-job.out")
		os.Remove(jobOut)
		out, err = tb.Output(ctx, "node2", "bob", "sbatch", "-N2", "-o", jobOut, "--wrap", "srun hostname; id -un")
		if err != nil || !strings.Contains(out, "Submitted batch job") {
			t.Fatalf("sbatch: %q %v", out, err)
		}
		var got string
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			b, _ := os.ReadFile(jobOut)
			if got = string(b); strings.Count(got, "\n") >= 3 {
				break
			}
		}
		l := strings.Fields(got)
		sort.Strings(l)
		if strings.Join(l, " ") != "bob node1 node2" {
			t.Errorf("sbatch job output: %q", got)
		}
		os.Remove(jobOut)
	})
	t.Run("SSH", func(t *testing.T) {
		for _, c := range []struct{ from, user, to string }{
			{"node1", "alice", "node2"}, {"node2", "bob", "node3-ib"}, {"node1", "", "node2"}, {"node3", "", "2001:2::1"},
			{"outside", "carol", "node1"}, {"node1", "svc", "node3"},
		} {
			out, err := tb.Output(ctx, c.from, c.user, "ssh", c.to, "hostname; id -un")
			host := strings.TrimSuffix(c.to, "-ib")
			if c.to == "2001:2::1" {
				host = "node1"
			}
			user := c.user
			if user == "" {
				user = "root"
			}
			if err != nil || out != host+"\n"+user+"\n" {
				t.Errorf("ssh %s -> %s as %s: %q %v", c.from, c.to, user, out, err)
			}
		}
		// The mode's PAM session hook saw the logins, as root, on the target node.
		b, _ := os.ReadFile(filepath.Join(tb.LogDir(), "tbtest-pam.log"))
		for _, want := range []string{"open_session alice node2 0", "open_session root node2 0", "open_session carol node1 0"} {
			if !strings.Contains(string(b), want) {
				t.Errorf("PAM session hook: no %q in\n%s", want, b)
			}
		}
		if _, err := os.Stat("/root/.ssh/known_hosts"); err == nil {
			b, _ := os.ReadFile("/root/.ssh/known_hosts")
			if strings.Contains(string(b), "198.18.0.") {
				t.Error("root's known_hosts got testbed entries")
			}
		}
	})
	t.Run("MPI", func(t *testing.T) {
		if tb.MPIHello == "" {
			t.Fatal("no MPI test program")
		}
		check := func(how, out string) {
			re := regexp.MustCompile(`(?m)^rank (\d) of 4 on (node\d) sum 4$`)
			m := re.FindAllStringSubmatch(out, -1)
			hosts := map[string]int{}
			ranks := map[string]bool{}
			for _, x := range m {
				hosts[x[2]]++
				ranks[x[1]] = true
			}
			twoEach := len(hosts) == 2
			for _, c := range hosts {
				twoEach = twoEach && c == 2
			}
			if len(m) != 4 || len(ranks) != 4 || !twoEach {
				t.Errorf("%s: %q", how, out)
			}
		}
		out, err := tb.Output(ctx, "node1", "alice", "srun", "-N2", "-n4", "--mpi=pmix", tb.MPIHello)
		if err != nil {
			t.Error(err)
		}
		check("srun --mpi=pmix", out)
		out, err = tb.Output(ctx, "node1", "bob", "salloc", "-N2", "--ntasks-per-node=2", "mpirun", tb.MPIHello)
		if err != nil {
			t.Error(err)
		}
		check("salloc mpirun", out)
	})
	t.Run("Groups", func(t *testing.T) {
		out, err := tb.Output(ctx, "node2", "alice", "sg", "proj1", "-c", "id -g")
		if err != nil || strings.TrimSpace(out) != "2100" {
			t.Errorf("alice sg proj1: %q %v", out, err)
		}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if out, err := tb.Output(sctx, "node2", "carol", "sg", "proj1", "-c", "id -g"); err == nil {
			t.Errorf("carol (not a member) got sg proj1: %q", out)
		}
	})
	t.Run("Status", func(t *testing.T) {
		st := tb.Status(ctx)
		if !strings.Contains(st, "mode tbtest") || strings.Count(st, " idle ") != 3 || strings.Contains(st, "DEAD") {
			t.Errorf("status:\n%s", st)
		}
	})

	// The namespaces' identities, to find any process still in them after Down.
	nsIDs := map[string]bool{}
	for _, ns := range tb.netnsNames() {
		if l, err := os.Readlink("/proc/self/fd/" + openFD(t, "/run/netns/"+ns)); err == nil {
			nsIDs[l] = true
		}
	}
	if len(nsIDs) != len(tb.netnsNames()) {
		t.Fatalf("namespaces: %v", nsIDs)
	}
	start = time.Now()
	if err := Down(ctx, tbName); err != nil {
		t.Fatal(err)
	}
	downed = true
	t.Logf("down in %s", time.Since(start))
	if rec.downs.Load() != 1 {
		t.Errorf("mode Down ran %d times", rec.downs.Load())
	}
	after := takeSnapshot(t)
	if after.netns != before.netns || after.links != before.links {
		t.Errorf("namespaces/links differ:\nbefore %q %q\nafter %q %q", before.netns, before.links, after.netns, after.links)
	}
	if l := leftovers(tb.Dir, tbName); len(l) > 0 {
		t.Errorf("processes left: %v", l)
	}
	for _, pid := range procfs.PIDs() {
		if l, err := procfs.Namespace(pid, "net"); err == nil && nsIDs[l] && procfs.Alive(pid) {
			t.Errorf("process %d (%q) still in a namespace of the testbed", pid, procfs.Cmdline(pid))
		}
	}
	if _, err := os.Stat(tb.Dir); err == nil {
		t.Errorf("%s left behind", tb.Dir)
	}
	if _, err := os.Stat(lockPath(tbName)); err == nil {
		t.Errorf("%s left behind", lockPath(tbName))
	}
	if got := dirListing("/root/.ssh"); got != rootSSH {
		t.Errorf("/root/.ssh changed:\nbefore %s\nafter %s", rootSSH, got)
	}
	for _, n := range tb.netnsNames() {
		if _, err := os.Lstat("/etc/netns/" + n); err == nil {
			t.Errorf("/etc/netns/%s left behind", n)
		}
	}
	if len(before.others) == 0 && len(after.others) == 0 {
		if before.passwd != after.passwd || before.group != after.group {
			t.Errorf("/etc/passwd or /etc/group changed:\nbefore\n%s\nafter\n%s", before.passwd, after.passwd)
		}
	} else {
		t.Logf("other instances up (%v / %v): users stay, /etc/passwd not compared", before.others, after.others)
	}
}

// testNetwork: each host runs a TCP listener answering with its hostname;
// connections on both underlays and both families, and across the router
// in both directions, must reach the right host.
func testNetwork(ctx context.Context, t *testing.T, tb *Testbed) {
	lctx, stop := context.WithCancel(ctx)
	defer stop()
	var cmds []*exec.Cmd
	for _, n := range append(tb.NodeNames(), "outside") {
		c := tb.Command(lctx, n, "carol", "socat", "TCP6-LISTEN:7000,reuseaddr,fork", "SYSTEM:hostname")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, c)
	}
	defer func() {
		stop()
		for _, c := range cmds {
			c.Wait()
		}
	}()
	type path struct{ from, to, addr string }
	var paths []path
	n1, n2, n3 := tb.Nodes[0], tb.Nodes[1], tb.Nodes[2]
	for _, a := range []string{n2.Eth0V4.String(), n2.Eth0V6.String(), n2.IBV4.String(), n2.IBV6.String()} {
		paths = append(paths, path{"node1", "node2", a})
	}
	paths = append(paths,
		path{"node3", "node1", n1.IBV6.String()},
		path{"node3", "outside", tb.Outside.Eth0V4.String()},
		path{"node3", "outside", tb.Outside.Eth0V6.String()},
		path{"outside", "node3", n3.Eth0V4.String()},
		path{"outside", "node2", n2.Eth0V6.String()},
		path{"node2", "node2", "127.0.0.1"},
		path{"node2", "node2", "::1"},
	)
	for _, p := range paths {
		addr := p.addr
		if strings.Contains(addr, ":") {
			addr = "[" + addr + "]"
		}
		var out string
		var err error
		// The listeners may still be starting.
		for i := 0; i < 30; i++ {
			out, err = tb.Output(ctx, p.from, "alice", "socat", "-T2", "-u", "TCP:"+addr+":7000,connect-timeout=2", "STDOUT")
			if err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil || strings.TrimSpace(out) != p.to {
			t.Errorf("%s -> %s (%s): %q %v", p.from, p.to, p.addr, out, err)
		}
	}
}

// TestEightNodes: the cluster scales to 8 nodes (addresses, Slurm, ssh).
func TestEightNodes(t *testing.T) {
	needRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := RunName("t8")
	tb, err := Up(ctx, Options{Name: name, Nodes: 8, Binary: "/bin/true"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := Down(context.Background(), name); err != nil {
			t.Error(err)
		}
		if l := grepLines(mustRun(t, "ip", "-o", "link"), name); len(l) > 0 {
			t.Errorf("links left: %v", l)
		}
	}()
	if tb.Nodes[7].Eth0V4.String() != "198.18.0.8" || tb.Nodes[7].IBV6.String() != "2001:2:0:1::8" {
		t.Errorf("node8 addresses: %+v", tb.Nodes[7])
	}
	out, err := tb.Output(ctx, "node8", "carol", "srun", "-N8", "hostname")
	got := strings.Fields(out)
	sort.Strings(got)
	if err != nil || strings.Join(got, " ") != "node1 node2 node3 node4 node5 node6 node7 node8" {
		t.Errorf("srun -N8 hostname: %q %v", out, err)
	}
	if out, err := tb.Output(ctx, "node8", "bob", "ssh", "node7-ib", "hostname"); err != nil || out != "node7\n" {
		t.Errorf("ssh node8 -> node7-ib: %q %v", out, err)
	}
}

// openFD opens path for the rest of the test and returns its fd number
// (nsfs files read back through /proc/self/fd as "net:[inode]").
func openFD(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return strconv.Itoa(int(f.Fd()))
}

// dirListing is names, sizes and mtimes of a directory's entries.
func dirListing(dir string) string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range ents {
		if fi, err := e.Info(); err == nil {
			fmt.Fprintf(&b, "%s %d %s; ", e.Name(), fi.Size(), fi.ModTime())
		}
	}
	return b.String()
}
