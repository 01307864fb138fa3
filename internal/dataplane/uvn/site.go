package uvn

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

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
		// The trusted-source test is Decide's: identity is believed only
		// from a trusted source. On the own path the VRF proves it (the
		// connector is u whatever address u sends from: its NAT address
		// 100.64.x.y is not in the cluster's subnets), so a deny applies
		// from every source there; an allow keeps the test, which makes it
		// decide no more than Decide lets it (docs/policy.md, OwnVerdict).
		trusted := len(r.Sources) == 0 || !r.IdentityFree()
		if path == pathOwn && !r.Allow {
			trusted = false
		}
		out = append(out, siteMatch{Rule: i, Name: r.Name, Allow: r.Allow, Proto: r.Proto, Ports: ports,
			Sources: r.Sources, Trusted: trusted})
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
//	c<N>: its segments in order (siteSegments):
//	      wide rules: [l4proto] [th dport @p<J>] [saddr ...] -> accept | drop
//	      a run of narrow rules: th dport vmap @m<N>_<S> (port class -> jump r<K>)
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
	srcSet := map[string]*nftables.Set{}
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
	// emit appends the nft rules of ms to ch, in order; port: the rule's
	// own destination-port test (a wide rule outside a port dispatch).
	var subErr error
	portSets := map[string]*nftables.Set{}
	emit := func(ch *nftables.Chain, ms []siteMatch, port bool) {
		for _, m := range ms {
			head := []expr.Any{}
			if m.Proto != 0 {
				head = append(head, &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(m.Proto)}})
			}
			if port && !m.allPorts(p) {
				// One set per rule and ports (the callback path's
				// ports are the rule's within SrunPortRange).
				key := fmt.Sprint(m.Rule, m.Ports)
				set, ok := portSets[key]
				if !ok {
					var els []nftables.SetElement
					for _, r := range mergePorts(m.Ports) {
						els = append(els, nftables.SetElement{Key: be16(r.First)})
						if r.Last < 65535 {
							els = append(els, nftables.SetElement{Key: be16(r.Last + 1), IntervalEnd: true})
						}
					}
					set = &nftables.Set{Table: t, Name: fmt.Sprintf("p%d", len(portSets)), KeyType: nftables.TypeInetService, Interval: true}
					if err := c.AddSet(set, els); err != nil {
						subErr = err
					}
					portSets[key] = set
				}
				head = append(head, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
					&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID})
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
					key := fmt.Sprint(fam, m.Sources)
					set, ok := srcSet[key]
					if !ok {
						var err error
						if set, err = addSet(fmt.Sprintf("s%d_%d", len(srcSet), fam), typ, els); err != nil {
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
	}
	// Sub-chains hold the narrow rules of one port class and test no
	// port, so chains share them.
	subs := map[string]string{}
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
		emit(c.AddChain(&nftables.Chain{Name: name, Table: t}), ms, false)
		return name
	}
	chainName := func(i int) string { return fmt.Sprintf("c%d", i) }
	for i, ms := range s.chains {
		ch := c.AddChain(&nftables.Chain{Name: chainName(i), Table: t})
		for j, seg := range siteSegments(ms, p) {
			if seg.wide != nil {
				emit(ch, seg.wide, true)
				continue
			}
			// A run of narrow rules: an interval map from its port
			// classes to the sub-chain of the rules covering each
			// (jump: a class none of whose rules matches returns here,
			// to the next segment).
			var els []nftables.SetElement
			for _, cl := range seg.classes {
				els = append(els, nftables.SetElement{Key: be16(cl.ports.First), VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: sub(cl.rules)}})
				if cl.end {
					els = append(els, nftables.SetElement{Key: be16(cl.ports.Last + 1), IntervalEnd: true})
				}
			}
			m := &nftables.Set{Table: t, Name: fmt.Sprintf("m%d_%d", i, j), IsMap: true, Interval: true,
				KeyType: nftables.TypeInetService, DataType: nftables.TypeVerdict}
			if err := c.AddSet(m, els); err != nil {
				return err
			}
			c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Lookup{SourceRegister: 1, SetName: m.Name, SetID: m.ID, DestRegister: 0, IsDestRegSet: true},
			}})
		}
		if subErr != nil {
			return subErr
		}
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

// siteInstalled is what the table in the kernel was built from
// (site-installed.json in the state directory): the fingerprint of
// everything but the devices' verdict maps, and those maps.
type siteInstalled struct {
	Body string         `json:"body"`
	Own  map[string]int `json:"own"`
	Srun map[string]int `json:"srun"`
}

