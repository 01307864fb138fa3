package userwall

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
)

// restartAgent stops node's agent (its pinned programs keep enforcing) and
// starts it again with the node's configuration file as it is now; it
// returns once the new agent enforces.
func restartAgent(t *testing.T, node string) {
	t.Helper()
	n, _ := tb.Node(node)
	if err := TermAgent(tb, node); err != nil {
		t.Fatal(err)
	}
	if err := StartAgent(context.Background(), tb, n); err != nil {
		t.Fatal(err)
	}
}

// editConfig rewrites node's configuration file with edit and restores it
// (and the agent's configuration, by restart) at the end of the test.
func editConfig(t *testing.T, node string, edit func(string) string) {
	t.Helper()
	p := tb.ConfigPath(node)
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		restartAgent(t, node)
	})
	c := edit(string(orig))
	if c == string(orig) {
		t.Fatalf("%s: the edit changed nothing", node)
	}
	if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
		t.Fatal(err)
	}
}

func hasError(s *control.Status, text string) bool {
	return slices.ContainsFunc(s.Errors, func(e string) bool { return strings.Contains(e, text) })
}

// capSet is a capability set of /proc/PID/status as names.
func procCaps(t *testing.T, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + field + `:\s*(\S+)$`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("no %s in /proc/%d/status", field, pid)
	}
	out, err := exec.Command("capsh", "--decode="+string(m[1])).Output()
	if err != nil {
		t.Fatal(err)
	}
	_, caps, _ := strings.Cut(strings.TrimSpace(string(out)), "=")
	return caps
}

// TestAgentAsTheUnitRunsIt: the testbed's agents run with exactly the
// shipped unit's capabilities, no_new_privs, read-only /etc and /usr, its
// system call filter and umask;
// under them the ident service still sees other users' processes: `who`
// from another node names the listener's process and group, and root's
// explain decides (before CAP_SYS_PTRACE was in the unit: "process not
// visible" and "undecided … gid 4294967295").
func TestAgentAsTheUnitRunsIt(t *testing.T) {
	needTestbed(t)
	u, err := AgentUnit()
	if err != nil {
		t.Fatal(err)
	}
	pid := control.ReadPid(AgentPidFile(tb, "node1"))
	if pid == 0 {
		t.Fatal("node1: no agent")
	}
	// The unit's set, less what this machine withholds from its root (a
	// container without CAP_SYS_RESOURCE, say): systemd could not grant
	// those either.
	ours := strings.Split(procCaps(t, os.Getpid(), "CapBnd"), ",")
	var want []string
	for _, c := range u.Caps {
		if slices.Contains(ours, "cap_"+c) {
			want = append(want, "cap_"+c)
		} else {
			t.Logf("this machine's root lacks cap_%s: not expected in the agent", c)
		}
	}
	for _, field := range []string{"CapBnd", "CapEff", "CapPrm"} {
		got := strings.Split(procCaps(t, pid, field), ",")
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("agent's %s = %v, want the unit's %v", field, got, want)
		}
	}
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if !regexp.MustCompile(`(?m)^NoNewPrivs:\s*1$`).Match(st) {
		t.Errorf("agent runs without no_new_privs")
	}
	// The unit's system call filter (2: a seccomp filter) and umask.
	if !strings.Contains(string(st), "\nSeccomp:\t2\n") || !strings.Contains(string(st), "\nUmask:\t"+u.Umask+"\n") {
		t.Errorf("agent's seccomp mode and umask (want 2, %s):\n%s\n%s", u.Umask, grepLines(string(st), "Seccomp:"), grepLines(string(st), "Umask:"))
	}
	mi, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	for _, d := range []string{"/etc", "/usr"} {
		if !regexp.MustCompile(`(?m)^\S+ \S+ \S+ \S+ ` + d + ` ro[, ]`).Match(mi) {
			t.Errorf("%s is not read-only for the agent", d)
		}
	}

	listen(t, "node1", "alice", "tcp", "0.0.0.0", 5401)
	addr := fmt.Sprintf("%s:5401", tb.Nodes[0].Eth0V4)
	n2, _ := tb.Node("node2")
	out, err := nodeCommand(context.Background(), tb, n2, "who", addr).CombinedOutput()
	if err != nil || strings.Contains(string(out), "not visible") || !regexp.MustCompile(`(?m)^process\s+\d+ python3`).Match(out) ||
		!regexp.MustCompile(`(?m)^group\s+alice`).Match(out) {
		t.Errorf("who %s from node2 (root): %v\n%s", addr, err, out)
	}
	out, err = nodeCommand(context.Background(), tb, n2, "explain", "--from", "bob", "--to", addr).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "DENY (rule default-deny)") || strings.Contains(string(out), "4294967295") {
		t.Errorf("explain --from bob --to %s from node2 (root): %v\n%s", addr, err, out)
	}
}

