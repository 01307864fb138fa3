package uvn

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"testing"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// siteWorld is a small cluster for the site rules' tests.
var (
	siteSubnets = []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24"), netip.MustParsePrefix("198.19.0.0/24"),
		netip.MustParsePrefix("2001:2::/64")}
	siteSources = []netip.Addr{netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2"),
		netip.MustParseAddr("198.19.0.3"), netip.MustParseAddr("2001:2::2"), netip.MustParseAddr("127.0.0.1"),
		netip.MustParseAddr("::1"), netip.MustParseAddr("203.0.113.9"), netip.MustParseAddr("2001:db8::9"),
		netip.MustParseAddr("fe80::2"), netip.MustParseAddr("::ffff:198.18.0.2")}
	sitePrefixes = []netip.Prefix{netip.MustParsePrefix("198.18.0.2/32"), netip.MustParsePrefix("198.18.0.0/28"),
		netip.MustParsePrefix("198.19.0.0/24"), netip.MustParsePrefix("2001:2::2/128"), netip.MustParsePrefix("203.0.113.0/24"),
		netip.MustParsePrefix("2001:db8::/32"), netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("127.0.0.0/8")}
	siteUIDs   = []uint32{2001, 2002, 2003, 2004}
	siteGIDs   = []uint32{3001, 3002, 3003}
	siteNodes  = []string{"node1", "node2", "node3"}
	siteSrun   = policy.PortRange{First: 61000, Last: 61099}
	siteSystem = []uint32{0, 64030, 105} // root, slurm, a system account
)

func pick[T any](r *rand.Rand, from []T, max int) []T {
	var out []T
	for _, x := range from {
		if r.IntN(len(from)+1) < max {
			out = append(out, x)
		}
	}
	return out
}

// randomRule draws a site rule of random kinds (every key optional).
func randomRule(r *rand.Rand, i int) policy.SiteRule {
	sr := policy.SiteRule{Name: "r" + string(rune('a'+i%26)) + string(rune('a'+i/26)), Allow: r.IntN(2) == 0}
	if r.IntN(3) == 0 {
		sr.From = pick(r, siteUIDs, 2)
	}
	if r.IntN(4) == 0 {
		sr.FromGroups = pick(r, siteGIDs, 1)
	}
	if r.IntN(3) == 0 {
		sr.To = pick(r, siteUIDs, 2)
	}
	if r.IntN(4) == 0 {
		sr.ToGroups = pick(r, siteGIDs, 1)
	}
	if r.IntN(3) == 0 {
		sr.Nodes = pick(r, siteNodes, 1)
	}
	if r.IntN(3) == 0 {
		sr.Sources = pick(r, sitePrefixes, 2)
	}
	if r.IntN(3) != 0 {
		n := 1 + r.IntN(3)
		for range n {
			f := uint16(1024 + r.IntN(8))
			if r.IntN(4) == 0 {
				f = uint16(61000 + r.IntN(120))
			}
			sr.Ports = append(sr.Ports, policy.PortRange{First: f, Last: f + uint16(r.IntN(3))})
		}
	}
	sr.Proto = []policy.Proto{0, policy.TCP, policy.UDP}[r.IntN(3)]
	if r.IntN(5) == 0 {
		sr.Relation = []policy.Relation{policy.SameUser, policy.SharedGroup}[r.IntN(2)]
	}
	return sr
}

