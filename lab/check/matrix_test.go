package check

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// fixture is the testbed's users and groups and a 3-node topology, without
// running anything.
func fixture(t *testing.T) (*testbed.Testbed, identity.Resolver) {
	t.Helper()
	res, err := identity.ParseTables([]byte(`root:x:0:0::/root:/bin/bash
svc:x:2004:2004::/h/svc:/bin/bash
alice:x:2001:2001::/h/alice:/bin/bash
bob:x:2002:2002::/h/bob:/bin/bash
carol:x:2003:2003::/h/carol:/bin/bash
slurm:x:64030:64030::/h:/bin/false
`), []byte(`root:x:0:
alice:x:2001:
bob:x:2002:
carol:x:2003:
svc:x:2004:
proj1:x:2100:alice,bob
slurm:x:64030:
`))
	if err != nil {
		t.Fatal(err)
	}
	tb := &testbed.Testbed{Name: "fixture"}
	for i := byte(1); i <= 3; i++ {
		tb.Nodes = append(tb.Nodes, testbed.Node{Name: fmt.Sprintf("node%d", i),
			Eth0V4: netip.AddrFrom4([4]byte{198, 18, 0, i}), Eth0V6: netip.AddrFrom16([16]byte{0x20, 1, 0, 2, 15: i}),
			IBV4: netip.AddrFrom4([4]byte{198, 19, 0, i}), IBV6: netip.AddrFrom16([16]byte{0x20, 1, 0, 2, 0, 0, 0, 1, 15: i})})
	}
	tb.Outside = testbed.Node{Name: "outside", Eth0V4: netip.MustParseAddr("198.18.200.1"),
		Eth0V6: netip.MustParseAddr("2001:2:0:c8::1")}
	return tb, res
}

// testbedPolicy is the policy the testbed writes for every node, built by
// hand here so that the expectations are checked independently of Load.
func testbedPolicy() *policy.Policy {
	return &policy.Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{0, 2004},
		ExemptListeners: []uint32{0, 64030, 2004}, ClusterSubnets: testbed.ClusterSubnets}
}

func TestMatrixShape(t *testing.T) {
	tb, res := fixture(t)
	m, err := buildMatrix(tb, res, Launchers, false)
	if err != nil {
		t.Fatal(err)
	}
	// Per connector host: 5 paths × 6 listeners × 2 protocols × 2 families
	// = 120; mpirun runs on two hosts; outside → node adds 24 per user.
	want := 5 * (120*5 + 240 + 24)
	if len(m.cases) != want {
		t.Errorf("%d cases, want %d", len(m.cases), want)
	}
	ids := map[string]bool{}
	cover := map[string]int{}
	for _, c := range m.cases {
		if ids[c.ID] {
			t.Fatalf("duplicate id %s", c.ID)
		}
		ids[c.ID] = true
		if !c.Dst.IsValid() || !c.Src.IsValid() || c.Dst.Addr().Is4() != (c.Family == 4) || c.Src.Is4() != (c.Family == 4) {
			t.Errorf("%s: bad addresses src=%v dst=%v", c, c.Src, c.Dst)
		}
		cover[fmt.Sprintf("%s/%s/%s", c.Launcher, c.Path, c.ProtoFamily())]++
	}
	for _, l := range Launchers {
		for _, p := range Paths {
			for _, pf := range protoFams {
				k := fmt.Sprintf("%s/%s/%s", l, p, pf)
				// Outside → node runs only as a plain process.
				if want := p != OutsideIn || l == Plain; want != (cover[k] > 0) {
					t.Errorf("%s: %d cases", k, cover[k])
				}
			}
		}
	}
	// Quick still covers every launcher, path, protocol and family.
	q, err := buildMatrix(tb, res, Launchers, true)
	if err != nil {
		t.Fatal(err)
	}
	qcover := map[string]bool{}
	for _, c := range q.cases {
		qcover[fmt.Sprintf("%s/%s/%s", c.Launcher, c.Path, c.ProtoFamily())] = true
	}
	for k := range cover {
		if !qcover[k] {
			t.Errorf("quick misses %s", k)
		}
	}
}

func TestPlacement(t *testing.T) {
	nodes := []string{"node1", "node2", "node3"}
	for _, l := range Launchers {
		for i := range Connectors {
			start, hosts := placement(l, i, nodes)
			if start != "node1" {
				t.Errorf("%s: starts on %s", l, start)
			}
			switch l {
			case SSH:
				if hosts[0] == start {
					t.Errorf("ssh must reach another node, got %v", hosts)
				}
			case MPIRun:
				if len(hosts) != 2 || hosts[0] == hosts[1] {
					t.Errorf("mpirun must span two nodes, got %v", hosts)
				}
			}
		}
	}
}

