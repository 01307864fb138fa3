package attack

import (
	"errors"
	"fmt"
	"net/netip"
)

// Cases found by attacking data plane v2 (redteam): what the first suite
// did not try. Each has the attack and the rightful user's traffic on the
// same path as its control.
func casesV2() []*Case {
	return []*Case{
		replyUnstamped("ipopts", true, 4), replyUnstamped("ipopts", false, 4),
		replyUnstamped("fragment", false, 4), replyUnstamped("fragment", false, 6),
		replySpoofedV6(), replyOutside(4), replyOutside(6),
		mptcpNoBind(true, 4), mptcpNoBind(false, 4), mptcpNoBind(false, 6),
		coBindMapped(), coBindUDPLite(),
		mcastLoopCredited(), mcastLoopFirst(),
	}
}

// nopOptions is an IPv4 option list any user may set (IP_OPTIONS): four
// NOPs. A packet with options is not stamped.
const nopOptions = "01010101"

// bigDatagram is larger than the testbed's MTU (1500): the datagram is
// fragmented and therefore sent without a stamp.
const bigDatagram = 1600

// --- UDP replies without a stamp ----------------------------------------------

func replyUnstamped(how string, local bool, fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-reply-unstamped-%s-%s-v%d", how, where(local), fam), Class: "udp-reply",
		Why: "alice's UDP socket sent to bob's port R (a service address bob holds); bob answers from R with an unstamped datagram (" + how +
			"): an identity-less reply skips the reverse check that refuses bob's stamped one",
		Run: func(e *Env, r *Run) error {
			node, peer, dst := e.B.Name, eth(e.B, fam), eth(e.A, fam)
			if local {
				node, peer, dst = e.A.Name, lo(fam), lo(fam)
			}
			pr, pc := e.Port+1, e.Port+2
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.Port)},
				SendFirst: []string{ap(peer, pr), ap(peer, pc)}})
			if err != nil {
				return err
			}
			to := ap(dst, e.Port)
			from := Sock{Proto: "udp", Family: fam, Bind: ap(peer, pr)}
			r.Attack(e, s, node, Attacker, "udp "+from.Bind+" → "+to+" (stamped: baseline)", ActSpec{Sock: from, Dst: to, Count: 3})
			un := ActSpec{Sock: from, Dst: to, Count: 3}
			switch how {
			case "ipopts":
				un.Sock.IPOptions = nopOptions
			case "fragment":
				un.Size = bigDatagram
			}
			r.Attack(e, s, node, Attacker, "udp "+from.Bind+" → "+to+" unstamped ("+how+")", un)
			ctl := ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(peer, pc)}, Dst: to, Count: 3}
			r.Control(e, s, node, Victim, "udp "+ctl.Sock.Bind+" → "+to, ctl)
			return nil
		}}
}

func replySpoofedV6() *Case {
	return &Case{Name: "udp-reply-spoofed-source-cross-v6", Class: "udp-reply",
		Why: "alice's UDP socket sent to a cluster address S:R (a node that is down); bob on B binds S with IP_FREEBIND (unprivileged) and sends from S:R — IPv6 lets him use any source — unstamped (fragmented)",
		Run: func(e *Env, r *Run) error {
			spoofed := ap(netip.MustParseAddr("2001:2::77"), e.Port+1)
			pc := ap(e.B.Eth0V6, e.Port+2)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: ap(wild(6), e.Port)},
				SendFirst: []string{spoofed, pc}})
			if err != nil {
				return err
			}
			to := ap(e.A.Eth0V6, e.Port)
			from := Sock{Proto: "udp", Family: 6, Bind: spoofed, FreeBind: true}
			r.Attack(e, s, e.B.Name, Attacker, "udp "+spoofed+" (spoofed) → "+to+" (stamped)", ActSpec{Sock: from, Dst: to, Count: 3})
			r.Attack(e, s, e.B.Name, Attacker, "udp "+spoofed+" (spoofed) → "+to+" unstamped (fragment)",
				ActSpec{Sock: from, Dst: to, Count: 3, Size: bigDatagram})
			// The kernel checks IP_FREEBIND at bind time only: cleared
			// again, the socket keeps sending from the foreign address.
			off := from
			off.FreeBindOff = true
			r.Attack(e, s, e.B.Name, Attacker, "udp "+spoofed+" (spoofed, IP_FREEBIND cleared after bind) → "+to+" unstamped (fragment)",
				ActSpec{Sock: off, Dst: to, Count: 3, Size: bigDatagram})
			ctl := ActSpec{Sock: Sock{Proto: "udp", Family: 6, Bind: pc}, Dst: to, Count: 3}
			r.Control(e, s, e.B.Name, Victim, "udp "+pc+" → "+to, ctl)
			return nil
		}}
}