func (s store) installedPath() string { return filepath.Join(s.dir, "site-installed.json") }

// body fingerprints the table but for which device uses which chain.
func (s *siteSpec) body() string {
	type chainKey struct {
		Rule  int
		Ports []policy.PortRange
	}
	var cs [][]chainKey
	for _, ms := range s.chains {
		var c []chainKey
		for _, m := range ms {
			c = append(c, chainKey{m.Rule, m.Ports})
		}
		cs = append(cs, c)
	}
	b, err := json.Marshal(struct {
		P      *policy.Policy
		Chains [][]chainKey
	}{s.p, cs})
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// installSpec puts s in the kernel, changing only what differs from the
// table there (node lock held). A setup or teardown usually changes only
// which devices use which chain (users selected by the same rules share
// one): then only those verdict-map elements change, in one transaction.
// Anything else, or a table that is not there (removed behind uvn's back),
// replaces the whole table (installSite).
func (m *Manager) installSpec(s *siteSpec) error {
	var inst siteInstalled
	ok, _ := readJSON(m.st.installedPath(), &inst)
	body := s.body()
	if s.empty() {
		os.Remove(m.st.installedPath())
		return installSite(s)
	}
	if ok && body != "" && inst.Body == body && sitePresent() {
		err := updateSiteMaps(inst, s)
		if err == nil {
			return writeJSON(m.st.installedPath(), siteInstalled{Body: body, Own: s.own, Srun: s.srun})
		}
		m.logf("uvn: site rules: update of the device maps failed (%v): replacing the table", err)
	}
	// Forget the old record first: a crash between the two leaves a
	// table that the next rebuild replaces whole.
	os.Remove(m.st.installedPath())
	if err := installSite(s); err != nil {
		return err
	}
	return writeJSON(m.st.installedPath(), siteInstalled{Body: body, Own: s.own, Srun: s.srun})
}

// updateSiteMaps changes the own and srun verdict maps from inst's to s's
// in one transaction.
func updateSiteMaps(inst siteInstalled, s *siteSpec) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: siteTable, Family: nftables.TableFamilyINet}
	changes := 0
	for _, mp := range []struct {
		name     string
		old, new map[string]int
	}{{"own", inst.Own, s.own}, {"srun", inst.Srun, s.srun}} {
		set := &nftables.Set{Table: t, Name: mp.name, IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
		var del, add []nftables.SetElement
		for d, ch := range mp.old {
			if n, ok := mp.new[d]; !ok || n != ch {
				del = append(del, nftables.SetElement{Key: ifname(d)})
			}
		}
		for d, ch := range mp.new {
			if o, ok := mp.old[d]; !ok || o != ch {
				add = append(add, nftables.SetElement{Key: ifname(d), VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: fmt.Sprintf("c%d", ch)}})
			}
		}
		if len(del) > 0 {
			if err := c.SetDeleteElements(set, del); err != nil {
				return err
			}
		}
		if len(add) > 0 {
			if err := c.SetAddElements(set, add); err != nil {
				return err
			}
		}
		changes += len(del) + len(add)
	}
	if changes == 0 {
		return nil
	}
	return c.Flush()
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

// wideClasses is how many port classes of its block a rule may cover and
// still sit in the port dispatch (narrow). A rule without ports covers
// them all; with it in every class's sub-chain a chain of n such rules and
// k classes held n×k nft rules (200 + 800 rules: ~320,000). A wide rule is
// tested once, with its own port test, instead (siteSegments).
const wideClasses = 8

// siteSegment is a part of a chain: wide rules tested one by one with
// their own port test (wide), or narrow rules dispatched on the port
// (classes).
type siteSegment struct {
	wide    []siteMatch
	classes []portClass
}

// allPorts reports whether m covers every port above the system ports.
func (m *siteMatch) allPorts(p *policy.Policy) bool {
	rs := mergePorts(m.Ports)
	return len(rs) == 1 && rs[0].First <= p.SystemPortMax+1 && rs[0].Last == 65535
}

