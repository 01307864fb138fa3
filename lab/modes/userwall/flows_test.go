package userwall

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/palisade-hpc/palisade/internal/cli"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
)

// holdPy connects and keeps the connection open until stdin closes, so the
// connector's process is there to be named (a refused or finished
// connection's socket is gone by the time anyone asks).
const holdPy = `import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
s.sendall(b'hi'); s.recv(100)
print('CONNECTED', flush=True)
sys.stdin.read()
`

// hold connects as user from node and keeps the connection open until the
// end of the test.
func hold(t *testing.T, node, user, addr string, port int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := tb.Command(ctx, node, user, "/usr/bin/python3", "-c", holdPy, addr, strconv.Itoa(port))
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cancel(); cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "CONNECTED\n" {
		t.Fatalf("%s@%s → %s:%d: %q %v", user, node, addr, port, line, err)
	}
}

// flows runs `palisade flows -o json` as user on node.
func flows(t *testing.T, node, user string, args ...string) []uw.Flow {
	t.Helper()
	argv := append([]string{tb.Binary, "flows", "-o", "json", "--config", tb.ConfigPath(node)}, args...)
	cmd := tb.Command(context.Background(), node, user, argv...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("palisade flows as %q on %s: %v", user, node, err)
	}
	var fs []uw.Flow
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var f uw.Flow
		if err := dec.Decode(&f); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("palisade flows output: %v\n%s", err, out)
		}
		fs = append(fs, f)
	}
	return fs
}

func flowText(f uw.Flow) string {
	c := "-"
	if f.Connector != nil {
		c = fmt.Sprintf("%s %s[%d]@%s", f.Connector.User, f.Connector.Comm, f.Connector.PID, f.Connector.Node)
	}
	return fmt.Sprintf("%s %s %s → %s %s[%d]@%s %s", f.Verdict, f.Rule, c, f.Listener.User, f.Listener.Comm,
		f.Listener.PID, f.Listener.Node, f.Dst)
}

// findFlow waits until `palisade flows` as user on node lists a flow that
// match accepts, and returns it (nil after the deadline).
func findFlow(t *testing.T, node, user string, match func(uw.Flow) bool, args ...string) *uw.Flow {
	t.Helper()
	var found *uw.Flow
	var last []uw.Flow
	waitFor(t, fmt.Sprintf("a flow in `palisade flows %s` as %q on %s", strings.Join(args, " "), user, node), func() bool {
		last = flows(t, node, user, args...)
		for _, f := range last {
			if match(f) {
				found = &f
				return true
			}
		}
		return false
	})
	if found == nil {
		for _, f := range last {
			t.Logf("  listed: %s", flowText(f))
		}
	}
	return found
}

// flowPort is a port no earlier test (nor run, with -count) used: the
// agents remember the flows of earlier runs.
func flowPort() int {
	flowPorts++
	return 5700 + flowPorts
}

var flowPorts int

