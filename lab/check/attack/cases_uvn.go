package attack

import (
	"bufio"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
)

// uvn's attack set (`check --attacks --mode uvn`, in the VM: issue 21, the
// threat model of docs/uvn.md). A user's network is a boundary: bob, from
// his sessions and as a stray process (outside PAM and Slurm, in the
// default VRF), and an off-cluster host try every way the kernel leaves an
// unprivileged socket into alice's VRF after its creation; each case's
// control is alice (or the path's rightful user: root, Slurm's default VRF)
// using the same path.

// alice's devices (the VRF, her VXLAN on eth0's underlay) and the testbed's
// SrunPortRange (lab/testbed: 61000-62999).
var (
	aliceVRF = uvn.VRFName(victimUID)
	aliceVX  = uvn.VXLANName(0, victimUID)
	bobVRF   = uvn.VRFName(attackerUID)
)

const srunPortBase = 61500

var (
	strayBob   = "stray:" + strconv.Itoa(attackerUID)
	strayAlice = "stray:" + strconv.Itoa(victimUID)
)

// UVNCases is uvn's attack set, in the order it runs. A is alice's node
// (her listeners), B another node where she has a process too (so her VRF
// and VXLAN exist there: the cross-node attacks go through them).
func UVNCases() []*Case {
	var cs []*Case
	add := func(c ...*Case) { cs = append(cs, c...) }
	add(uvnScopedBind("vrf-local", aliceVRF, false, 4, ""), uvnScopedBind("vrf-cross", aliceVRF, true, 4, ""),
		uvnScopedBind("vxlan-cross-v4", aliceVX, true, 4, ""), uvnScopedBind("vxlan-cross-v6", aliceVX, true, 6, ""),
		uvnScopedBind("stray", aliceVRF, false, 4, strayBob), uvnSquat())
	add(uvnPktInfo("vrf-local", 4, false, ""), uvnPktInfo("vxlan-cross", 4, true, ""),
		uvnPktInfo("stray", 4, false, strayBob), uvnPktInfo("stray-v6", 6, false, strayBob))
	add(uvnScopedSend("mcast-vrf", false, ""), uvnScopedSend("mcast-vxlan-cross", true, ""),
		uvnScopedSend("mcast-vxlan-stray", false, strayBob), uvnLinkLocal())
	for _, who := range []string{Attacker, strayBob} {
		add(uvnDeviceOptions(who), uvnMulticastIf(who))
	}
	add(uvnStrayListener("tcp"), uvnStrayListener("udp"), uvnStrayToStray("tcp"), uvnStrayToStray("udp"), uvnNAT(strayBob), uvnNAT(Attacker))
	add(uvnStrayCrossNode("tcp"), uvnStrayCrossNode("udp"), uvnStraySrun())
	add(uvnBroadcast(Attacker), uvnBroadcast(strayBob))
	add(uvnSrunPort("nat-source", Attacker), uvnSrunPort("stray", strayBob))
	add(uvnOffCluster(), uvnInjection())
	add(uvnMPTCP(), uvnNATMark(), uvnSrunLinger(), uvnStrayLocalDelivery("broadcast"), uvnStrayLocalDelivery("device-bound"))
	return cs
}

func userTag(u string) string {
	if strings.HasPrefix(u, "stray:") {
		return "stray"
	}
	return "session"
}

// uvnWait is the connect and reply bound of a uvn act: under emulation a
// handshake across the overlay takes seconds (check's matrix allows 5 s).
func uvnWait() int {
	if inVM() {
		return 5000
	}
	return 0
}

// devAddr is the first address of dev on node that is link-local IPv6
// (ll) or, else, in 100.64.0.0/10 (a NAT address).
func (e *Env) devAddr(node, dev string, ll bool) (netip.Addr, error) {
	out, err := e.Root(node, "ip", "-o", "addr", "show", "dev", dev)
	if err != nil {
		return netip.Addr{}, err
	}
	nat := netip.MustParsePrefix("100.64.0.0/10")
	for _, f := range strings.Fields(out) {
		p, err := netip.ParsePrefix(f)
		if err != nil {
			continue
		}
		if ll && p.Addr().IsLinkLocalUnicast() {
			return p.Addr().WithZone(dev), nil
		}
		if !ll && nat.Contains(p.Addr()) {
			return p.Addr(), nil
		}
	}
	return netip.Addr{}, fmt.Errorf("%s: no %s address on %s", node, map[bool]string{true: "link-local", false: "NAT"}[ll], dev)
}

// presence keeps a process of user on node for the case (in uvn: her VRF
// and VXLANs exist there while it runs).
func (e *Env) presence(r *Run, node, user string) error {
	if e.present[node+"/"+user] {
		return nil
	}
	_, err := e.Sink(r, node, user, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port+9)}})
	return err
}

