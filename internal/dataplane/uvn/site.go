package uvn

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Site rules ([[rule]], docs/policy.md) in uvn. uvn has no per-connection
// decision of its own: a new connection reaches a listener in user U's VRF
// by two paths only, and on each of them everything but the packet's
// protocol, port and source is known when U's network is set up:
//
//   - pathOwn: from U's own VRF (a session or a job step of U, on this node
//     or over U's overlay from another node). Connector and listener are
//     both U; the built-in verdict is same-user (allowed). A site rule can
//     only close what U does with U's own listeners (deny), or decide first
//     (allow, which shadows a later deny).
//   - pathSrun: Slurm's callback from a node's default VRF into
//     SrunPortRange (bpf/srun.c marks it srunMark). The sender is one of
//     Slurm's daemons or root; which one, uvn cannot see: rules that ask for
//     the connector's identity (from, relation) do not match it, the others
//     decide as in policy.Decide.
//
// Other users' connections never reach U's VRF, whatever a rule allows (VRFs
// do not share: an allow rule between two users opens nothing in uvn; config
// check says so). Both paths pass the VRF device palv<U> at the input hook:
// the nftables table siteTable sends each new TCP/UDP connection above the
// system ports through a chain of U's compiled rules (siteMatch).

// siteTable is the nftables table of the compiled site rules (one per
// node, apart from the guard's palisade_uvn so that a policy reload never
// touches the VXLAN guard).
const siteTable = "palisade_uvn_site"

// SiteUser is a user with a VRF on this node as the site rules see him.
type SiteUser struct {
	UID uint32
	// Groups are every group the directory gives the user now (primary
	// included): what from = ["@g"] and to = ["@g"] test.
	Groups []uint32
	// GroupsUnknown: the lookup failed. A deny rule's group condition then
	// counts as met and an allow rule's as not (fail closed).
	GroupsUnknown bool
}

type sitePath uint8

const (
	pathOwn sitePath = iota
	pathSrun
)

// siteMatch is one site rule compiled for one user and path: what remains
// of it once the user and the node are decided; the packet decides the rest.
type siteMatch struct {
	Rule  int // index in Policy.Rules
	Name  string
	Allow bool
	Proto policy.Proto // 0: TCP and UDP
	// Ports: never empty (a rule without ports: every port above the
	// system ports).
	Ports []policy.PortRange
	// Sources: nil means any source.
	Sources []netip.Prefix
	// Trusted: the source must carry a trusted identity (policy.Trusted).
	Trusted bool
}

// siteGroups reports whether u's groups meet a rule's group condition gs,
// failing closed when they are unknown.
func siteGroups(u SiteUser, gs []uint32, allow bool) bool {
	if u.GroupsUnknown {
		return !allow && len(gs) > 0
	}
	return slices.ContainsFunc(gs, func(g uint32) bool { return slices.Contains(u.Groups, g) })
}

// compileSite returns the rules that can decide a new connection entering
// u's VRF on node over path, in the policy's order. srun is SrunPortRange
// (pathSrun carries nothing else).
func compileSite(p *policy.Policy, node string, srun policy.PortRange, u SiteUser, path sitePath) []siteMatch {
	if p == nil || p.SystemPortMax == 65535 {
		return nil
	}
	var out []siteMatch
	for i := range p.Rules {
		r := &p.Rules[i]
		if len(r.Nodes) > 0 && !slices.Contains(r.Nodes, node) {
			continue
		}
		// The listener is u: its uid, or u's membership of a group (the
		// socket's own gid is not visible at the input hook; docs/policy.md).
		if (len(r.To) > 0 || len(r.ToGroups) > 0) && !slices.Contains(r.To, u.UID) && !siteGroups(u, r.ToGroups, r.Allow) {
			continue
		}
		switch path {
		case pathOwn:
			// The connector is u too: same-user holds, and shared-group
			// (the listener's gid is one of u's groups).
			if (len(r.From) > 0 || len(r.FromGroups) > 0) && !slices.Contains(r.From, u.UID) && !siteGroups(u, r.FromGroups, r.Allow) {
				continue
			}
		case pathSrun:
			if !r.IdentityFree() {
				continue
			}
		}
		ports := r.Ports
		if len(ports) == 0 {
			ports = []policy.PortRange{{First: p.SystemPortMax + 1, Last: 65535}}
		}
		if path == pathSrun {
			ports = intersectPorts(ports, srun)
			if len(ports) == 0 {
				continue
			}
		}
		out = append(out, siteMatch{Rule: i, Name: r.Name, Allow: r.Allow, Proto: r.Proto, Ports: ports,
			Sources: r.Sources, Trusted: len(r.Sources) == 0 || !r.IdentityFree()})
	}
	return out
}