// TestSiteCompileDecide holds the compiled rules (what the nftables rules
// test) against policy.Decide on random policies, users and packets, on
// both of uvn's paths into a user's VRF: from the user's own VRF
// (connector = listener = the user, groups from the directory) and Slurm's
// callback from a default VRF (a system account without the users' groups,
// on SrunPortRange). Where Decide's verdict is a site rule, the compiled
// chain must pick the same rule; where it is a built-in, no compiled rule.
func TestSiteCompileDecide(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 1))
	decided := map[bool]int{}
	for world := range 400 {
		p := &policy.Policy{SystemPortMax: 1023, ClusterSubnets: siteSubnets, ExemptConnectors: []uint32{0}}
		for i := range 1 + r.IntN(12) {
			p.Rules = append(p.Rules, randomRule(r, i))
		}
		node := siteNodes[r.IntN(len(siteNodes))]
		for _, uid := range siteUIDs {
			groups := append([]uint32{uid}, pick(r, siteGIDs, 2)...)
			u := SiteUser{UID: uid, Groups: groups}
			id := policy.Identity{UID: uid, GID: uid, Groups: groups, GroupsKnown: true}
			own := compileSite(p, node, siteSrun, u, pathOwn)
			srun := compileSite(p, node, siteSrun, u, pathSrun)
			for range 40 {
				proto := []policy.Proto{policy.TCP, policy.UDP}[r.IntN(2)]
				src := siteSources[r.IntN(len(siteSources))]
				port := uint16(1020 + r.IntN(14))
				c := policy.Conn{Source: src, Connector: id, Listener: id, Port: port, Proto: proto, Node: node}
				check := func(path string, ms []siteMatch, c policy.Conn, decide func(policy.Conn) policy.Verdict) {
					v := decide(c)
					m := firstSiteMatch(ms, p, c.Proto, c.Port, c.Source)
					want := ""
					if p.SiteRule(v.Rule) != nil {
						want = string(v.Rule)
						decided[v.Allow]++
					}
					got := ""
					if m != nil {
						got = m.Name
						if m.Allow != v.Allow && want != "" {
							t.Errorf("world %d %s: verdicts differ", world, path)
						}
					}
					if got != want {
						t.Fatalf("world %d, %s, node %s, user %+v: %v %s:%d from %v: Decide says %s (%v), compiled %q\nrules %+v\ncompiled %+v",
							world, path, node, u, c.Proto, "", c.Port, c.Source, v.Rule, v.Allow, got, p.Rules, ms)
					}
				}
				check("own VRF", own, c, func(c policy.Conn) policy.Verdict { return decideOwn(p, c) })
				// Slurm's callback: a system account, a cluster node's
				// address or loopback, an SrunPortRange port.
				c.Connector = policy.Identity{UID: siteSystem[r.IntN(len(siteSystem))], GroupsKnown: true}
				c.Connector.GID = c.Connector.UID
				c.Port = siteSrun.First + uint16(r.IntN(int(siteSrun.Last-siteSrun.First)+1))
				c.Source = []netip.Addr{netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.3"),
					netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("2001:2::3")}[r.IntN(4)]
				check("srun callback", srun, c, p.Decide)
			}
		}
	}
	if decided[true] < 100 || decided[false] < 100 {
		t.Errorf("too few site-rule verdicts to mean anything: %v", decided)
	}
	t.Logf("site-rule verdicts compared: %d allow, %d deny", decided[true], decided[false])
}

// decideOwn is policy.Decide for a connection from the listener's own VRF
// (connector = listener): the VRF proves the identity whatever the source
// address (the user's NAT address is not a cluster address), so a deny
// rule matches as for a trusted source; an allow rule matches only where
// Decide would let it (a trusted source, or an identity-free rule naming
// the source). A site rule's verdict is reported; otherwise Decide's.
func decideOwn(p *policy.Policy, c policy.Conn) policy.Verdict {
	if c.Port <= p.SystemPortMax {
		return policy.Verdict{Allow: true, Rule: policy.RuleSystemPort}
	}
	trusted := p.Trusted(c.Source)
	for i := range p.Rules {
		if r := &p.Rules[i]; r.Matches(c, trusted || !r.Allow) {
			return policy.Verdict{Allow: r.Allow, Rule: policy.Rule(r.Name)}
		}
	}
	return p.Decide(c)
}

// TestSiteOwnNATSource: a user sending from her own NAT address (not a
// cluster address) to her own listener is refused by a deny rule, as a
// trusted source is (the review's finding: it matched no rule that asked
// for a trusted source and passed). An allow rule still needs a trusted
// source, so it does not shadow a later deny for her NAT address.
func TestSiteOwnNATSource(t *testing.T) {
	pr := []policy.PortRange{{First: 5432, Last: 5432}}
	p := &policy.Policy{SystemPortMax: 1023, ClusterSubnets: siteSubnets, Rules: []policy.SiteRule{
		{Name: "allow-alice-5432", Allow: true, From: []uint32{2001}, Ports: pr},
		{Name: "deny-5432", Ports: pr},
		{Name: "deny-bob-6000", From: []uint32{2002}, Ports: []policy.PortRange{{First: 6000, Last: 6000}}},
	}}
	nat := netip.MustParseAddr("100.64.0.7")
	for _, c := range []struct {
		uid  uint32
		port uint16
		src  netip.Addr
		rule string
	}{
		{2001, 5432, nat, "deny-5432"},
		{2001, 5432, netip.MustParseAddr("198.18.0.2"), "allow-alice-5432"},
		{2002, 5432, nat, "deny-5432"},
		{2002, 6000, nat, "deny-bob-6000"},
		{2001, 6000, nat, ""},
	} {
		u := SiteUser{UID: c.uid, Groups: []uint32{c.uid}}
		allow, rule := SiteVerdict(p, "node1", policy.PortRange{}, u, false, policy.TCP, c.port, c.src)
		if rule != c.rule || (rule != "" && allow != p.SiteRule(policy.Rule(rule)).Allow) {
			t.Errorf("uid %d -> :%d from %v: got %v by %q, want rule %q", c.uid, c.port, c.src, allow, rule, c.rule)
		}
	}
}

