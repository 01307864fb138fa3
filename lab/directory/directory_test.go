package directory

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// As cmd/palisade-lab wires it (the check runs in the lab binary, which
// registers the check settler itself).
func init() { testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{}) }

// bound is the stated bound on a membership change reaching the kernel
// (docs/policy.md): group_refresh + SSSD's entry_cache_timeout + one
// lookup round (well under a second at this size).
var bound = testbed.GroupRefresh + testbed.SSSDCacheTimeout + 2*time.Second

// waitProj1 waits until node's NSS (SSSD, as sg asks it) lists bob in proj1
// as want. SSSD serves its cache for up to SSSDCacheTimeout after a directory
// change, so a subtest that starts right after an earlier one re-added bob
// would see sg prompt bob for proj1's password (ci4: it waited on the pipe
// until the test's deadline). Polled: SSSD sends no signal.
func waitProj1(ctx context.Context, t *testing.T, dt *testbed.Testbed, node string, want bool) {
	t.Helper()
	t0 := time.Now()
	for {
		out, err := dt.Output(ctx, node, "", "getent", "group", "proj1")
		f := strings.Split(strings.TrimSpace(out), ":")
		if err == nil && len(f) == 4 && slices.Contains(strings.Split(f[3], ","), "bob") == want {
			return
		}
		if time.Since(t0) > bound+10*time.Second {
			t.Fatalf("%s: getent group proj1 = %q (%v) after %v, want bob a member: %v", node, out, err, time.Since(t0), want)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestDirectoryUserwall runs the userwall agent on a testbed whose accounts
// come from LDAP through SSSD without enumeration: the whole check matrix
// (shared-group cases included, cross-node), then a membership change in
// the directory (bob out of proj1 and back) reaching the kernel within the
// stated bound.
func TestDirectoryUserwall(t *testing.T) {
	if os.Geteuid() != 0 || testing.Short() {
		t.Skip("needs root (brings up a testbed)")
	}
	name := testbed.RunName("dm")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	testbed.DownOrphans(ctx)
	dt, err := testbed.Up(ctx, testbed.Options{Name: name, Nodes: 3, Mode: "userwall", Directory: testbed.DirectoryLDAP})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := testbed.Down(context.Background(), name); err != nil {
			t.Error(err)
		}
	}()

	// The agent (host mount namespace, for bpffs) sees the node's accounts.
	for _, n := range dt.Nodes {
		pid, _ := os.ReadFile(filepath.Join(dt.RunDir(), n.Name, "agent.pid"))
		b, err := os.ReadFile("/proc/" + strings.TrimSpace(string(pid)) + "/root/etc/group")
		if err != nil || strings.Contains(string(b), "proj1:") || !strings.Contains(string(b), "root:") {
			t.Fatalf("%s: the agent's /etc/group is not the node's: %v\n%s", n.Name, err, b)
		}
	}

	t.Run("check", func(t *testing.T) {
		out, err := exec.CommandContext(ctx, dt.LabBinary, "check", "--name", name, "--mode", "userwall", "--quiet").CombinedOutput()
		s := string(out)
		// Shared-group cases must be in the matrix (and pass), whatever its size.
		if err != nil || !strings.Contains(s, " 0 failed") || !regexp.MustCompile(`shared-group [1-9][0-9]* allow`).MatchString(s) {
			t.Fatalf("check --mode userwall: %v\n%s", err, s)
		}
	})

	t.Run("membership-change", func(t *testing.T) {
		// alice listens on node2 under sg proj1 (socket gid 2100).
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		l := dt.Command(lctx, "node2", "alice", "sg", "proj1", "-c",
			"exec "+dt.LabBinary+" probe listen --ports 29500 --exit-on-stdin-eof --lifetime 10m")
		stdin, _ := l.StdinPipe()
		stdout, _ := l.StdoutPipe()
		if err := l.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { stdin.Close(); lcancel(); l.Wait() }()
		if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || !strings.Contains(line, `"gid":2100`) {
			t.Fatalf("listener: %q %v", line, err)
		}
		allowed := func(user string) bool {
			out, err := dt.Output(ctx, "node1", user, dt.LabBinary, "probe", "connect", "tcp:198.18.0.2:29500")
			if err != nil {
				t.Fatal(err)
			}
			return strings.Contains(out, `"allowed":true`)
		}
		// until polls user's connection until it is allowed (want) and
		// returns how long that took; alice (same user) and carol (never a
		// member) are the controls.
		until := func(user string, want bool) time.Duration {
			t0 := time.Now()
			for allowed(user) != want {
				if time.Since(t0) > bound+10*time.Second {
					t.Fatalf("%s still allowed=%v after %v", user, !want, time.Since(t0))
				}
				time.Sleep(100 * time.Millisecond) // sampling the kernel's decision; there is nothing to wait on
			}
			if !allowed("alice") || allowed("carol") {
				t.Fatal("controls: alice must always reach her listener, carol never")
			}
			return time.Since(t0)
		}
		until("bob", true)
		modify := func(op string) {
			if err := dt.LDAPModify(ctx, "dn: cn=proj1,ou=groups,"+testbed.LDAPBase+"\nchangetype: modify\n"+op+": memberUid\nmemberUid: bob\n"); err != nil {
				t.Fatal(err)
			}
		}
		modify("delete")
		if d := until("bob", false); d > bound {
			t.Errorf("bob removed from proj1: took %v to apply, bound %v", d, bound)
		} else {
			t.Logf("bob removed from proj1: applied cross-node in %v (bound %v)", d.Round(time.Millisecond), bound)
		}
		modify("add")
		if d := until("bob", true); d > bound {
			t.Errorf("bob added to proj1: took %v, bound %v", d, bound)
		} else {
			t.Logf("bob added to proj1: applied in %v (bound %v)", d.Round(time.Millisecond), bound)
		}
	})
	t.Run("revocation-live-process", func(t *testing.T) {
		// bob's process started under sg proj1 keeps egid 2100 after bob
		// leaves proj1 in the directory: the gid its connections carry is a
		// claim, checked against membership on the listener's node. alice
		// listens on node2 under sg proj1; bob's long-lived shell on node1
		// (sg proj1) connects once per line it reads.
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		l := dt.Command(lctx, "node2", "alice", "sg", "proj1", "-c",
			"exec "+dt.LabBinary+" probe listen --ports 29502 --exit-on-stdin-eof --lifetime 10m")
		lin, _ := l.StdinPipe()
		lout, _ := l.StdoutPipe()
		if err := l.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { lin.Close(); lcancel(); l.Wait() }()
		if line, err := bufio.NewReader(lout).ReadString('\n'); err != nil || !strings.Contains(line, `"gid":2100`) {
			t.Fatalf("listener: %q %v", line, err)
		}
		waitProj1(ctx, t, dt, "node1", true)
		b := dt.Command(lctx, "node1", "bob", "sg", "proj1", "-c",
			"while read x; do "+dt.LabBinary+" probe connect tcp:198.18.0.2:29502; echo PALEND; done")
		bin, _ := b.StdinPipe()
		bout, _ := b.StdoutPipe()
		if err := b.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { bin.Close(); lcancel(); b.Wait() }()
		br := bufio.NewReader(bout)
		allowed := func() bool {
			if _, err := io.WriteString(bin, "go\n"); err != nil {
				t.Fatal(err)
			}
			ok := false
			for {
				line, err := br.ReadString('\n')
				if err != nil {
					t.Fatalf("bob's sg proj1 shell: %v", err)
				}
				if strings.HasPrefix(line, "PALEND") {
					return ok
				}
				if strings.Contains(line, `"start"`) && !strings.Contains(line, "2100") {
					t.Fatalf("bob's process does not run with proj1: %s", line)
				}
				ok = ok || strings.Contains(line, `"allowed":true`)
			}
		}
		until := func(want bool) time.Duration {
			t0 := time.Now()
			for allowed() != want {
				if time.Since(t0) > bound+10*time.Second {
					t.Fatalf("bob's live sg proj1 process still allowed=%v after %v", !want, time.Since(t0))
				}
				time.Sleep(100 * time.Millisecond) // sampling the kernel's decision; there is nothing to wait on
			}
			return time.Since(t0)
		}
		until(true)
		modify := func(op string) {
			if err := dt.LDAPModify(ctx, "dn: cn=proj1,ou=groups,"+testbed.LDAPBase+"\nchangetype: modify\n"+op+": memberUid\nmemberUid: bob\n"); err != nil {
				t.Fatal(err)
			}
		}
		modify("delete")
		defer modify("add")
		if d := until(false); d > bound {
			t.Errorf("bob removed from proj1: his live process was refused after %v, bound %v", d, bound)
		} else {
			t.Logf("bob removed from proj1: his live sg proj1 process refused cross-node after %v (bound %v)", d.Round(time.Millisecond), bound)
		}
	})
	t.Run("revocation-first-contact", func(t *testing.T) {
		// As revocation-live-process, but the listener's node has never
		// looked bob up: its agent restarts (knowing only node3's own
		// users) after bob left proj1. Only node1, where bob's sg proj1
		// shell runs, knows he is no longer a member: it must not seal
		// proj1 into his identity, or node3 takes the gid on his word.
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		l := dt.Command(lctx, "node3", "alice", "sg", "proj1", "-c",
			"exec "+dt.LabBinary+" probe listen --ports 29503 --exit-on-stdin-eof --lifetime 10m")
		lin, _ := l.StdinPipe()
		lout, _ := l.StdoutPipe()
		if err := l.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { lin.Close(); lcancel(); l.Wait() }()
		if line, err := bufio.NewReader(lout).ReadString('\n'); err != nil || !strings.Contains(line, `"gid":2100`) {
			t.Fatalf("listener: %q %v", line, err)
		}
		waitProj1(ctx, t, dt, "node1", true)
		b := dt.Command(lctx, "node1", "bob", "sg", "proj1", "-c",
			"echo PALREADY $(id -g); while read x; do "+dt.LabBinary+" probe connect tcp:198.18.0.3:29503; echo PALEND; done")
		bin, _ := b.StdinPipe()
		bout, _ := b.StdoutPipe()
		if err := b.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { bin.Close(); lcancel(); b.Wait() }()
		br := bufio.NewReader(bout)
		// sg has switched to proj1 before bob leaves it (ci3: under load
		// sg looked the group up after the LDAP change, refused, and the
		// shell was gone: "EOF").
		if line, err := br.ReadString('\n'); err != nil || strings.TrimSpace(line) != "PALREADY 2100" {
			t.Fatalf("bob's sg proj1 shell did not start in proj1: %q %v", line, err)
		}
		modify := func(op string) {
			if err := dt.LDAPModify(ctx, "dn: cn=proj1,ou=groups,"+testbed.LDAPBase+"\nchangetype: modify\n"+op+": memberUid\nmemberUid: bob\n"); err != nil {
				t.Fatal(err)
			}
		}
		// bob's shell has run on node1 for a while: node1 has looked him
		// up (he is one of its users) and has him in proj1.
		if err := userwalllab.WaitKnown(ctx, dt, "node1", 2002, true, bound); err != nil {
			t.Fatal(err)
		}
		if err := userwalllab.WaitMembers(ctx, dt, "node1", []kernel.MemberPair{{UID: 2002, GID: 2100}}, bound); err != nil {
			t.Fatal(err)
		}
		modify("delete")
		defer modify("add")
		// node1's agent no longer has bob in proj1 (its acknowledgement).
		pin1, err := userwalllab.NodePinDir(dt, "node1")
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		for {
			missing, err := kernel.MissingMembers(pin1, []kernel.MemberPair{{UID: 2002, GID: 2100}})
			if err == nil && len(missing) == 1 {
				break
			}
			if time.Since(t0) > bound+10*time.Second {
				t.Fatalf("node1 still has bob in proj1 after %v (%v)", time.Since(t0), err)
			}
			time.Sleep(100 * time.Millisecond) // polling the pinned map: the agent sends no signal
		}
		// node3 forgets whom it looked up.
		n3, _ := dt.Node("node3")
		if err := userwalllab.TermAgent(dt, "node3"); err != nil {
			t.Fatal(err)
		}
		if err := userwalllab.StartAgent(ctx, dt, n3); err != nil {
			t.Fatal(err)
		}
		pin3, err := userwalllab.NodePinDir(dt, "node3")
		if err != nil {
			t.Fatal(err)
		}
		if known, err := kernel.KnowsUser(pin3, 2002); err != nil || known {
			t.Fatalf("node3 knows bob after its agent restarted (%v)", err)
		}
		if _, err := io.WriteString(bin, "go\n"); err != nil {
			t.Fatal(err)
		}
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("bob's sg proj1 shell: %v", err)
			}
			if strings.HasPrefix(line, "PALEND") {
				break
			}
			if strings.Contains(line, `"allowed":true`) {
				t.Fatalf("bob, out of proj1, reached alice's proj1 listener on node3 on his first contact: %s", line)
			}
		}
		// The control: alice from node1 (same user) reaches it.
		out, err := dt.Output(ctx, "node1", "alice", dt.LabBinary, "probe", "connect", "tcp:198.18.0.3:29503")
		if err != nil || !strings.Contains(out, `"allowed":true`) {
			t.Fatalf("control: alice from node1: %v %s", err, out)
		}
	})
	t.Run("exempt-group", func(t *testing.T) {
		// bob listens on node2 as himself; carol (node1) shares nothing
		// with him. The nodes exempt the connectors of "@2300" (hpc-portal
		// in the directory, svc only at first).
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		l := dt.Command(lctx, "node2", "bob", dt.LabBinary, "probe", "listen", "--ports", "29501", "--exit-on-stdin-eof", "--lifetime", "10m")
		stdin, _ := l.StdinPipe()
		stdout, _ := l.StdoutPipe()
		if err := l.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { stdin.Close(); lcancel(); l.Wait() }()
		if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || !strings.Contains(line, `"ready"`) {
			t.Fatalf("listener: %q %v", line, err)
		}
		allowed := func(user string) bool {
			out, err := dt.Output(ctx, "node1", user, dt.LabBinary, "probe", "connect", "tcp:198.18.0.2:29501")
			if err != nil {
				t.Fatal(err)
			}
			return strings.Contains(out, `"allowed":true`)
		}
		until := func(want bool) time.Duration {
			t0 := time.Now()
			for allowed("carol") != want {
				if time.Since(t0) > bound+10*time.Second {
					t.Fatalf("carol still allowed=%v after %v", !want, time.Since(t0))
				}
				time.Sleep(100 * time.Millisecond) // sampling the kernel's decision
			}
			if !allowed("svc") || allowed("alice") {
				t.Fatal("controls: svc (in hpc-portal) must reach bob's listener, alice never")
			}
			return time.Since(t0)
		}
		until(false)
		modify := func(op string) {
			if err := dt.LDAPModify(ctx, "dn: cn=hpc-portal,ou=groups,"+testbed.LDAPBase+"\nchangetype: modify\n"+op+": memberUid\nmemberUid: carol\n"); err != nil {
				t.Fatal(err)
			}
		}
		modify("add")
		if d := until(true); d > bound {
			t.Errorf("carol added to hpc-portal: exempt after %v, bound %v", d, bound)
		} else {
			t.Logf("carol added to hpc-portal: exempt connector after %v", d.Round(time.Millisecond))
		}
		modify("delete")
		if d := until(false); d > bound {
			t.Errorf("carol removed from hpc-portal: still exempt after %v, bound %v", d, bound)
		} else {
			t.Logf("carol removed from hpc-portal: refused again after %v", d.Round(time.Millisecond))
		}
	})
}
