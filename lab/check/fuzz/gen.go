package fuzz

import (
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"

	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/check/craft"
)

// World is what the generator knows of the testbed: nodes and their
// addresses, the sentinels, who attacks and how processes can start.
type World struct {
	Nodes     []NodeAddrs
	Sentinels []*Sentinel
	Attackers []string // bob, carol
	Owner     string   // alice: the positive control runs as her
	// Slurm: srun steps can be launched (the testbed's Slurm is up).
	Slurm bool
	// Protos are the socket protocols the kernel has (sentinels' and
	// SCTP's one-to-many form).
	Protos []string
	// VictimUID/GID are what a forged stamp claims (alice's).
	VictimUID, VictimGID uint32
}

// NodeAddrs are one node's addresses.
type NodeAddrs struct {
	Name                       string
	Eth0V4, Eth0V6, IBV4, IBV6 netip.Addr
	LinkLocal                  netip.Addr // eth0's, with zone "eth0" (may be invalid)
	Eth0Bcast4, IBBcast4       netip.Addr
	eth0Prefix4, ibPrefix4     netip.Prefix
}

// Sentinel is one socket of the owner (or of the owner under a group) on a
// node: it reports every byte and echoes every nonce.
type Sentinel struct {
	Tag   string // "node1/alice+proj1/udp6-wild"
	Node  string
	Owner string // "alice" or "alice+proj1"
	Group string // "" or "proj1" (started under sg)
	Proto string // tcp, udp, udplite, sctp, dccp, mptcp
	Fam   int
	Dual  bool
	Form  string // wild, eth0, ib0, lo, ll, mcast, reuse
	Addr  netip.Addr
	Port  int
	Join  string // multicast member: "group%eth0"
}

// stream reports whether the sentinel's protocol is connection-oriented.
func (s *Sentinel) stream() bool { return s.Proto != "udp" && s.Proto != "udplite" }

// Spec is the sentinel as `probe sentinel` binds it.
func (s *Sentinel) Spec() attack.SinkSpec {
	so := attack.Sock{Proto: s.Proto, Family: s.Fam, Dual: s.Dual,
		Bind: netip.AddrPortFrom(s.Addr, uint16(s.Port)).String(), ReuseAddr: s.Form == "reuse"}
	if s.Join != "" {
		so.Join = []string{s.Join}
	}
	return attack.SinkSpec{Sock: so, Echo: true, EchoMark: true, Any: true, Tag: s.Tag}
}

// sentinelForms are the sockets every owner holds on every node, the
// protocols the kernel lacks dropped when they fail to bind.
type form struct {
	proto, form string
	fam         int
	dual        bool
}

var sentinelForms = []form{
	{"tcp", "wild", 4, false}, {"tcp", "wild", 6, false}, {"tcp", "wild", 6, true}, {"tcp", "eth0", 4, false},
	{"tcp", "lo", 4, false}, {"tcp", "ll", 6, false}, {"tcp", "ib0", 6, false},
	{"udp", "wild", 4, false}, {"udp", "wild", 6, false}, {"udp", "wild", 6, true}, {"udp", "eth0", 4, false},
	{"udp", "lo", 6, false}, {"udp", "ll", 6, false}, {"udp", "ib0", 4, false},
	{"udp", "reuse", 4, false}, {"udp", "mcast", 4, false}, {"udp", "mcast", 6, false},
	{"udplite", "wild", 4, false}, {"udplite", "wild", 6, false},
	{"sctp", "wild", 4, false}, {"sctp", "wild", 6, false},
	{"dccp", "wild", 4, false}, {"mptcp", "wild", 4, false},
}

// Multicast groups the member sentinels join (on eth0).
var (
	group4 = netip.MustParseAddr("239.255.80.1")
	group6 = netip.MustParseAddr("ff12::5041")
)

// Owners are the sentinels' identities: the victim herself and the victim
// under her project group (`sg proj1`), which bob may reach and carol not.
var Owners = []struct{ Name, Group string }{{"alice", ""}, {"alice+proj1", "proj1"}}