func replyOutside(fam int) *Case {
	return &Case{Name: fmt.Sprintf("spoof-outside-udp-reply-v%d", fam), Class: "spoofing",
		Why: "alice's UDP socket on A sent to a service on B, port R; root on the outside host sends datagrams with source B:R and no stamp to alice's port (guessing it is cheap: one ephemeral range)",
		Run: func(e *Env, r *Run) error {
			peer := ap(eth(e.B, fam), e.Port+1)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.Port)},
				SendFirst: []string{peer}})
			if err != nil {
				return err
			}
			rs, err := e.Sink(r, e.A.Name, "root", SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.sysPort())}})
			if err != nil {
				return err
			}
			spec := ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: peer}, Raw: true, Dst: ap(eth(e.A, fam), e.Port), Count: 3}
			r.Attack(e, s, e.Outside.Name, "root", "raw udp "+peer+" (no stamp) → "+spec.Dst, spec)
			ctl := spec
			ctl.Dst = ap(eth(e.A, fam), e.sysPort())
			r.Control(e, rs, e.Outside.Name, "root", "raw udp "+peer+" → root's system port "+ctl.Dst, ctl)
			return nil
		}}
}

// --- MPTCP listener without bind ------------------------------------------------

func mptcpNoBind(local bool, fam int) *Case {
	return &Case{Name: fmt.Sprintf("mptcp-listen-nobind-%s-v%d", where(local), fam), Class: "other-protocols",
		Why: "alice's MPTCP socket listens without bind() (an ephemeral port): the kernel creates its listening subflow itself and no bind hook runs, so it may have no owner",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "mptcp", Family: fam}})
			var se *SinkError
			if errors.As(err, &se) && (se.Errno == "EPROTONOSUPPORT" || se.Errno == "ENOPROTOOPT") {
				r.NA = "the kernel has no MPTCP (" + se.Errno + ")"
				return nil
			}
			if err != nil {
				return err
			}
			bound, err := netip.ParseAddrPort(s.Addr)
			if err != nil {
				return fmt.Errorf("sink address %q: %v", s.Addr, err)
			}
			node, dst := e.path(local, fam)
			if local {
				dst = lo(fam)
			}
			to := ap(dst, int(bound.Port()))
			for _, p := range []string{"tcp", "mptcp"} {
				spec := ActSpec{Sock: sock(p, fam), Dst: to}
				r.Attack(e, s, node, Attacker, p+" → "+to, spec)
				r.Control(e, s, node, Victim, p+" → "+to, spec)
			}
			return nil
		}}
}

// --- co-binding another user's UDP port -----------------------------------------

func coBindMapped() *Case {
	return &Case{Name: "reuseaddr-cobind-v4mapped-cross", Class: "port-reuse",
		Why: "alice's UDP service listens on 0.0.0.0:P with SO_REUSEADDR; bob co-binds P with an IPv6 dual-stack socket on ::ffff:<A's address> (bind6, where the IPv4 socket is not looked up): his socket wins alice's unicast",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true}})
			if err != nil {
				return err
			}
			mapped := ap(netip.AddrFrom16(e.A.Eth0V4.As16()), p)
			if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "udp", Family: 6, Dual: true, Bind: mapped, ReuseAddr: true}}); err != nil {
				var se *SinkError
				if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EACCES") {
					return err
				}
				r.Note("bob's co-bind of %s refused: %v", mapped, err)
			} else {
				r.Note("bob co-bound %s", mapped)
			}
			spec := ActSpec{Sock: sock("udp", 4), Dst: ap(e.A.Eth0V4, p), Count: 3}
			r.Attack(e, s, e.B.Name, Attacker, "udp → "+spec.Dst, spec)
			r.Control(e, s, e.B.Name, Victim, "udp → "+spec.Dst+" (alice's own datagrams to her service)", spec)
			return nil
		}}
}

