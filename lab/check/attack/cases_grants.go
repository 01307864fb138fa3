package attack

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Cases of user grants (issue 23, `palisade share`): a grant is made only
// by the listener's owner, and only ever admits to the owner's socket.
func casesGrants() []*Case {
	return []*Case{grantForged(), grantOutlivesSocket()}
}

// palisade runs the palisade CLI as user on node with the node's
// configuration.
func (e *Env) palisade(node, user string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(e.Ctx, 20*time.Second)
	defer cancel()
	argv := append(append([]string{e.TB.Binary}, args...), "--config", e.TB.ConfigPath(node))
	return e.TB.Output(ctx, node, asUser(user), argv...)
}

func grantForged() *Case {
	return &Case{Name: "grant-forged", Class: "user-grants",
		Why: "bob runs palisade share on alice's port (on her node, and from his own through --node) to let himself in: the agent must refuse (bob holds no listener there) and the kernel change nothing",
		Run: func(e *Env, r *Run) error {
			port := itoa(e.Port)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			r.Defer(func() { e.palisade(e.A.Name, "", "unshare", port) })
			for _, try := range []struct{ node, via string }{{e.A.Name, ""}, {e.B.Name, e.A.Name}} {
				args := []string{"share", port, "--with", Attacker}
				if try.via != "" {
					args = append(args, "--node", try.via)
				}
				out, err := e.palisade(try.node, Attacker, args...)
				if err == nil || !strings.Contains(out, "you hold no TCP listener") {
					r.Note("bob's palisade %s on %s was not refused as expected: %v %s", strings.Join(args, " "), try.node, err, strings.TrimSpace(out))
				}
			}
			if out, _ := e.palisade(e.A.Name, "", "share", "--list"); !strings.Contains(out, "no grants") {
				r.Note("grants on %s after bob's attempts: %s", e.A.Name, out)
			}
			to := ap(e.A.Eth0V4, e.Port)
			r.Attack(e, s, e.B.Name, Attacker, "tcp → "+to+" after bob's share of alice's port", ActSpec{Sock: sock("tcp", 4), Dst: to})
			// Control: alice's own grant lets bob in on the same path.
			if out, err := e.palisade(e.A.Name, Victim, "share", port, "--with", Attacker, "--for", "5m"); err != nil {
				return fmt.Errorf("alice's share: %v %s", err, out)
			}
			r.Control(e, s, e.B.Name, Attacker, "tcp → "+to+" with alice's grant", ActSpec{Sock: sock("tcp", 4), Dst: to})
			return nil
		}}
}

func grantOutlivesSocket() *Case {
	return &Case{Name: "grant-outlives-socket", Class: "user-grants",
		Why: "alice shares her port with carol and closes the socket; bob binds the port: alice's grant, still held (alice keeps a listener on ::1), must not let carol reach bob's socket",
		Run: func(e *Env, r *Run) error {
			port := itoa(e.Port)
			to := ap(e.A.Eth0V4, e.Port)
			alice, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			// alice keeps the port on ::1: the agent keeps her grant, and
			// only the kernel's keying on the owner stands between carol
			// and bob.
			if _, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 6, Bind: ap(lo(6), e.Port)}}); err != nil {
				return err
			}
			r.Defer(func() { e.palisade(e.A.Name, "", "unshare", port) })
			if out, err := e.palisade(e.A.Name, Victim, "share", port, "--with", "carol", "--for", "5m"); err != nil {
				return fmt.Errorf("alice's share: %v %s", err, out)
			}
			ctl := r.Control(e, alice, e.B.Name, "carol", "tcp → "+to+" (alice's socket, her grant)", ActSpec{Sock: sock("tcp", 4), Dst: to})
			alice.Got(ctl.Nonce, controlWait) // arrived (or never will) before the socket closes
			alice.stop()
			bob, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
			if err != nil {
				return err
			}
			if out, _ := e.palisade(e.A.Name, "", "share", "--list"); !strings.Contains(out, "carol") {
				r.Note("alice's grant is no longer held (%s): the agent removed it, the kernel's keying is not what was tested", strings.TrimSpace(out))
			}
			r.Attack(e, bob, e.B.Name, "carol", "tcp → "+to+" (bob's socket, alice's grant)", ActSpec{Sock: sock("tcp", 4), Dst: to})
			return nil
		}}
}
