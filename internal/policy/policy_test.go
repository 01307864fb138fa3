package policy

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

// The testbed's users: alice and bob share project group proj1 (2100);
// carol has none; svc is an exempt service account.
const (
	root  = 0
	alice = 2001
	bob   = 2002
	carol = 2003
	svc   = 2004
	proj1 = 2100
)

func testPolicy() *Policy {
	return &Policy{
		SystemPortMax:    1023,
		ExemptConnectors: []uint32{root, svc},
		ExemptListeners:  []uint32{root, svc},
		ClusterSubnets: []netip.Prefix{
			netip.MustParsePrefix("198.18.0.0/24"), netip.MustParsePrefix("198.19.0.0/24"),
			netip.MustParsePrefix("2001:2::/64"), netip.MustParsePrefix("2001:2:0:1::/64"),
		},
		OffClusterPorts: []PortRange{{8443, 8443}, {9000, 9100}},
	}
}

// user is a login identity: private group, plus supplementary groups.
func user(uid uint32, groups ...uint32) Identity { return Identity{UID: uid, GID: uid, Groups: groups} }

// sg is the identity after `sg group` (effective gid changed).
func sg(id Identity, gid uint32) Identity { id.GID = gid; return id }

var (
	local     = netip.Addr{}
	lo4       = netip.MustParseAddr("127.0.0.1")
	lo6       = netip.MustParseAddr("::1")
	lo4in6    = netip.MustParseAddr("::ffff:127.0.0.1")
	node2     = netip.MustParseAddr("198.18.0.2")
	node2ib   = netip.MustParseAddr("198.19.0.2")
	node2v6   = netip.MustParseAddr("2001:2::2")
	node2ib6  = netip.MustParseAddr("2001:2:0:1::2")
	node2map  = netip.MustParseAddr("::ffff:198.18.0.2")
	outside   = netip.MustParseAddr("198.18.200.1")
	outside6  = netip.MustParseAddr("2001:2:0:c8::1")
	outsideM  = netip.MustParseAddr("::ffff:198.18.200.1")
	nearMiss  = netip.MustParseAddr("198.18.1.2")    // just past 198.18.0.0/24
	nearMiss6 = netip.MustParseAddr("2001:2:0:2::2") // just past 2001:2:0:1::/64
)

