package attack

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/lab/check/craft"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Cases is the suite, in the order it runs. Node A (the first node) is the
// victim's; B (the second) another node; "outside" the off-cluster host.
// Victim alice (2001), attacker bob (2002): two plain users without a
// common group.
func Cases() []*Case {
	var cs []*Case
	add := func(c ...*Case) { cs = append(cs, c...) }
	for _, local := range []bool{true, false} {
		for _, fam := range []int{4, 6} {
			add(replyStolenPort(local, fam), replyForged(local, fam))
		}
	}
	add(multicast(true, 4, ""), multicast(false, 4, ""), multicast(true, 6, ""), multicast(false, 6, ""),
		multicast(true, 4, "239.255.80.1"), multicast(false, 4, "239.255.80.1"), multicast(false, 6, "ff12::5041"),
		broadcast(true, "198.18.0.255"), broadcast(true, "255.255.255.255"), broadcast(false, "198.18.0.255"),
		broadcastCoBound())
	add(deviceBound("tcp", "lo", true), deviceBound("udp", "lo", true), deviceBound("udp", "eth0", false),
		deviceBound("tcp", "eth0", false),
		linkLocal("tcp", true), linkLocal("udp", true), linkLocal("tcp", false), linkLocal("udp", false),
		newAddress(true), newAddress(false), newAddressAgentStopped())
	add(otherProto("udplite", 4, true), otherProto("udplite", 4, false), otherProto("udplite", 6, false),
		otherProto("mptcp", 4, true), otherProto("mptcp", 4, false), otherProto("sctp", 4, false),
		otherProto("dccp", 4, false))
	add(v4Mapped("tcp", true), v4Mapped("udp", true), v4Mapped("udp", false))
	add(reuseAddrSpecific(), reusePortJoin())
	add(forgeOption("udp", 4), forgeOption("tcp", 4), forgeOption("udp", 6), forgeOption("tcp", 6), tcpMD5())
	add(spoofUDP(4), spoofUDP(6), spoofSYN(4), spoofSYN(6))
	add(nftFlush("tcp"), nftFlush("udp"), agentKill(syscall.SIGKILL), agentKill(syscall.SIGTERM))
	add(sshForward("L"), sshForward("R"), sshForward("D"))
	add(userns("-r"), userns("-rn"))
	add(timeWait(), fastOpen())
	add(abstractUnix("unix-stream"), abstractUnix("unix-dgram"))
	add(casesV2()...)
	add(casesV3()...)
	add(casesRedteam()...)
	add(casesIdent()...)
	add(casesUDP()...)
	add(casesGrants()...)
	add(casesPortal()...)
	return cs
}

func where(local bool) string {
	if local {
		return "local"
	}
	return "cross"
}

func wild(fam int) netip.Addr {
	if fam == 6 {
		return netip.IPv6Unspecified()
	}
	return netip.IPv4Unspecified()
}

func lo(fam int) netip.Addr {
	if fam == 6 {
		return netip.IPv6Loopback()
	}
	return netip.AddrFrom4([4]byte{127, 0, 0, 1})
}

func eth(n testbed.Node, fam int) netip.Addr {
	if fam == 6 {
		return n.Eth0V6
	}
	return n.Eth0V4
}

func ib(n testbed.Node, fam int) netip.Addr {
	if fam == 6 {
		return n.IBV6
	}
	return n.IBV4
}

// path picks, for a local or cross-node case, the attacker's node and the
// destination address of the victim's node A.
func (e *Env) path(local bool, fam int) (node string, dst netip.Addr) {
	if local {
		return e.A.Name, eth(e.A, fam)
	}
	return e.B.Name, eth(e.A, fam)
}

func sock(proto string, fam int) Sock { return Sock{Proto: proto, Family: fam} }

// simple is the common shape: alice's socket spec on A, bob's and then
// alice's step from node with spec.
func simple(e *Env, r *Run, sink SinkSpec, node, desc string, spec ActSpec) error {
	s, err := e.Sink(r, e.A.Name, Victim, sink)
	if err != nil {
		return err
	}
	r.Attack(e, s, node, Attacker, desc, spec)
	r.Control(e, s, node, Victim, desc, spec)
	return nil
}

// --- UDP reply state -------------------------------------------------------

func replyStolenPort(local bool, fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-reply-stolen-port-%s-v%d", where(local), fam), Class: "udp-reply",
		Why: "alice's client used port Q to talk to her UDP service and got answers; bob then binds Q and talks to the service: reply state keyed by port would let him in",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), p)}, Echo: true})
			if err != nil {
				return err
			}
			node, src, dst := e.B.Name, eth(e.B, fam), eth(e.A, fam)
			if local {
				node, src, dst = e.A.Name, lo(fam), lo(fam)
			}
			from := Sock{Proto: "udp", Family: fam, Bind: ap(src, q), ReuseAddr: true}
			res, err := e.Act(node, Victim, ActSpec{Sock: from, Dst: ap(dst, p), Nonce: newNonce(), Reply: true})
			if err != nil {
				return err
			}
			if !res.Reply {
				return fmt.Errorf("setup: alice's own exchange from %s failed: %s", ap(src, q), res.Error)
			}
			desc := "udp " + ap(src, q) + " → " + ap(dst, p)
			r.Attack(e, s, node, Attacker, desc, ActSpec{Sock: from, Dst: ap(dst, p), Count: 3})
			// Baseline: the same from a port of bob's own (refused unless
			// the data plane is open anyway).
			r.Attack(e, s, node, Attacker, "udp (ephemeral port) → "+ap(dst, p), ActSpec{Sock: sock("udp", fam), Dst: ap(dst, p), Count: 3})
			r.Control(e, s, node, Victim, desc, ActSpec{Sock: from, Dst: ap(dst, p)})
			return nil
		}}
}