// aliceSink is alice's dual-stack listener (tcp or udp) on A, port p.
func (e *Env) aliceSink(r *Run, proto string, p int) (*Sink, error) {
	return e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true, Bind: ap(wild(6), p)}})
}

func mapped(a netip.Addr) netip.Addr {
	if a.Is4() {
		return netip.AddrFrom16(a.As16())
	}
	return a
}

func scoped(a, dev string) string { return "[" + a + "%" + dev + "]:0" }

func uvnScopedBind(name, dev string, cross bool, fam int, who string) *Case {
	if who == "" {
		who = Attacker
	}
	return &Case{Name: "uvn-scoped-bind-" + name, Class: "scoped-bind",
		Why: "bind(fe80::1%" + dev + ") fails (EADDRNOTAVAIL) but the kernel has already bound the socket to the scope's device: bob's connection would then be in alice's VRF",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "tcp", e.Port)
			if err != nil {
				return err
			}
			node, dst := e.A.Name, netip.MustParseAddr("::ffff:127.0.0.1")
			if cross {
				node, dst = e.B.Name, mapped(e.A.Eth0V4)
				if fam == 6 {
					dst = e.A.Eth0V6
				}
				if err := e.presence(r, node, Victim); err != nil {
					return err
				}
			}
			sock := Sock{Proto: "tcp", Family: 6, Dual: true}
			atk := sock
			atk.PreBind = scoped("fe80::1", dev)
			desc := "tcp → " + ap(dst, e.Port)
			r.Attack(e, s, node, who, "bind fe80::1%"+dev+", "+desc, ActSpec{Sock: atk, Dst: ap(dst, e.Port), WaitMS: uvnWait()})
			r.Control(e, s, node, Victim, desc, ActSpec{Sock: sock, Dst: ap(dst, e.Port), WaitMS: uvnWait()})
			return nil
		}}
}

// uvnSquat: bob listening inside alice's VRF (alice's connection to a port
// of 127.0.0.1 would reach him).
func uvnSquat() *Case {
	return &Case{Name: "uvn-scoped-bind-listen", Class: "scoped-bind",
		Why: "bob's listener bound fe80::1%" + aliceVRF + " (failed, but moved into her VRF) then [::]:P: alice's connection to 127.0.0.1:P would reach him",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "tcp", Family: 6, Dual: true,
				PreBind: scoped("fe80::1", aliceVRF), Bind: ap(wild(6), e.Port), ReuseAddr: true}})
			if err != nil {
				return err
			}
			dst := ap(netip.MustParseAddr("::ffff:127.0.0.1"), e.Port)
			spec := ActSpec{Sock: Sock{Proto: "tcp", Family: 6, Dual: true}, Dst: dst, WaitMS: uvnWait()}
			r.Attack(e, s, e.A.Name, Victim, "alice (the victim: her data would reach bob) tcp → "+dst, spec)
			r.Control(e, s, e.A.Name, Attacker, "bob to his own listener, tcp → "+dst, spec)
			return nil
		}}
}

func uvnPktInfo(name string, fam int, cross bool, who string) *Case {
	if who == "" {
		who = Attacker
	}
	ctl := Victim
	if who == strayBob {
		ctl = strayAlice
	}
	return &Case{Name: "uvn-pktinfo-" + name, Class: "pktinfo",
		Why: "sendmsg with IP(V6)_PKTINFO naming alice's device as the output interface (the kernel checks nothing for unprivileged senders)",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "udp", e.Port)
			if err != nil {
				return err
			}
			node, dev, dst := e.A.Name, aliceVRF, lo(fam)
			if cross {
				node, dev, dst = e.B.Name, aliceVX, eth(e.A, fam)
				if err := e.presence(r, node, Victim); err != nil {
					return err
				}
			}
			spec := ActSpec{Sock: sock("udp", fam), Dst: ap(dst, e.Port), PktInfo: dev}
			desc := "udp pktinfo " + dev + " → " + ap(dst, e.Port)
			r.Attack(e, s, node, who, desc, spec)
			// alice's own process (her stray one for a stray attacker:
			// the guard lets a user's unbound socket use her own devices).
			r.Control(e, s, node, ctl, desc, spec)
			return nil
		}}
}

func uvnScopedSend(name string, cross bool, who string) *Case {
	if who == "" {
		who = Attacker
	}
	return &Case{Name: "uvn-scoped-send-" + name, Class: "scoped-destination",
		Why: "sendto(ff02::1%<alice's device>): a scoped multicast destination reaches every socket of the port on the device's link — alice's on every node",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "udp", e.Port)
			if err != nil {
				return err
			}
			node, dev := e.A.Name, aliceVRF
			switch {
			case cross:
				node, dev = e.B.Name, aliceVX
				if err := e.presence(r, node, Victim); err != nil {
					return err
				}
			case who != Attacker:
				dev = aliceVX
			}
			dst := ap(netip.MustParseAddr("ff02::1").WithZone(dev), e.Port)
			r.Attack(e, s, node, who, "udp → "+dst, ActSpec{Sock: sock("udp", 6), Dst: dst})
			// alice over IPv6 into her own listener (a scoped send to her
			// VRF device is refused by the kernel even for her: ENETUNREACH).
			ctl := ap(lo(6), e.Port)
			cnode := e.A.Name
			if cross {
				ctl, cnode = ap(e.A.Eth0V6, e.Port), e.B.Name
			}
			r.Control(e, s, cnode, Victim, "udp → "+ctl, ActSpec{Sock: sock("udp", 6), Dst: ctl})
			return nil
		}}
}