func intersectPorts(ps []policy.PortRange, with policy.PortRange) []policy.PortRange {
	var out []policy.PortRange
	for _, r := range ps {
		if r.Overlaps(with) {
			out = append(out, policy.PortRange{First: max(r.First, with.First), Last: min(r.Last, with.Last)})
		}
	}
	return out
}

// matches is the compiled rule on one packet: what the nftables rules made
// of it test (siteRules), and what the unit test holds against
// policy.Decide.
func (m *siteMatch) matches(p *policy.Policy, proto policy.Proto, port uint16, src netip.Addr) bool {
	src = src.Unmap()
	if m.Proto != 0 && m.Proto != proto {
		return false
	}
	if !slices.ContainsFunc(m.Ports, func(r policy.PortRange) bool { return r.Contains(port) }) {
		return false
	}
	if m.Sources != nil && !slices.ContainsFunc(m.Sources, func(s netip.Prefix) bool { return s.Contains(src) }) {
		return false
	}
	return !m.Trusted || slices.ContainsFunc(trustedPrefixes(p), func(s netip.Prefix) bool { return s.Contains(src) })
}

// firstSiteMatch is the compiled rule that decides a packet, or nil.
func firstSiteMatch(ms []siteMatch, p *policy.Policy, proto policy.Proto, port uint16, src netip.Addr) *siteMatch {
	if port <= p.SystemPortMax {
		return nil
	}
	for i := range ms {
		if ms[i].matches(p, proto, port, src) {
			return &ms[i]
		}
	}
	return nil
}

// trustedPrefixes are the sources policy.Trusted trusts, as prefixes:
// loopback, link-local unicast and the cluster subnets.
func trustedPrefixes(p *policy.Policy) []netip.Prefix {
	out := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"),
		netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fe80::/10")}
	return append(out, p.ClusterSubnets...)
}

// SiteVerdict says what uvn does with a new connection into uid's VRF on
// node (explain): srunPath is Slurm's callback from a default VRF, else the
// connection comes from uid's own VRF. rule is the site rule that decides,
// "" when none does (the connection then passes as uvn's structure lets
// it).
func SiteVerdict(p *policy.Policy, node string, srun policy.PortRange, u SiteUser, srunPath bool, proto policy.Proto, port uint16, src netip.Addr) (allow bool, rule string) {
	path := pathOwn
	if srunPath {
		path = pathSrun
	}
	if m := firstSiteMatch(compileSite(p, node, srun, u, path), p, proto, port, src); m != nil {
		return m.Allow, m.Name
	}
	return true, ""
}

// siteSpec is the whole table: distinct chains, and which VRF device uses
// which chain on each path.
type siteSpec struct {
	p      *policy.Policy
	chains [][]siteMatch
	own    map[string]int // VRF device name -> chain
	srun   map[string]int
}

