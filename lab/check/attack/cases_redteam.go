package attack

import (
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Cases of the redteam pass on round 3.
func casesRedteam() []*Case {
	return []*Case{coBindDualWild(), revokedClaimFirstContact()}
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
			if known, err := userwall.KnowsUser(pinA, outsiderID); err != nil {
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
			if known, err := userwall.KnowsUser(pinA, outsiderID); err != nil || known {
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