// BuildSentinels lays out every owner's sentinels on every node, each on
// its own port from base.
func BuildSentinels(nodes []NodeAddrs, base int) []*Sentinel {
	var out []*Sentinel
	for _, n := range nodes {
		for oi, o := range Owners {
			for fi, f := range sentinelForms {
				s := &Sentinel{Node: n.Name, Owner: o.Name, Group: o.Group, Proto: f.proto, Fam: f.fam, Dual: f.dual,
					Form: f.form, Port: base + 100*oi + fi}
				switch f.form {
				case "wild", "mcast":
					s.Addr = netip.IPv4Unspecified()
					if f.fam == 6 {
						s.Addr = netip.IPv6Unspecified()
					}
					if f.form == "mcast" {
						s.Join = group4.String() + "%eth0"
						if f.fam == 6 {
							s.Join = group6.String() + "%eth0"
						}
					}
				case "eth0", "reuse":
					s.Addr = pick(f.fam, n.Eth0V4, n.Eth0V6)
				case "ib0":
					s.Addr = pick(f.fam, n.IBV4, n.IBV6)
				case "lo":
					s.Addr = pick(f.fam, netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback())
				case "ll":
					if !n.LinkLocal.IsValid() {
						continue
					}
					s.Addr = n.LinkLocal
				}
				dual := ""
				if f.dual {
					dual = "-dual"
				}
				s.Tag = fmt.Sprintf("%s/%s/%s%d-%s%s", n.Name, o.Name, f.proto, f.fam, f.form, dual)
				out = append(out, s)
			}
		}
	}
	return out
}

func pick(fam int, v4, v6 netip.Addr) netip.Addr {
	if fam == 6 {
		return v6
	}
	return v4
}

// NewNodeAddrs fills in the broadcast addresses (the testbed's subnets are
// /24 for IPv4).
func NewNodeAddrs(name string, eth4, eth6, ib4, ib6, ll netip.Addr) NodeAddrs {
	n := NodeAddrs{Name: name, Eth0V4: eth4, Eth0V6: eth6, IBV4: ib4, IBV6: ib6, LinkLocal: ll}
	bc := func(a netip.Addr) (netip.Prefix, netip.Addr) {
		if !a.Is4() {
			return netip.Prefix{}, netip.Addr{}
		}
		p := netip.PrefixFrom(a, 24).Masked()
		b := p.Addr().As4()
		b[3] = 255
		return p, netip.AddrFrom4(b)
	}
	n.eth0Prefix4, n.Eth0Bcast4 = bc(eth4)
	n.ibPrefix4, n.IBBcast4 = bc(ib4)
	return n
}

// loopTarget is a datagram sentinel on node (nil if none); cobind: most
// likely one whose port another socket can share (SO_REUSEADDR).
func (g *gen) loopTarget(node string, cobind bool) *Sentinel {
	var c []*Sentinel
	for _, s := range g.w.Sentinels {
		if s.Node == node && !s.stream() {
			c = append(c, s)
			if cobind && s.Form == "reuse" {
				c = append(c, s, s, s, s, s, s, s, s)
			}
		}
	}
	if len(c) == 0 {
		return nil
	}
	return oneOf(g, c...)
}

func (w *World) isSentinelPort(p int) bool {
	return slices.ContainsFunc(w.Sentinels, func(s *Sentinel) bool { return s.Port == p })
}

// isLocal reports whether a is one of node's addresses or a form any
// socket may bind (wildcard, loopback, multicast).
func (w *World) isLocal(node string, a netip.Addr) bool {
	a = a.Unmap().WithZone("")
	return a.IsUnspecified() || a.IsLoopback() || a.IsMulticast() || w.addrOf(node, a)
}

// gen draws programs.
type gen struct {
	r *rand.Rand
	w *World
}

func (g *gen) chance(p float64) bool { return g.r.Float64() < p }

func oneOf[T any](g *gen, xs ...T) T { return xs[g.r.IntN(len(xs))] }

func (g *gen) node(name string) NodeAddrs {
	for _, n := range g.w.Nodes {
		if n.Name == name {
			return n
		}
	}
	return g.w.Nodes[0]
}

// Generate draws program number round of the run with seed: the same seed
// and round always give the same program on the same testbed layout.
func Generate(w *World, seed uint64, round int) *Program {
	g := &gen{r: rand.New(rand.NewPCG(seed, uint64(round))), w: w}
	return g.program()
}