// buildSite compiles the rules for every user with a VRF on this node.
// Users whose compiled rules are the same share one chain, so the table
// grows with the rules and the distinct ways they select users, not with
// rules × users.
//
// devs names a user's devices besides the VRF (nil: none): IPv4 multicast
// arrives at the input hook on the VXLAN device it came through, not the
// VRF device, so each of the user's VXLANs dispatches to the user's chain
// too.
func buildSite(p *policy.Policy, node string, srun policy.PortRange, users []SiteUser, devs func(uint32) []string) *siteSpec {
	s := &siteSpec{p: p, own: map[string]int{}, srun: map[string]int{}}
	if p == nil || len(p.Rules) == 0 {
		return s
	}
	byKey := map[string]int{}
	chain := func(ms []siteMatch) int {
		var k strings.Builder
		for _, m := range ms {
			k.WriteString(strconv.Itoa(m.Rule))
			k.WriteByte(',')
			// The same rule compiles differently on the two paths
			// (SrunPortRange): its ports are part of the key.
			for _, r := range m.Ports {
				k.WriteString(r.String())
				k.WriteByte(' ')
			}
			k.WriteByte(';')
		}
		if i, ok := byKey[k.String()]; ok {
			return i
		}
		s.chains = append(s.chains, ms)
		byKey[k.String()] = len(s.chains) - 1
		return len(s.chains) - 1
	}
	for _, u := range users {
		if ms := compileSite(p, node, srun, u, pathOwn); len(ms) > 0 {
			c := chain(ms)
			s.own[VRFName(u.UID)] = c
			if devs != nil {
				for _, d := range devs(u.UID) {
					s.own[d] = c
				}
			}
		}
		if srun == (policy.PortRange{}) {
			continue
		}
		if ms := compileSite(p, node, srun, u, pathSrun); len(ms) > 0 {
			s.srun[VRFName(u.UID)] = chain(ms)
		}
	}
	return s
}

func (s *siteSpec) empty() bool { return s.p == nil || len(s.p.Rules) == 0 }

// installSite replaces the table with s in one transaction (the kernel
// applies all of it or none: a failure leaves the running table); a policy
// without site rules removes it.
//
//	input (filter, policy accept): tcp/udp, ct state new -> goto dispatch
//	dispatch: th dport <= system_port_max -> accept
//	          meta mark srunMark -> iifname vmap @srun ; accept
//	          iifname vmap @own
//	c<N>: th dport vmap @m<N>           (port class -> goto r<K>)
//	r<K>: one rule per compiled rule (and family) covering the class, in
//	      order: [l4proto] [saddr @s<i>_4|6] [saddr @trusted4|6] -> accept | drop
func installSite(s *siteSpec) error {
	// A large policy is thousands of messages in one batch (one sendmsg),
	// each acked: room for both (ENOBUFS would leave the outcome unknown).
	c, err := nftables.New(nftables.WithSockOptions(func(nc *netlink.Conn) error {
		rc, err := nc.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = errors.Join(unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 16<<20),
				unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, 64<<20))
		}); err != nil {
			return err
		}
		return serr
	}))
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: siteTable, Family: nftables.TableFamilyINet}
	c.AddTable(t)
	c.DelTable(t)
	if s.empty() {
		if err := c.Flush(); err != nil {
			return fmt.Errorf("nftables table %s: %w", siteTable, err)
		}
		return nil
	}
	c.AddTable(t)
	if err := s.add(c, t); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables table %s: %w", siteTable, err)
	}
	return nil
}