func replyForged(local bool, fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-reply-self-made-%s-v%d", where(local), fam), Class: "udp-reply",
		Why: "alice's UDP service is bound to A's eth0 address, port P; bob binds P on A's ib0 address and sends from it to a port Q of his own, then sends from Q to alice's P: a reply entry not tied to the socket would be his key",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(eth(e.A, fam), p)}})
			if err != nil {
				return err
			}
			node, far := e.B.Name, eth(e.B, fam)
			if local {
				node, far = e.A.Name, eth(e.A, fam)
			}
			// Bob's helper socket on A's other address, same port P.
			res, err := e.Act(e.A.Name, Attacker, ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(ib(e.A, fam), p)},
				Dst: ap(far, q), Nonce: newNonce()})
			if err != nil {
				return err
			}
			if !res.OK {
				r.Note("bob's helper send from %s failed: %s", ap(ib(e.A, fam), p), res.Error)
			}
			from := Sock{Proto: "udp", Family: fam, Bind: ap(far, q)}
			desc := "udp " + ap(far, q) + " → " + ap(eth(e.A, fam), p)
			r.Attack(e, s, node, Attacker, desc+" (after bob's "+ap(ib(e.A, fam), p)+" → "+ap(far, q)+")",
				ActSpec{Sock: from, Dst: ap(eth(e.A, fam), p), Count: 3})
			r.Attack(e, s, node, Attacker, "udp (ephemeral port) → "+ap(eth(e.A, fam), p),
				ActSpec{Sock: sock("udp", fam), Dst: ap(eth(e.A, fam), p), Count: 3})
			r.Control(e, s, node, Victim, desc, ActSpec{Sock: from, Dst: ap(eth(e.A, fam), p)})
			return nil
		}}
}

// --- multicast and broadcast ----------------------------------------------

func multicast(local bool, fam int, group string) *Case {
	name := "mcast-allhosts"
	dst := "224.0.0.1"
	if fam == 6 {
		name, dst = "mcast-allnodes", "ff02::1"
	}
	why := fmt.Sprintf("bob sends to %s on the victim's port: every wildcard UDP socket on the link receives it (IP_MULTICAST_ALL)", dst)
	if group != "" {
		name, dst = "mcast-joined-group", group
		why = fmt.Sprintf("bob makes node A join %s with a socket of his own; alice's wildcard socket on port P then receives the group's datagrams to P too (IP_MULTICAST_ALL)", group)
	}
	return &Case{Name: fmt.Sprintf("%s-%s-v%d", name, where(local), fam), Class: "multicast", Why: why,
		Run: func(e *Env, r *Run) error {
			p := e.Port
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), p)}})
			if err != nil {
				return err
			}
			if group != "" {
				if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "udp", Family: fam,
					Bind: ap(wild(fam), p+1), Join: []string{group + "%eth0"}}}); err != nil {
					return err
				}
			}
			node, _ := e.path(local, fam)
			to := ap(netip.MustParseAddr(dst), p)
			if fam == 6 {
				to = ap(netip.MustParseAddr(dst).WithZone("eth0"), p)
			}
			spec := ActSpec{Sock: Sock{Proto: "udp", Family: fam, MulticastIf: "eth0"}, Dst: to, Count: 3}
			r.Attack(e, s, node, Attacker, "udp → "+to, spec)
			r.Control(e, s, node, Victim, "udp → "+to, spec)
			return nil
		}}
}

func broadcast(local bool, dst string) *Case {
	kind := "subnet"
	if dst == "255.255.255.255" {
		kind = "limited"
	}
	return &Case{Name: fmt.Sprintf("bcast-%s-%s-v4", kind, where(local)), Class: "broadcast",
		Why: "bob broadcasts to " + dst + " on the victim's port: every node's wildcard UDP socket on that port receives it",
		Run: func(e *Env, r *Run) error {
			node, _ := e.path(local, 4)
			to := ap(netip.MustParseAddr(dst), e.Port)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port)}}, node, "udp → "+to,
				ActSpec{Sock: Sock{Proto: "udp", Family: 4, Broadcast: true}, Dst: to, Count: 3})
		}}
}

func broadcastCoBound() *Case {
	return &Case{Name: "bcast-reuseaddr-cobound-local-v4", Class: "port-reuse",
		Why: "alice's UDP socket has SO_REUSEADDR; bob co-binds the same wildcard port and broadcasts to it: a check that looks up one socket finds bob's, but the kernel delivers to both",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			spec := SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true}}
			s, err := e.Sink(r, e.A.Name, Victim, spec)
			if err != nil {
				return err
			}
			// A data plane may refuse the co-bind itself: then bob
			// broadcasts without it.
			if _, err := e.Sink(r, e.A.Name, Attacker, spec); err != nil {
				var se *SinkError
				if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EACCES") {
					return err
				}
				r.Note("bob's co-bind refused: %v", err)
			}
			to := "198.18.0.255:" + itoa(p)
			act := ActSpec{Sock: Sock{Proto: "udp", Family: 4, Broadcast: true}, Dst: to, Count: 3}
			r.Attack(e, s, e.A.Name, Attacker, "udp → "+to, act)
			r.Control(e, s, e.A.Name, Victim, "udp → "+to, act)
			return nil
		}}
}