// TestStartsDespiteUnresolvableName: an exempt name NSS cannot resolve
// (an SSSD outage at boot, a deleted account) does not stop the agent: it
// enforces the rest, says so in status's first line, its log and its
// metrics, refuses a reload that keeps the name, and applies the name by
// itself once it resolves.
func TestStartsDespiteUnresolvableName(t *testing.T) {
	needTestbed(t)
	const ghost = "palopsghost"
	exec.Command("userdel", ghost).Run()
	t.Cleanup(func() { exec.Command("userdel", ghost).Run() })
	editConfig(t, "node2", func(c string) string {
		c = strings.Replace(c, `exempt_listeners = ["root", "slurm", "svc"`, `exempt_listeners = ["root", "slurm", "svc", "`+ghost+`"`, 1)
		return strings.Replace(c, "[agent]\n", "[agent]\ngroup_refresh = \"1s\"\n", 1)
	})
	restartAgent(t, "node2")
	s := status(t, "node2")
	if !strings.Contains(s.Headline, "ERROR") || !strings.Contains(s.Headline, `unknown user "`+ghost+`"`) || !hasError(s, `policy.exempt_listeners: unknown user "`+ghost+`"`) {
		t.Errorf("status: headline %q, errors %v", s.Headline, s.Errors)
	}
	log, _ := os.ReadFile(filepath.Join(tb.LogDir(), "node2-agent.log"))
	if !regexp.MustCompile(`level=ERROR msg="configuration: \S+: policy.exempt_listeners: unknown user \\"` + ghost).Match(log) {
		t.Errorf("the agent's log does not report the name as an ERROR")
	}
	m, err := metrics("node2", "127.0.0.1:9464")
	if err != nil || !strings.Contains(m, "palisade_config_unresolved_names 1") || !strings.Contains(m, `palisade_config_findings{level="ERROR"} 1`) {
		t.Errorf("metrics: %v\n%s", err, grepLines(m, "palisade_config"))
	}
	// Enforcing the rest: bob still cannot reach alice, alice reaches her own.
	listen(t, "node2", "alice", "tcp", "0.0.0.0", 5402)
	run(t, []tcase{
		{"node2", "bob", "tcp", "127.0.0.1", 5402, eperm, nil},
		{"node2", "alice", "tcp", "127.0.0.1", 5402, "OK", nil},
	})
	if why := reloadRefused(t, "node2"); !strings.Contains(why, `unknown user "`+ghost+`"`) {
		t.Errorf("reload refused for %q, want the unresolved name", why)
	}
	// The account appears: the agent exempts it without a reload.
	before := mapEntries(t, m, "exempt_lis")
	if out, err := exec.Command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ghost).CombinedOutput(); err != nil {
		t.Fatalf("useradd: %v %s", err, out)
	}
	// The agent resolves again on its 5 s tick once group_refresh (1 s)
	// has passed: wait for its acknowledgement (the state file), longer
	// than waitFor's 5 s on a loaded machine.
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := control.ReadState(AgentPidFile(tb, "node2"))
		if err == nil && st.Unresolved == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent did not resolve %s within 60 s", ghost)
		}
		time.Sleep(100 * time.Millisecond)
	}
	m, _ = metrics("node2", "127.0.0.1:9464")
	if after := mapEntries(t, m, "exempt_lis"); after != before+1 || !strings.Contains(m, "palisade_config_unresolved_names 0") {
		t.Errorf("after the name resolved: exempt_lis %d → %d\n%s", before, after, grepLines(m, "palisade_config"))
	}
	if s := status(t, "node2"); len(s.Errors) != 0 {
		t.Errorf("status errors after the name resolved: %v", s.Errors)
	}
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func mapEntries(t *testing.T, metrics, name string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^palisade_userwall_map_entries\{map="` + name + `"\} (\d+)$`).FindStringSubmatch(metrics)
	if m == nil {
		t.Fatalf("no map_entries for %s", name)
	}
	var n int
	fmt.Sscan(m[1], &n)
	return n
}

// TestReloadRefusesErrors: a file that config check calls an ERROR — the
// key file missing or readable by others, a subnet typo that leaves the
// node outside the cluster, an exempt name that does not resolve — is
// refused by `palisade agent --reload` (exit 1, the reason), the running
// configuration stays (same generation, cross-node traffic still works,
// the key still in force), and the metrics say the reload was refused.
func TestReloadRefusesErrors(t *testing.T) {
	needTestbed(t)
	const node = "node2"
	p := tb.ConfigPath(node)
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		if out, err := reloadNode(t, node); err != nil {
			t.Errorf("restoring: %v %s", err, out)
		}
	})
	listen(t, "node1", "alice", "tcp", "0.0.0.0", 5403)
	loose := filepath.Join(tb.Dir, "palisade-loose.key")
	body, _ := os.ReadFile(tb.ClusterKeyPath())
	os.WriteFile(loose, body, 0o644)
	defer os.Remove(loose)
	subnetsLine := regexp.MustCompile(`(?m)^subnets = .*$`)
	nodesLine := regexp.MustCompile(`(?m)^nodes = .*\n`)
	for _, tc := range []struct{ name, want string }{
		{"no key file", "no-such.key"},
		{"key readable by others", "palisade-loose.key"},
		{"subnet typo", "none of this node's addresses"},
		{"unresolvable name", `unknown user "palopsnobody"`},
	} {
		c := string(orig)
		switch tc.name {
		case "no key file":
			c = strings.Replace(c, tb.ClusterKeyPath(), filepath.Join(tb.Dir, "no-such.key"), 1)
		case "key readable by others":
			c = strings.Replace(c, tb.ClusterKeyPath(), loose, 1)
		case "subnet typo":
			c = withoutPolicyTests(nodesLine.ReplaceAllString(subnetsLine.ReplaceAllString(c, `subnets = ["198.81.0.0/24"]`), ""))
		case "unresolvable name":
			c = strings.Replace(c, `exempt_connectors = ["root"`, `exempt_connectors = ["root", "palopsnobody"`, 1)
		}
		os.WriteFile(p, []byte(c), 0o644)
		before, _ := control.ReadState(AgentPidFile(tb, node))
		out, err := reloadNode(t, node)
		if err == nil || !strings.Contains(out, "refused") || !strings.Contains(out, tc.want) {
			t.Errorf("%s: agent --reload: %v\n%s", tc.name, err, out)
		}
		after, _ := control.ReadState(AgentPidFile(tb, node))
		if after.Generation != before.Generation || !after.KeyLoaded {
			t.Errorf("%s: generation %d → %d, key loaded %v", tc.name, before.Generation, after.Generation, after.KeyLoaded)
		}
		run(t, []tcase{{node, "alice", "tcp", n1addr(), 5403, "OK", nil}})
		m, _ := metrics(node, "127.0.0.1:9464")
		if !strings.Contains(m, "palisade_config_last_reload_success 0") || !strings.Contains(m, "palisade_cluster_key_loaded 1") {
			t.Errorf("%s: metrics\n%s", tc.name, grepLines(m, "palisade_c"))
		}
		// config check says the same.
		cmd := tb.Command(context.Background(), node, "", tb.Binary, "config", "check", "--config", p)
		cout, _ := cmd.CombinedOutput()
		if cmd.ProcessState.ExitCode() != 1 || !strings.Contains(string(cout), "# ERROR: ") || !strings.Contains(string(cout), tc.want) {
			t.Errorf("%s: config check: exit %d\n%s", tc.name, cmd.ProcessState.ExitCode(), cout)
		}
	}
}

// TestStartsWithoutKey: an agent that starts without a usable key still
// enforces (its users' local traffic works and stays isolated), trusts no
// other node (fails closed), and says so first in status, in its metrics
// (palisade_cluster_key_loaded 0: PalisadeNoClusterKey) and its log.
func TestStartsWithoutKey(t *testing.T) {
	needTestbed(t)
	listen(t, "node1", "alice", "tcp", "::", 5311)
	listen(t, "node2", "alice", "tcp", "::", 5312)
	loose := filepath.Join(tb.Dir, "palisade-loose.key")
	body, _ := os.ReadFile(tb.ClusterKeyPath())
	os.WriteFile(loose, body, 0o644) // the right key, but world-readable
	defer os.Remove(loose)
	for _, bad := range []string{filepath.Join(tb.Dir, "no-such.key"), loose} {
		t.Run(filepath.Base(bad), func(t *testing.T) {
			editConfig(t, "node2", func(c string) string { return strings.Replace(c, tb.ClusterKeyPath(), bad, 1) })
			restartAgent(t, "node2")
			s := status(t, "node2")
			if !strings.HasPrefix(s.Headline, "enforcing, ERROR: no usable cluster key") {
				t.Errorf("status headline %q", s.Headline)
			}
			m, _ := metrics("node2", "127.0.0.1:9464")
			if !strings.Contains(m, "palisade_cluster_key_loaded 0") {
				t.Errorf("metrics\n%s", grepLines(m, "palisade_c"))
			}
			notDelivered(t, "node2", "alice", "tcp", n1addr(), 5311) // not believed on node1
			run(t, []tcase{
				{"node2", "alice", "tcp", "::1", 5312, "OK", nil}, // local traffic still works
				{"node2", "bob", "tcp", "::1", 5312, eperm, nil},  // and is still isolated
			})
		})
	}
	run(t, []tcase{{"node2", "alice", "tcp", n1addr(), 5311, "OK", nil}}) // key back
}

// TestLogRotationReopensWithoutReload: what the shipped logrotate file does
// (move the event log, then `palisade agent --reopen-logs`, SIGUSR1) makes
// the agent write to a new file without reloading its configuration (no
// reload counted, same generation); the next refusal is in the new file,
// not in the rotated one.
func TestLogRotationReopensWithoutReload(t *testing.T) {
	needTestbed(t)
	rot, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging/logrotate/palisade"))
	if err != nil {
		t.Fatal(err)
	}
	if regexp.MustCompile(`(?m)^\s*copytruncate`).Match(rot) || !strings.Contains(string(rot), "--signal=USR1 palisade-agent.service") ||
		!strings.Contains(string(rot), "/usr/bin/palisade agent --reopen-logs") || strings.Contains(string(rot), "HUP") {
		t.Errorf("packaging/logrotate/palisade does not reopen by SIGUSR1 / --reopen-logs:\n%s", rot)
	}
	const node = "node1"
	c, err := (&control.Options{ConfigPath: tb.ConfigPath(node)}).LoadConfig()
	if err != nil {
		t.Fatal(err)
	}
	logPath := c.Agent.EventLog
	before, err := control.ReadState(AgentPidFile(tb, node))
	if err != nil {
		t.Fatal(err)
	}
	rotated := logPath + ".1"
	if err := os.Rename(logPath, rotated); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(rotated)
	n, _ := tb.Node(node)
	if out, err := nodeCommand(context.Background(), tb, n, "agent", "--reopen-logs").CombinedOutput(); err != nil || !strings.Contains(string(out), "event log reopened") {
		t.Fatalf("agent --reopen-logs: %v %s", err, out)
	}
	after, _ := control.ReadState(AgentPidFile(tb, node))
	if after.LogReopens != before.LogReopens+1 || after.Reloads != before.Reloads || after.Generation != before.Generation {
		t.Errorf("state before %+v\nafter %+v", before, after)
	}
	listen(t, node, "alice", "tcp", "0.0.0.0", 5404)
	run(t, []tcase{{node, "carol", "tcp", "127.0.0.1", 5404, eperm, nil}})
	waitFor(t, "the refusal in the new event log", func() bool {
		b, _ := os.ReadFile(logPath)
		return strings.Contains(string(b), `"127.0.0.1:5404"`)
	})
	if b, _ := os.ReadFile(rotated); strings.Contains(string(b), `"127.0.0.1:5404"`) {
		t.Errorf("the refusal was written to the rotated file")
	}
}

// repoRoot is the module root (the tests run in their package directory).
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
	}
	t.Fatal("no go.mod above " + dir)
	return ""
}

// TestSlurmdGate: the shipped slurmd drop-in's ExecStartPre= (status
// --enforcing) lets slurmd start on a node whose programs are in force —
// also while the agent is stopped or restarting (the pins enforce) — and
// refuses it (exit 2) on a node with nothing in force.
func TestSlurmdGate(t *testing.T) {
	needTestbed(t)
	dropin, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging/systemd/slurmd-palisade.conf"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^ExecStartPre=/usr/bin/palisade (.*)$`).FindSubmatch(dropin)
	if m == nil {
		t.Fatalf("no ExecStartPre=/usr/bin/palisade in the drop-in:\n%s", dropin)
	}
	const node = "node2"
	n, _ := tb.Node(node)
	gate := func() (int, string) {
		cmd := nodeCommand(context.Background(), tb, n, strings.Fields(string(m[1]))...)
		out, _ := cmd.CombinedOutput()
		return cmd.ProcessState.ExitCode(), string(out)
	}
	if code, out := gate(); code != 0 || out != "" {
		t.Errorf("enforcing node: exit %d %q", code, out)
	}
	pidFile := AgentPidFile(tb, node)
	t.Cleanup(func() {
		if control.ReadPid(pidFile) == 0 {
			if err := StartAgent(context.Background(), tb, n); err != nil {
				t.Error(err)
			}
		}
	})
	if err := TermAgent(tb, node); err != nil {
		t.Fatal(err)
	}
	if code, out := gate(); code != 0 {
		t.Errorf("agent stopped, pins in force: exit %d %q", code, out)
	}
	if err := StopAgent(context.Background(), tb, n); err != nil {
		t.Fatal(err)
	}
	if code, out := gate(); code != 2 || !strings.Contains(out, "does not enforce") {
		t.Errorf("nothing in force: exit %d %q", code, out)
	}
	if err := StartAgent(context.Background(), tb, n); err != nil {
		t.Fatal(err)
	}
	if code, out := gate(); code != 0 {
		t.Errorf("enforcing again: exit %d %q", code, out)
	}
}

// TestStatusAllHostlist: [cluster] nodes as a Slurm hostlist of names
// ("node[1-2]"), resolved when status --all runs (the node's hosts file):
// each node is asked at its address; a name that does not resolve is
// "down" with the reason, not a failure of the whole view.
func TestStatusAllHostlist(t *testing.T) {
	needTestbed(t)
	p := tb.ConfigPath("node1")
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	defer os.WriteFile(p, orig, 0o644)
	c := withoutPolicyTests(regexp.MustCompile(`(?m)^nodes = .*$`).ReplaceAllString(string(orig), `nodes = ["node[1-2]", "palnode9"]`))
	if c == string(orig) {
		t.Fatal("no nodes line in node1's configuration")
	}
	os.WriteFile(p, []byte(c), 0o644)
	cmd := tb.Command(context.Background(), "node1", "", tb.Binary, "status", "--all", "--json", "--timeout", "5s", "--config", p)
	out, _ := cmd.Output()
	var view struct {
		Nodes []control.NodeView `json:"nodes"`
	}
	if err := json.Unmarshal(out, &view); err != nil {
		t.Fatalf("status --all: %v\n%s", err, out)
	}
	got := map[string]control.NodeView{}
	for _, v := range view.Nodes {
		got[v.Name] = v
	}
	for i, name := range []string{"node1", "node2"} {
		v := got[name]
		if v.Addr != tb.Nodes[i].Eth0V4 || v.Report == nil || v.Report.Mode != "userwall" {
			t.Errorf("%s: %+v", name, v)
		}
	}
	if v := got["palnode9"]; v.State != control.NodeDown || !strings.Contains(v.Error, "node palnode9: not resolvable") {
		t.Errorf("palnode9: %+v", v)
	}
	if cmd.ProcessState.ExitCode() != 2 {
		t.Errorf("exit %d, want 2 (a node down)", cmd.ProcessState.ExitCode())
	}
}

// TestExplainForPeople: explain takes node names as targets (--to
// node2:PORT, the example of its --help), answers what-if questions with no
// live listener (--port, --listener-user, --listener-group), and tells a
// user without access to the other node's ident service what their own
// listener would get; each answer agrees with what the kernel does.
func TestExplainForPeople(t *testing.T) {
	needTestbed(t)
	explain := func(user string, args ...string) string {
		t.Helper()
		out, err := tb.Command(context.Background(), "node1", user, append([]string{tb.Binary, "explain", "--config", tb.ConfigPath("node1")}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("explain %v as %q: %v\n%s", args, user, err, out)
		}
		return string(out)
	}
	n2 := tb.Nodes[1].Eth0V4.String()
	// A name as target, root looking the listener up: DENY, as the kernel.
	listen(t, "node2", "alice", "tcp", "0.0.0.0", 5405)
	if out := explain("", "--from", "bob", "--to", "node2:5405"); !strings.Contains(out, "("+"node2)") || !strings.Contains(out, "DENY (rule default-deny)") {
		t.Errorf("explain --from bob --to node2:5405:\n%s", out)
	}
	run(t, []tcase{{"node1", "bob", "tcp", n2, 5405, refused, nil}})
	// What-if, no listener on 5406 yet: bob reaches alice's service only
	// if she starts it under proj1.
	if out := explain("bob", "--to", "node2", "--port", "5406", "--listener-user", "alice", "--listener-group", "proj1"); !strings.Contains(out, "what-if") || !strings.Contains(out, "ALLOW (rule shared-group)") {
		t.Errorf("what-if under proj1:\n%s", out)
	}
	if out := explain("bob", "--to", "node2", "--port", "5406", "--listener-user", "alice"); !strings.Contains(out, "DENY (rule default-deny)") || !strings.Contains(out, "sg proj1") {
		t.Errorf("what-if under alice's own group:\n%s", out)
	}
	listen(t, "node2", "alice+proj1", "tcp", "0.0.0.0", 5406)
	run(t, []tcase{{"node1", "bob", "tcp", n2, 5406, "OK", nil}, {"node1", "carol", "tcp", n2, 5406, refused, nil}})
	// A user who may not ask node2: what her own listener gets.
	out := explain("alice", "--to", "node2:5405")
	if !strings.Contains(out, "undecided") || !strings.Contains(out, "if yours  ALLOW (rule same-user)") || !strings.Contains(out, "--listener-user") {
		t.Errorf("alice about her own listener:\n%s", out)
	}
	run(t, []tcase{{"node1", "alice", "tcp", n2, 5405, "OK", nil}})
	// Bad input: a clear error.
	cmd := tb.Command(context.Background(), "node1", "bob", tb.Binary, "explain", "--config", tb.ConfigPath("node1"), "--to", "palnosuchnode:5405")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), `node "palnosuchnode": not an address, a [cluster] node, a Slurm node or a resolvable name`) {
		t.Errorf("unknown node: %v\n%s", err, out)
	}
}

// withoutPolicyTests drops the [[test]] tables of a configuration (the
// testbed's name nodes by their [cluster] nodes addresses, which the tests
// above remove or turn into names).
func withoutPolicyTests(c string) string {
	var out []string
	in := false
	for _, l := range strings.Split(c, "\n") {
		if t := strings.TrimSpace(l); strings.HasPrefix(t, "[") {
			in = t == "[[test]]"
		}
		if !in {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