func (s *siteSpec) add(c *nftables.Conn, t *nftables.Table) error {
	p := s.p
	// Sets: each used rule's sources, the trusted sources.
	srcSet := map[[2]int]*nftables.Set{}
	addSet := func(name string, typ nftables.SetDatatype, els []nftables.SetElement) (*nftables.Set, error) {
		set := &nftables.Set{Table: t, Name: name, KeyType: typ, Interval: true}
		return set, c.AddSet(set, els)
	}
	trusted := map[int]*nftables.Set{}
	for fam, typ := range map[int]nftables.SetDatatype{4: nftables.TypeIPAddr, 6: nftables.TypeIP6Addr} {
		if els := addrIntervals(trustedPrefixes(p), fam == 6); len(els) > 0 {
			set, err := addSet(fmt.Sprintf("trusted%d", fam), typ, els)
			if err != nil {
				return err
			}
			trusted[fam] = set
		}
	}
	// Each chain dispatches on the destination port: an interval map from
	// port classes (the ranges between its rules' port boundaries) to a
	// sub-chain of only the rules whose ports hold that class, in order.
	// A new connection then costs two map lookups plus the rules that
	// cover its port, whatever the number of rules. Sub-chains do not test
	// ports, so chains share them.
	subs := map[string]string{}
	var subErr error
	sub := func(ms []siteMatch) string {
		var k strings.Builder
		for _, m := range ms {
			k.WriteString(strconv.Itoa(m.Rule) + ",")
		}
		if name, ok := subs[k.String()]; ok {
			return name
		}
		name := fmt.Sprintf("r%d", len(subs))
		subs[k.String()] = name
		ch := c.AddChain(&nftables.Chain{Name: name, Table: t})
		for _, m := range ms {
			head := []expr.Any{}
			if m.Proto != 0 {
				head = append(head, &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(m.Proto)}})
			}
			verdict := []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}
			if m.Allow {
				verdict = []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictAccept}}
			}
			if m.Sources == nil && !m.Trusted {
				c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(head, verdict)})
				continue
			}
			for _, fam := range []int{4, 6} {
				nfproto, off, alen, typ := byte(unix.NFPROTO_IPV4), uint32(12), uint32(4), nftables.TypeIPAddr
				if fam == 6 {
					nfproto, off, alen, typ = unix.NFPROTO_IPV6, 8, 16, nftables.TypeIP6Addr
				}
				e := cat([]expr.Any{
					&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{nfproto}},
				}, head)
				saddr := &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: alen}
				if m.Sources != nil {
					els := addrIntervals(m.Sources, fam == 6)
					if len(els) == 0 {
						continue // no source of this family
					}
					key := [2]int{m.Rule, fam}
					set, ok := srcSet[key]
					if !ok {
						var err error
						if set, err = addSet(fmt.Sprintf("s%d_%d", m.Rule, fam), typ, els); err != nil {
							subErr = err
						}
						srcSet[key] = set
					}
					e = append(e, saddr, &expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID})
				}
				if m.Trusted {
					set := trusted[fam]
					if set == nil {
						continue
					}
					e = append(e, saddr, &expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID})
				}
				c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(e, verdict)})
			}
		}
		return name
	}
	chainName := func(i int) string { return fmt.Sprintf("c%d", i) }
	for i, ms := range s.chains {
		ch := c.AddChain(&nftables.Chain{Name: chainName(i), Table: t})
		var els []nftables.SetElement
		for _, cl := range portClasses(ms) {
			els = append(els, nftables.SetElement{Key: be16(cl.ports.First), VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: sub(cl.rules)}})
			if cl.end {
				els = append(els, nftables.SetElement{Key: be16(cl.ports.Last + 1), IntervalEnd: true})
			}
		}
		if subErr != nil {
			return subErr
		}
		m := &nftables.Set{Table: t, Name: fmt.Sprintf("m%d", i), IsMap: true, Interval: true,
			KeyType: nftables.TypeInetService, DataType: nftables.TypeVerdict}
		if err := c.AddSet(m, els); err != nil {
			return err
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Lookup{SourceRegister: 1, SetName: m.Name, SetID: m.ID, DestRegister: 0, IsDestRegSet: true},
		}})
	}
	// Verdict maps: VRF device -> goto its chain (a chain that matches
	// nothing returns to the base chain's policy, accept).
	vmap := func(name string, m map[string]int) (*nftables.Set, error) {
		set := &nftables.Set{Table: t, Name: name, IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
		var els []nftables.SetElement
		devs := make([]string, 0, len(m))
		for d := range m {
			devs = append(devs, d)
		}
		sort.Strings(devs)
		for _, d := range devs {
			els = append(els, nftables.SetElement{Key: ifname(d), VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: chainName(m[d])}})
		}
		return set, c.AddSet(set, els)
	}
	ownMap, err := vmap("own", s.own)
	if err != nil {
		return err
	}
	srunMap, err := vmap("srun", s.srun)
	if err != nil {
		return err
	}
	accept := nftables.ChainPolicyAccept
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	d := c.AddChain(&nftables.Chain{Name: "dispatch", Table: t})
	for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
		c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: cat(
			[]expr.Any{
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
			},
			ctState(expr.CtStateBitNEW),
			[]expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: d.Name}})})
	}
	c.AddRule(&nftables.Rule{Table: t, Chain: d, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpLte, Register: 1, Data: be16(p.SystemPortMax)},
		&expr.Verdict{Kind: expr.VerdictAccept},
	}})
	mark := func() []expr.Any {
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: nativeU32(srunMark)},
		}
	}
	iif := &expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}
	c.AddRule(&nftables.Rule{Table: t, Chain: d, Exprs: cat(mark(), []expr.Any{iif,
		&expr.Lookup{SourceRegister: 1, SetName: srunMap.Name, SetID: srunMap.ID, DestRegister: 0, IsDestRegSet: true}})})
	c.AddRule(&nftables.Rule{Table: t, Chain: d, Exprs: cat(mark(), []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}})})
	c.AddRule(&nftables.Rule{Table: t, Chain: d, Exprs: []expr.Any{iif,
		&expr.Lookup{SourceRegister: 1, SetName: ownMap.Name, SetID: ownMap.ID, DestRegister: 0, IsDestRegSet: true}}})
	return nil
}