// uvnLinkLocal: link-local destinations. Node A's eth0 link-local address
// is the default VRF's (eth0 is no user's): alice's listener, in her VRF,
// is not behind it — her own link-local path is her VXLAN's address, which
// bob must not use.
func uvnLinkLocal() *Case {
	return &Case{Name: "uvn-link-local", Class: "scoped-destination",
		Why: "connect to alice's listener at a link-local address: eth0's (the default VRF's) from bob's session and as a stray process, her VXLAN's scoped to her VXLAN",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "tcp", e.Port)
			if err != nil {
				return err
			}
			if err := e.presence(r, e.B.Name, Victim); err != nil {
				return err
			}
			eth0, err := e.LinkLocal(e.A.Name)
			if err != nil {
				return err
			}
			vx, err := e.devAddr(e.A.Name, aliceVX, true)
			if err != nil {
				return err
			}
			// The same address scoped to B's device of that name.
			spec := func(a netip.Addr) ActSpec {
				return ActSpec{Sock: sock("tcp", 6), Dst: ap(a, e.Port), WaitMS: uvnWait()}
			}
			for _, who := range []string{Attacker, strayBob} {
				r.Attack(e, s, e.B.Name, who, "tcp → "+ap(eth0, e.Port), spec(eth0))
				r.Attack(e, s, e.B.Name, who, "tcp → "+ap(vx, e.Port), spec(vx))
			}
			r.Control(e, s, e.B.Name, Victim, "tcp → "+ap(vx, e.Port), spec(vx))
			return nil
		}}
}

// uvnDeviceOptions: every option that names a device (one attack each,
// one sink and control for all).
func uvnDeviceOptions(who string) *Case {
	opts := []string{"SO_BINDTODEVICE", "SO_BINDTODEVICE_LONG", "SO_BINDTOIFINDEX", "IP_UNICAST_IF", "IPV6_UNICAST_IF"}
	return &Case{Name: "uvn-sockopt-device-" + userTag(who), Class: "device-option",
		Why: strings.Join(opts, ", ") + " naming alice's VRF, then connect to 127.0.0.1: the socket would be in her VRF (an unbound, stray socket needs no privilege for it since Linux 5.7)",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "tcp", e.Port)
			if err != nil {
				return err
			}
			v4 := ap(netip.MustParseAddr("127.0.0.1"), e.Port)
			for _, opt := range opts {
				dst, so := v4, Sock{Proto: "tcp", Family: 4}
				if strings.HasPrefix(opt, "IPV6") {
					dst = ap(netip.MustParseAddr("::ffff:127.0.0.1"), e.Port)
					so = Sock{Proto: "tcp", Family: 6, Dual: true}
				}
				so.Device, so.DeviceOpt = aliceVRF, opt
				r.Attack(e, s, e.A.Name, who, opt+"="+aliceVRF+", tcp → "+dst, ActSpec{Sock: so, Dst: dst, WaitMS: uvnWait()})
			}
			r.Control(e, s, e.A.Name, Victim, "tcp → "+v4, ActSpec{Sock: sock("tcp", 4), Dst: v4, WaitMS: uvnWait()})
			return nil
		}}
}

// uvnMulticastIf: IP_MULTICAST_IF and IPV6_MULTICAST_IF naming alice's
// VXLAN, then a datagram to the all-hosts / all-nodes group.
func uvnMulticastIf(who string) *Case {
	return &Case{Name: "uvn-mcast-if-" + userTag(who), Class: "multicast",
		Why: "IP(V6)_MULTICAST_IF naming alice's VXLAN, then a datagram to 224.0.0.1 / ff02::1: every socket of the port on her overlay would get it",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "udp", e.Port)
			if err != nil {
				return err
			}
			if err := e.presence(r, e.B.Name, Victim); err != nil {
				return err
			}
			for _, fam := range []int{4, 6} {
				group, opt := "224.0.0.1", "IP_MULTICAST_IF"
				if fam == 6 {
					group, opt = "ff02::1", "IPV6_MULTICAST_IF"
				}
				dst := ap(netip.MustParseAddr(group), e.Port)
				atk := sock("udp", fam)
				atk.MulticastIf = aliceVX
				r.Attack(e, s, e.B.Name, who, opt+"="+aliceVX+", udp → "+dst, ActSpec{Sock: atk, Dst: dst})
				ctl := ap(eth(e.A, fam), e.Port)
				r.Control(e, s, e.B.Name, Victim, "udp → "+ctl, ActSpec{Sock: sock("udp", fam), Dst: ctl})
			}
			return nil
		}}
}

