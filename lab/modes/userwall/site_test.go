package userwall

import (
	"context"
	"os"
	"strings"
	"testing"
)

// siteRules has a site rule of every kind ([[rule]], docs/policy.md), each
// on ports of its own, and a [[test]] per rule (the agent refuses a policy
// whose tests fail).
const siteRules = `
[[rule]]
name = "carol-alice"          # users
action = "allow"
from = ["carol"]
to = ["alice"]
ports = [9150]
proto = "tcp"

[[rule]]
name = "proj1-reaches-9160"   # connector group
action = "allow"
from = ["@proj1"]
ports = [9160]

[[rule]]
name = "no-bob-on-node2"      # deny, listener node set
action = "deny"
from = ["bob"]
on_nodes = ["node[2-3]"]
ports = [9170]

[[rule]]
name = "from-node1"           # connector node set (hostlist)
action = "allow"
from_nodes = ["node[1]"]
to = ["alice"]
ports = [9180]

[[rule]]
name = "from-ib"              # subnet
action = "allow"
from_subnets = ["198.19.0.0/24", "2001:2:0:1::/64"]
to = ["alice"]
ports = [9190]

[[rule]]
name = "outside-9200"         # off-cluster subnet, no identity asked
action = "allow"
from_subnets = ["198.18.200.0/24"]
ports = [9200]

[[rule]]
name = "to-proj1-members"     # listener group
action = "allow"
to = ["@proj1"]
ports = [9210]

[[rule]]
name = "no-project-tcp-9220"  # relation, protocol
action = "deny"
relation = "shared-group"
ports = [9220]
proto = "tcp"

[[rule]]
name = "carol-range"          # port range
action = "allow"
from = ["carol"]
ports = ["9230-9239"]

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
node = "node2"
port = 9150
expect = "allow"
rule = "carol-alice"

[[test]]
from = "carol"
from_node = "node1"
to = "bob"
port = 9160
expect = "deny"
rule = "default-deny"

[[test]]
from = "alice"
from_node = "node1"
to = "bob"
port = 9160
expect = "allow"
rule = "proj1-reaches-9160"

[[test]]
from = "bob"
from_node = "node1"
to = "bob"
node = "node2"
port = 9170
expect = "deny"
rule = "no-bob-on-node2"

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
node = "node2"
port = 9180
expect = "allow"
rule = "from-node1"

[[test]]
from = "carol"
source = "198.19.0.1"
to = "alice"
port = 9190
expect = "allow"
rule = "from-ib"

[[test]]
from = "carol"
source = "198.18.200.1"
to = "alice"
port = 9200
expect = "allow"
rule = "outside-9200"

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
port = 9210
expect = "allow"
rule = "to-proj1-members"

[[test]]
from = "bob"
from_node = "node1"
to = "alice"
to_group = "proj1"
port = 9220
expect = "deny"
rule = "no-project-tcp-9220"

[[test]]
from = "carol"
from_node = "node1"
to = "bob"
port = 9235
expect = "allow"
rule = "carol-range"
`

