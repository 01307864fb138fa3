package check

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// instance is this package's own testbed: packages test in parallel, and
// other engineers run theirs on the same machine.
var instance = testbed.RunName("ck")

// TestIntegration brings up a real testbed, runs the whole matrix in mode
// none (everything must be open, data checked both ways), proves the
// harness sees refusal by rejecting one user's port inside one node, then
// brings the testbed down and checks that nothing is left behind.
func TestIntegration(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root: real network namespaces, Slurm, sshd")
	}
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	testbed.DownOrphans(ctx) // leftovers of interrupted runs
	before := takeSnapshot(t)
	t0 := time.Now()
	tb, err := testbed.Up(ctx, testbed.Options{Name: instance})
	if err != nil {
		testbed.Down(ctx, instance)
		t.Fatalf("testbed up: %v", err)
	}
	t.Logf("testbed %s up in %v", instance, time.Since(t0).Round(time.Millisecond))
	downed := false
	defer func() {
		if !downed {
			testbed.Down(context.Background(), instance)
		}
	}()

	t.Run("ModeNone", func(t *testing.T) { testModeNone(ctx, t, tb) })
	t.Run("SeesRefusal", func(t *testing.T) { testSeesRefusal(ctx, t, tb) })
	t.Run("Repeat", func(t *testing.T) { testRepeat(ctx, t, tb) })

	t0 = time.Now()
	downed = true
	if err := testbed.Down(ctx, instance); err != nil {
		t.Fatalf("testbed down: %v", err)
	}
	t.Logf("testbed %s down in %v", instance, time.Since(t0).Round(time.Millisecond))
	checkNothingLeft(t, before)
}

func testModeNone(ctx context.Context, t *testing.T, tb *testbed.Testbed) {
	t0 := time.Now()
	rep, err := Run(ctx, tb, Options{Mode: "none"})
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Since(t0)
	var table bytes.Buffer
	rep.WriteTable(&table)
	t.Logf("matrix in %v:\n%s", wall.Round(time.Millisecond), table.String())
	passed, failed := rep.Counts()
	if failed > 0 || passed != len(rep.Cases) {
		t.Errorf("mode none: %d passed, %d failed", passed, failed)
		for i, c := range rep.Failures() {
			if i == 40 {
				t.Errorf("… and %d more", failed-i)
				break
			}
			t.Errorf("%s", describeFailure(c))
		}
	}
	if len(rep.Cases) < 200 {
		t.Errorf("only %d cases, want at least 200", len(rep.Cases))
	}
	// Every launcher × path × protocol/family cell exists and every case
	// really exchanged data with the listener it aimed at.
	seen := map[string]int{}
	for _, c := range rep.Cases {
		seen[fmt.Sprintf("%s/%s/%s", c.Launcher, c.Path, c.ProtoFamily())]++
		if c.Observed.State == Allowed && (c.Observed.Peer == nil || c.Observed.Peer.UID != c.Listener.UID ||
			c.Observed.Peer.GID != c.Listener.GID || c.Observed.Peer.Host != c.Listener.Node) {
			t.Errorf("%s: answered by %v", c, c.Observed.Peer)
		}
	}
	for _, l := range Launchers {
		for _, p := range Paths {
			if p == OutsideIn && l != Plain {
				continue
			}
			for _, pf := range protoFams {
				if seen[fmt.Sprintf("%s/%s/%s", l, p, pf)] == 0 {
					t.Errorf("no case for %s %s %s", l, p, pf)
				}
			}
		}
	}
	// The listener under sg proj1 really ran with the group's gid, and the
	// MPI job really spanned two nodes.
	ranks := map[string]bool{}
	for _, c := range rep.Cases {
		if c.Listener.Name == "alice+proj1" && c.Observed.Peer != nil && c.Observed.Peer.GID != 2100 {
			t.Errorf("%s: proj1 listener answered with gid %d", c, c.Observed.Peer.GID)
		}
		if c.Launcher == MPIRun && c.Observed.State == Allowed {
			ranks[c.Connector.Node] = true
		}
	}
	if len(ranks) != 2 {
		t.Errorf("mpirun connectors answered from %d nodes, want 2", len(ranks))
	}
	noProbesLeft(t)
}