// uvnStrayListener: bob's stray listener is unbound, in the default VRF;
// the default VRF's services serve every VRF (l3mdev_accept), his must
// not serve alice's.
func uvnStrayListener(proto string) *Case {
	return &Case{Name: "uvn-stray-listener-" + proto, Class: "stray",
		Why: "bob's " + proto + " socket started outside any session (unbound, default VRF): alice's traffic from her VRF would reach it through l3mdev_accept",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, strayBob, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true, Bind: ap(wild(6), e.Port)}})
			if err != nil {
				return err
			}
			dst := ap(netip.MustParseAddr("127.0.0.1"), e.Port)
			spec := ActSpec{Sock: sock(proto, 4), Dst: dst, WaitMS: uvnWait()}
			r.Attack(e, s, e.A.Name, Victim, "alice "+proto+" → "+dst, spec)
			r.Control(e, s, e.A.Name, "root", "root (a system service's client) "+proto+" → "+dst, spec)
			return nil
		}}
}

// uvnStrayToStray: two users' stray processes on one node, both in the
// default VRF (across nodes no owner travels with a packet: docs/uvn.md
// Limits).
func uvnStrayToStray(proto string) *Case {
	return &Case{Name: "uvn-stray-to-stray-" + proto, Class: "stray",
		Why: "alice's and bob's processes started outside any session are both in the default VRF: bob's would reach alice's " + proto + " socket as without Palisade",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, strayAlice, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true, Bind: ap(wild(6), e.Port)}})
			if err != nil {
				return err
			}
			for _, dst := range []string{ap(netip.MustParseAddr("127.0.0.1"), e.Port), ap(e.A.Eth0V4, e.Port)} {
				spec := ActSpec{Sock: sock(proto, 4), Dst: dst, WaitMS: uvnWait()}
				r.Attack(e, s, e.A.Name, strayBob, proto+" → "+dst, spec)
				r.Control(e, s, e.A.Name, strayAlice, "alice's own stray process, "+proto+" → "+dst, spec)
			}
			return nil
		}}
}

// uvnStrayCrossNode: alice's stray socket on A (unbound, in the default
// VRF) from node B and from off the cluster. Nothing on the wire names a
// packet's sending user, so a user's socket outside any VRF takes from the
// network only what it asked for (its own connections, replies to its
// datagrams); only system accounts and root serve the network from the
// default VRF. The control is alice's session on B, whose packets arrive
// through her own overlay (her VXLAN: the kernel's record of whose they
// are).
func uvnStrayCrossNode(proto string) *Case {
	return &Case{Name: "uvn-stray-cross-node-" + proto, Class: "stray",
		Why: "alice's " + proto + " socket started outside any session (unbound, default VRF) on node A: bob's stray process on node B, root there, and the off-cluster host reached it through the underlay, as without Palisade",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, strayAlice, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true, Bind: ap(wild(6), e.Port)}})
			if err != nil {
				return err
			}
			// Her network on both nodes (the control's overlay).
			for _, n := range []string{e.A.Name, e.B.Name} {
				if err := e.presence(r, n, Victim); err != nil {
					return err
				}
			}
			for _, fam := range []int{4, 6} {
				dst := ap(eth(e.A, fam), e.Port)
				spec := ActSpec{Sock: sock(proto, fam), Dst: dst, WaitMS: uvnWait()}
				r.Attack(e, s, e.B.Name, strayBob, "bob's stray process "+proto+" → "+dst, spec)
				r.Control(e, s, e.B.Name, Victim, "alice's session on B (her overlay) "+proto+" → "+dst, spec)
			}
			dst := ap(eth(e.A, 4), e.Port)
			spec := ActSpec{Sock: sock(proto, 4), Dst: dst, WaitMS: uvnWait()}
			r.Attack(e, s, e.B.Name, "root", "root on B (no user is named on the wire) "+proto+" → "+dst, spec)
			r.Attack(e, s, "outside", "root", "the off-cluster host "+proto+" → "+dst, spec)
			return nil
		}}
}