func (g *gen) program() *Program {
	w := g.w
	p := &Program{User: oneOf(g, w.Attackers...), Node: oneOf(g, w.Nodes...).Name}
	switch x := g.r.IntN(100); {
	case x < 45:
	case x < 57:
		p.Wrap = "sg"
	case x < 69:
		p.Wrap = "unshare-r"
	case x < 72:
		p.Wrap = "unshare-rn"
	case x < 84 && len(w.Nodes) > 1:
		p.Wrap = "ssh"
	case x < 92 && w.Slurm:
		p.Wrap = "srun"
	case x < 94:
		p.Wrap = "su"
	}
	if p.Wrap == "sg" && p.User != "bob" && g.chance(0.8) {
		// Only bob is in proj1; carol's sg asks for a password and fails
		// (tried now and then, not every time).
		p.Wrap = ""
	}
	run := p.Node
	if p.Wrap == "ssh" || p.Wrap == "srun" {
		for p.Via == "" || (p.Wrap == "ssh" && p.Via == p.Node) {
			p.Via = oneOf(g, w.Nodes...).Name
		}
		run = p.Via
	}
	nsock := 1 + g.r.IntN(3)
	var per [][]Step
	for s := 0; s < nsock; s++ {
		per = append(per, g.socketSteps(s, g.node(run)))
	}
	// Interleave the sockets' steps (each socket's own order kept): one
	// socket's bind may matter to another's send.
	for {
		var live []int
		for i := range per {
			if len(per[i]) > 0 {
				live = append(live, i)
			}
		}
		if len(live) == 0 {
			break
		}
		i := oneOf(g, live...)
		p.Steps = append(p.Steps, per[i][0])
		per[i] = per[i][1:]
	}
	if g.chance(0.12) && p.Wrap != "ssh" && p.Wrap != "srun" && p.Wrap != "unshare-rn" {
		// fd passing: hand a socket to the other attacker's process,
		// which then aims it.
		for _, u := range w.Attackers {
			if u != p.User {
				p.Peer = u
			}
		}
		if p.Peer != "" {
			s := g.r.IntN(nsock)
			p.Steps = append(p.Steps, Step{Op: "passfd", S: s})
			t := g.target()
			if g.chance(0.3) {
				p.PeerSteps = append(p.PeerSteps, g.option(0, t.Fam, t.Proto, g.node(run)))
			}
			p.PeerSteps = append(p.PeerSteps, g.sendSteps(0, t, t.Fam, t.Proto, g.node(run))...)
		}
	}
	return p
}

// target picks a sentinel to aim at.
func (g *gen) target() *Sentinel { return oneOf(g, g.w.Sentinels...) }