// removeSite deletes the table; a missing table is fine.
func removeSite() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: siteTable, Family: nftables.TableFamilyINet}
	c.AddTable(t)
	c.DelTable(t)
	return c.Flush()
}

// sitePresent reports whether the table exists.
func sitePresent() bool {
	c, err := nftables.New()
	if err != nil {
		return false
	}
	_, err = c.ListTableOfFamily(siteTable, nftables.TableFamilyINet)
	return err == nil
}

// portClass is a range of ports that the same rules of a chain cover.
type portClass struct {
	ports policy.PortRange
	rules []siteMatch
	// end: an interval end element closes it (every class but one
	// ending at 65535).
	end bool
}

// portClasses splits ms's ports at every rule's boundaries and lists, for
// each class some rule covers, those rules in order (adjacent classes with
// the same rules merged).
func portClasses(ms []siteMatch) []portClass {
	var cuts []int
	for _, m := range ms {
		for _, r := range m.Ports {
			cuts = append(cuts, int(r.First), int(r.Last)+1)
		}
	}
	slices.Sort(cuts)
	cuts = slices.Compact(cuts)
	var out []portClass
	for j := 0; j+1 < len(cuts); j++ {
		first, last := uint16(cuts[j]), uint16(cuts[j+1]-1)
		var rules []siteMatch
		for _, m := range ms {
			if slices.ContainsFunc(m.Ports, func(r policy.PortRange) bool { return r.Contains(first) }) {
				rules = append(rules, m)
			}
		}
		if len(rules) == 0 {
			continue
		}
		if n := len(out); n > 0 && int(out[n-1].ports.Last)+1 == int(first) && sameRules(out[n-1].rules, rules) {
			out[n-1].ports.Last = last
			continue
		}
		out = append(out, portClass{ports: policy.PortRange{First: first, Last: last}, rules: rules})
	}
	for j := range out {
		// Adjacent intervals too: the kernel takes an end and a start
		// with one key (and refuses a start that meets an open interval).
		out[j].end = out[j].ports.Last < 65535
	}
	return out
}

func sameRules(a, b []siteMatch) bool {
	return slices.EqualFunc(a, b, func(x, y siteMatch) bool { return x.Rule == y.Rule })
}