// TestFlows: alice's allowed and bob's refused connection to alice's
// listener on node2 appear in `palisade flows` on both nodes, with both
// ends' users, nodes, the listener's process and the rule; alice's
// connector process is named while it is connected; bob sees his own flow
// (without alice's process) and not alice's nor carol's; the metrics count
// the sample.
func TestFlows(t *testing.T) {
	needTestbed(t)
	port := flowPort()
	node2 := tb.Nodes[1].Eth0V4.String()
	listen(t, "node2", "alice", "tcp", "0.0.0.0", port)
	hold(t, "node1", "alice", node2, port)
	run(t, []tcase{
		{"node1", "bob", "tcp", node2, port, "ERR ECONNREFUSED", nil},
		{"node1", "carol", "tcp", node2, port, "ERR ECONNREFUSED", nil},
	})
	p := "--port=" + strconv.Itoa(port)
	for _, node := range []string{"node1", "node2"} {
		allowed := findFlow(t, node, "", func(f uw.Flow) bool {
			// Its process comes from node1, a moment after the verdict.
			return f.Verdict == "allow" && f.Connector != nil && f.Connector.User == "alice" && f.Connector.Comm != ""
		}, p)
		if f := allowed; f == nil || f.Rule != "same-user" || !f.Sampled || f.Connector.Node != "node1" ||
			f.Connector.Comm != "python3" || f.Connector.PID == 0 || f.Listener.User != "alice" ||
			f.Listener.Comm != "python3" || f.Listener.PID == 0 || f.Listener.Node != "node2" || f.Proto != "tcp" ||
			f.Dst != node2+":"+strconv.Itoa(port) {
			t.Errorf("%s: alice's allowed flow: %+v", node, f)
		}
		refused := findFlow(t, node, "", func(f uw.Flow) bool {
			return f.Verdict == "deny" && f.Connector != nil && f.Connector.User == "bob"
		}, p)
		if f := refused; f == nil || f.Rule != "default-deny" || f.Sampled || f.Connector.Node != "node1" ||
			f.Listener.User != "alice" || f.Listener.Comm != "python3" || f.Listener.Node != "node2" || f.Stamp != "valid" {
			t.Errorf("%s: bob's refused flow: %+v", node, f)
		}
	}
	// Filters: --verdict, --listener-user, --node.
	for _, f := range flows(t, "node1", "", p, "--verdict", "deny", "--node", "node2") {
		if f.Verdict != "deny" || f.Listener.Node != "node2" {
			t.Errorf("--verdict deny --node node2 listed %s", flowText(f))
		}
	}
	if fs := flows(t, "node1", "", p, "--node", "node1"); len(fs) != 0 {
		t.Errorf("--node node1 lists node2's flows: %d", len(fs))
	}
	// bob: his own refused flow, nothing of alice's or carol's.
	mine := flows(t, "node1", "bob", p)
	sawOwn := false
	for _, f := range mine {
		c := ""
		if f.Connector != nil {
			c = f.Connector.User
		}
		if c != "bob" && f.Listener.User != "bob" {
			t.Errorf("bob sees a flow he is no end of: %s", flowText(f))
		}
		sawOwn = sawOwn || c == "bob"
		if f.Listener.User != "bob" && (f.Listener.Comm != "" || f.Listener.PID != 0) {
			t.Errorf("bob sees %s's process: %s", f.Listener.User, flowText(f))
		}
	}
	if !sawOwn {
		t.Errorf("bob does not see his own refused flow (%d listed)", len(mine))
	}
	// Filters narrow a user's view, never widen it: carol's flows are not
	// bob's, whatever he asks.
	if fs := flows(t, "node1", "bob", p, "--user", "carol"); len(fs) != 0 {
		t.Errorf("bob with --user carol sees %d flows (e.g. %s)", len(fs), flowText(fs[0]))
	}
	if fs := flows(t, "node1", "carol", p, "--connector-user", "carol"); len(fs) != 1 {
		t.Errorf("carol sees %d of her flows, want 1", len(fs))
	}

	m, err := metrics("node2", "127.0.0.1:9464")
	if err != nil {
		t.Fatal(err)
	}
	for _, re := range []string{
		`palisade_userwall_allowed_samples_total\{outcome="sampled"\} [1-9]`,
		`palisade_userwall_flows_total\{outcome="recorded"\} [1-9]`,
		`palisade_userwall_refusals_top\{connector="bob",listener="alice",port="tcp/` + strconv.Itoa(port) + `",rule="default-deny",verdict="deny"\} [1-9]`,
	} {
		if !regexp.MustCompile(re).MatchString(m) {
			t.Errorf("node2's metrics lack %s", re)
		}
	}
}

// setAudit switches every node's agent in or out of audit mode by reload.
func setAudit(t *testing.T, on bool) {
	t.Helper()
	for _, n := range tb.Nodes {
		p := tb.ConfigPath(n.Name)
		b := string(must(os.ReadFile(p)))
		b = regexp.MustCompile(`(?m)^audit = (true|false)\n`).ReplaceAllString(b, "")
		b = strings.Replace(b, "[agent]\n", "[agent]\naudit = "+strconv.FormatBool(on)+"\n", 1)
		if err := os.WriteFile(p, []byte(b), 0o644); err != nil {
			t.Fatal(err)
		}
		if s := reload(t, n.Name); s.Audit != on {
			t.Fatalf("%s: audit %v after reload", n.Name, s.Audit)
		}
	}
}