// uvnStraySrun: an srun started outside any session (a cron job's) listens
// unbound in the default VRF on an SrunPortRange port; Slurm's daemons on
// other nodes must reach it, nobody else.
func uvnStraySrun() *Case {
	return &Case{Name: "uvn-stray-srun-port", Class: "stray",
		Why: "alice's stray listener on an SrunPortRange port (a cron job's srun): the guard lets new connections from the network into a user's stray socket only there, for Slurm's callbacks — from a cluster node's default VRF, not from bob's stray process nor off the cluster",
		Run: func(e *Env, r *Run) error {
			p := srunPortBase + 100 + e.Port%500
			s, err := e.Sink(r, e.A.Name, strayAlice, SinkSpec{Sock: Sock{Proto: "tcp", Family: 6, Dual: true, Bind: ap(wild(6), p)}})
			if err != nil {
				return err
			}
			dst := ap(eth(e.A, 4), p)
			spec := ActSpec{Sock: sock("tcp", 4), Dst: dst, WaitMS: uvnWait()}
			r.Attack(e, s, e.B.Name, strayBob, "bob's stray process tcp → "+dst, spec)
			r.Attack(e, s, "outside", "root", "the off-cluster host tcp → "+dst, spec)
			r.Control(e, s, e.B.Name, "root", "root on B (Slurm's daemons' default VRF) tcp → "+dst, spec)
			return nil
		}}
}

// uvnNAT: alice's NAT address, from a stray process of bob (the main
// table routes the address into her VRF) and from bob's session (his VRF
// routes it off-subnet through his own NAT address and the main table).
func uvnNAT(who string) *Case {
	return &Case{Name: "uvn-nat-address-" + userTag(who), Class: "nat",
		Why: "bob connects to alice's NAT address on her node: the main table's route to it leads into her VRF",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "tcp", e.Port)
			if err != nil {
				return err
			}
			nat, err := e.devAddr(e.A.Name, aliceVRF, false)
			if err != nil {
				return err
			}
			spec := ActSpec{Sock: sock("tcp", 4), Dst: ap(nat, e.Port), WaitMS: uvnWait()}
			r.Attack(e, s, e.A.Name, who, "tcp → "+ap(nat, e.Port), spec)
			r.Control(e, s, e.A.Name, Victim, "tcp → "+ap(nat, e.Port)+" (her own NAT address)", spec)
			return nil
		}}
}

// uvnBroadcast: the subnet's broadcast address from node B, where alice
// has her VXLAN on that subnet too.
func uvnBroadcast(who string) *Case {
	return &Case{Name: "uvn-broadcast-" + userTag(who), Class: "broadcast",
		Why: "bob broadcasts to alice's port on eth0's subnet from node B: her sockets on A must get only her overlay's broadcasts",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "udp", e.Port)
			if err != nil {
				return err
			}
			if err := e.presence(r, e.B.Name, Victim); err != nil {
				return err
			}
			b := e.A.Eth0V4.As4()
			b[3] = 255
			dst := ap(netip.AddrFrom4(b), e.Port)
			spec := ActSpec{Sock: Sock{Proto: "udp", Family: 4, Broadcast: true}, Dst: dst}
			r.Attack(e, s, e.B.Name, who, "udp → "+dst, spec)
			r.Control(e, s, e.B.Name, Victim, "udp → "+dst+" (her overlay)", spec)
			return nil
		}}
}

// uvnSrunPort: alice's listener on an SrunPortRange port (srun's, in her
// VRF): the default VRF reaches it there for Slurm's callbacks, no user
// may.
func uvnSrunPort(name, who string) *Case {
	return &Case{Name: "uvn-srun-port-" + name, Class: "srun-port",
		Why: map[string]string{
			"nat-source": "bob binds his own NAT address and connects to alice's srun port on another node: routing by source address would send it through the main table, masquerade give it the node's address, the hand-over take it for Slurm's",
			"stray":      "a stray process of bob (default VRF) connects to alice's srun port: the hand-over takes the default VRF's segments to claimed ports for Slurm's",
		}[name],
		Run: func(e *Env, r *Run) error {
			p := srunPortBase + e.Port%1000
			s, err := e.aliceSink(r, "tcp", p)
			if err != nil {
				return err
			}
			dst := ap(e.A.Eth0V4, p)
			spec := ActSpec{Sock: sock("tcp", 4), Dst: dst, WaitMS: uvnWait()}
			atk := spec
			if who == Attacker {
				nat, err := e.devAddr(e.B.Name, bobVRF, false)
				if err != nil {
					// bob's network on B exists once he has a process there.
					if err := e.presence(r, e.B.Name, Attacker); err != nil {
						return err
					}
					if nat, err = e.devAddr(e.B.Name, bobVRF, false); err != nil {
						return err
					}
				}
				atk.Sock.Bind = ap(nat, 0)
			}
			r.Attack(e, s, e.B.Name, who, "tcp from "+atk.Sock.Bind+" → "+dst, atk)
			r.Control(e, s, e.B.Name, "root", "root (Slurm's daemons' default VRF) tcp → "+dst, spec)
			return nil
		}}
}

