package attack

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Cases of the redteam pass on round 3.
func casesRedteam() []*Case {
	return []*Case{coBindDualWild(), revokedClaimFirstContact(),
		predatesAgentFailedSend("noaddr", false, 4), predatesAgentFailedSend("port0", true, 6),
		groupNearMTU("bcast"), groupNearMTU("allhosts"), groupNearMTU("allnodes"), groupNearMTU("linklocal")}
}

// coBindDualWild: bind6 looked up only the IPv6 table, so an IPv6 socket on
// [::] that takes IPv4 too (IPV6_V6ONLY=0) co-bound alice's IPv4 wildcard
// port (both with SO_REUSEADDR). The kernel scores alice's IPv4 socket 2
// and bob's 1, plus 1 for a socket whose SO_INCOMING_CPU is the receiving
// CPU: with one such socket per CPU bob ties, and the socket bound last
// comes first — bob's took every unicast datagram to alice's service
// (under sg of a group alice is in, he read them and answered for her).
func coBindDualWild() *Case {
	return &Case{Name: "reuseaddr-cobind-dualstack-wild-cross", Class: "port-reuse",
		Why: "alice's UDP service listens on 0.0.0.0:P with SO_REUSEADDR; bob co-binds [::]:P with dual-stack IPv6 sockets, one per CPU with SO_INCOMING_CPU: his sockets win alice's unicast",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true}})
			if err != nil {
				return err
			}
			for cpu := 1; cpu <= runtime.NumCPU(); cpu++ {
				att := Sock{Proto: "udp", Family: 6, Dual: true, Bind: ap(wild(6), p), ReuseAddr: true, IncomingCPU: cpu}
				if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: att}); err != nil {
					var se *SinkError
					if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EACCES") {
						return err
					}
					r.Note("bob's co-bind of [::]:%d refused: %v", p, err)
					break
				}
				r.Note("bob co-bound [::]:%d (incoming CPU %d)", p, cpu-1)
			}
			spec := ActSpec{Sock: sock("udp", 4), Dst: ap(e.A.Eth0V4, p), Count: 3}
			r.Attack(e, s, e.B.Name, Attacker, "udp → "+spec.Dst, spec)
			r.Control(e, s, e.B.Name, Victim, "udp → "+spec.Dst+" (alice's own datagrams to her service)", spec)
			return nil
		}}
}

// Users of the testbed's project group (testbed.ProjectGroup: alice, bob)
// and one outside it.
const (
	projectGID = testbed.ProjectGID
	outsiderID = 2003 // carol: never in proj1
)

