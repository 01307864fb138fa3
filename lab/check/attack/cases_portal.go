package attack

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Cases of the portal delegation (issue 24, docs/portals.md): a proxy
// account opens connections as the users it authenticated. Each attack is
// a request the agent must refuse (or whose connection the victim's node
// must refuse); its control is the same request made legitimately. The
// portal is node B (cross-node) or A itself (local); the victim's listener
// is on A.
func casesPortal() []*Case {
	return []*Case{
		portalCrossUser(false), portalCrossUser(true),
		portalNonProxy(), portalForbiddenUser("root"), portalForbiddenUser("svc"),
		portalNoSession(), portalOtherSession(), portalSessionGone("expired"), portalSessionGone("ended"),
		portalSessionGone("holder-gone"),
	}
}

const portalProxy = testbed.PortalProxy

// portalCmd runs `palisade portal ARGS` as user on node.
func (e *Env) portalCmd(node, user string, stdin []byte, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(e.Ctx, 20*time.Second)
	defer cancel()
	cmd := e.TB.Command(ctx, node, asUser(user), append([]string{"palisade", "portal"}, args...)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// session registers user's session with the proxy on node (ended when the
// case ends).
func (e *Env) session(r *Run, node, user string, extra ...string) error {
	r.Defer(func() { e.portalCmd(node, user, nil, "end") })
	out, err := e.portalCmd(node, user, nil, append([]string{"session", "--proxy", portalProxy, "--ttl", "5m"}, extra...)...)
	if err != nil {
		return fmt.Errorf("%s's session on %s: %v: %s", user, node, err, out)
	}
	return nil
}

// delegate: proxy on node asks the agent for a connection as `as` to `to`
// and sends the step's nonce over it.
func (r *Run) delegate(e *Env, attack bool, s *Sink, node, proxy, as, to, desc string) *Step {
	st := &Step{Sink: s, Node: node, User: proxy, Desc: desc, Nonce: newNonce()}
	if attack {
		r.Attacks = append(r.Attacks, st)
	} else {
		r.Controls = append(r.Controls, st)
	}
	out, err := e.portalCmd(node, proxy, Payload(st.Nonce), "connect", "--user", as, to)
	st.Res = ActResult{OK: err == nil}
	if err != nil {
		st.Res.Error = lastLine(out)
	}
	return st
}

// portalVictim starts alice's TCP listener on A and returns it and the
// address the portal (on node) connects to.
func (e *Env) portalVictim(r *Run, local bool) (*Sink, string, string, error) {
	s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port)}})
	if err != nil {
		return nil, "", "", err
	}
	node, dst := e.path(local, 4)
	return s, node, ap(dst, e.Port), nil
}

// The isolation claim itself: bob, logged in to the portal as himself (a
// session of his own), asks for alice's node and port; the connection is
// his, and alice's node refuses it.
func portalCrossUser(local bool) *Case {
	return &Case{Name: "portal-cross-user-" + where(local), Class: "portal",
		Why: "the portal proxy, acting for bob (who has a session), connects to alice's listener: the connection is bob's and is refused; the same for alice is delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, local)
			if err != nil {
				return err
			}
			if err := e.session(r, node, Attacker); err != nil {
				return err
			}
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, true, s, node, portalProxy, Attacker, to, "proxy as bob → alice's "+to)
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice → alice's "+to)
			return nil
		}}
}

// A user who is not a proxy asks for a connection as another user (the
// agent knows the asker from SO_PEERCRED, which the kernel fills at
// connect and the asker cannot choose).
func portalNonProxy() *Case {
	return &Case{Name: "portal-forged-delegation-non-proxy", Class: "portal",
		Why: "bob (not a [portal] proxy) asks the agent for a connection as alice, who has a session: refused; the proxy's same request is delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, true, s, node, Attacker, Victim, to, "bob asks for a connection as alice → "+to)
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice → "+to)
			return nil
		}}
}