// --- device-bound and link-local listeners ---------------------------------

func deviceBound(proto, dev string, local bool) *Case {
	return &Case{Name: fmt.Sprintf("bindtodevice-%s-%s-%s", dev, proto, where(local)), Class: "device-bound",
		Why: fmt.Sprintf("alice's %s listener is bound to device %s (SO_BINDTODEVICE, unprivileged since 5.7): a lookup without the device misses it, the kernel still delivers", proto, dev),
		Run: func(e *Env, r *Run) error {
			node, dst := e.path(local, 4)
			if dev == "lo" {
				dst = lo(4)
			}
			to := ap(dst, e.Port)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: proto, Family: 4, Bind: ap(wild(4), e.Port), Device: dev}}, node,
				proto+" → "+to, ActSpec{Sock: sock(proto, 4), Dst: to, Count: 3, Connect: proto == "udp"})
		}}
}

func linkLocal(proto string, local bool) *Case {
	return &Case{Name: fmt.Sprintf("linklocal-%s-%s-v6", proto, where(local)), Class: "device-bound",
		Why: "alice's " + proto + " listener is bound to A's link-local address (fe80::/10 on eth0): not a node address in the data plane's tables, yet delivered",
		Run: func(e *Env, r *Run) error {
			ll, err := e.LinkLocal(e.A.Name)
			if err != nil {
				return err
			}
			node, _ := e.path(local, 6)
			to := ap(ll, e.Port)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Bind: to}}, node, proto+" → "+to,
				ActSpec{Sock: sock(proto, 6), Dst: to, Count: 3, Connect: proto == "udp"})
		}}
}

// newAddrs picks the addresses the new-address cases add to A's eth0.
func (e *Env) newAddrs() (k int, a4, a6 netip.Addr) {
	k = 150 + (e.Port/10)%50
	return k, netip.AddrFrom4([4]byte{198, 18, 0, byte(k)}), netip.MustParseAddr(fmt.Sprintf("2001:2::%d", k))
}

// addAddrs adds addresses to A's eth0 (each: prefix, then `ip addr add`
// flags) and removes them when the case ends.
func (e *Env) addAddrs(r *Run, addrs ...[]string) error {
	for _, a := range addrs {
		if _, err := e.Root(e.A.Name, append([]string{"ip", "addr", "add", a[0], "dev", "eth0"}, a[1:]...)...); err != nil {
			return err
		}
		r.Defer(func() { e.Root(e.A.Name, "ip", "addr", "del", a[0], "dev", "eth0") })
	}
	return nil
}

// wildSinks are alice's wildcard TCP v4 and UDP v6 listeners on A.
func (e *Env) wildSinks(r *Run) (t, u *Sink, err error) {
	if t, err = e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}}); err != nil {
		return nil, nil, err
	}
	u, err = e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: ap(wild(6), e.Port)}})
	return t, u, err
}

func newAddress(local bool) *Case {
	return &Case{Name: "new-address-" + where(local), Class: "device-bound",
		Why: "an administrator adds an address to A's eth0 while alice's wildcard listeners run; bob connects to the new address (tcp v4, udp v6) before the data plane may know it",
		Run: func(e *Env, r *Run) error {
			_, a4, a6 := e.newAddrs()
			t, u, err := e.wildSinks(r)
			if err != nil {
				return err
			}
			if err := e.addAddrs(r, []string{a4.String() + "/24"}, []string{a6.String() + "/64"}); err != nil {
				return err
			}
			node := e.B.Name
			if local {
				node = e.A.Name
			}
			tspec := ActSpec{Sock: sock("tcp", 4), Dst: ap(a4, e.Port)}
			uspec := ActSpec{Sock: sock("udp", 6), Dst: ap(a6, e.Port), Count: 3, Connect: true}
			r.Attack(e, t, node, Attacker, "tcp → "+tspec.Dst, tspec)
			r.Attack(e, u, node, Attacker, "udp → "+uspec.Dst, uspec)
			// The testbed has no DAD: a new IPv6 address is a source at
			// once, and one the agent does not list yet is refused (see
			// uw_skb_egress). The controls wait for its acknowledgement.
			if err := e.waitListed(e.A, a4, a6); err != nil {
				return err
			}
			r.Control(e, t, node, Victim, "tcp → "+tspec.Dst, tspec)
			r.Control(e, u, node, Victim, "udp → "+uspec.Dst, uspec)
			return nil
		}}
}