// uvnOffCluster: a host off the cluster that routes the NAT pool to node A
// (any L2 neighbour of an uplink can) connects to alice's NAT address.
func uvnOffCluster() *Case {
	return &Case{Name: "uvn-off-cluster-nat", Class: "off-cluster",
		Why: "the outside host routes 100.64.0.0/10 to node A and connects to alice's NAT address: forwarding must admit only replies into the pool",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "tcp", e.Port)
			if err != nil {
				return err
			}
			nat, err := e.devAddr(e.A.Name, aliceVRF, false)
			if err != nil {
				return err
			}
			if _, err := e.Root(e.A.Name, "ip", "netns", "exec", e.TB.Router, "ip", "route", "replace", "100.64.0.0/10", "via", e.A.Eth0V4.String()); err != nil {
				return err
			}
			r.Defer(func() { e.Root(e.A.Name, "ip", "netns", "exec", e.TB.Router, "ip", "route", "del", "100.64.0.0/10") })
			dst := ap(nat, e.Port)
			spec := ActSpec{Sock: sock("tcp", 4), Dst: dst, WaitMS: uvnWait()}
			r.Attack(e, s, "outside", "root", "tcp → "+dst, spec)
			// Control: the same connection with the forward filter taken
			// out arrives (the attack is real); a setup puts it back.
			if _, err := e.Root(e.A.Name, "nft", "delete", "table", "inet", "palisade_uvn"); err != nil {
				return err
			}
			restored := false
			r.Defer(func() {
				if !restored {
					e.Root(e.A.Name, e.TB.Binary, "uvn", "setup", "--uid", Victim)
				}
			})
			r.Control(e, s, "outside", "root", "tcp → "+dst+" without the forward filter", spec)
			if _, err := e.Root(e.A.Name, e.TB.Binary, "uvn", "setup", "--uid", Victim); err != nil {
				return err
			}
			restored = true
			r.Attack(e, s, "outside", "root", "tcp → "+dst+" once a setup restored the filter", spec)
			return nil
		}}
}

// uvnInjection: VXLAN frames into alice's VNI, crafted by an unprivileged
// process of bob (a UDP socket: no privilege needed) and by the off-cluster
// host, to node A's VTEP.
func uvnInjection() *Case {
	return &Case{Name: "uvn-vxlan-injection", Class: "injection",
		Why: "a VXLAN frame to node A's VTEP with alice's VNI, sent from an unprivileged port or from off the cluster, would be decapsulated into her VRF",
		Run: func(e *Env, r *Run) error {
			s, err := e.aliceSink(r, "udp", e.Port)
			if err != nil {
				return err
			}
			out, err := e.Root(e.A.Name, "ip", "-d", "link", "show", "dev", aliceVX)
			if err != nil {
				return err
			}
			port := ""
			if _, rest, ok := strings.Cut(out, "dstport "); ok {
				port = strings.Fields(rest)[0]
			}
			if port == "" {
				return fmt.Errorf("no dstport in %s", out)
			}
			inject := func(attack bool, node, user, desc string) {
				nonce := newNonce()
				argv := []string{e.TB.LabBinary, "vm", "inject", "--to", e.A.Eth0V4.String() + ":" + port,
					"--vni", strconv.Itoa(int(uvn.VNI(victimUID))), "--src", e.B.Eth0V4.String(), "--dst", e.A.Eth0V4.String(),
					"--dport", strconv.Itoa(e.Port), "--payload", string(Payload(nonce))}
				ctx := e.Ctx
				if o, err := e.command(ctx, node, user, argv...).CombinedOutput(); err != nil {
					r.Note("%s: %v: %s", desc, err, strings.TrimSpace(string(o)))
				}
				wait := patient(Grace)
				if !attack {
					wait = patient(controlWait)
				}
				got := s.Got(nonce, wait)
				r.Judged(attack, node, user, desc, got, "nonce "+nonce)
			}
			inject(true, e.B.Name, strayBob, "bob's VXLAN frame from an unprivileged port")
			inject(true, "outside", "root", "the outside host's VXLAN frame")
			// Control: without the nft guard (B's output chain drops
			// unprivileged sends to VTEP ports, A's input chain the rest)
			// the same frames arrive; a setup puts the guard back.
			nodes := []string{e.A.Name, e.B.Name}
			restore := func() error {
				var errs []error
				for _, n := range nodes {
					if _, err := e.Root(n, e.TB.Binary, "uvn", "setup", "--uid", Victim); err != nil {
						errs = append(errs, err)
					}
				}
				return errors.Join(errs...)
			}
			restored := false
			r.Defer(func() {
				if !restored {
					restore()
				}
			})
			for _, n := range nodes {
				if _, err := e.Root(n, "nft", "delete", "table", "inet", "palisade_uvn"); err != nil {
					return err
				}
			}
			inject(false, e.B.Name, strayBob, "bob's frame without the guard")
			inject(false, "outside", "root", "the outside host's frame without the guard")
			if err := restore(); err != nil {
				return err
			}
			restored = true
			inject(true, e.B.Name, strayBob, "bob's frame once a setup restored the guard")
			inject(true, "outside", "root", "the outside host's frame once a setup restored the guard")
			return nil
		}}
}