func coBindUDPLite() *Case {
	return &Case{Name: "reuseaddr-cobind-udplite-cross-v4", Class: "port-reuse",
		Why: "alice's UDP-Lite service listens on 0.0.0.0:P; bob co-binds A's address, port P with SO_REUSEADDR (no lookup helper searches the UDP-Lite table): his socket would win alice's unicast. Users' UDP-Lite sockets may not set SO_REUSEADDR at bind (uw_bind4/6), so alice's socket cannot share its port either",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udplite", Family: 4, Bind: ap(wild(4), p)}})
			var se *SinkError
			if errors.As(err, &se) && (se.Errno == "EPROTONOSUPPORT" || se.Errno == "ESOCKTNOSUPPORT") {
				r.NA = "the kernel has no UDP-Lite (" + se.Errno + ")"
				return nil
			}
			if err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "udplite", Family: 4, Bind: ap(e.A.Eth0V4, p), ReuseAddr: true}}); err != nil {
				if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EACCES") {
					return err
				}
				r.Note("bob's co-bind refused: %v", err)
			} else {
				r.Note("bob co-bound %s", ap(e.A.Eth0V4, p))
			}
			spec := ActSpec{Sock: sock("udplite", 4), Dst: ap(e.A.Eth0V4, p), Count: 3}
			r.Attack(e, s, e.B.Name, Attacker, "udplite → "+spec.Dst, spec)
			r.Control(e, s, e.B.Name, Victim, "udplite → "+spec.Dst+" (alice's own datagrams to her service)", spec)
			return nil
		}}
}

// --- multicast looped back on the node ---------------------------------------------

func mcastLoopCredited() *Case {
	return &Case{Name: "mcast-loop-credited-cobound-local-v4", Class: "multicast",
		Why: "alice's multicast peer (0.0.0.0:P, SO_REUSEADDR) sends to 224.0.0.1:P every 200 ms; bob co-binds P on ::ffff:<A's address> and sends to the group: the looped copy is identified by its 4-tuple alone, noted from the previous datagram — alice's",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			group := "224.0.0.1:" + itoa(p)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true},
				Heartbeat: group})
			if err != nil {
				return err
			}
			mapped := ap(netip.AddrFrom16(e.A.Eth0V4.As16()), p)
			to := "[::ffff:224.0.0.1]:" + itoa(p)
			for i := 0; i < 3; i++ {
				r.Attack(e, s, e.A.Name, Attacker, "udp "+mapped+" (co-bound) → "+to,
					ActSpec{Sock: Sock{Proto: "udp", Family: 6, Dual: true, Bind: mapped, ReuseAddr: true}, Dst: to})
			}
			r.Attack(e, s, e.A.Name, Attacker, "udp (own port) → "+group, ActSpec{Sock: sock("udp", 4), Dst: group, Count: 3})
			r.Control(e, s, e.A.Name, Victim, "udp → "+group, ActSpec{Sock: sock("udp", 4), Dst: group, Count: 3})
			return nil
		}}
}

func mcastLoopFirst() *Case {
	return &Case{Name: "mcast-loop-first-datagram-local-v4", Class: "multicast",
		Why: "a node's own multicast reaches its own listeners: alice sends ONE datagram to 224.0.0.1:P from a new socket (the looped IPv4 copy is delivered before the cgroup egress program notes its sender); bob's single datagram is the attack",
		Run: func(e *Env, r *Run) error {
			group := "224.0.0.1:" + itoa(e.Port)
			return simple(e, r, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port)}}, e.A.Name, "udp (1 datagram) → "+group,
				ActSpec{Sock: sock("udp", 4), Dst: group, Count: 1})
		}}
}