// newAddressAgentStopped takes the agent's address list out of the question:
// with A's agent stopped it cannot learn of the new addresses. An IPv4
// source the kernel chose and checked is admitted on the kernel's word; an
// IPv6 one is admitted only once the agent lists it (IPv6 does not check a
// source again after bind), and a forged one never, whether the socket still
// has IP_FREEBIND or cleared it after binding.
func newAddressAgentStopped() *Case {
	return &Case{Name: "new-address-agent-stopped", Class: "device-bound",
		Why: "A's agent is stopped (SIGSTOP) while an administrator adds addresses (v4, v6 nodad); alice's TCP from the new IPv4 address is admitted (the kernel checked it), her UDP from the new IPv6 address only once the agent, resumed, lists it; alice sending from an address A does not have (IPv6, IP_FREEBIND, also cleared again after bind) stays refused",
		Run: func(e *Env, r *Run) error {
			k, a4, a6 := e.newAddrs()
			forged := ap(netip.MustParseAddr(fmt.Sprintf("2001:2::%d", k+50)), e.Port+1)
			t, u, err := e.wildSinks(r)
			if err != nil {
				return err
			}
			pid := control.ReadPid(uwlab.AgentPidFile(e.TB, e.A.Name))
			if pid == 0 {
				return fmt.Errorf("no agent runs on %s", e.A.Name)
			}
			if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
				return err
			}
			stopped := true
			resume := func() {
				if stopped {
					syscall.Kill(pid, syscall.SIGCONT)
					stopped = false
				}
			}
			r.Defer(resume)
			if err := e.addAddrs(r, []string{a4.String() + "/24"}, []string{a6.String() + "/64", "nodad"}); err != nil {
				return err
			}
			tspec := ActSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(a4, 0)}, Dst: ap(a4, e.Port)}
			uspec := ActSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: ap(a6, 0)}, Dst: ap(a6, e.Port), Count: 3}
			fspec := ActSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: forged, FreeBind: true}, Dst: ap(a6, e.Port), Count: 3}
			ospec := fspec
			ospec.Sock.FreeBindOff = true
			r.Attack(e, t, e.A.Name, Attacker, "tcp → "+tspec.Dst, ActSpec{Sock: sock("tcp", 4), Dst: tspec.Dst})
			r.Attack(e, u, e.A.Name, Victim, "udp "+uspec.Sock.Bind+" → "+uspec.Dst+" (IPv6 source the agent does not list yet: refused)", uspec)
			r.Attack(e, u, e.A.Name, Victim, "udp "+forged+" (IP_FREEBIND, not A's) → "+fspec.Dst, fspec)
			r.Attack(e, u, e.A.Name, Victim, "udp "+forged+" (IP_FREEBIND cleared after bind) → "+ospec.Dst, ospec)
			r.Control(e, t, e.A.Name, Victim, "tcp "+tspec.Sock.Bind+" → "+tspec.Dst+" (agent stopped)", tspec)
			resume()
			if err := e.waitListed(e.A, a6); err != nil {
				return err
			}
			r.Control(e, u, e.A.Name, Victim, "udp "+uspec.Sock.Bind+" → "+uspec.Dst+" (agent resumed, lists it)", uspec)
			return nil
		}}
}

// --- other protocols, v4-mapped, port reuse ---------------------------------

func otherProto(proto string, fam int, local bool) *Case {
	return &Case{Name: fmt.Sprintf("proto-%s-%s-v%d", proto, where(local), fam), Class: "other-protocols",
		Why: "bob reaches alice's " + strings.ToUpper(proto) + " socket: a data plane that parses only TCP and UDP never sees it",
		Run: func(e *Env, r *Run) error {
			node, dst := e.path(local, fam)
			if local {
				dst = lo(fam)
			}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: proto, Family: fam, Bind: ap(wild(fam), e.Port)}})
			var se *SinkError
			if errors.As(err, &se) && (se.Errno == "EPROTONOSUPPORT" || se.Errno == "ESOCKTNOSUPPORT" || se.Errno == "EAFNOSUPPORT") {
				r.NA = fmt.Sprintf("the kernel has no %s (socket(): %s)", strings.ToUpper(proto), se.Errno)
				return nil
			}
			if err != nil {
				return err
			}
			spec := ActSpec{Sock: sock(proto, fam), Dst: ap(dst, e.Port), Count: 3}
			r.Attack(e, s, node, Attacker, proto+" → "+spec.Dst, spec)
			r.Control(e, s, node, Victim, proto+" → "+spec.Dst, spec)
			return nil
		}}
}

func v4Mapped(proto string, local bool) *Case {
	return &Case{Name: fmt.Sprintf("v4mapped-%s-%s", proto, where(local)), Class: "v4-mapped",
		Why: "bob's IPv6 socket sends to ::ffff:a.b.c.d (alice's dual-stack listener): the IPv4 path is taken where IPv6 hooks looked",
		Run: func(e *Env, r *Run) error {
			node, dst := e.path(local, 4)
			if local {
				dst = lo(4)
			}
			to := ap(netip.AddrFrom16(dst.As16()), e.Port)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true, Bind: ap(wild(6), e.Port)}}, node,
				proto+" → "+to, ActSpec{Sock: Sock{Proto: proto, Family: 6, Dual: true}, Dst: to, Count: 3})
		}}
}