// The proxy asks to act as root or as an exempt account (svc): either
// would reach every listener.
func portalForbiddenUser(as string) *Case {
	return &Case{Name: "portal-delegation-to-" + as, Class: "portal",
		Why: "the proxy asks for a connection as " + as + " (exempt: it would reach alice's listener): refused; as alice it is delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			if as != "root" {
				// Even a session of the exempt account's own does not help.
				if out, err := e.portalCmd(node, as, nil, "session", "--proxy", portalProxy); err == nil {
					r.Defer(func() { e.portalCmd(node, as, nil, "end") })
					r.Note("%s registered a session: %s", as, out)
				}
			}
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, true, s, node, portalProxy, as, to, "proxy as "+as+" → alice's "+to)
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice → "+to)
			return nil
		}}
}

// The proxy acts for a user who never came through the portal.
func portalNoSession() *Case {
	return &Case{Name: "portal-no-session", Class: "portal",
		Why: "the proxy asks for a connection as alice, who has no session: refused; once her own process registered one, the same request is delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			e.portalCmd(node, Victim, nil, "end")
			r.delegate(e, true, s, node, portalProxy, Victim, to, "proxy as alice (no session) → "+to)
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice (session) → "+to)
			return nil
		}}
}

// A session of bob's does not let the proxy act for alice.
func portalOtherSession() *Case {
	return &Case{Name: "portal-session-of-another-user", Class: "portal",
		Why: "bob has a session, alice has none: the proxy asking as alice is refused; once alice has hers, delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			e.portalCmd(node, Victim, nil, "end")
			if err := e.session(r, node, Attacker); err != nil {
				return err
			}
			r.delegate(e, true, s, node, portalProxy, Victim, to, "proxy as alice (only bob has a session) → "+to)
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice (her session) → "+to)
			return nil
		}}
}

// A session that expired, was ended (logout), or whose holder is gone no
// longer serves.
func portalSessionGone(how string) *Case {
	return &Case{Name: "portal-session-" + how, Class: "portal",
		Why: map[string]string{"expired": "alice's session expired (ttl 1s)", "ended": "alice ended her session (logout)",
			"holder-gone": "the process holding alice's session (--hold) ended"}[how] + ": the proxy asking as alice is refused; with a live session the same request is delivered",
		Run: func(e *Env, r *Run) error {
			s, node, to, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			r.Defer(func() { e.portalCmd(node, Victim, nil, "end") })
			switch how {
			case "expired":
				if out, err := e.portalCmd(node, Victim, nil, "session", "--proxy", portalProxy, "--ttl", "1s"); err != nil {
					return fmt.Errorf("session: %v: %s", err, out)
				}
				// The agent's own list is the acknowledgement that it expired.
				if err := e.waitNoSession(node); err != nil {
					return err
				}
			case "ended":
				if err := e.session(r, node, Victim); err != nil {
					return err
				}
				if out, err := e.portalCmd(node, Victim, nil, "end"); err != nil || !strings.Contains(out, "1 session") {
					return fmt.Errorf("end: %v: %s", err, out)
				}
			case "holder-gone":
				ctx, cancel := context.WithCancel(e.Ctx)
				cmd := e.TB.Command(ctx, node, Victim, "palisade", "portal", "session", "--proxy", portalProxy, "--hold")
				out, err := cmd.StdoutPipe()
				if err != nil {
					cancel()
					return err
				}
				if err := cmd.Start(); err != nil {
					cancel()
					return err
				}
				line := make([]byte, 256)
				n, _ := out.Read(line) // "session ... held": in place
				if !strings.Contains(string(line[:n]), "held") {
					cancel()
					cmd.Wait()
					return fmt.Errorf("held session not in place: %q", line[:n])
				}
				cancel() // the holder ends: so does the session
				cmd.Wait()
				if err := e.waitNoSession(node); err != nil {
					return err
				}
			}
			r.delegate(e, true, s, node, portalProxy, Victim, to, "proxy as alice (session "+how+") → "+to)
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			r.delegate(e, false, s, node, portalProxy, Victim, to, "proxy as alice (live session) → "+to)
			return nil
		}}
}

// waitNoSession waits until the agent on node lists no session of alice's.
func (e *Env) waitNoSession(node string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		out, err := e.portalCmd(node, Victim, nil, "sessions")
		if err == nil && !strings.Contains(out, Victim+" ") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("alice's session still listed after 15 s: %v: %s", err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