// uvnMPTCP: sockets the kernel makes on a user's behalf (review s9 H1). An
// MPTCP socket's TCP subflows come from sock_create_kern: no sock_create
// program runs for them, so they had no birth record and the guard let
// them through. bob's stray MPTCP connection reached alice's srun listener
// through the hand-over, and her NAT address (the main table routes it
// into her VRF). Control: root's MPTCP from B (Slurm's daemons' default
// VRF) to the same srun listener.
func uvnMPTCP() *Case {
	return &Case{Name: "uvn-mptcp-stray", Class: "kernel-socket",
		Why: "bob's MPTCP socket outside any session: its TCP subflow is a kernel socket with no birth record, which the guard passed unjudged — to alice's srun listener (hand-over) and to her NAT address",
		Run: func(e *Env, r *Run) error {
			p := srunPortBase + 300 + e.Port%400
			s, err := e.aliceSink(r, "tcp", p)
			if err != nil {
				return err
			}
			nat, err := e.devAddr(e.A.Name, aliceVRF, false)
			if err != nil {
				return err
			}
			mptcp := func(dst string) ActSpec {
				return ActSpec{Sock: Sock{Proto: "mptcp", Family: 4}, Dst: dst, WaitMS: uvnWait()}
			}
			srun := ap(e.A.Eth0V4, p)
			r.Attack(e, s, e.B.Name, strayBob, "bob's stray process mptcp → "+srun, mptcp(srun))
			r.Attack(e, s, e.A.Name, strayBob, "bob's stray process mptcp → "+ap(nat, p)+" (alice's NAT address)", mptcp(ap(nat, p)))
			r.Control(e, s, e.B.Name, "root", "root (Slurm's daemons' default VRF) mptcp → "+srun, mptcp(srun))
			return nil
		}}
}

// uvnNATMark: the NAT mark outliving its destination (review s9 M2). bob's
// UDP socket connected to an underlay port of a node (port 53 of node A)
// is marked for rules 998/999 (the local and main tables); sendto()
// another destination on it, or after connect(AF_UNSPEC) (which runs no
// program), kept the mark, so his datagram to node A's address left his
// VRF and reached alice's stray socket there. Control: alice's own stray
// process to it.
func uvnNATMark() *Case {
	return &Case{Name: "uvn-nat-mark", Class: "nat",
		Why: "bob's UDP socket connected to an underlay port keeps its NAT mark when it sends elsewhere: the mark routes any destination by the main table, out of his VRF",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, strayAlice, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			dst, first := ap(e.A.Eth0V4, e.Port), ap(e.A.Eth0V4, 53)
			spec := ActSpec{Sock: sock("udp", 4), Dst: dst, ConnectFirst: first}
			r.Attack(e, s, e.A.Name, Attacker, "udp connect "+first+", sendto "+dst, spec)
			spec.Disconnect = true
			r.Attack(e, s, e.A.Name, Attacker, "udp connect "+first+", connect(AF_UNSPEC), sendto "+dst, spec)
			r.Control(e, s, e.A.Name, strayAlice, "alice's own stray process udp → "+dst, ActSpec{Sock: sock("udp", 4), Dst: dst})
			return nil
		}}
}

// srunBindScript binds each TCP port of SrunPortRange given (from, to),
// closing each at once (hold: keeping them, until the file stop exists
// or 120 s), and prints how many binds were refused with EPERM (a claim
// of another VRF) and how many succeeded.
const srunBindScript = `
import errno, os, socket, sys, time
first, last, hold, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hold", sys.argv[4]
eperm = ok = 0
kept = []
for p in range(first, last + 1):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", p))
        ok += 1
    except OSError as e:
        if e.errno == errno.EPERM:
            eperm += 1
    if hold:
        kept.append(s)
    else:
        s.close()
print("eperm %d ok %d" % (eperm, ok), flush=True)
deadline = time.time() + 120
while hold and not os.path.exists(stop) and time.time() < deadline:
    time.sleep(0.2)
`