func reuseAddrSpecific() *Case {
	return &Case{Name: "reuseaddr-cobound-cross-v4", Class: "port-reuse",
		Why: "alice binds A's eth0 address with SO_REUSEADDR, bob co-binds the wildcard on the same port; bob sends from B to alice's address: the decision must be on the socket that receives",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(e.A.Eth0V4, p), ReuseAddr: true}})
			if err != nil {
				return err
			}
			// Since round 4 the wildcard bind itself is refused (cases
			// reuseaddr-wild-over-specific-*); the datagrams are checked
			// at alice's socket either way.
			if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true}}); err != nil {
				var se *SinkError
				if !errors.As(err, &se) || se.Errno != "EPERM" {
					return err
				}
				r.Note("bob's co-bind of the wildcard refused: %v", err)
			}
			spec := ActSpec{Sock: sock("udp", 4), Dst: ap(e.A.Eth0V4, p), Count: 3, Connect: true}
			r.Attack(e, s, e.B.Name, Attacker, "udp → "+spec.Dst, spec)
			r.Control(e, s, e.B.Name, Victim, "udp → "+spec.Dst, spec)
			return nil
		}}
}

func reusePortJoin() *Case {
	return &Case{Name: "reuseport-join-cross-tcp", Class: "port-reuse",
		Why: "alice's TCP listener uses SO_REUSEPORT; bob tries to join its group (the kernel requires the same uid) and connects from B",
		Run: func(e *Env, r *Run) error {
			spec := SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port), ReusePort: true}}
			s, err := e.Sink(r, e.A.Name, Victim, spec)
			if err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, Attacker, spec); err != nil {
				r.Note("bob's SO_REUSEPORT bind refused: %v", err)
			} else {
				r.Note("bob JOINED alice's SO_REUSEPORT group")
			}
			act := ActSpec{Sock: sock("tcp", 4), Dst: ap(e.A.Eth0V4, e.Port)}
			for i := 0; i < 3; i++ {
				r.Attack(e, s, e.B.Name, Attacker, "tcp → "+act.Dst, act)
			}
			r.Control(e, s, e.B.Name, Victim, "tcp → "+act.Dst, act)
			return nil
		}}
}

// --- forged identity ----------------------------------------------------------

func forgeOption(proto string, fam int) *Case {
	return &Case{Name: fmt.Sprintf("forge-stamp-%s-v%d", proto, fam), Class: "forged-identity",
		Why: "bob (unprivileged) sets the v1 stamp claiming alice with IP_OPTIONS / IPV6_DSTOPTS and sends to alice's socket on A",
		Run: func(e *Env, r *Run) error {
			so := sock(proto, fam)
			if fam == 4 {
				so.IPOptions = hex.EncodeToString(craft.StampV1IPv4(victimUID, victimUID))
			} else {
				so.DstOpts = hex.EncodeToString(craft.StampV1IPv6(victimUID, victimUID))
			}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: proto, Family: fam, Bind: ap(wild(fam), e.Port)}})
			if err != nil {
				return err
			}
			to := ap(eth(e.A, fam), e.Port)
			r.Attack(e, s, e.B.Name, Attacker, proto+" with forged stamp → "+to, ActSpec{Sock: so, Dst: to, Count: 3})
			r.Control(e, s, e.B.Name, Victim, proto+" → "+to, ActSpec{Sock: sock(proto, fam), Dst: to})
			return nil
		}}
}

func tcpMD5() *Case {
	return &Case{Name: "tcp-option-md5-cross-v4", Class: "forged-identity",
		Why: "bob fills the SYN's option space with TCP-MD5 (what a user can do to TCP options) and connects to alice from B",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port), MD5Key: ""}})
			if err != nil {
				return err
			}
			to := ap(e.A.Eth0V4, e.Port)
			r.Attack(e, s, e.B.Name, Attacker, "tcp+md5 → "+to, ActSpec{Sock: Sock{Proto: "tcp", Family: 4, MD5Key: "palisade"}, Dst: to})
			r.Control(e, s, e.B.Name, Victim, "tcp → "+to, ActSpec{Sock: sock("tcp", 4), Dst: to})
			return nil
		}}
}

// sysPort is a system port (≤ system_port_max) for root's control sinks.
func (e *Env) sysPort() int { return 600 + (e.Port/10)%300 }

func spoofUDP(fam int) *Case {
	return &Case{Name: fmt.Sprintf("spoof-outside-udp-v%d", fam), Class: "spoofing",
		Why: "root on the outside host sends datagrams with node B's source address and a stamp claiming alice to alice's UDP socket on A (the router does not filter sources)",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.Port)}})
			if err != nil {
				return err
			}
			rs, err := e.Sink(r, e.A.Name, "root", SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.sysPort())}})
			if err != nil {
				return err
			}
			src := ap(eth(e.B, fam), 40000+e.Port%1000)
			spec := ActSpec{Sock: sock("udp", fam), Raw: true, Dst: ap(eth(e.A, fam), e.Port), Count: 3,
				Stamp: "v1", StampUID: victimUID, StampGID: victimUID}
			spec.Sock.Bind = src
			r.Attack(e, s, e.Outside.Name, "root", "raw udp "+src+" (stamp: alice) → "+spec.Dst, spec)
			ctl := spec
			ctl.Dst, ctl.Stamp = ap(eth(e.A, fam), e.sysPort()), ""
			r.Control(e, rs, e.Outside.Name, "root", "raw udp "+src+" → root's system port "+ctl.Dst, ctl)
			return nil
		}}
}