// siteSegments lays a chain's compiled rules out for the kernel. Only the
// verdict of the first rule that matches counts there (the rule's name is
// explain's and the events', from the compiled list), and consecutive
// rules with the same verdict give the same verdict in any order: so each
// block of consecutive rules with one verdict becomes (1) a port dispatch
// of its narrow rules and (2) its wide rules — those without ports or
// covering more than wideClasses of the block's port classes — merged
// where they differ only by source (one address set). Blocks keep their
// order.
//
// Size: a narrow rule sits in at most wideClasses sub-chains (the block's
// classes cut its ranges into at most that many), a wide one in its chain
// once: at most (wideClasses+1)·n compiled rules for a chain of n, two nft
// rules each at most (address families). Cost: per block one map lookup
// and the rules covering the port, plus its wide rules after merging.
func siteSegments(ms []siteMatch, p *policy.Policy) []siteSegment {
	var out []siteSegment
	for len(ms) > 0 {
		n := 1
		for n < len(ms) && ms[n].Allow == ms[0].Allow {
			n++
		}
		block := ms[:n]
		ms = ms[n:]
		var ported []siteMatch
		for _, m := range block {
			if !m.allPorts(p) {
				ported = append(ported, m)
			}
		}
		cover := map[int]int{}
		for _, cl := range portClasses(ported) {
			for _, m := range cl.rules {
				cover[m.Rule]++
			}
		}
		var narrow, wide []siteMatch
		for _, m := range block {
			if m.allPorts(p) || cover[m.Rule] > wideClasses {
				wide = append(wide, m)
			} else {
				narrow = append(narrow, m)
			}
		}
		if len(narrow) > 0 {
			out = append(out, siteSegment{classes: portClasses(narrow)})
		}
		if len(wide) > 0 {
			out = append(out, siteSegment{wide: mergeWide(wide, p)})
		}
	}
	return out
}

// mergeWide merges rules of one verdict that differ only by their sources
// into one (the union of the sources); a rule without sources absorbs the
// others of its kind.
func mergeWide(ms []siteMatch, p *policy.Policy) []siteMatch {
	type kind struct {
		proto   policy.Proto
		ports   string
		trusted bool
	}
	var out []siteMatch
	at := map[kind]int{}
	for _, m := range ms {
		ports := "all"
		if !m.allPorts(p) {
			ports = fmt.Sprint(mergePorts(m.Ports))
		}
		k := kind{m.Proto, ports, m.Trusted}
		i, ok := at[k]
		if !ok {
			at[k] = len(out)
			m.Sources = slices.Clone(m.Sources)
			out = append(out, m)
			continue
		}
		if out[i].Sources == nil || m.Sources == nil {
			out[i].Sources = nil
			continue
		}
		out[i].Sources = append(out[i].Sources, m.Sources...)
	}
	return out
}

// mergePorts sorts and merges overlapping and adjacent ranges.
func mergePorts(rs []policy.PortRange) []policy.PortRange {
	rs = slices.Clone(rs)
	slices.SortFunc(rs, func(a, b policy.PortRange) int { return int(a.First) - int(b.First) })
	var out []policy.PortRange
	for _, r := range rs {
		if n := len(out); n > 0 && int(r.First) <= int(out[n-1].Last)+1 {
			out[n-1].Last = max(out[n-1].Last, r.Last)
			continue
		}
		out = append(out, r)
	}
	return out
}

// siteSize is the number of nft rules the table of s holds (the bound's
// measure; TestSiteTableBound).
func siteSize(s *siteSpec) int {
	per := func(m siteMatch) int {
		if m.Sources == nil && !m.Trusted {
			return 1
		}
		return 2
	}
	n := 0
	subs := map[string]bool{}
	for _, ms := range s.chains {
		for _, seg := range siteSegments(ms, s.p) {
			n++ // the dispatch rule, or counted below for wide
			if seg.wide != nil {
				n--
				for _, m := range seg.wide {
					n += per(m)
				}
				continue
			}
			for _, cl := range seg.classes {
				var k strings.Builder
				for _, m := range cl.rules {
					k.WriteString(strconv.Itoa(m.Rule) + ",")
				}
				if subs[k.String()] {
					continue
				}
				subs[k.String()] = true
				for _, m := range cl.rules {
					n += per(m)
				}
			}
		}
	}
	return n
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
	// Vet runs the policy's [[test]]s (nil: nothing to run). Asked only
	// when the node has accepted no policy yet (acceptedSite).
	Vet func() error
}

// acceptedSite is the site policy this node last accepted, in the state
// directory (site-policy.json): what `palisade uvn reload` applied after
// its [[test]]s passed, or what the node's first setup found with passing
// tests. Every later setup and teardown compiles it, never the file on
// disk: an edit (even one reload refused) applies only through reload.
type acceptedSite struct {
	Policy *policy.Policy `json:"policy"`
	At     time.Time      `json:"at"`
}