// revokedClaimFirstContact: a carried gid is a claim the receiving node
// checks against membership only once it has looked the connector up; until
// then the gid counted. A user removed from a group whose process kept the
// group's gid (sg proj1 started before the removal) got his first
// connections to every node that had not looked him up through on it. The
// sending node knows its own users: it now seals a gid only if the user is
// a member of it now. carol's process on B runs with proj1's gid without
// being a member — the kernel state of a live process whose user left
// proj1 (lab/directory's revocation-first-contact does it with a real
// directory); A's agent has never looked carol up (it is restarted if it
// has). The control is bob, a member, with the same gid.
func revokedClaimFirstContact() *Case {
	return &Case{Name: "revoked-claim-first-contact-cross", Class: "identity",
		Why: "carol's live process on B kept proj1's gid after she left proj1 (B knows she is not a member); alice's proj1 services on A, whose agent has not looked carol up, must not take the gid on her word",
		Run: func(e *Env, r *Run) error {
			pinA, err := uwlab.NodePinDir(e.TB, e.A.Name)
			if err != nil {
				return err
			}
			if known, err := kernel.KnowsUser(pinA, outsiderID); err != nil {
				return err
			} else if known {
				// An earlier case or run made A look carol up: a new
				// agent knows only the users running on A.
				r.Note("%s knew carol: its agent restarted", e.A.Name)
				if err := e.restartAgent(e.A, syscall.SIGTERM); err != nil {
					return err
				}
				if err := uwlab.WaitKnown(e.Ctx, e.TB, e.A.Name, outsiderID, false, 5*time.Second); err != nil {
					return err
				}
			}
			proj := func(uid int) *Creds { return &Creds{RUID: uid, EUID: uid, SUID: uid, GID: projectGID} }
			tcp, err := e.Sink(r, e.A.Name, "root", SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}, Creds: proj(victimUID)})
			if err != nil {
				return err
			}
			udp, err := e.Sink(r, e.A.Name, "root", SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port+1)}, Creds: proj(victimUID)})
			if err != nil {
				return err
			}
			if tcp.Spec.Creds == nil || udp.Spec.Creds == nil {
				return fmt.Errorf("alice's sinks lost their gid")
			}
			// carol's long-lived process on B (her "sg proj1" shell): B
			// looks her up while it runs.
			if _, err := e.Sink(r, e.B.Name, "root", SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), e.Port+2)}, Creds: proj(outsiderID)}); err != nil {
				return err
			}
			if err := uwlab.WaitKnown(e.Ctx, e.TB, e.B.Name, outsiderID, true, 10*time.Second); err != nil {
				return err
			}
			if known, err := kernel.KnowsUser(pinA, outsiderID); err != nil || known {
				return fmt.Errorf("%s looked carol up before her first connection (%v): the case cannot show first contact", e.A.Name, err)
			}
			// bob's gid is vouched for by B, and A counts it either way.
			if err := uwlab.WaitMembers(e.Ctx, e.TB, e.A.Name, []uwlab.MemberPair{{UID: attackerUID, GID: projectGID}}, 10*time.Second); err != nil {
				return err
			}
			for _, s := range []*Sink{tcp, udp} {
				to := ap(e.A.Eth0V4, e.Port)
				if s == udp {
					to = ap(e.A.Eth0V4, e.Port+1)
				}
				pr := s.Spec.Proto
				r.Attack(e, s, e.B.Name, "root", pr+" as carol with proj1's gid (not a member) → "+to,
					ActSpec{Sock: sock(pr, 4), Dst: to, Count: 3, Creds: proj(outsiderID)})
				r.Control(e, s, e.B.Name, "root", pr+" as bob with proj1's gid (a member) → "+to,
					ActSpec{Sock: sock(pr, 4), Dst: to, Count: 3, Creds: proj(attackerUID)})
			}
			return nil
		}}
}

// predatesAgentFailedSend: a datagram socket older than the agent got its
// owner at the connect/sendmsg hook that binds it — but inet_sendmsg
// autobinds before udp_sendmsg, which returns several errors (no
// destination, port 0, a datagram over 64 KiB, MSG_OOB) before its cgroup
// hook runs: the socket was bound without a record and received everyone's
// datagrams. Now a socket without a record is decided at delivery with the
// kernel's own record of its owner (adopt_at_delivery).
func predatesAgentFailedSend(how string, local bool, fam int) *Case {
	return &Case{Name: "udp-socket-predates-agent-failed-send-" + how + "-" + where(local) + "-v" + itoa(fam), Class: "missing-state",
		Why: "alice's UDP socket was created while A had no agent and bound by a send that failed (" + how + ") after the agent started: autobind ran, the sendmsg hook did not, so it has no owner record",
		Run: func(e *Env, r *Run) error {
			r.Defer(func() { e.restoreAgent(e.A) })
			if err := uwlab.StopAgent(e.Ctx, e.TB, e.A); err != nil {
				return err
			}
			spec := SinkSpec{Sock: sock("udp", fam), FailedSend: how}
			s, err := e.SinkGated(r, e.A.Name, Victim, spec, func() error { return uwlab.StartAgent(e.Ctx, e.TB, e.A) })
			if err != nil {
				return err
			}
			bound, err := netip.ParseAddrPort(s.Addr)
			if err != nil || bound.Port() == 0 {
				return fmt.Errorf("sink address %q (the failed send must have bound it): %v", s.Addr, err)
			}
			node, dst := e.path(local, fam)
			to := ap(dst, int(bound.Port()))
			act := ActSpec{Sock: sock("udp", fam), Dst: to, Count: 3}
			r.Attack(e, s, node, Attacker, "udp → "+to+" (a socket older than the agent, bound by a failed send)", act)
			r.Control(e, s, node, Victim, "udp → "+to, act)
			return nil
		}}
}