// testSeesRefusal rejects every connection to bob's listener port inside
// node2 (TCP reset, UDP ICMP administratively prohibited) with a table of
// our own, and requires that exactly the cases aimed at bob's listener on
// node2 — from every launcher and path that reaches it — are reported as
// refused, hence mismatches under mode none: the checker can fail.
func testSeesRefusal(ctx context.Context, t *testing.T, tb *testbed.Testbed) {
	node := tb.Nodes[1]
	var bob ListenerSpec
	for _, l := range Listeners {
		if l.Name == "bob" {
			bob = l
		}
	}
	rules := fmt.Sprintf(`table inet palchk {
	chain in {
		type filter hook input priority 0;
		tcp dport %d reject with tcp reset
		udp dport %d reject with icmpx admin-prohibited
	}
}
`, bob.Port, bob.Port)
	nft := exec.Command("ip", "netns", "exec", node.NetNS, "nft", "-f", "-")
	nft.Stdin = strings.NewReader(rules)
	if out, err := nft.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v\n%s", err, out)
	}
	defer func() {
		if out, err := exec.Command("ip", "netns", "exec", node.NetNS, "nft", "delete", "table", "inet", "palchk").CombinedOutput(); err != nil {
			t.Errorf("removing nft table palchk: %v %s", err, out)
		}
	}()
	rep, err := Run(ctx, tb, Options{Mode: "none", Quick: true})
	if err != nil {
		t.Fatal(err)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	t.Logf("with bob's port rejected on %s:\n%s", node.Name, table.String())
	refused, launchers := 0, map[Launcher]bool{}
	for _, c := range rep.Cases {
		target := c.Listener.Node == node.Name && c.Listener.Name == "bob"
		switch {
		case target && c.Observed.State != Refused:
			t.Errorf("%s: want refused, observed %s %s", c, c.Observed.State, c.Observed.Error)
		case target:
			refused++
			launchers[c.Launcher] = true
			if c.Passed() {
				t.Errorf("%s: refused yet passed under mode none", c)
			}
		case !c.Passed():
			t.Errorf("%s: should be untouched, observed %s %s %s", c, c.Observed.State, c.Observed.Kind, c.Observed.Error)
		}
	}
	_, failed := rep.Counts()
	if refused == 0 || failed != refused {
		t.Errorf("%d cases refused, %d failed: want the same, non-zero", refused, failed)
	}
	if len(launchers) != len(Launchers) {
		t.Errorf("refusal seen under %d launchers, want all %d", len(launchers), len(Launchers))
	}
	t.Logf("%d cases aimed at bob@%s refused and reported as mismatches; %d others passed", refused, node.Name, len(rep.Cases)-failed)
}