// synRecv reports whether node has a request socket (SYN_RECV) from src to
// local port port: a spoofed SYN's handshake can never complete, so that is
// how far "delivered to the listener" goes.
func (e *Env) synRecv(node, src string, port int, wait time.Duration) (bool, string) {
	deadline := time.Now().Add(wait)
	for {
		out, err := e.Root(node, "ss", "-Htn", "state", "syn-recv", "sport", "= :"+itoa(port))
		if err == nil && strings.Contains(out, src) {
			return true, "SYN_RECV " + strings.Join(strings.Fields(out), " ")
		}
		if time.Now().After(deadline) {
			return false, "no request socket"
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func spoofSYN(fam int) *Case {
	return &Case{Name: fmt.Sprintf("spoof-outside-syn-v%d", fam), Class: "spoofing",
		Why: "root on the outside host sends SYNs from an unused cluster address with the v1 TCP stamp claiming alice: a request socket on alice's listener means the SYN was accepted",
		Run: func(e *Env, r *Run) error {
			if _, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: fam, Bind: ap(wild(fam), e.Port)}}); err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, "root", SinkSpec{Sock: Sock{Proto: "tcp", Family: fam, Bind: ap(wild(fam), e.sysPort())}}); err != nil {
				return err
			}
			unused := netip.MustParseAddr("198.18.0.77")
			if fam == 6 {
				unused = netip.MustParseAddr("2001:2::77")
			}
			src := ap(unused, 40000+e.Port%1000)
			ctl := ActSpec{Sock: Sock{Proto: "tcp", Family: fam, Bind: src}, Raw: true, Dst: ap(eth(e.A, fam), e.sysPort())}
			if _, err := e.Act(e.Outside.Name, "root", ctl); err != nil {
				return err
			}
			ok, ev := e.synRecv(e.A.Name, src, e.sysPort(), 3*time.Second)
			r.Judged(false, e.Outside.Name, "root", "raw SYN "+src+" → root's system port "+ctl.Dst, ok, ev)
			att := ctl
			att.Dst, att.Stamp, att.StampUID, att.StampGID = ap(eth(e.A, fam), e.Port), "v1", victimUID, victimUID
			att.Nonce = newNonce()
			if _, err := e.Act(e.Outside.Name, "root", att); err != nil {
				return err
			}
			ok, ev = e.synRecv(e.A.Name, src, e.Port, Grace)
			r.Judged(true, e.Outside.Name, "root", "raw SYN "+src+" (stamp: alice) → "+att.Dst, ok, ev)
			return nil
		}}
}

// --- administrators and the agent ------------------------------------------

// restoreAgent makes sure A's agent runs with its nft table after a case
// that flushed or killed things.
func (e *Env) restoreAgent(node testbed.Node) error {
	if _, err := e.Root(node.Name, "nft", "list", "table", "inet", "palisade_userwall"); err == nil &&
		control.ReadPid(uwlab.AgentPidFile(e.TB, node.Name)) != 0 {
		return nil
	}
	if err := uwlab.TermAgent(e.TB, node.Name); err != nil {
		return err
	}
	return uwlab.StartAgent(e.Ctx, e.TB, node)
}

func nftFlush(proto string) *Case {
	return &Case{Name: "nft-flush-" + proto + "-cross", Class: "fail-open",
		Why: "an administrator runs `nft flush ruleset` on A; bob then sends to alice from B: refusals must not depend on the nft table",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: proto, Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			r.Defer(func() {
				if err := e.restoreAgent(e.A); err != nil {
					e.Log("restore agent on %s: %v", e.A.Name, err)
				}
			})
			if _, err := e.Root(e.A.Name, "nft", "flush", "ruleset"); err != nil {
				return err
			}
			spec := ActSpec{Sock: sock(proto, 4), Dst: ap(e.A.Eth0V4, e.Port), Count: 3, Connect: proto == "udp"}
			r.Attack(e, s, e.B.Name, Attacker, proto+" → "+spec.Dst+" after nft flush", spec)
			r.Control(e, s, e.B.Name, Victim, proto+" → "+spec.Dst+" after nft flush", spec)
			return nil
		}}
}

func agentKill(sig syscall.Signal) *Case {
	name := "agent-sigkill-restart"
	if sig == syscall.SIGTERM {
		name = "agent-sigterm-restart"
	}
	return &Case{Name: name, Class: "agent-lifecycle",
		Why: fmt.Sprintf("A's agent gets %v; bob attacks alice's TCP and UDP sockets from B while it is gone and again after its restart", sig),
		Run: func(e *Env, r *Run) error {
			t, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			u, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: ap(wild(6), e.Port)}})
			if err != nil {
				return err
			}
			r.Defer(func() { e.restoreAgent(e.A) })
			if control.ReadPid(uwlab.AgentPidFile(e.TB, e.A.Name)) == 0 {
				return errors.New("no agent runs on " + e.A.Name)
			}
			if err := uwlab.SignalAgent(e.TB, e.A.Name, sig); err != nil {
				return err
			}
			tspec := ActSpec{Sock: sock("tcp", 4), Dst: ap(e.A.Eth0V4, e.Port)}
			uspec := ActSpec{Sock: sock("udp", 6), Dst: ap(e.A.Eth0V6, e.Port), Count: 3, Connect: true}
			for _, phase := range []string{"agent down", "agent restarted"} {
				if phase == "agent restarted" {
					if err := uwlab.StartAgent(e.Ctx, e.TB, e.A); err != nil {
						return err
					}
				}
				r.Attack(e, t, e.B.Name, Attacker, "tcp → "+tspec.Dst+" ("+phase+")", tspec)
				r.Attack(e, u, e.B.Name, Attacker, "udp → "+uspec.Dst+" ("+phase+")", uspec)
				r.Control(e, t, e.B.Name, Victim, "tcp → "+tspec.Dst+" ("+phase+")", tspec)
				r.Control(e, u, e.B.Name, Victim, "udp → "+uspec.Dst+" ("+phase+")", uspec)
			}
			return nil
		}}
}