func TestDecide(t *testing.T) {
	A, B, C, S, R := user(alice), user(bob, proj1), user(carol), user(svc), user(root)
	tests := []struct {
		name      string
		src       netip.Addr
		conn, lis Identity
		port      uint16
		proto     Proto
		want      Rule
	}{
		// same user, over every kind of trusted source
		{"same user local", local, A, A, 5000, TCP, RuleSameUser},
		{"same user udp", local, A, A, 5000, UDP, RuleSameUser},
		{"same user loopback v4", lo4, A, A, 5000, TCP, RuleSameUser},
		{"same user loopback v6", lo6, A, A, 5000, TCP, RuleSameUser},
		{"same user loopback v4-mapped", lo4in6, A, A, 5000, TCP, RuleSameUser},
		{"same user eth0 v4", node2, A, A, 5000, TCP, RuleSameUser},
		{"same user ib0 v4", node2ib, A, A, 5000, UDP, RuleSameUser},
		{"same user eth0 v6", node2v6, A, A, 5000, TCP, RuleSameUser},
		{"same user ib0 v6", node2ib6, A, A, 5000, UDP, RuleSameUser},
		{"same user v4-mapped", node2map, A, A, 5000, TCP, RuleSameUser},
		{"same uid, different effective groups", local, sg(A, proj1), A, 5000, TCP, RuleSameUser},

		// other users are refused above the system ports
		{"other user local", local, B, A, 5000, TCP, RuleDenied},
		{"other user loopback", lo6, C, A, 5000, UDP, RuleDenied},
		{"other user remote v4", node2, C, A, 5000, TCP, RuleDenied},
		{"other user remote v6", node2v6, C, A, 5000, TCP, RuleDenied},
		{"other user v4-mapped", node2map, C, A, 5000, TCP, RuleDenied},

		// groups: the listener's effective gid against all the connector's groups
		{"group via supplementary", local, B, sg(A, proj1), 5000, TCP, RuleSharedGroup},
		{"group via effective gid", node2, sg(user(bob), proj1), sg(A, proj1), 5000, TCP, RuleSharedGroup},
		{"group, connector private group is listener's", local, Identity{UID: carol, GID: alice}, A, 5000, TCP, RuleSharedGroup},
		{"group not held", local, C, sg(A, proj1), 5000, TCP, RuleDenied},
		{"connector in project, listener in private group", local, B, A, 5000, TCP, RuleDenied},
		{"listener supplementary groups do not count", local, B, user(alice, proj1), 5000, TCP, RuleDenied},
		{"connector effective gid only, listener private", local, sg(B, proj1), A, 5000, UDP, RuleDenied},

		// system ports: everyone, from everywhere, boundaries
		{"system port 22 other user", node2, C, A, 22, TCP, RuleSystemPort},
		{"system port 1023 boundary", node2, C, A, 1023, TCP, RuleSystemPort},
		{"port 1024 not system", node2, C, A, 1024, TCP, RuleDenied},
		{"port 0", local, C, A, 0, UDP, RuleSystemPort},
		{"port 65535", local, C, A, 65535, UDP, RuleDenied},
		{"system port from outside", outside, C, A, 22, TCP, RuleSystemPort},
		{"system port from outside v6", outside6, C, A, 53, UDP, RuleSystemPort},

		// exemptions
		{"exempt connector root", node2, R, A, 5000, TCP, RuleExemptConnector},
		{"exempt connector svc", local, S, C, 5000, UDP, RuleExemptConnector},
		{"exempt listener root", node2v6, C, R, 6818, TCP, RuleExemptListener},
		{"exempt listener svc", local, A, S, 5000, TCP, RuleExemptListener},

		// rule order: the first allowing rule is reported
		{"same user before exempt (svc)", local, S, S, 5000, TCP, RuleSameUser},
		{"same user before exempt (root)", local, R, R, 5000, TCP, RuleSameUser},
		{"group before exempt listener", local, B, sg(S, proj1), 5000, TCP, RuleSharedGroup},
		{"exempt connector before exempt listener", local, R, S, 5000, TCP, RuleExemptConnector},
		{"system port before same user", local, A, A, 80, TCP, RuleSystemPort},

		// off-cluster sources: identity not trusted
		{"outside same uid denied", outside, A, A, 5000, TCP, RuleOffClusterDenied},
		{"outside root denied", outside, R, A, 5000, TCP, RuleOffClusterDenied},
		{"outside to exempt listener denied", outside, C, R, 6817, TCP, RuleOffClusterDenied},
		{"outside v6 denied", outside6, A, A, 5000, UDP, RuleOffClusterDenied},
		{"outside v4-mapped denied", outsideM, A, A, 5000, TCP, RuleOffClusterDenied},
		{"just outside subnet v4", nearMiss, A, A, 5000, TCP, RuleOffClusterDenied},
		{"just outside subnet v6", nearMiss6, A, A, 5000, TCP, RuleOffClusterDenied},
		{"outside allowed port", outside, C, A, 8443, TCP, RuleOffClusterPort},
		{"outside allowed port udp v6", outside6, C, A, 8443, UDP, RuleOffClusterPort},
		{"outside range first", outside, C, A, 9000, TCP, RuleOffClusterPort},
		{"outside range last", outside, C, A, 9100, TCP, RuleOffClusterPort},
		{"outside below range", outside, C, A, 8999, TCP, RuleOffClusterDenied},
		{"outside above range", outside, C, A, 9101, TCP, RuleOffClusterDenied},
		{"outside next to single port", outside, C, A, 8444, TCP, RuleOffClusterDenied},
		{"allowed off-cluster port is not open in-cluster", node2, C, A, 8443, TCP, RuleDenied},
	}
	p := testPolicy()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Conn{Source: tt.src, Connector: tt.conn, Listener: tt.lis, Port: tt.port, Proto: tt.proto}
			got := p.Decide(c)
			wantAllow := tt.want != RuleDenied && tt.want != RuleOffClusterDenied
			if got.Rule != tt.want || got.Allow != wantAllow {
				t.Errorf("Decide(%+v) = %+v, want {Allow:%v Rule:%s}", c, got, wantAllow, tt.want)
			}
			if ex := p.Explain(c); !strings.Contains(ex, string(got.Rule)) || (got.Allow != strings.HasPrefix(ex, "Allowed")) {
				t.Errorf("Explain disagrees with Decide %+v: %s", got, ex)
			}
		})
	}
}

func TestDecideDefaultPolicy(t *testing.T) {
	p := Default()
	a, b := user(alice), user(bob)
	for _, tc := range []struct {
		src  netip.Addr
		conn Identity
		port uint16
		want Rule
	}{
		{local, a, 5000, RuleSameUser},
		{lo4, b, 5000, RuleDenied},
		{local, user(root), 5000, RuleExemptConnector},
		// no cluster subnets: every remote address is off-cluster
		{node2, a, 5000, RuleOffClusterDenied},
		{node2v6, user(root), 5000, RuleOffClusterDenied},
		{node2, b, 1023, RuleSystemPort},
	} {
		if got := p.Decide(Conn{Source: tc.src, Connector: tc.conn, Listener: a, Port: tc.port}); got.Rule != tc.want {
			t.Errorf("default policy %v %d->%d:%d = %s, want %s", tc.src, tc.conn.UID, alice, tc.port, got.Rule, tc.want)
		}
	}
}