// TestAuditReport: in audit mode bob reaches alice's listeners on both
// nodes (nothing refused); `palisade audit report` groups the would-be
// refusals of both nodes into one line (alice, the port, bob, default-deny,
// audit) with the count, both nodes and both ends' processes; carol's
// attempts are a line of their own; bob's report has only his; the
// metrics count them as audit, never deny.
func TestAuditReport(t *testing.T) {
	needTestbed(t)
	port := flowPort()
	setAudit(t, true)
	t.Cleanup(func() { setAudit(t, false) })
	n1, n2 := tb.Nodes[0].Eth0V4.String(), tb.Nodes[1].Eth0V4.String()
	listen(t, "node1", "alice", "tcp", "0.0.0.0", port)
	listen(t, "node2", "alice", "tcp", "0.0.0.0", port)
	denyBefore := decisionCount(t, "node2", "remote-tcp", "default-deny", "deny")
	hold(t, "node2", "bob", n1, port) // audit: let through
	hold(t, "node1", "bob", n2, port)
	run(t, []tcase{
		{"node2", "bob", "tcp", n1, port, "OK", nil},
		{"node1", "carol", "tcp", n2, port, "OK", nil},
	})
	var rep cli.AuditReport
	waitFor(t, "bob's 3 and carol's 1 would-be refusals in the audit report", func() bool {
		out, err := tb.Output(context.Background(), "node1", "", tb.Binary, "audit", "report", "-o", "json",
			"--since", "10m", "--port", strconv.Itoa(port), "--config", tb.ConfigPath("node1"))
		if err != nil {
			t.Fatal(err)
		}
		rep = cli.AuditReport{}
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		// The connectors' processes come from their nodes, a moment later.
		return len(rep.Groups) == 2 && rep.Groups[0].Count == 3 && rep.Groups[1].Count == 1 &&
			containsStr(rep.Groups[0].ConnectorProcs, "python3")
	})
	if len(rep.Groups) != 2 {
		t.Fatalf("groups: %+v", rep.Groups)
	}
	bob, carol := rep.Groups[0], rep.Groups[1]
	if bob.Connector == nil || bob.Connector.User != "bob" || bob.Listener.User != "alice" || int(bob.Port) != port ||
		bob.Proto != "tcp" || bob.Rule != "default-deny" || bob.Verdict != "audit" ||
		strings.Join(bob.Nodes, ",") != "node1,node2" || !containsStr(bob.ListenerProcs, "python3") ||
		!containsStr(bob.ConnectorProcs, "python3") || bob.First.After(bob.Last) {
		t.Errorf("bob's group: %+v (connector %+v)", bob, bob.Connector)
	}
	if carol.Connector == nil || carol.Connector.User != "carol" || carol.Verdict != "audit" ||
		strings.Join(carol.Nodes, ",") != "node2" {
		t.Errorf("carol's group: %+v", carol)
	}
	for _, n := range rep.Nodes {
		if n.Error != "" || !n.Audit {
			t.Errorf("node %+v", n)
		}
	}
	// bob's own report: his group only.
	out, err := tb.Output(context.Background(), "node2", "bob", tb.Binary, "audit", "report", "-o", "json",
		"--port", strconv.Itoa(port), "--config", tb.ConfigPath("node2"))
	if err != nil {
		t.Fatal(err)
	}
	var mine cli.AuditReport
	if err := json.Unmarshal([]byte(out), &mine); err != nil || len(mine.Groups) != 1 || mine.Groups[0].Connector.User != "bob" {
		t.Errorf("bob's audit report: %v\n%s", err, out)
	}
	// The text form an administrator reads.
	text, _ := tb.Output(context.Background(), "node1", "", tb.Binary, "audit", "report", "--port", strconv.Itoa(port),
		"--config", tb.ConfigPath("node1"))
	if !regexp.MustCompile(`(?m)^3 +audit +alice +tcp/` + strconv.Itoa(port) + ` +bob +default-deny +node1,node2 `).MatchString(text) {
		t.Errorf("audit report text:\n%s", text)
	}
	t.Logf("audit report:\n%s", text)
	if got := decisionCount(t, "node2", "remote-tcp", "default-deny", "deny"); got != denyBefore {
		t.Errorf("audit verdicts counted as deny: %d → %d", denyBefore, got)
	}
	if decisionCount(t, "node2", "remote-tcp", "default-deny", "audit") == 0 {
		t.Error("no decisions_total{verdict=\"audit\"} on node2")
	}
}

func containsStr(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// decisionCount reads palisade_userwall_decisions_total from node's metrics.
func decisionCount(t *testing.T, node, path, rule, verdict string) int {
	t.Helper()
	m, err := metrics(node, "127.0.0.1:9464")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`palisade_userwall_decisions_total\{path="` + path + `",rule="` + rule + `",verdict="` + verdict + `"\} (\d+)`)
	x := re.FindStringSubmatch(m)
	if x == nil {
		return 0
	}
	n, _ := strconv.Atoi(x[1])
	return n
}

// TestMetricsMapSizes: the map sizes the metrics report without walking the
// maps (what the agent wrote) are what the maps hold.
func TestMetricsMapSizes(t *testing.T) {
	needTestbed(t)
	st := status(t, "node2")
	metric := func(name string) string {
		m, err := metrics("node2", "127.0.0.1:9464")
		if err != nil {
			t.Fatal(err)
		}
		x := regexp.MustCompile(`palisade_userwall_map_entries\{map="` + name + `"\} (\d+)`).FindStringSubmatch(m)
		if x == nil {
			t.Fatalf("no map_entries metric for %s", name)
		}
		return x[1]
	}
	count := func(name string) string {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(st.PinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		defer mp.Close()
		n := 0
		k, v := make([]byte, mp.KeySize()), make([]byte, mp.ValueSize())
		for it := mp.Iterate(); it.Next(&k, &v); {
			n++
		}
		return strconv.Itoa(n)
	}
	for _, name := range []string{"exempt_conn", "exempt_lis", "local_addrs", "cluster_nets", "unenforced_nets", "members"} {
		// The membership tracker may write members meanwhile: a reading
		// counts when the metric is the same before and after the walk.
		var before, n, after string
		for range 5 {
			before, n, after = metric(name), count(name), metric(name)
			if before == after {
				break
			}
		}
		if before != after || n != before {
			t.Errorf("%s: metric %s (then %s), map holds %s", name, before, after, n)
		}
	}
}