// socketSteps are one socket's life: creation, options, maybe a bind,
// then whatever sends it makes.
func (g *gen) socketSteps(s int, me NodeAddrs) []Step {
	t := g.target()
	fam, proto := t.Fam, t.Proto
	if t.Dual && g.chance(0.5) {
		fam = oneOf(g, 4, 6)
	}
	if g.chance(0.15) {
		fam = oneOf(g, 4, 6)
	}
	if g.chance(0.15) {
		proto = oneOf(g, g.w.Protos...)
	}
	steps := []Step{{Op: "socket", S: s, Fam: fam, Proto: proto}}
	// Draw what the socket does first, then the options that would make
	// it work (a co-bind needs SO_REUSEADDR, a broadcast SO_BROADCAST, a
	// foreign source IP_FREEBIND …), each only likely: the fuzzer must
	// also try without.
	bind := ""
	if g.chance(0.55) {
		bind = g.bindAddr(fam, me, t)
	}
	var sends []Step
	looped := false
	if loop := g.loopTarget(me.Name, true); loop != nil && !isStream(proto) && g.chance(0.15) {
		// The class that looped copies open: co-bind the port of one of
		// the owner's UDP sockets on this node and send to a group or
		// broadcast address, whose copy this node delivers to itself.
		fam = loop.Fam
		if loop.Dual {
			fam = 6
		}
		proto = loop.Proto
		steps[0].Fam, steps[0].Proto = fam, proto
		bind = netip.AddrPortFrom(oneOf(g, loop.Addr, pick(fam, netip.IPv4Unspecified(), netip.IPv6Unspecified())), uint16(loop.Port)).String()
		if loop.Form == "ll" {
			bind = netip.AddrPortFrom(loop.Addr, uint16(loop.Port)).String()
		}
		t = g.loopTarget(me.Name, false)
		for n := 0; n < 50 && (t.Proto != proto || (t.Form != "wild" && t.Form != "mcast")); n++ {
			t = g.loopTarget(me.Name, false)
		}
		looped = true
	}
	for n := 1 + g.r.IntN(2); n > 0; n-- {
		tt := t
		if n == 1 && g.chance(0.3) {
			tt = g.target()
		}
		sends = append(sends, g.sendSteps(s, tt, fam, proto, me)...)
	}
	if looped {
		for i := range sends {
			if sends[i].Addr != "" && g.chance(0.7) {
				sends[i].Addr = g.groupAddr(fam, me, t.Port)
			}
		}
	}
	var opts []Step
	need := func(p float64, opt, val string) {
		if g.chance(p) {
			opts = append(opts, Step{Op: "setsockopt", S: s, Opt: opt, Val: val})
		}
	}
	if bind != "" {
		ap := netip.MustParseAddrPort(bind)
		if g.w.isSentinelPort(int(ap.Port())) {
			need(map[bool]float64{false: 0.6, true: 0.85}[looped], "SO_REUSEADDR", "1")
			need(0.3, "SO_REUSEPORT", "1")
		}
		if !g.w.isLocal(me.Name, ap.Addr()) {
			need(0.6, oneOf(g, "IP_FREEBIND", "IPV6_FREEBIND"), "1")
		}
	}
	for _, st := range sends {
		if st.Addr != "" {
			a := netip.MustParseAddrPort(st.Addr).Addr().Unmap()
			switch {
			case a.Is4() && (a.As4()[3] == 255 || a.IsMulticast()):
				need(0.7, "SO_BROADCAST", "1")
				need(0.3, oneOf(g, "IP_MULTICAST_IF", "IP_UNICAST_IF", "SO_BINDTODEVICE"), oneOf(g, devices...))
			case a.IsMulticast():
				need(0.4, oneOf(g, "IPV6_MULTICAST_IF", "SO_BINDTODEVICE"), oneOf(g, devices...))
			}
		}
		if slices.Contains(st.Flags, "MSG_ZEROCOPY") {
			need(0.7, "SO_ZEROCOPY", "1")
		}
		if slices.Contains(st.Flags, "MSG_FASTOPEN") {
			need(0.3, "TCP_FASTOPEN_CONNECT", "1")
		}
	}
	for n := g.r.IntN(4); n > 0; n-- {
		opts = append(opts, g.option(s, fam, proto, me))
	}
	g.r.Shuffle(len(opts), func(i, j int) { opts[i], opts[j] = opts[j], opts[i] })
	steps = append(steps, opts...)
	if bind != "" {
		steps = append(steps, Step{Op: "bind", S: s, Addr: bind})
		// An option may come after bind, too (IP_FREEBIND cleared again,
		// a device bound later).
		if g.chance(0.2) {
			steps = append(steps, g.option(s, fam, proto, me))
		}
	}
	if g.chance(0.08) {
		steps = append(steps, Step{Op: "listen", S: s}, Step{Op: "accept", S: s})
	}
	steps = append(steps, sends...)
	if g.chance(0.15) {
		steps = append(steps, Step{Op: "recv", S: s})
	}
	if g.chance(0.05) {
		steps = append(steps, Step{Op: "close", S: s})
	}
	return steps
}

func isStream(proto string) bool { return proto != "udp" && proto != "udplite" }

// sendSteps aim socket s at sentinel t: connect and send, sendto or
// sendmsg with control messages, to one of the forms of t's address.
func (g *gen) sendSteps(s int, t *Sentinel, fam int, proto string, me NodeAddrs) []Step {
	dst := g.dstAddr(t, fam, me)
	size := g.size()
	var flags []string
	if g.chance(0.25) {
		flags = append(flags, oneOf(g, "MSG_ZEROCOPY", "MSG_DONTROUTE", "MSG_CONFIRM", "MSG_MORE", "MSG_OOB", "MSG_EOR"))
	}
	if isStream(proto) {
		if proto == "tcp" && g.chance(0.2) {
			return []Step{{Op: "sendto", S: s, Addr: dst, Size: size, Flags: append(flags, "MSG_FASTOPEN")}}
		}
		steps := []Step{{Op: "connect", S: s, Addr: dst}}
		op := oneOf(g, "send", "sendmsg")
		st := Step{Op: op, S: s, Size: size, Flags: flags}
		if op == "sendmsg" && g.chance(0.3) {
			st.Cmsgs = g.cmsgs(fam, me, t)
		}
		return append(steps, st)
	}
	if g.chance(0.25) {
		return []Step{{Op: "connect", S: s, Addr: dst}, {Op: "send", S: s, Size: size, Flags: flags}}
	}
	st := Step{Op: oneOf(g, "sendto", "sendmsg", "sendmsg"), S: s, Addr: dst, Size: size, Flags: flags}
	if st.Op == "sendmsg" && g.chance(0.6) {
		st.Cmsgs = g.cmsgs(fam, me, t)
	}
	return []Step{st}
}