// testRepeat: --repeat runs the matrix again and again and counts every
// run's mismatches. Run 1 is clean; before run 2, bob's port is rejected on
// node2: exactly that run reports mismatches, and the total is theirs.
func testRepeat(ctx context.Context, t *testing.T, tb *testbed.Testbed) {
	node := tb.Nodes[1]
	rules := fmt.Sprintf("table inet palchk {\n chain in {\n  type filter hook input priority 0;\n  tcp dport %d reject with tcp reset\n  udp dport %d reject with icmpx admin-prohibited\n }\n}\n", bobPort(), bobPort())
	defer exec.Command("ip", "netns", "exec", node.NetNS, "nft", "delete", "table", "inet", "palchk").Run()
	var out bytes.Buffer
	opts := Options{Mode: "none", Quick: true, Launchers: []Launcher{Plain, SSH}}
	reps, err := RunRepeat(ctx, tb, opts, 2, func(i int, r *Report) {
		WriteRepeatRun(&out, i, 2, r, 5)
		if i == 1 {
			nft := exec.Command("ip", "netns", "exec", node.NetNS, "nft", "-f", "-")
			nft.Stdin = strings.NewReader(rules)
			if o, err := nft.CombinedOutput(); err != nil {
				t.Fatalf("nft: %v %s", err, o)
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	passed, failed := WriteRepeatSummary(&out, reps)
	t.Logf("repeat:\n%s", out.String())
	if len(reps) != 2 {
		t.Fatalf("%d runs, want 2", len(reps))
	}
	_, f1 := reps[0].Counts()
	_, f2 := reps[1].Counts()
	if f1 != 0 || f2 == 0 || failed != f2 || passed+failed != len(reps[0].Cases)+len(reps[1].Cases) {
		t.Errorf("run 1: %d failed, run 2: %d failed, total %d passed %d failed: want 0, >0 and the totals of both", f1, f2, passed, failed)
	}
	for _, c := range reps[1].Failures() {
		if c.Listener.Node != node.Name || c.Listener.Name != "bob" {
			t.Errorf("run 2: unexpected mismatch %s", describeFailure(c))
		}
	}
	if !strings.Contains(out.String(), "run 2/2: ") || !strings.HasSuffix(strings.TrimSpace(out.String()), fmt.Sprintf("%d passed, %d failed", passed, failed)) {
		t.Errorf("repeat output lacks the per-run or total line:\n%s", out.String())
	}
}

func bobPort() uint16 {
	for _, l := range Listeners {
		if l.Name == "bob" {
			return l.Port
		}
	}
	return 0
}

// noProbesLeft: every probe process a run started has ended.
func noProbesLeft(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := ourProcesses(func(cmdline string) bool {
			return strings.Contains(cmdline, "\x00probe\x00")
		})
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("probe processes left after the run: %v", left)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ourProcesses lists live processes of this instance (started through
// tb.Command, which sets PALISADE_TESTBED, or running from its directory)
// whose command line satisfies match.
func ourProcesses(match func(cmdline string) bool) []string {
	var out []string
	for _, pid := range procfs.PIDs() {
		if pid == os.Getpid() || !procfs.Alive(pid) {
			continue
		}
		cl := strings.Join(procfs.Cmdline(pid), "\x00")
		mine := slices.Contains(procfs.Environ(pid), "PALISADE_TESTBED="+instance) ||
			strings.Contains(cl, filepath.Join(testbed.BaseDir, instance)+"/")
		if mine && match("\x00"+cl+"\x00") {
			out = append(out, fmt.Sprintf("%d:%s", pid, strings.ReplaceAll(cl, "\x00", " ")))
		}
	}
	return out
}

// snapshot is the machine state `testbed down` must restore.
type snapshot struct {
	netns, links []string
	passwd       []byte
}

// scratch are the probe package's own namespaces (palchk-<pid>-a/b), which
// may come and go while this test runs.
var scratch = regexp.MustCompile(`^palchk-\d+-[ab]$`)

func takeSnapshot(t *testing.T) snapshot {
	t.Helper()
	var s snapshot
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, ln := range strings.Split(string(out), "\n") {
		if f := strings.Fields(ln); len(f) > 0 && strings.HasPrefix(f[0], instance+"-") && !scratch.MatchString(f[0]) {
			s.netns = append(s.netns, f[0])
		}
	}
	out, err = exec.Command("ip", "-o", "link", "show").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, ln := range strings.Split(string(out), "\n") {
		if f := strings.Fields(ln); len(f) > 1 && strings.HasPrefix(f[1], instance+"-") {
			s.links = append(s.links, strings.TrimSuffix(strings.SplitN(f[1], "@", 2)[0], ":"))
		}
	}
	if s.passwd, err = os.ReadFile("/etc/passwd"); err != nil {
		t.Fatal(err)
	}
	return s
}

func checkNothingLeft(t *testing.T, before snapshot) {
	t.Helper()
	var after snapshot
	var left []string
	deadline := time.Now().Add(5 * time.Second)
	for {
		after = takeSnapshot(t)
		left = ourProcesses(func(string) bool { return true })
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !slices.Equal(before.netns, after.netns) {
		t.Errorf("ip netns list: before %v, after %v", before.netns, after.netns)
	}
	if !slices.Equal(before.links, after.links) {
		t.Errorf("ip link: before %v, after %v", before.links, after.links)
	}
	if len(left) > 0 {
		t.Errorf("processes left: %v", left)
	}
	if !bytes.Equal(before.passwd, after.passwd) {
		// The testbed touches only its own accounts, and those are shared
		// by instances: another engineer's testbed coming up meanwhile may
		// add them. Other accounts are the host's, which may change them at
		// any time (lab/sidebyside does); they are not the testbed's to
		// restore.
		var ours, others []string
		for _, l := range passwdDiff(before.passwd, after.passwd) {
			if onlyTestbedUsers([]string{l}) {
				ours = append(ours, l)
			} else {
				others = append(others, l)
			}
		}
		if len(others) > 0 {
			t.Logf("/etc/passwd: accounts not the testbed's changed meanwhile: %v", others)
		}
		if len(ours) > 0 && otherInstanceUp() {
			t.Logf("/etc/passwd: the testbed's shared accounts changed by another instance meanwhile: %v", ours)
		} else if len(ours) > 0 {
			t.Errorf("/etc/passwd: the testbed's accounts changed: %v", ours)
		}
	}
}

func passwdDiff(a, b []byte) []string {
	la, lb := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	var d []string
	for _, l := range la {
		if !slices.Contains(lb, l) {
			d = append(d, "-"+l)
		}
	}
	for _, l := range lb {
		if !slices.Contains(la, l) {
			d = append(d, "+"+l)
		}
	}
	return d
}

func onlyTestbedUsers(diff []string) bool {
	for _, l := range diff {
		name, _, _ := strings.Cut(l[1:], ":")
		if !slices.Contains([]string{"alice", "bob", "carol", "svc"}, name) {
			return false
		}
	}
	return true
}

func otherInstanceUp() bool {
	ents, _ := os.ReadDir(testbed.BaseDir)
	for _, e := range ents {
		if e.Name() != instance && testbed.Exists(e.Name()) {
			return true
		}
	}
	return false
}