// TestSiteGroupsUnknown: a user whose groups could not be looked up gets
// every deny rule that names a group and no allow rule that does.
func TestSiteGroupsUnknown(t *testing.T) {
	p := &policy.Policy{SystemPortMax: 1023, Rules: []policy.SiteRule{
		{Name: "allow-g", Allow: true, FromGroups: []uint32{3001}, Ports: []policy.PortRange{{First: 5000, Last: 5000}}},
		{Name: "deny-g", FromGroups: []uint32{3001}, Ports: []policy.PortRange{{First: 5000, Last: 5001}}},
		{Name: "deny-to-g", ToGroups: []uint32{3002}, Ports: []policy.PortRange{{First: 6000, Last: 6000}}},
	}}
	ms := compileSite(p, "node1", policy.PortRange{}, SiteUser{UID: 2001, GroupsUnknown: true}, pathOwn)
	var names []string
	for _, m := range ms {
		names = append(names, m.Name)
	}
	if !slices.Equal(names, []string{"deny-g", "deny-to-g"}) {
		t.Errorf("groups unknown: compiled %v, want the deny rules only", names)
	}
}

// TestSiteSpecShared: users selected by the same rules share one chain.
func TestSiteSpecShared(t *testing.T) {
	p := &policy.Policy{SystemPortMax: 1023, Rules: []policy.SiteRule{
		{Name: "all", Ports: []policy.PortRange{{First: 5000, Last: 5000}}},
		{Name: "alice", To: []uint32{2001}, Ports: []policy.PortRange{{First: 5001, Last: 5001}}},
	}}
	var users []SiteUser
	for uid := uint32(2001); uid < 2101; uid++ {
		users = append(users, SiteUser{UID: uid})
	}
	s := buildSite(p, "node1", siteSrun, users, nil)
	if len(s.chains) != 2 || len(s.own) != 100 || len(s.srun) != 0 {
		t.Errorf("100 users, 2 rules: want 2 own chains + none on the callback path, got %d chains, %d own, %d srun", len(s.chains), len(s.own), len(s.srun))
	}
}

// TestSitePortClasses: the port classes of a chain hold, for every port,
// exactly the rules whose ports contain it, in order; their intervals do
// not overlap.
func TestSitePortClasses(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 2))
	for world := range 100 {
		p := &policy.Policy{SystemPortMax: 1023}
		for i := range 1 + r.IntN(12) {
			p.Rules = append(p.Rules, randomRule(r, i))
		}
		ms := compileSite(p, "node1", siteSrun, SiteUser{UID: 2001, Groups: []uint32{2001}}, pathOwn)
		cls := portClasses(ms)
		for j := 1; j < len(cls); j++ {
			if cls[j].ports.First <= cls[j-1].ports.Last {
				t.Fatalf("world %d: classes overlap: %+v %+v", world, cls[j-1].ports, cls[j].ports)
			}
		}
		for port := 1024; port <= 65535; port++ {
			var want []string
			for _, m := range ms {
				if slices.ContainsFunc(m.Ports, func(pr policy.PortRange) bool { return pr.Contains(uint16(port)) }) {
					want = append(want, m.Name)
				}
			}
			var got []string
			for _, c := range cls {
				if c.ports.Contains(uint16(port)) {
					for _, m := range c.rules {
						got = append(got, m.Name)
					}
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("world %d port %d: class rules %v, want %v", world, port, got, want)
			}
		}
	}
}