// TestExpectPolicy checks the userwall expectation against cases whose
// verdict follows from the rules by hand.
func TestExpectPolicy(t *testing.T) {
	tb, res := fixture(t)
	m, err := buildMatrix(tb, res, []Launcher{Plain, Srun}, false)
	if err != nil {
		t.Fatal(err)
	}
	pol := testbedPolicy()
	find := func(l Launcher, path Path, from, to, pf string) *Case {
		for _, c := range m.cases {
			if c.Launcher == l && c.Path == path && c.Connector.Name == from && c.Listener.Name == to && c.ProtoFamily() == pf {
				if c.Managed() {
					c.Policy = pol
				}
				return c
			}
		}
		t.Fatalf("no case %s %s %s→%s %s", l, path, from, to, pf)
		return nil
	}
	for _, tc := range []struct {
		l        Launcher
		path     Path
		from, to string
		pf       string
		allow    bool
		rule     string
	}{
		{Plain, Loopback, "alice", "alice", "tcp4", true, "same-user"},
		{Plain, Loopback, "alice", "bob", "udp6", false, "default-deny"},
		{Plain, Self, "bob", "alice+proj1", "tcp6", true, "shared-group"},
		{Srun, IB, "bob", "alice+proj1", "udp4", true, "shared-group"},
		{Srun, Eth0, "carol", "alice+proj1", "tcp4", false, "default-deny"},
		{Plain, Eth0, "carol", "root", "udp6", true, "system-port"},
		{Plain, Eth0, "svc", "carol", "tcp4", true, "exempt-connector"},
		{Plain, IB, "root", "bob", "tcp6", true, "exempt-connector"},
		{Plain, Eth0, "carol", "svc", "tcp4", true, "exempt-listener"},
		{Plain, OutsideIn, "alice", "alice", "tcp4", false, "off-cluster-denied"},
		{Plain, OutsideIn, "root", "bob", "udp6", false, "off-cluster-denied"},
		{Plain, OutsideIn, "carol", "root", "tcp6", true, "system-port"},
		{Plain, OutsideOut, "carol", "alice", "tcp4", true, RuleUnmanaged},
	} {
		c := find(tc.l, tc.path, tc.from, tc.to, tc.pf)
		v := ExpectPolicy(c)
		if v.Allow != tc.allow || v.Rule != tc.rule {
			t.Errorf("%s: got %+v, want allow=%v rule=%s", c, v, tc.allow, tc.rule)
		}
		if v := ExpectOpen(c); !v.Allow {
			t.Errorf("%s: mode none denies", c)
		}
	}
}

func TestModes(t *testing.T) {
	if _, err := lookupMode("nosuch"); err == nil {
		t.Error("unknown mode accepted")
	}
	RegisterMode("test-deny-all", func(*Case) Verdict { return Verdict{Rule: "x"} })
	e, err := lookupMode("test-deny-all")
	if err != nil || e(&Case{}).Allow {
		t.Errorf("registered mode not used: %v", err)
	}
}

func TestPassed(t *testing.T) {
	for _, tc := range []struct {
		allow bool
		state string
		pass  bool
	}{
		{true, Allowed, true}, {true, Refused, false}, {true, Broken, false},
		{false, Allowed, false}, {false, Refused, true}, {false, Broken, false},
	} {
		c := &Case{Expected: Verdict{Allow: tc.allow}, Observed: Observation{State: tc.state}}
		if c.Passed() != tc.pass {
			t.Errorf("expected allow=%v observed %s: pass=%v", tc.allow, tc.state, c.Passed())
		}
	}
}

func TestShellJoin(t *testing.T) {
	got := shellJoin([]string{"/a/b", "--out", "/x/{host}.jsonl", "it's", ""})
	want := `/a/b --out '/x/{host}.jsonl' 'it'\''s' ''`
	if got != want {
		t.Errorf("got %s, want %s", got, want)
	}
}

func TestSelectIdentities(t *testing.T) {
	tb, res := fixture(t)
	c, l, err := SelectIdentities(true, []string{"root", "bob"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := buildMatrixFor(tb, res, Launchers, c, l)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, p := range m.procs {
		seen[p.User] = true
	}
	// Explicit connectors win over quick's; listeners stay quick's.
	if len(seen) != 2 || !seen["bob"] || !seen["root"] || len(m.listeners) != len(quickListeners) {
		t.Errorf("connectors %v, %d listeners", seen, len(m.listeners))
	}
	// 2 users × (5 launchers × 100 + mpirun 200) + outside 2 × 20
	if want := 2*(5*100+200) + 2*20; len(m.cases) != want {
		t.Errorf("%d cases, want %d", len(m.cases), want)
	}
	for _, bad := range [][2][]string{{{"mallory"}, nil}, {nil, {"alice+proj2"}}} {
		if _, _, err := SelectIdentities(false, bad[0], bad[1]); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if _, err := buildMatrixFor(tb, res, Launchers, []string{}, nil); err == nil {
		t.Error("empty connector list accepted")
	}
}