func TestSystemPortMax(t *testing.T) {
	for _, max := range []uint16{0, 1, 1023, 2047, 65535} {
		p := testPolicy()
		p.SystemPortMax = max
		for _, port := range []uint16{max, max + 1} {
			if max == 65535 && port == 0 {
				continue // wrapped
			}
			got := p.Decide(Conn{Source: node2, Connector: user(carol), Listener: user(alice), Port: port})
			if want := port <= max; (got.Rule == RuleSystemPort) != want || got.Allow != want {
				t.Errorf("SystemPortMax=%d port %d: %+v", max, port, got)
			}
		}
	}
}

func TestExemptListsAreSeparate(t *testing.T) {
	p := testPolicy()
	p.ExemptConnectors = []uint32{svc}
	p.ExemptListeners = nil
	if v := p.Decide(Conn{Connector: user(alice), Listener: user(svc), Port: 5000}); v.Allow {
		t.Errorf("exempt connector must not make its listeners reachable: %+v", v)
	}
	if v := p.Decide(Conn{Connector: user(svc), Listener: user(alice), Port: 5000}); v.Rule != RuleExemptConnector {
		t.Errorf("svc connector: %+v", v)
	}
}

func TestInCluster(t *testing.T) {
	p := testPolicy()
	for addr, want := range map[netip.Addr]bool{
		local: true, lo4: true, lo6: true, lo4in6: true, netip.MustParseAddr("127.8.9.10"): true,
		node2: true, node2ib: true, node2v6: true, node2ib6: true, node2map: true,
		outside: false, outside6: false, outsideM: false, nearMiss: false, nearMiss6: false,
		netip.MustParseAddr("198.18.0.255"): true, netip.MustParseAddr("198.17.255.255"): false,
	} {
		if got := p.InCluster(addr); got != want {
			t.Errorf("InCluster(%v) = %v, want %v", addr, got, want)
		}
	}
}

// TestTrustedLinkLocal: a link-local source carries a trusted identity as the
// data plane treats it (userwall verifies its stamp), so a proj1 member from
// a neighbour's fe80:: address reaches a proj1 listener, and carol does not.
func TestTrustedLinkLocal(t *testing.T) {
	p := testPolicy()
	for addr, want := range map[netip.Addr]bool{
		netip.MustParseAddr("fe80::1"): true, netip.MustParseAddr("fe80::1%eth0"): true,
		netip.MustParseAddr("169.254.3.4"): true, netip.MustParseAddr("::ffff:169.254.3.4"): true,
		netip.MustParseAddr("fec0::1"): false, outside: false, outside6: false, node2: true,
	} {
		if got := p.Trusted(addr); got != want {
			t.Errorf("Trusted(%v) = %v, want %v", addr, got, want)
		}
	}
	ll := netip.MustParseAddr("fe80::6856:91ff:feba:2608%eth0")
	shared := Identity{UID: alice, GID: proj1}
	if v := p.Decide(Conn{Source: ll, Connector: Identity{UID: bob, GID: bob, Groups: []uint32{proj1}}, Listener: shared, Port: 5000}); !v.Allow || v.Rule != RuleSharedGroup {
		t.Errorf("proj1 member from link-local: %+v, want shared-group", v)
	}
	if v := p.Decide(Conn{Source: ll, Connector: user(carol), Listener: shared, Port: 5000}); v.Allow || v.Rule != RuleDenied {
		t.Errorf("carol from link-local: %+v, want default-deny", v)
	}
}

func TestHasGroup(t *testing.T) {
	id := Identity{UID: 1, GID: 10, Groups: []uint32{20, 30}}
	for gid, want := range map[uint32]bool{10: true, 20: true, 30: true, 1: false, 40: false} {
		if id.HasGroup(gid) != want {
			t.Errorf("HasGroup(%d) != %v", gid, want)
		}
	}
}

func TestSealedGID(t *testing.T) {
	groups := []uint32{10, 20}
	for _, tc := range []struct {
		gid   uint32
		known bool
		want  uint32
	}{
		{10, true, 10},       // a member: vouched for
		{30, true, NoGID},    // left the group (or never in it): no group
		{30, false, 30},      // not looked up yet: a claim
		{NoGID, true, NoGID}, // no group to carry
	} {
		if got := SealedGID(tc.gid, tc.known, groups); got != tc.want {
			t.Errorf("SealedGID(%d, known=%v) = %d, want %d", tc.gid, tc.known, got, tc.want)
		}
	}
	// What a receiver that has not looked the user up then sees: the
	// claim no longer matches the group he left.
	sent := Identity{UID: 1, GID: SealedGID(30, true, groups)}
	if sent.HasGroup(30) {
		t.Error("a gid the sender did not vouch for still counts at the receiver")
	}
}