// uvnSrunLinger: holding SrunPortRange by binding and closing (review s9
// M4). Each closed claim lingered for 120 s outside its VRF's budget and
// refused every other VRF: bob bound and closed every port of the range,
// and alice's binds there were all refused (srun: "all ports in range
// exhausted"). Control: ports bob holds open (live claims) are refused to
// alice — the claims are real, and the probe sees a hold.
func uvnSrunLinger() *Case {
	return &Case{Name: "uvn-srun-linger", Class: "srun-port",
		Why: "bob binds and closes every SrunPortRange port from his session: each closed claim lingered outside his budget, refusing alice's claims for 120 s",
		Run: func(e *Env, r *Run) error {
			const first, last = 61000, 62999
			stop := fmt.Sprintf("/tmp/pal-srun-linger-%d", e.Port)
			bind := func(user string, from, to int, hold bool) (*exec.Cmd, *bufio.Reader, error) {
				mode := "close"
				if hold {
					mode = "hold"
				}
				cmd := e.command(e.Ctx, e.A.Name, user, "python3", "-c", srunBindScript, strconv.Itoa(from), strconv.Itoa(to), mode, stop)
				out, err := cmd.StdoutPipe()
				if err != nil {
					return nil, nil, err
				}
				if err := cmd.Start(); err != nil {
					return nil, nil, err
				}
				return cmd, bufio.NewReader(out), nil
			}
			counts := func(rd *bufio.Reader) (eperm, ok int, line string) {
				line, _ = rd.ReadString('\n')
				fmt.Sscanf(line, "eperm %d ok %d", &eperm, &ok)
				return eperm, ok, strings.TrimSpace(line)
			}
			run := func(user string, from, to int) (int, int, string, error) {
				cmd, rd, err := bind(user, from, to, false)
				if err != nil {
					return 0, 0, "", err
				}
				eperm, ok, line := counts(rd)
				return eperm, ok, line, cmd.Wait()
			}
			// Attack: bob binds and closes the whole range, then alice
			// claims there.
			_, bobOK, line, err := run(Attacker, first, last)
			if err != nil || bobOK == 0 {
				return fmt.Errorf("bob's binds: %v (%s)", err, line)
			}
			eperm, _, line, err := run(Victim, first, last)
			if err != nil {
				return fmt.Errorf("alice's binds: %v", err)
			}
			r.Judged(true, e.A.Name, Attacker, fmt.Sprintf("bob bound and closed %d ports of %d-%d; alice's binds there refused", bobOK, first, last), eperm > 0, "alice: "+line)
			// Control: bob holds 10 ports open; alice's binds of those are
			// refused.
			e.Root(e.A.Name, "rm", "-f", stop)
			r.Defer(func() { e.Root(e.A.Name, "touch", stop) })
			hold, rd, err := bind(Attacker, last-9, last, true)
			if err != nil {
				return err
			}
			_, held, hline := counts(rd)
			eperm, _, line, err = run(Victim, last-9, last)
			e.Root(e.A.Name, "touch", stop)
			hold.Wait()
			if err != nil {
				return fmt.Errorf("alice's binds: %v", err)
			}
			r.Judged(false, e.A.Name, Attacker, fmt.Sprintf("bob holds %d ports of %d-%d open (%s); alice's binds there refused", held, last-9, last, hline), held > 0 && eperm == held, "alice: "+line)
			return nil
		}}
}

// uvnStrayLocalDelivery: two users' stray processes on one node meeting
// where the sender's egress check cannot see the receiver (review s9 M1):
// a broadcast to 127.255.255.255 (every wildcard socket of the port gets
// it) and a datagram to the node's address for a socket bound to eth0
// (looked up on eth0, not lo). Control: alice's own stray process.
func uvnStrayLocalDelivery(kind string) *Case {
	return &Case{Name: "uvn-stray-local-" + kind, Class: "stray",
		Why: map[string]string{
			"broadcast":    "bob's stray process broadcasts to 127.255.255.255 on the port of alice's stray socket: a broadcast goes to every wildcard socket of the port, which the sender's check (one receiving socket) did not see",
			"device-bound": "alice's stray socket is bound to eth0: local delivery looks it up on eth0, so the sender's check (device lo) did not find it and bob's stray datagram to A's address reached it",
		}[kind],
		Run: func(e *Env, r *Run) error {
			sink := Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port), ReuseAddr: true}
			dst := ap(netip.MustParseAddr("127.255.255.255"), e.Port)
			atk := ActSpec{Sock: Sock{Proto: "udp", Family: 4, Broadcast: true, ReuseAddr: true, Bind: dst}, Dst: dst}
			ctl := ActSpec{Sock: Sock{Proto: "udp", Family: 4, Broadcast: true}, Dst: dst}
			if kind == "device-bound" {
				sink = Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port), Device: "eth0"}
				dst = ap(e.A.Eth0V4, e.Port)
				atk = ActSpec{Sock: sock("udp", 4), Dst: dst}
				ctl = atk
			}
			s, err := e.Sink(r, e.A.Name, strayAlice, SinkSpec{Sock: sink})
			if err != nil {
				return err
			}
			r.Control(e, s, e.A.Name, strayAlice, "alice's own stray process udp → "+dst, ctl)
			r.Attack(e, s, e.A.Name, strayBob, "bob's stray process udp → "+dst, atk)
			if kind == "device-bound" {
				bound := atk
				bound.Sock.Device = "eth0"
				r.Attack(e, s, e.A.Name, strayBob, "bob's stray process, bound to eth0 too, udp → "+dst, bound)
			}
			return nil
		}}
}