func (s store) sitePath() string { return filepath.Join(s.dir, "site-policy.json") }

// readAccepted returns the accepted policy, nil when there is none.
func (s store) readAccepted() (*policy.Policy, error) {
	var a acceptedSite
	ok, err := readJSON(s.sitePath(), &a)
	if err != nil || !ok {
		return nil, err
	}
	if a.Policy == nil {
		return nil, fmt.Errorf("%s: no policy", s.sitePath())
	}
	return a.Policy, nil
}

func (s store) accept(p *policy.Policy) error {
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return err
	}
	return writeJSON(s.sitePath(), acceptedSite{Policy: p, At: time.Now().UTC()})
}

func samePolicy(a, b *policy.Policy) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && string(ja) == string(jb)
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

// SiteGroupsTTL is how long a user's looked-up groups serve the rebuilds
// of the table that other users' setups and teardowns cause. The user
// being set up is looked up afresh, and `uvn reload` looks everyone up.
const SiteGroupsTTL = 5 * time.Minute

// siteLookups is how many users' groups are looked up at once.
const siteLookups = 8

// groupsEntry is a user's groups as last looked up.
type groupsEntry struct {
	Groups []uint32  `json:"groups"`
	At     time.Time `json:"at"`
}

func (s store) groupsPath() string { return filepath.Join(s.dir, "site-groups.json") }

// sitePrep is what a rebuild needs that may take time, gathered before the
// node lock is taken: the policy and the users' groups (NSS lookups, up to
// 10 s each when the directory hangs). Under the lock only the table is
// compiled and replaced, so a slow directory never holds every other
// user's setup on the node.
type sitePrep struct {
	p *policy.Policy
	// fromFile: no policy was accepted yet, p is the file's; passed: its
	// tests pass (it is accepted under the lock).
	fromFile, passed bool
	known            map[uint32]groupsEntry
}

// prepareSite (no lock held) reads the policy to enforce and looks up the
// groups of the node's users (and of uid, fresh > 0: being set up) that
// the policy needs: afresh for fresh (all: everyone, reload), from the
// cache when younger than SiteGroupsTTL for the others. A failed lookup is
// not cached: the user is unknown, which fails closed (SiteUser), and is
// looked up again at the next rebuild.
func (m *Manager) prepareSite(fresh uint32, all bool) (*sitePrep, error) {
	pr := &sitePrep{known: map[uint32]groupsEntry{}}
	var err error
	if all {
		pr.p = m.Site.Policy
	} else if pr.p, err = m.st.readAccepted(); err != nil {
		// Fail closed: a setup without the accepted policy stops (and
		// rolls back) rather than enforce an unvetted one.
		return nil, fmt.Errorf("accepted site policy: %w", err)
	} else if pr.p == nil {
		pr.p, pr.fromFile, pr.passed = m.Site.Policy, true, true
		if m.Site.Vet != nil {
			if err := m.Site.Vet(); err != nil {
				m.logf("uvn: site rules: no accepted policy on this node and the configuration's tests fail (%v): enforcing it unaccepted until `palisade uvn reload` accepts a passing one", err)
				pr.passed = false
			}
		}
	} else if !samePolicy(pr.p, m.Site.Policy) {
		m.logf("uvn: site rules: the configuration differs from the policy this node accepted: `palisade uvn reload` applies it once its tests pass")
	}
	if pr.p == nil || !siteNeedsGroups(pr.p) || m.Site.Groups == nil {
		return pr, nil
	}
	uids, err := m.st.users()
	if err != nil {
		return nil, err
	}
	if fresh > 0 && !slices.Contains(uids, fresh) {
		uids = append(uids, fresh)
	}
	cache := map[uint32]groupsEntry{}
	if _, err := readJSON(m.st.groupsPath(), &cache); err != nil {
		m.logf("uvn: site rules: %v (looking every user up)", err)
		cache = map[uint32]groupsEntry{}
	}
	now := time.Now()
	var ask []uint32
	for _, uid := range uids {
		if e, ok := cache[uid]; ok && !all && uid != fresh && now.Sub(e.At) >= 0 && now.Sub(e.At) < SiteGroupsTTL {
			pr.known[uid] = e
			continue
		}
		ask = append(ask, uid)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, siteLookups)
	for _, uid := range ask {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			gs, err := m.Site.Groups(uid)
			if err != nil {
				m.logf("uvn: site rules: groups of uid %d: %v: its group conditions fail closed until a lookup succeeds", uid, err)
				return
			}
			mu.Lock()
			pr.known[uid] = groupsEntry{Groups: gs, At: now}
			mu.Unlock()
		}()
	}
	wg.Wait()
	return pr, nil
}