func (g *gen) size() int {
	switch x := g.r.IntN(100); {
	case x < 60:
		return 0
	case x < 75:
		return 1400 + g.r.IntN(90) // within a stamp's margin of the MTU
	case x < 90:
		return 1500 + g.r.IntN(7000) // fragmented
	}
	return 16000 + g.r.IntN(49000) // past what a stamp can grow
}

// dstAddr is one of the ways to name t's socket (or a near miss).
func (g *gen) dstAddr(t *Sentinel, fam int, me NodeAddrs) string {
	n := g.node(t.Node)
	port := t.Port
	if g.chance(0.05) {
		port = t.Port + oneOf(g, -1, 1)
	}
	var a netip.Addr
	if fam == 4 || (fam == 6 && g.chance(0.15)) {
		a = oneOf(g, n.Eth0V4, n.Eth0V4, n.IBV4, netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.3.4.5"),
			netip.IPv4Unspecified(), n.Eth0Bcast4, n.IBBcast4, netip.MustParseAddr("255.255.255.255"),
			netip.MustParseAddr("224.0.0.1"), group4, me.Eth0V4)
		if t.Addr.Is4() && !t.Addr.IsUnspecified() && g.chance(0.5) {
			a = t.Addr
		}
		if fam == 6 {
			a = netip.AddrFrom16(a.As16()) // v4-mapped
		}
	} else {
		a = oneOf(g, n.Eth0V6, n.Eth0V6, n.IBV6, netip.IPv6Loopback(), netip.IPv6Unspecified(), n.LinkLocal,
			netip.MustParseAddr("ff02::1").WithZone("eth0"), group6.WithZone("eth0"), me.Eth0V6)
		if t.Addr.Is6() && !t.Addr.IsUnspecified() && g.chance(0.5) {
			a = t.Addr
		}
	}
	if !a.IsValid() {
		a = pick(fam, n.Eth0V4, n.Eth0V6)
	}
	return netip.AddrPortFrom(a, uint16(port)).String()
}

// groupAddr is a broadcast or multicast address whose copy node me loops
// back to itself.
func (g *gen) groupAddr(fam int, me NodeAddrs, port int) string {
	var a netip.Addr
	if fam == 4 {
		a = oneOf(g, me.Eth0Bcast4, me.IBBcast4, netip.MustParseAddr("255.255.255.255"), netip.MustParseAddr("224.0.0.1"), group4)
	} else {
		a = oneOf(g, netip.MustParseAddr("ff02::1").WithZone("eth0"), group6.WithZone("eth0"),
			netip.AddrFrom16(me.Eth0Bcast4.As16()), netip.AddrFrom16(netip.MustParseAddr("224.0.0.1").As16()))
	}
	return netip.AddrPortFrom(a, uint16(port)).String()
}

// bindAddr is an address form to bind: wildcard, the node's own, loopback,
// link-local with scope, v4-mapped, a multicast group, another node's
// address (IP_FREEBIND), on port 0, a port of its own or a sentinel's.
func (g *gen) bindAddr(fam int, me NodeAddrs, t *Sentinel) string {
	other := g.node(t.Node)
	var a netip.Addr
	if fam == 4 {
		a = oneOf(g, netip.IPv4Unspecified(), netip.IPv4Unspecified(), me.Eth0V4, me.IBV4, netip.MustParseAddr("127.0.0.1"),
			group4, netip.MustParseAddr("224.0.0.1"), other.Eth0V4, me.Eth0Bcast4)
	} else {
		a = oneOf(g, netip.IPv6Unspecified(), netip.IPv6Unspecified(), me.Eth0V6, me.IBV6, netip.IPv6Loopback(),
			me.LinkLocal, netip.AddrFrom16(me.Eth0V4.As16()), netip.AddrFrom16(netip.IPv4Unspecified().As16()),
			group6, other.Eth0V6, other.LinkLocal)
	}
	if !a.IsValid() {
		a = pick(fam, netip.IPv4Unspecified(), netip.IPv6Unspecified())
	}
	port := 0
	switch x := g.r.IntN(100); {
	case x < 40:
	case x < 75:
		// Co-bind a sentinel's port (SO_REUSEADDR/REUSEPORT may let it).
		port = g.target().Port
	default:
		port = 40000 + g.r.IntN(2000)
	}
	return netip.AddrPortFrom(a, uint16(port)).String()
}