// addrIntervals are the prefixes of one family, merged (overlapping and
// adjacent ranges: a node's address inside a listed subnet), as
// interval-set elements.
func addrIntervals(ps []netip.Prefix, v6 bool) []nftables.SetElement {
	type rng struct{ first, last netip.Addr }
	var rs []rng
	for _, p := range ps {
		if p.Addr().Is6() != v6 {
			continue
		}
		rs = append(rs, rng{p.Masked().Addr(), lastAddr(p)})
	}
	slices.SortFunc(rs, func(a, b rng) int { return a.first.Compare(b.first) })
	var merged []rng
	for _, r := range rs {
		if n := len(merged); n > 0 {
			prev := &merged[n-1]
			if next := prev.last.Next(); !next.IsValid() || r.first.Compare(next) <= 0 {
				if r.last.Compare(prev.last) > 0 {
					prev.last = r.last
				}
				continue
			}
		}
		merged = append(merged, r)
	}
	var els []nftables.SetElement
	for _, r := range merged {
		els = append(els, nftables.SetElement{Key: r.first.AsSlice()})
		if end := r.last.Next(); end.IsValid() {
			els = append(els, nftables.SetElement{Key: end.AsSlice(), IntervalEnd: true})
		}
	}
	return els
}

func nativeU32(v uint32) []byte { return binaryutil.NativeEndian.PutUint32(v) }

// SiteConfig is what the site rules need on this node.
type SiteConfig struct {
	Policy *policy.Policy
	// Node is this node's host name (on_nodes).
	Node string
	// Groups looks up a user's groups (NSS), asked only when a rule names
	// a group.
	Groups func(uid uint32) ([]uint32, error)
}

// siteNeedsGroups reports whether a rule names a group.
func siteNeedsGroups(p *policy.Policy) bool {
	return slices.ContainsFunc(p.Rules, func(r policy.SiteRule) bool { return len(r.FromGroups) > 0 || len(r.ToGroups) > 0 })
}

// SiteUserOf is uid as the site rules see him, his groups looked up with
// groups (nil or failing: unknown, which fails closed).
func SiteUserOf(p *policy.Policy, uid uint32, groups func(uint32) ([]uint32, error)) SiteUser {
	u := SiteUser{UID: uid}
	if p == nil || !siteNeedsGroups(p) {
		return u
	}
	if groups == nil {
		u.GroupsUnknown = true
		return u
	}
	gs, err := groups(uid)
	u.Groups, u.GroupsUnknown = gs, err != nil
	return u
}

// applySite compiles the site rules for every user with a network on this
// node and replaces the table (node lock held).
func (m *Manager) applySite() error {
	if m.Site == nil {
		return nil
	}
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	users := make([]SiteUser, 0, len(uids))
	for _, uid := range uids {
		u := SiteUserOf(m.Site.Policy, uid, m.Site.Groups)
		if u.GroupsUnknown {
			m.logf("uvn: site rules: groups of uid %d unknown: its group conditions fail closed", uid)
		}
		users = append(users, u)
	}
	vxlans := func(uid uint32) []string {
		var out []string
		for i := range m.cfg.Underlays {
			out = append(out, VXLANName(i, uid))
		}
		return out
	}
	return installSite(buildSite(m.Site.Policy, m.Site.Node, m.Srun, users, vxlans))
}

func (m *Manager) applySiteLocked() error {
	unlock, err := m.st.lockNode()
	if err != nil {
		return err
	}
	defer unlock()
	return m.applySite()
}

// siteIntact reports whether the table is where the policy wants it: there
// when the policy has site rules.
func (m *Manager) siteIntact() bool {
	if m.Site == nil || m.Site.Policy == nil || len(m.Site.Policy.Rules) == 0 {
		return true
	}
	return sitePresent()
}

// ReloadSite applies the manager's site rules to every user of the node
// at once (`palisade uvn reload`): one nftables transaction, so a failure
// leaves the running rules. A node without users has nothing to apply.
func (m *Manager) ReloadSite() (int, error) {
	unlock, err := m.st.lockNode()
	if err != nil {
		return 0, err
	}
	defer unlock()
	uids, err := m.st.users()
	if err != nil || len(uids) == 0 {
		return 0, err
	}
	return len(uids), m.applySite()
}