// evalSegments is what the table does with a packet in a chain laid out by
// siteSegments: wide rules tested in order with their own ports; narrow
// rules dispatched on the port to its class's rules, falling through to
// the next segment when none matches.
func evalSegments(segs []siteSegment, p *policy.Policy, proto policy.Proto, port uint16, src netip.Addr) *siteMatch {
	if port <= p.SystemPortMax {
		return nil
	}
	for _, seg := range segs {
		for i := range seg.wide {
			if seg.wide[i].matches(p, proto, port, src) {
				return &seg.wide[i]
			}
		}
		for _, cl := range seg.classes {
			if !cl.ports.Contains(port) {
				continue
			}
			for i := range cl.rules {
				if cl.rules[i].matches(p, proto, port, src) {
					return &cl.rules[i]
				}
			}
		}
	}
	return nil
}

// TestSiteSegments: the chain's layout (per block of one verdict, a port
// dispatch of its narrow rules and its merged wide rules) gives every
// packet the verdict of the compiled rules in order, on random policies
// with rules without ports and with wide ranges among port rules.
func TestSiteSegments(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 3))
	kinds := map[string]int{}
	for world := range 300 {
		p := &policy.Policy{SystemPortMax: 1023, ClusterSubnets: siteSubnets}
		for i := range 1 + r.IntN(20) {
			sr := randomRule(r, i)
			if r.IntN(5) == 0 {
				sr.Ports = []policy.PortRange{{First: 1024, Last: uint16(1030 + r.IntN(40))}}
			}
			p.Rules = append(p.Rules, sr)
		}
		u := SiteUser{UID: 2001, Groups: []uint32{2001, 3001}}
		for _, path := range []sitePath{pathOwn, pathSrun} {
			ms := compileSite(p, "node1", siteSrun, u, path)
			segs := siteSegments(ms, p)
			for _, sg := range segs {
				if sg.wide != nil {
					kinds["wide"]++
				} else {
					kinds["narrow"]++
				}
			}
			for range 200 {
				proto := []policy.Proto{policy.TCP, policy.UDP}[r.IntN(2)]
				src := siteSources[r.IntN(len(siteSources))]
				port := uint16(1020 + r.IntN(80))
				if path == pathSrun {
					port = siteSrun.First + uint16(r.IntN(120)) - 10
				}
				want, got := firstSiteMatch(ms, p, proto, port, src), evalSegments(segs, p, proto, port, src)
				if (want == nil) != (got == nil) || (want != nil && want.Allow != got.Allow) {
					t.Fatalf("world %d path %d: %v :%d from %v: in order %+v, segments %+v", world, path, proto, port, src, want, got)
				}
			}
		}
	}
	if kinds["wide"] < 100 || kinds["narrow"] < 100 {
		t.Errorf("too few segments of each kind to mean anything: %v", kinds)
	}
}

// TestSiteTableBound: 200 rules without ports and 800 with ports of their
// own make a table of at most (wideClasses+1)·n·2 nft rules (two address
// families at most per compiled rule) — it was rules without ports × port
// classes (~320,000).
func TestSiteTableBound(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 4))
	p := &policy.Policy{SystemPortMax: 1023, ClusterSubnets: siteSubnets}
	for i := range 1000 {
		sr := policy.SiteRule{Name: "r" + strconv.Itoa(i), Proto: []policy.Proto{0, policy.TCP, policy.UDP}[r.IntN(3)],
			Sources: pick(r, sitePrefixes, 1)}
		if i%5 != 0 {
			f := uint16(2000 + r.IntN(60000))
			sr.Ports = []policy.PortRange{{First: f, Last: f + uint16(r.IntN(3))}}
		}
		p.Rules = append(p.Rules, sr)
	}
	s := buildSite(p, "node1", siteSrun, []SiteUser{{UID: 2001}}, nil)
	ms := s.chains[s.own[VRFName(2001)]]
	before := 0
	for _, cl := range portClasses(ms) {
		before += len(cl.rules)
	}
	got := siteSize(s)
	if bound := (wideClasses + 1) * len(p.Rules) * 2; got > bound {
		t.Errorf("table of %d nft rules, bound %d", got, bound)
	}
	t.Logf("1000 rules (200 without ports): %d nft rules; the layout before held %d compiled rules in its sub-chains", got, before)
}