// TestSiteRules: every kind of site rule, positive and negative, with real
// connections between the testbed's nodes under the real agents; explain
// names the rule, the event log too; a policy whose [[test]] fails is
// refused by `agent --reload` and by the agent itself (SIGHUP), and the
// running rules stay enforced.
func TestSiteRules(t *testing.T) {
	needTestbed(t)
	orig := map[string][]byte{}
	for _, n := range tb.Nodes[:2] {
		p := tb.ConfigPath(n.Name)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		orig[n.Name] = b
		t.Cleanup(func() {
			os.WriteFile(p, orig[n.Name], 0o644)
			if s, err := signalReload(n.Name); err != nil || s.LastReloadError != "" {
				t.Errorf("%s: restoring the configuration: %v %+v", n.Name, err, s)
			}
		})
		if err := os.WriteFile(p, append(append([]byte{}, b...), siteRules...), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := reloadNode(t, n.Name); err != nil {
			t.Fatalf("%s: reload with site rules: %v\n%s", n.Name, err, out)
		}
	}
	n1, n2 := tb.Nodes[0], tb.Nodes[1]
	e2, ib2, e2v6, ib2v6 := n2.Eth0V4.String(), n2.IBV4.String(), n2.Eth0V6.String(), n2.IBV6.String()
	for _, l := range []struct {
		node, user string
		port       int
	}{
		{"node2", "alice", 9150}, {"node2", "bob", 9160}, {"node2", "bob", 9170}, {"node1", "bob", 9170},
		{"node2", "alice", 9180}, {"node2", "alice", 9190}, {"node2", "alice", 9200}, {"node2", "alice", 9201},
		{"node2", "alice", 9210}, {"node1", "carol", 9210}, {"node2", "alice+proj1", 9220},
		{"node2", "bob", 9235}, {"node2", "bob", 9240},
	} {
		listen(t, l.node, l.user, "tcp", "::", l.port)
		listen(t, l.node, l.user, "udp", "::", l.port)
	}
	udpRefused := func(addr string) (string, []string) { return icmpFor(addr), []string{"connected"} }
	u2, ux := udpRefused(e2)
	run(t, []tcase{
		// users: carol may reach alice's 9150 (tcp only); bob may not
		{"node1", "carol", "tcp", e2, 9150, "OK", nil},
		{"node1", "carol", "tcp", e2v6, 9150, "OK", nil},
		{"node1", "bob", "tcp", e2, 9150, refused, nil},
		{"node1", "carol", "udp", e2, 9150, u2, ux},
		// connector group: proj1 members reach anyone's 9160, carol does not
		{"node1", "alice", "tcp", e2, 9160, "OK", nil},
		{"node1", "alice", "udp", ib2, 9160, "OK", nil},
		{"node1", "carol", "tcp", e2, 9160, refused, nil},
		// deny on node2 only: bob's own 9170 on node2 refused to him,
		// on node1 not (same-user)
		{"node1", "bob", "tcp", e2, 9170, refused, nil},
		{"node2", "bob", "tcp", "127.0.0.1", 9170, eperm, nil},
		{"node2", "bob", "tcp", n1.Eth0V4.String(), 9170, "OK", nil},
		// node set: from node1 (any of its addresses), not from node2 itself
		{"node1", "carol", "tcp", e2, 9180, "OK", nil},
		{"node1", "carol", "tcp", ib2v6, 9180, "OK", nil},
		{"node2", "carol", "tcp", e2, 9180, eperm, nil},
		// subnet: over ib0 only
		{"node1", "carol", "tcp", ib2, 9190, "OK", nil},
		{"node1", "carol", "udp", ib2v6, 9190, "OK", nil},
		{"node1", "carol", "tcp", e2, 9190, refused, nil},
		// off-cluster subnet: the outside host reaches 9200, not 9201
		{"outside", "carol", "tcp", e2, 9200, "OK", nil},
		{"outside", "carol", "tcp", e2, 9201, refused, nil},
		// listener group: proj1's members' listeners (alice), not carol's
		{"node1", "carol", "tcp", e2, 9210, "OK", nil},
		{"node2", "bob", "tcp", n1.Eth0V4.String(), 9210, refused, nil},
		// relation + protocol: sharing through proj1 refused on tcp 9220,
		// still allowed on udp
		{"node1", "bob", "tcp", e2, 9220, refused, nil},
		{"node1", "bob", "udp", e2, 9220, "OK", nil},
		// port range
		{"node1", "carol", "tcp", e2, 9235, "OK", nil},
		{"node1", "carol", "tcp", e2, 9240, refused, nil},
	})

	// explain names the deciding rule; the event log the refusing one.
	out, err := nodeCommand(context.Background(), tb, n1, "explain", "--from", "carol", "--node", "node1", "--to", e2+":9150").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ALLOW (rule carol-alice)") || !strings.Contains(string(out), `site rule "carol-alice"`) {
		t.Errorf("explain: %v\n%s", err, out)
	}
	log2 := tb.LogDir() + "/node2-userwall.jsonl"
	waitFor(t, "a site-deny event naming no-bob-on-node2", func() bool {
		b, _ := os.ReadFile(log2)
		return strings.Contains(string(b), `"rule":"site-deny","site_rule":"no-bob-on-node2"`)
	})

	// A change whose test fails: refused by agent --reload before the
	// agent sees it, and by the agent itself on SIGHUP; nothing changes.
	p2 := tb.ConfigPath("node2")
	bad := strings.Replace(string(orig["node2"])+siteRules, `ports = ["9230-9239"]`, `ports = ["9230-9240"]`, 1) +
		"\n[[test]]\nfrom = \"carol\"\nfrom_node = \"node1\"\nto = \"bob\"\nport = 9240\nexpect = \"deny\"\nrule = \"default-deny\"\n"
	if err := os.WriteFile(p2, []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	gen := status(t, "node2").Agent.Generation
	out2, err := reloadNode(t, "node2")
	if err == nil || !strings.Contains(out2, "policy tests failed") || !strings.Contains(out2, "got allow by rule carol-range") {
		t.Errorf("agent --reload with a failing test: %v\n%s", err, out2)
	}
	s, err := signalReload("node2")
	if err != nil || !strings.Contains(s.LastReloadError, "policy tests failed") {
		t.Errorf("SIGHUP with a failing test: %v %+v", err, s)
	}
	if g := status(t, "node2").Agent.Generation; g != gen {
		t.Errorf("generation %d → %d after refused reloads", gen, g)
	}
	run(t, []tcase{
		{"node1", "carol", "tcp", e2, 9240, refused, nil}, // the refused change is not enforced
		{"node1", "carol", "tcp", e2, 9235, "OK", nil},    // the running rules are
	})

	// A start has no running policy to keep: the agent enforces the file
	// (refusing would leave a rebooted node open) and says so.
	if err := StopAgent(context.Background(), tb, n2); err != nil {
		t.Fatal(err)
	}
	if err := StartAgent(context.Background(), tb, n2); err != nil {
		t.Fatal(err)
	}
	if st := status(t, "node2"); !hasWarning(st, "policy tests fail") {
		t.Errorf("status after a start with failing tests: %q", st.Warnings)
	}
	run(t, []tcase{{"node1", "carol", "tcp", e2, 9240, "OK", nil}})
}