// applySite compiles the prepared policy for every user with a network on
// this node and replaces the table (node lock held). A policy another
// process accepted since pr was read wins (a reload in between).
func (m *Manager) applySite(pr *sitePrep) error {
	if m.Site == nil {
		return nil
	}
	p := pr.p
	acc, err := m.st.readAccepted()
	if err != nil {
		return fmt.Errorf("accepted site policy: %w", err)
	}
	if acc != nil {
		p = acc // the same, or one a reload accepted meanwhile
	} else if pr.fromFile && pr.passed && p != nil {
		if err := m.st.accept(p); err != nil {
			return fmt.Errorf("accept site policy: %w", err)
		}
	}
	return m.installFor(p, pr.known)
}

// installFor compiles p for every user with a network on this node, their
// groups from known (absent: unknown, failing closed), replaces the table
// and keeps known as the cache (node lock held).
func (m *Manager) installFor(p *policy.Policy, known map[uint32]groupsEntry) error {
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	needs := p != nil && siteNeedsGroups(p)
	users := make([]SiteUser, 0, len(uids))
	cache := map[uint32]groupsEntry{}
	for _, uid := range uids {
		u := SiteUser{UID: uid}
		if needs {
			e, ok := known[uid]
			u.Groups, u.GroupsUnknown = e.Groups, !ok
			if ok {
				cache[uid] = e
			}
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
	if err := m.installSpec(buildSite(p, m.Site.Node, m.Srun, users, vxlans)); err != nil {
		return err
	}
	// The cache holds only the node's users (its bound).
	if needs {
		if err := writeJSON(m.st.groupsPath(), cache); err != nil {
			m.logf("uvn: site rules: %v", err)
		}
	}
	return nil
}

// applySiteLocked rebuilds the table: lookups first, then the node lock.
// fresh is the user being set up (0: none), looked up afresh.
func (m *Manager) applySiteLocked(fresh uint32) error {
	if m.Site == nil {
		return nil
	}
	pr, err := m.prepareSite(fresh, false)
	if err != nil {
		return err
	}
	unlock, err := m.st.lockNode()
	if err != nil {
		return err
	}
	defer unlock()
	return m.applySite(pr)
}

// siteIntact reports whether the table is where the policy wants it: there
// when the policy has site rules.
func (m *Manager) siteIntact() bool {
	if m.Site == nil {
		return true
	}
	p, err := m.st.readAccepted()
	if err != nil {
		return false
	}
	if p == nil {
		p = m.Site.Policy
	}
	if p == nil || len(p.Rules) == 0 || p.SystemPortMax == 65535 {
		return true
	}
	return sitePresent()
}

// ReloadSite accepts the manager's site policy (its caller has run its
// tests: `palisade uvn reload`) and applies it to every user of the node at
// once: one nftables transaction, so a failure leaves the running rules and
// the policy accepted before. It also restores a table removed behind uvn's
// back (nft flush ruleset). A node without users only records the policy
// for its next setup.
func (m *Manager) ReloadSite() (int, error) {
	if m.Site == nil || m.Site.Policy == nil {
		return 0, errors.New("no site policy to apply")
	}
	pr, err := m.prepareSite(0, true)
	if err != nil {
		return 0, err
	}
	unlock, err := m.st.lockNode()
	if err != nil {
		return 0, err
	}
	defer unlock()
	prev, err := os.ReadFile(m.st.sitePath())
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, err
	}
	if err := m.st.accept(m.Site.Policy); err != nil {
		return 0, fmt.Errorf("accept site policy: %w", err)
	}
	uids, err := m.st.users()
	if err == nil && len(uids) > 0 {
		err = m.installFor(m.Site.Policy, pr.known)
	}
	if err != nil {
		// Keep the policy accepted before: later setups enforce it.
		if prev != nil {
			err = errors.Join(err, writeJSON(m.st.sitePath(), json.RawMessage(prev)))
		} else {
			err = errors.Join(err, os.Remove(m.st.sitePath()))
		}
		return 0, err
	}
	return len(uids), nil
}