func TestPortRange(t *testing.T) {
	r := PortRange{9000, 9100}
	if !r.Contains(9000) || !r.Contains(9100) || r.Contains(8999) || r.Contains(9101) {
		t.Error("Contains boundaries")
	}
	for _, tc := range []struct {
		o    PortRange
		want bool
	}{{PortRange{9100, 9200}, true}, {PortRange{8000, 9000}, true}, {PortRange{9050, 9050}, true}, {PortRange{9101, 9200}, false}, {PortRange{1, 8999}, false}} {
		if r.Overlaps(tc.o) != tc.want || tc.o.Overlaps(r) != tc.want {
			t.Errorf("%v overlaps %v != %v", r, tc.o, tc.want)
		}
	}
	if r.String() != "9000-9100" || (PortRange{8443, 8443}).String() != "8443" {
		t.Error("String")
	}
}

func TestExplain(t *testing.T) {
	p := testPolicy()
	for _, tc := range []struct {
		c    Conn
		want []string
	}{
		{Conn{Source: node2, Connector: user(bob, proj1), Listener: sg(user(alice), proj1), Port: 5000},
			[]string{"Allowed by rule shared-group", "supplementary", "198.18.0.0/24"}},
		{Conn{Source: node2, Connector: sg(user(bob), proj1), Listener: sg(user(alice), proj1), Port: 5000},
			[]string{"Allowed by rule shared-group", "effective group"}},
		{Conn{Connector: user(carol), Listener: user(alice), Port: 5000, Proto: UDP},
			[]string{"Denied by rule default-deny", "5000/udp", "local to this node"}},
		{Conn{Source: outside, Connector: user(alice), Listener: user(alice), Port: 5000},
			[]string{"Denied by rule off-cluster-denied", "198.18.200.1", "8443 9000-9100"}},
		{Conn{Source: outside, Connector: user(alice), Listener: user(alice), Port: 9050},
			[]string{"Allowed by rule off-cluster-port", "9000-9100"}},
		{Conn{Source: lo6, Connector: user(root), Listener: user(alice), Port: 5000},
			[]string{"exempt_connectors", "::1 is loopback"}},
	} {
		got := p.Explain(tc.c)
		for _, w := range tc.want {
			if !strings.Contains(got, w) {
				t.Errorf("Explain(%+v) = %q, missing %q", tc.c, got, w)
			}
		}
		if strings.Contains(got, "\n") {
			t.Errorf("Explain is one paragraph: %q", got)
		}
	}
}

func ExamplePolicy_Explain() {
	p := testPolicy()
	fmt.Println(p.Explain(Conn{Source: node2, Connector: user(carol), Listener: user(alice), Port: 5000}))
	// Output: Denied by rule default-deny: the connector (uid 2003; effective gid 2003, no supplementary groups) is not the listener's user (uid 2001), does not hold the listener's group (gid 2001), neither is exempt, and port 5000/tcp is above the system ports (<= 1023); the source 198.18.0.2 is in cluster subnet 198.18.0.0/24, so its identity is trusted.
}

func FuzzHostlist(f *testing.F) {
	for _, s := range []string{"node[1-3]", "db[01-10],login1", "r[1-2]n[001-003]", "a[", "a]", "n[3-1]", "x[1-99999999]", "a,,b", "n[1,1,2]"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		hosts, err := ExpandHostlist(s)
		if err != nil {
			return
		}
		if len(hosts) == 0 || len(hosts) > MaxHostlist {
			t.Fatalf("%q: %d hosts", s, len(hosts))
		}
		seen := map[string]bool{}
		for _, h := range hosts {
			if h == "" || seen[h] || strings.ContainsAny(h, "[],") {
				t.Fatalf("%q: bad host %q in %v", s, h, hosts)
			}
			seen[h] = true
		}
	})
}

func TestExpandHostlist(t *testing.T) {
	for in, want := range map[string]string{
		"node1":              "node1",
		"node[1-3]":          "node1 node2 node3",
		"db[01-03,10],login": "db01 db02 db03 db10 login",
		"r[1-2]n[1-2]":       "r1n1 r1n2 r2n1 r2n2",
		"n[1,1]":             "n1",
	} {
		got, err := ExpandHostlist(in)
		if err != nil || strings.Join(got, " ") != want {
			t.Errorf("%q: %v %v, want %s", in, got, err, want)
		}
	}
	for _, in := range []string{"", "a[", "a]", "n[3-1]", "x[1-99999999]", "a,,b", "a b", "n[[1]]", "n[]"} {
		if got, err := ExpandHostlist(in); err == nil {
			t.Errorf("%q: %v, want an error", in, got)
		}
	}
}