// --- ssh forwarding, user namespaces ----------------------------------------

// listening waits until node has a TCP listener on port.
func (e *Env) listening(node string, port int) bool {
	for i := 0; i < 100; i++ {
		out, _ := e.Root(node, "ss", "-Hltn", "sport", "= :"+itoa(port))
		if strings.TrimSpace(out) != "" {
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

func sshForward(kind string) *Case {
	return &Case{Name: "ssh-forward-" + kind, Class: "ssh",
		Why: "bob uses ssh -" + kind + " so that his sshd (or ssh client) on another node makes the connection to alice's listener for him",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			for i, user := range []string{Attacker, Victim} {
				f := e.Port + 5 + i
				var argv []string
				fwdNode, useNode := e.B.Name, e.B.Name
				spec := ActSpec{Sock: sock("tcp", 4), Dst: "127.0.0.1:" + itoa(f)}
				switch kind {
				case "L":
					argv = []string{"-L", "127.0.0.1:" + itoa(f) + ":127.0.0.1:" + itoa(e.Port)}
				case "R":
					argv = []string{"-R", "127.0.0.1:" + itoa(f) + ":" + ap(e.A.Eth0V4, e.Port)}
					fwdNode, useNode = e.A.Name, e.A.Name
				case "D":
					argv = []string{"-D", "127.0.0.1:" + itoa(f)}
					spec = ActSpec{SOCKS: "127.0.0.1:" + itoa(f), Dst: "127.0.0.1:" + itoa(e.Port)}
				}
				ctx, cancel := context.WithCancel(e.Ctx)
				argv = append([]string{"ssh", "-N", "-o", "ExitOnForwardFailure=yes"}, append(argv, e.A.Name)...)
				cmd := e.TB.Command(ctx, e.B.Name, user, argv...)
				var out strings.Builder
				cmd.Stdout, cmd.Stderr = &out, &out
				if err := cmd.Start(); err != nil {
					cancel()
					return err
				}
				r.Defer(func() { cancel(); cmd.Wait() })
				if !e.listening(fwdNode, f) {
					return fmt.Errorf("%s's ssh -%s: no forward listening on %s:%d: %s", user, kind, fwdNode, f, out.String())
				}
				desc := "tcp via ssh -" + strings.Join(argv[4:len(argv)-1], " ")
				if user == Attacker {
					r.Attack(e, s, useNode, user, desc, spec)
				} else {
					r.Control(e, s, useNode, user, desc, spec)
				}
			}
			return nil
		}}
}

func userns(flags string) *Case {
	return &Case{Name: "userns-unshare" + flags, Class: "user-namespaces",
		Why: "bob becomes root in a user namespace (unshare " + flags + "): raw sockets and forged IP options there must gain nothing against alice's socket on A",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			to := ap(e.A.Eth0V4, e.Port)
			forged := Sock{Proto: "udp", Family: 4, IPOptions: hex.EncodeToString(craft.StampV1IPv4(victimUID, victimUID))}
			raw := ActSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(e.B.Eth0V4, 40000)}, Raw: true, Dst: to,
				Stamp: "v1", StampUID: victimUID, StampGID: victimUID}
			who := "unshare:" + flags + ":"
			r.Attack(e, s, e.B.Name, who+Attacker, "udp with forged stamp → "+to, ActSpec{Sock: forged, Dst: to, Count: 3})
			r.Attack(e, s, e.B.Name, who+Attacker, "raw udp (stamp: alice) → "+to, raw)
			r.Attack(e, s, e.B.Name, who+Attacker, "udp → "+to, ActSpec{Sock: sock("udp", 4), Dst: to, Count: 3})
			ctl := who + Victim
			if flags == "-rn" {
				// A new network namespace reaches nothing: the control is
				// alice's plain send on the same path.
				ctl = Victim
			}
			r.Control(e, s, e.B.Name, ctl, "udp → "+to, ActSpec{Sock: sock("udp", 4), Dst: to})
			return nil
		}}
}

// --- TCP state: TIME_WAIT, Fast Open ----------------------------------------