var devices = []string{"eth0", "ib0", "lo"}

// option draws one socket option with a value that means something.
func (g *gen) option(s, fam int, proto string, me NodeAddrs) Step {
	type choice struct {
		opt  string
		vals []string
	}
	stamp4 := hex.EncodeToString(craft.StampV1IPv4(g.w.VictimUID, g.w.VictimGID))
	stamp6 := hex.EncodeToString(craft.StampV1IPv6(g.w.VictimUID, g.w.VictimGID))
	common := []choice{
		{"SO_REUSEADDR", []string{"1"}}, {"SO_REUSEPORT", []string{"1"}}, {"SO_BROADCAST", []string{"1"}},
		{"SO_BINDTODEVICE", append(slices.Clone(devices), "")}, {"SO_BINDTOIFINDEX", []string{"eth0", "ib0", "lo", "0"}},
		{"SO_DONTROUTE", []string{"1"}}, {"SO_PRIORITY", []string{"0", "6"}}, {"SO_MARK", []string{"1"}},
		{"SO_ZEROCOPY", []string{"1"}}, {"SO_NO_CHECK", []string{"1"}},
	}
	v4 := []choice{
		{"IP_FREEBIND", []string{"1", "0"}}, {"IP_TRANSPARENT", []string{"1"}}, {"IP_UNICAST_IF", devices},
		{"IP_MULTICAST_IF", devices}, {"IP_MULTICAST_LOOP", []string{"0", "1"}}, {"IP_MULTICAST_TTL", []string{"0", "1", "255"}},
		{"IP_MULTICAST_ALL", []string{"0", "1"}}, {"IP_ADD_MEMBERSHIP", []string{"224.0.0.1%eth0", group4.String() + "%eth0", group4.String() + "%ib0"}},
		{"IP_TTL", []string{"1", "255"}}, {"IP_TOS", []string{"16", "184", "3"}},
		{"IP_OPTIONS", []string{"01010101", "0707040000000000", "4408050000000000", stamp4, lsrr(g.node(me.Name).Eth0V4)}},
		{"IP_PKTINFO", []string{"1"}}, {"IP_MTU_DISCOVER", []string{"0", "2", "3"}}, {"IP_BIND_ADDRESS_NO_PORT", []string{"1"}},
		{"IP_RECVERR", []string{"1"}},
	}
	v6 := []choice{
		{"IPV6_V6ONLY", []string{"0", "1"}}, {"IPV6_FREEBIND", []string{"1", "0"}}, {"IPV6_TRANSPARENT", []string{"1"}},
		{"IPV6_UNICAST_IF", devices}, {"IPV6_MULTICAST_IF", devices}, {"IPV6_MULTICAST_LOOP", []string{"0", "1"}},
		{"IPV6_MULTICAST_HOPS", []string{"1", "255"}}, {"IPV6_MULTICAST_ALL", []string{"0", "1"}},
		{"IPV6_JOIN_GROUP", []string{"ff02::1%eth0", group6.String() + "%eth0"}}, {"IPV6_UNICAST_HOPS", []string{"1", "255"}},
		{"IPV6_TCLASS", []string{"16", "3"}}, {"IPV6_DSTOPTS", []string{stamp6, padOpts}}, {"IPV6_HOPOPTS", []string{padOpts}},
		{"IPV6_RTHDR", []string{rthdr(0, me.Eth0V6), rthdr(2, me.Eth0V6)}}, {"IPV6_RECVPKTINFO", []string{"1"}},
		{"IPV6_DONTFRAG", []string{"0", "1"}}, {"IPV6_MTU_DISCOVER", []string{"0", "2", "3"}}, {"IPV6_ADDRFORM", []string{"2"}},
		{"IPV6_AUTOFLOWLABEL", []string{"0", "1"}},
		// IPv4 options on an IPv6 socket apply to its v4-mapped traffic.
		{"IP_OPTIONS", []string{"01010101", stamp4}}, {"IP_FREEBIND", []string{"1"}}, {"IP_MULTICAST_ALL", []string{"0", "1"}},
	}
	tcp := []choice{
		{"TCP_FASTOPEN", []string{"5"}}, {"TCP_FASTOPEN_CONNECT", []string{"1"}}, {"TCP_NODELAY", []string{"1"}},
		{"TCP_MAXSEG", []string{"536", "1400"}}, {"TCP_CORK", []string{"1"}}, {"TCP_REPAIR", []string{"1"}},
		{"TCP_SAVE_SYN", []string{"1"}},
	}
	udp := []choice{
		{"UDP_SEGMENT", []string{"100", "500", "1400"}}, {"UDP_CORK", []string{"1"}}, {"UDP_GRO", []string{"1"}},
	}
	pool := slices.Clone(common)
	if fam == 6 {
		pool = append(pool, v6...)
	} else {
		pool = append(pool, v4...)
	}
	switch proto {
	case "tcp", "mptcp":
		pool = append(pool, tcp...)
	case "udp":
		pool = append(pool, udp...)
	case "udplite":
		pool = append(pool, append(udp, choice{"UDPLITE_SEND_CSCOV", []string{"0", "8", "20"}})...)
	}
	c := oneOf(g, pool...)
	return Step{Op: "setsockopt", S: s, Opt: c.opt, Val: oneOf(g, c.vals...)}
}

