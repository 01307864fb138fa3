package uvn

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// nftTable is the node-wide nftables table of uvn.
const nftTable = "palisade_uvn"

// guard is what the node-wide nftables table needs to know.
type guard struct {
	srcMin, srcMax uint16
	underlays      []guardUnderlay
	natPool        netip.Prefix // masquerade source (IPv4)
	nat6Pool       netip.Prefix // invalid: no IPv6 NAT
	// forwardGuard: forwarding was off before uvn turned it on for the
	// uplinks; forward only traffic to and from the NAT pools.
	forwardGuard bool
}

type guardUnderlay struct {
	portLo, portHi uint16
	nic            string         // local underlay NIC ("" if this node is not on it)
	v6             bool           // tunnel family
	peers          []netip.Prefix // allowed VXLAN sources
}

// installGuard (re)creates the table in one transaction:
//
//	output:  udp dport <vxlan ports> sport not in [src_port_min, src_port_max] -> drop
//	         The kernel's VXLAN sockets send from that privileged range; an
//	         unprivileged socket cannot bind there, so user-crafted VXLAN
//	         frames never leave the node.
//	input:   udp dport <ports> iif <underlay NIC> saddr <peers> sport in range -> accept
//	         udp dport <ports> -> drop
//	         Frames must come over the underlay (not through a user's VRF,
//	         where udp_l3mdev_accept would hand them to the VXLAN socket),
//	         from a node address, from a privileged source port.
//	postrouting (nat): saddr in the NAT pool, oif not a uvn device -> masquerade
//	forward: to the NAT pool: ct state established,related (reply direction)
//	         -> accept, else drop; if forwarding was off before: from the
//	         pool -> accept, drop the rest.
func installGuard(g guard) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: nftTable, Family: nftables.TableFamilyINet}
	// Delete-and-add in one batch: the flush is atomic, no window without rules.
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	accept := nftables.ChainPolicyAccept
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityRef(-10), Policy: &accept})
	out := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityRef(-10), Policy: &accept})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})

	for i, u := range g.underlays {
		ports := udpDport(u.portLo, u.portHi)
		// output: not from the kernel VXLAN source range -> drop
		c.AddRule(&nftables.Rule{Table: t, Chain: out, Exprs: cat(ports,
			[]expr.Any{
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
				&expr.Range{Op: expr.CmpOpNeq, Register: 1, FromData: be16(g.srcMin), ToData: be16(g.srcMax)},
				&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop},
			})})
		if u.nic != "" && len(u.peers) > 0 {
			set := &nftables.Set{Table: t, Name: fmt.Sprintf("peers%d", i), Interval: true, KeyType: nftables.TypeIPAddr}
			nfproto, off, alen := byte(unix.NFPROTO_IPV4), uint32(12), uint32(4)
			if u.v6 {
				set.KeyType = nftables.TypeIP6Addr
				nfproto, off, alen = unix.NFPROTO_IPV6, 8, 16
			}
			if err := c.AddSet(set, intervalElements(u.peers, u.v6)); err != nil {
				return err
			}
			c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: cat(
				[]expr.Any{
					&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{nfproto}},
				},
				ports,
				[]expr.Any{
					&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(u.nic)},
					&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: alen},
					&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID},
					&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
					&expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: be16(g.srcMin), ToData: be16(g.srcMax)},
					&expr.Verdict{Kind: expr.VerdictAccept},
				})})
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: cat(ports,
			[]expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}})})
	}
	for _, p := range []netip.Prefix{g.natPool, g.nat6Pool} {
		if !p.IsValid() {
			continue
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: post, Exprs: cat(
			saddrIn(p),
			notUVNDev(expr.MetaKeyOIFNAME),
			[]expr.Any{&expr.Masq{}})})
	}
	// Forwarded into a user's VRF (to a NAT address): only replies of
	// connections made from that address. Always, whatever forwarding was
	// before: the main table's return routes would otherwise let any
	// host that routes the pool to this node open connections to users'
	// listeners.
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	for _, p := range []netip.Prefix{g.natPool, g.nat6Pool} {
		if !p.IsValid() {
			continue
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: cat(daddrIn(p), replyOnly(),
			[]expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}})})
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: cat(daddrIn(p), ctState(expr.CtStateBitRELATED),
			[]expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}})})
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: cat(daddrIn(p),
			[]expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}})})
		if g.forwardGuard {
			c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: cat(saddrIn(p), []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}})})
		}
	}
	if g.forwardGuard {
		// Forwarding was off before uvn turned it on for the uplinks:
		// nothing else is forwarded.
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables table %s: %w", nftTable, err)
	}
	return nil
}

// removeGuard deletes the table; a missing table is fine.
func removeGuard() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: nftTable, Family: nftables.TableFamilyINet}
	c.AddTable(t) // makes the delete succeed when the table is absent
	c.DelTable(t)
	return c.Flush()
}

// guardPresent reports whether the table exists.
func guardPresent() bool {
	c, err := nftables.New()
	if err != nil {
		return false
	}
	_, err = c.ListTableOfFamily(nftTable, nftables.TableFamilyINet)
	return err == nil
}

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func be16(v uint16) []byte { return binaryutil.BigEndian.PutUint16(v) }

func ifname(n string) []byte {
	b := make([]byte, 16)
	copy(b, n)
	return b
}

// udpDport matches UDP with a destination port in [lo, hi].
func udpDport(lo, hi uint16) []expr.Any {
	e := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
	}
	if lo == hi {
		return append(e, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: be16(lo)})
	}
	return append(e, &expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: be16(lo), ToData: be16(hi)})
}

// notUVNDev matches packets whose device name does not start with "pal"
// followed by a uvn marker: our devices are palv<uid> and pal<i>x<uid>.
func notUVNDev(key expr.MetaKey) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte("palv")},
	}
}

func addrMatch(p netip.Prefix, src bool) []expr.Any {
	nfproto, off, alen := byte(unix.NFPROTO_IPV4), uint32(16), uint32(4)
	if src {
		off = 12
	}
	if p.Addr().Is6() {
		nfproto, off, alen = unix.NFPROTO_IPV6, 24, 16
		if src {
			off = 8
		}
	}
	mask := make([]byte, alen)
	for i := 0; i < p.Bits(); i++ {
		mask[i/8] |= 0x80 >> (i % 8)
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{nfproto}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: alen},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: alen, Mask: mask, Xor: make([]byte, alen)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Masked().Addr().AsSlice()},
	}
}

// ctState matches packets whose conntrack state has one of bits.
func ctState(bits uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

// replyOnly matches the reply direction of an established connection.
func replyOnly() []expr.Any {
	return cat(ctState(expr.CtStateBitESTABLISHED), []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeyDIRECTION},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}}, // IP_CT_DIR_REPLY
	})
}

func saddrIn(p netip.Prefix) []expr.Any { return addrMatch(p, true) }
func daddrIn(p netip.Prefix) []expr.Any { return addrMatch(p, false) }

// intervalElements turns prefixes into interval set elements
// ([first, last+1) pairs).
func intervalElements(ps []netip.Prefix, v6 bool) []nftables.SetElement {
	var els []nftables.SetElement
	for _, p := range ps {
		if p.Addr().Is6() != v6 {
			continue
		}
		p = p.Masked()
		first := p.Addr()
		end, overflow := lastAddr(p).Next(), false
		if !end.IsValid() {
			overflow = true
		}
		els = append(els, nftables.SetElement{Key: first.AsSlice()})
		if !overflow {
			els = append(els, nftables.SetElement{Key: end.AsSlice(), IntervalEnd: true})
		}
	}
	return els
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}