// groupNearMTU: the agent lowers the MTU of the cluster subnets' routes by
// the stamp's room, so a unicast datagram near the MTU (or fragmented) to
// another node is stamped. Broadcast (the local table's routes), multicast
// (224.0.0.0/24 takes no route at all) and IPv6 link-local (fe80::/64 is
// one route per interface) keep the device's MTU: a datagram within the
// room of it left unstamped and was refused by the receiver, without a
// word to the sender. Now it is refused at send with EPERM (rule
// unstampable), as a datagram with IP options is. The controls: alice's
// largest datagram that leaves the room reaches her listener on A, and her
// datagram one room larger gets EPERM at once; bob's get neither through.
func groupNearMTU(kind string) *Case {
	fam := 4
	if kind == "allnodes" || kind == "linklocal" {
		fam = 6
	}
	return &Case{Name: "group-near-mtu-" + kind + "-cross-v" + itoa(fam), Class: "false-deny",
		Why: "alice's datagram to " + kind + " within the stamp's room of the MTU must fail at send (EPERM), not vanish; one that leaves the room reaches her listener on A; bob's reach nothing",
		Run: func(e *Env, r *Run) error {
			p := e.Port
			dst := ap(netip.MustParseAddr("198.18.0.255"), p)
			switch kind {
			case "allhosts":
				dst = ap(netip.MustParseAddr("224.0.0.1"), p)
			case "allnodes":
				dst = ap(netip.MustParseAddr("ff02::1").WithZone("eth0"), p)
			case "linklocal":
				ll, err := e.LinkLocal(e.A.Name)
				if err != nil {
					return err
				}
				dst = ap(ll, p)
			}
			mtu, err := e.linkMTU(e.B.Name, "eth0")
			if err != nil {
				return err
			}
			// Payload sizes: the IP and UDP headers plus the stamp's room
			// fill the MTU exactly (fits), or the room is missing (big).
			hdr, room := 28, kernel.StampRoom4
			if fam == 6 {
				hdr, room = 48, kernel.StampRoom6
			}
			fit, big := mtu-hdr-room, mtu-hdr
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), p)}})
			if err != nil {
				return err
			}
			send := Sock{Proto: "udp", Family: fam, Broadcast: fam == 4, MulticastIf: "eth0"}
			r.Attack(e, s, e.B.Name, Attacker, fmt.Sprintf("udp %d bytes → %s", fit, dst), ActSpec{Sock: send, Dst: dst, Count: 3, Size: fit})
			r.Attack(e, s, e.B.Name, Attacker, fmt.Sprintf("udp %d bytes → %s", big, dst), ActSpec{Sock: send, Dst: dst, Count: 3, Size: big})
			r.Control(e, s, e.B.Name, Victim, fmt.Sprintf("udp %d bytes → %s", fit, dst), ActSpec{Sock: send, Dst: dst, Count: 3, Size: fit})
			res, err := e.Act(e.B.Name, Victim, ActSpec{Sock: send, Dst: dst, Count: 1, Size: big, Nonce: newNonce()})
			if err != nil {
				return err
			}
			r.Judged(false, e.B.Name, Victim, fmt.Sprintf("udp %d bytes → %s refused at send with EPERM", big, dst),
				!res.OK && res.Errno == "EPERM", fmt.Sprintf("send: ok=%v errno=%q", res.OK, res.Errno))
			return nil
		}}
}

// linkMTU is the MTU of dev on node.
func (e *Env) linkMTU(node, dev string) (int, error) {
	out, err := e.Root(node, "ip", "-o", "link", "show", "dev", dev)
	if err != nil {
		return 0, err
	}
	f := strings.Fields(out)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "mtu" {
			return strconv.Atoi(f[i+1])
		}
	}
	return 0, fmt.Errorf("%s: no MTU in %q", dev, out)
}