// padOpts is an IPv6 options header of PadN only (8 bytes).
const padOpts = "0000010400000000"

// lsrr is a loose source route through a (IPv4 option 131).
func lsrr(a netip.Addr) string {
	b := a.As4()
	return "830704" + hex.EncodeToString(b[:]) + "00"
}

// rthdr is a routing header of type typ with one address.
func rthdr(typ int, a netip.Addr) string {
	b := a.As16()
	return "0002" + fmt.Sprintf("%02x", typ) + "0100000000" + hex.EncodeToString(b[:])
}

// cmsgs draws control messages for one sendmsg.
func (g *gen) cmsgs(fam int, me NodeAddrs, t *Sentinel) []Cmsg {
	other := g.node(t.Node)
	var out []Cmsg
	for n := 1 + g.r.IntN(2); n > 0; n-- {
		var c Cmsg
		if fam == 4 {
			src := oneOf(g, "", me.Eth0V4.String(), me.IBV4.String(), other.Eth0V4.String(), "127.0.0.1", "198.18.0.77")
			c = oneOf(g,
				Cmsg{"IP_PKTINFO", src + "%" + oneOf(g, "", "eth0", "ib0", "lo")},
				Cmsg{"IP_TTL", oneOf(g, "1", "255")}, Cmsg{"IP_TOS", oneOf(g, "16", "3")},
				Cmsg{"IP_RETOPTS", oneOf(g, "01010101", hex.EncodeToString(craft.StampV1IPv4(g.w.VictimUID, g.w.VictimGID)))},
				Cmsg{"UDP_SEGMENT", oneOf(g, "100", "500", "1400")}, Cmsg{"SO_MARK", "1"}, Cmsg{"SO_PRIORITY", "3"})
		} else {
			src := oneOf(g, "", me.Eth0V6.String(), me.IBV6.String(), other.Eth0V6.String(), "::1", "2001:2::77")
			if me.LinkLocal.IsValid() && g.chance(0.2) {
				src = me.LinkLocal.WithZone("").String()
			}
			c = oneOf(g,
				Cmsg{"IPV6_PKTINFO", src + "%" + oneOf(g, "", "eth0", "ib0", "lo")},
				Cmsg{"IPV6_HOPLIMIT", oneOf(g, "1", "255")}, Cmsg{"IPV6_TCLASS", "16"}, Cmsg{"IPV6_DONTFRAG", "1"},
				Cmsg{"IPV6_DSTOPTS", oneOf(g, padOpts, hex.EncodeToString(craft.StampV1IPv6(g.w.VictimUID, g.w.VictimGID)))},
				Cmsg{"IPV6_HOPOPTS", padOpts}, Cmsg{"IPV6_RTHDR", rthdr(2, other.Eth0V6)},
				Cmsg{"UDP_SEGMENT", oneOf(g, "100", "500", "1400")}, Cmsg{"SO_MARK", "1"})
		}
		out = append(out, c)
	}
	return out
}