func timeWait() *Case {
	return &Case{Name: "tcp-timewait-cross", Class: "tcp-state",
		Why: "alice's connection from B port Q ends with A in TIME_WAIT; bob binds Q on B and sends a SYN matching that TIME_WAIT socket, which the kernel hands to alice's listener",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}, Echo: true, CloseFirst: true})
			if err != nil {
				return err
			}
			from := Sock{Proto: "tcp", Family: 4, Bind: ap(e.B.Eth0V4, e.Port+1), ReuseAddr: true}
			spec := ActSpec{Sock: from, Dst: ap(e.A.Eth0V4, e.Port), Reply: true, WaitClose: true}
			res, err := e.Act(e.B.Name, Victim, ActSpec{Sock: from, Dst: spec.Dst, Nonce: newNonce(), Reply: true, WaitClose: true})
			if err != nil {
				return err
			}
			if !res.Reply {
				return fmt.Errorf("setup: alice's own connection failed: %s", res.Error)
			}
			out, _ := e.Root(e.A.Name, "ss", "-Htn", "state", "time-wait", "sport", "= :"+itoa(e.Port))
			if !strings.Contains(out, from.Bind) {
				r.Note("no TIME_WAIT socket for %s on %s (%q)", from.Bind, e.A.Name, out)
			}
			spec.Reply, spec.WaitClose = false, false
			r.Attack(e, s, e.B.Name, Attacker, "tcp "+from.Bind+" → "+spec.Dst+" over TIME_WAIT", spec)
			r.Control(e, s, e.B.Name, Victim, "tcp "+from.Bind+" → "+spec.Dst, spec)
			return nil
		}}
}

func fastOpen() *Case {
	return &Case{Name: "tcp-fastopen-cross", Class: "tcp-state",
		Why: "bob gets a TFO cookie for A from a listener of his own (cookies are per client address, not per user) and sends data in a SYN to alice's TFO listener; alice's own TFO across nodes is the control",
		Run: func(e *Env, r *Run) error {
			for _, n := range []string{e.A.Name, e.B.Name} {
				old, err := e.Root(n, "sysctl", "-n", "net.ipv4.tcp_fastopen")
				if err != nil {
					return err
				}
				r.Defer(func() { e.Root(n, "sysctl", "-qw", "net.ipv4.tcp_fastopen="+strings.TrimSpace(old)) })
				if _, err := e.Root(n, "sysctl", "-qw", "net.ipv4.tcp_fastopen=3"); err != nil {
					return err
				}
			}
			tfo := Sock{Proto: "tcp", Family: 4, FastOpen: true}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port), FastOpen: true}})
			if err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port+1), FastOpen: true}}); err != nil {
				return err
			}
			// Cookie requests (data after the handshake).
			for _, u := range []string{Attacker, Victim} {
				port := e.Port + 1
				if u == Victim {
					port = e.Port
				}
				if _, err := e.Act(e.B.Name, u, ActSpec{Sock: tfo, Dst: ap(e.A.Eth0V4, port), Nonce: newNonce()}); err != nil {
					return err
				}
			}
			to := ap(e.A.Eth0V4, e.Port)
			r.Attack(e, s, e.B.Name, Attacker, "TFO SYN+data → "+to, ActSpec{Sock: tfo, Dst: to})
			r.Control(e, s, e.B.Name, Victim, "TFO SYN+data → "+to, ActSpec{Sock: tfo, Dst: to})
			return nil
		}}
}

// --- abstract Unix sockets ---------------------------------------------------

// unixEnforced asks node's agent whether its LSM programs are attached.
func (e *Env) unixEnforced(node testbed.Node) (bool, error) {
	var st struct {
		Unix bool `json:"unix_enforced"`
	}
	err := e.status(node, &st)
	return st.Unix, err
}

// status decodes node's `palisade status --json` into v. Exit status 1 is
// "enforcing with warnings": the JSON is complete.
func (e *Env) status(node testbed.Node, v any) error {
	cmd := exec.CommandContext(e.Ctx, "nsenter", "--net=/run/netns/"+node.NetNS, "--uts="+node.UTS, "--",
		e.TB.Binary, "status", "--json", "--config", e.TB.ConfigPath(node.Name))
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); err != nil && !(ok && ee.ExitCode() == 1) {
		return fmt.Errorf("status on %s: %v", node.Name, err)
	}
	if err := json.Unmarshal(out, v); err != nil {
		return fmt.Errorf("status on %s: %v", node.Name, err)
	}
	return nil
}

// waitListed waits until node's agent lists every address of addrs in its
// local-address map (its acknowledgement of a new address), or fails after
// 10 s.
func (e *Env) waitListed(node testbed.Node, addrs ...netip.Addr) error {
	var st struct {
		PinDir string `json:"pin_dir"`
	}
	if err := e.status(node, &st); err != nil {
		return err
	}
	if st.PinDir == "" {
		return fmt.Errorf("status on %s: no pin directory", node.Name)
	}
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		missing := 0
		for _, a := range addrs {
			if ok, err := kernel.ListsLocalAddr(st.PinDir, a); err != nil {
				return err
			} else if !ok {
				missing++
			}
		}
		if missing == 0 {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("the agent on %s does not list %v after 10 s", node.Name, addrs)
		}
	}
}

func abstractUnix(proto string) *Case {
	return &Case{Name: "abstract-" + proto, Class: "unix",
		Why: "bob connects to alice's abstract Unix socket on the same node (no file permissions guard abstract names)",
		Run: func(e *Env, r *Run) error {
			ok, err := e.unixEnforced(e.A)
			if err != nil {
				return err
			}
			if !ok {
				r.NA = "needs bpf LSM: the agent on " + e.A.Name + " cannot attach LSM programs on this kernel (abstract Unix sockets are NOT isolated here; proven in the VM)"
				return nil
			}
			name := fmt.Sprintf("palatk-%d-%s", e.Port, proto)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: proto, Bind: name}}, e.A.Name, proto+" → @"+name,
				ActSpec{Sock: Sock{Proto: proto}, Dst: name})
		}}
}
