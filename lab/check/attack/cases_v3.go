package attack

import (
	"fmt"
	"net/netip"

	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
)

// Cases of round 3 (issue 20): identity is what the kernel acts with.
func casesV3() []*Case {
	var cs []*Case
	for _, proto := range []string{"tcp", "udp"} {
		for _, local := range []bool{true, false} {
			cs = append(cs, deputy("seteuid", proto, local))
		}
	}
	cs = append(cs, deputy("setuid-root", "tcp", false), deputy("saved-uid", "udp", false))
	cs = append(cs, loopSpecific("bcast"), loopSpecific("allhosts"), loopSpecific("allnodes"))
	cs = append(cs, predatesAgent(true, 4), predatesAgent(false, 4), predatesAgent(false, 6))
	cs = append(cs, slurmDeputy())
	return cs
}

// deputyCreds are the ids of a root process acting for uid: how slurmstepd
// opens a step's I/O connection (seteuid), how a set-uid-root program run by
// uid looks (real uid the user, effective root), or a daemon half-way
// through dropping privileges (real and effective root, saved the user:
// every uid but one exempt).
func deputyCreds(kind string, uid int) *Creds {
	switch kind {
	case "setuid-root":
		return &Creds{RUID: uid, EUID: 0, SUID: 0, GID: uid}
	case "saved-uid":
		return &Creds{RUID: 0, EUID: 0, SUID: uid, GID: uid}
	}
	return &Creds{RUID: 0, EUID: uid, SUID: 0, GID: uid}
}

func deputy(kind, proto string, local bool) *Case {
	return &Case{Name: fmt.Sprintf("deputy-%s-%s-%s", kind, proto, where(local)), Class: "identity",
		Why: "a root process acting for bob (" + kind + ": slurmstepd calls back to the port bob's srun names after seteuid(bob)) connects to alice's listener: it must count as bob, not as root",
		Run: func(e *Env, r *Run) error {
			node, dst := e.path(local, 4)
			if local {
				dst = lo(4)
			}
			sink := SinkSpec{Sock: Sock{Proto: proto, Family: 4, Bind: ap(wild(4), e.Port)}}
			s, err := e.Sink(r, e.A.Name, Victim, sink)
			if err != nil {
				return err
			}
			to := ap(dst, e.Port)
			att := ActSpec{Sock: sock(proto, 4), Dst: to, Creds: deputyCreds(kind, attackerUID)}
			ctl := ActSpec{Sock: sock(proto, 4), Dst: to, Creds: deputyCreds(kind, victimUID)}
			r.Attack(e, s, node, "root", proto+" as root acting for bob ("+kind+") → "+to, att)
			r.Control(e, s, node, "root", proto+" as root acting for alice ("+kind+") → "+to, ctl)
			return nil
		}}
}

// loopSpecific: the sender of a looped multicast/broadcast copy was found by
// a lookup on its source address and port, which returns the best receiving
// socket — alice's socket bound to the specific address — not bob's wildcard
// socket that sent it.
func loopSpecific(kind string) *Case {
	fam := 4
	if kind == "allnodes" {
		fam = 6
	}
	return &Case{Name: "mcast-loop-specific-holder-" + kind + "-local-v" + itoa(fam), Class: "multicast",
		Why: "alice holds a UDP socket bound to A's own address, port Q, with SO_REUSEADDR; bob co-binds the wildcard on Q and sends to " + kind + " on port P: the looped copy's source (A's address, Q) names alice's socket, so a receive-side lookup credits alice",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			holder, group := ap(e.A.Eth0V4, q), ap(netip.MustParseAddr("198.18.0.255"), p)
			switch kind {
			case "allhosts":
				group = ap(netip.MustParseAddr("224.0.0.1"), p)
			case "allnodes":
				ll, err := e.LinkLocal(e.A.Name)
				if err != nil {
					return err
				}
				holder, group = ap(ll, q), ap(netip.MustParseAddr("ff02::1").WithZone("eth0"), p)
			}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), p)}})
			if err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: holder, ReuseAddr: true}}); err != nil {
				return err
			}
			send := Sock{Proto: "udp", Family: fam, Broadcast: fam == 4, MulticastIf: "eth0"}
			att := send
			att.Bind, att.ReuseAddr = ap(wild(fam), q), true
			r.Attack(e, s, e.A.Name, Attacker, "udp from *:"+itoa(q)+" (co-bound) → "+group, ActSpec{Sock: att, Dst: group, Count: 3})
			r.Control(e, s, e.A.Name, Victim, "udp → "+group, ActSpec{Sock: send, Dst: group, Count: 3})
			return nil
		}}
}

// predatesAgent: a datagram socket created while no agent ran and bound
// later by sendto (autobind fires no bind hook; the iterator sees only
// bound sockets) had no owner record, and a socket without one was open to
// everyone.
func predatesAgent(local bool, fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-socket-predates-agent-%s-v%d", where(local), fam), Class: "missing-state",
		Why: "alice's UDP socket was created while A had no agent (first deployment, an uninstall, an upgrade that changed the owner map's layout) and bound by its first sendto after the agent started: it has no owner record",
		Run: func(e *Env, r *Run) error {
			r.Defer(func() { e.restoreAgent(e.A) })
			if err := uwlab.StopAgent(e.Ctx, e.TB, e.A); err != nil {
				return err
			}
			spec := SinkSpec{Sock: sock("udp", fam), SendFirst: []string{ap(eth(e.B, fam), e.Port+5)}}
			s, err := e.SinkGated(r, e.A.Name, Victim, spec, func() error { return uwlab.StartAgent(e.Ctx, e.TB, e.A) })
			if err != nil {
				return err
			}
			bound, err := netip.ParseAddrPort(s.Addr)
			if err != nil {
				return fmt.Errorf("sink address %q: %v", s.Addr, err)
			}
			node, dst := e.path(local, fam)
			to := ap(dst, int(bound.Port()))
			act := ActSpec{Sock: sock("udp", fam), Dst: to, Count: 3}
			r.Attack(e, s, node, Attacker, "udp → "+to+" (a socket older than the agent)", act)
			r.Control(e, s, node, Victim, "udp → "+to, act)
			return nil
		}}
}
