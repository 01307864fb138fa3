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
		portalSessionGone("holder-gone"), portalFdReuse(),
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

// reuseScript, as the proxy: asks the agent (argv: socket, user, first
// target) for a connection as the user, sends the first line on it, then
// tries to make the descriptor it received carry a second connection —
// disconnect (connect AF_UNSPEC) and connect again to the second target, or
// bind and listen on it — and sends the second line there. It prints what
// each step did.
const reuseScript = `
import json, socket, sys, ctypes, struct
path, user, to1, to2, line1, line2 = sys.argv[1:7]
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(path)
c.sendall((json.dumps({"op": "connect", "user": user, "address": to1}) + "\n").encode())
msg, anc, _, _ = c.recvmsg(4096, socket.CMSG_SPACE(4))
fds = [struct.unpack("i", d[:4])[0] for (l, t, d) in anc if l == socket.SOL_SOCKET and t == socket.SCM_RIGHTS]
print("answer", msg.decode().strip(), "fds", len(fds), flush=True)
if not fds:
    sys.exit(0)
fd = fds[0]
s = socket.socket(fileno=fd)
print("family", s.family.name, flush=True)
s.sendall(line1.encode())
libc = ctypes.CDLL(None, use_errno=True)
unspec = struct.pack("H14x", 0)
print("disconnect", libc.connect(fd, unspec, len(unspec)), ctypes.get_errno(), flush=True)
h, p = to2.rsplit(":", 1)
sa = struct.pack("!HH4s8x", socket.AF_INET, int(p), socket.inet_aton(h))
sa = struct.pack("H", socket.AF_INET) + sa[2:]
rc = libc.connect(fd, sa, len(sa))
print("reconnect", rc, ctypes.get_errno(), flush=True)
if rc == 0:
    s.sendall(line2.encode())
    print("sent again", flush=True)
`

// portalFdReuse: the proxy must get one connection's worth, not alice's
// socket (redteam, session 7: with her TCP socket in hand it disconnected
// it and connected it again to her other listener after her session ended).
func portalFdReuse() *Case {
	return &Case{Name: "portal-delegated-socket-reuse", Class: "portal",
		Why: "the proxy, given a connection as alice, disconnects the descriptor (connect AF_UNSPEC) and connects it again to alice's second listener: the descriptor must be a relay of that one connection, not alice's socket; its first line reaches alice's first listener",
		Run: func(e *Env, r *Run) error {
			s1, node, to1, err := e.portalVictim(r, false)
			if err != nil {
				return err
			}
			s2, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port+1)}})
			if err != nil {
				return err
			}
			to2 := ap(eth(e.A, 4), e.Port+1)
			if err := e.session(r, node, Victim); err != nil {
				return err
			}
			ctl := &Step{Sink: s1, Node: node, User: portalProxy, Desc: "proxy as alice → " + to1 + " (the delegated connection itself)", Nonce: newNonce()}
			att := &Step{Sink: s2, Node: node, User: portalProxy, Desc: "the same descriptor reconnected → " + to2, Nonce: newNonce()}
			r.Controls = append(r.Controls, ctl)
			r.Attacks = append(r.Attacks, att)
			ctx, cancel := context.WithTimeout(e.Ctx, 20*time.Second)
			defer cancel()
			sock := e.TB.RunDir() + "/" + node + "/portal.sock"
			out, err := e.TB.Command(ctx, node, asUser(portalProxy), "python3", "-c", reuseScript,
				sock, Victim, to1, to2, string(Payload(ctl.Nonce)), string(Payload(att.Nonce))).CombinedOutput()
			r.Notes = append(r.Notes, "proxy: "+strings.ReplaceAll(strings.TrimSpace(string(out)), "\n", "; "))
			ctl.Res = ActResult{OK: err == nil && strings.Contains(string(out), "fds 1")}
			att.Res = ActResult{OK: err == nil && strings.Contains(string(out), "sent again")}
			if !ctl.Res.OK {
				ctl.Res.Error = lastLine(string(out))
			}
			if !att.Res.OK {
				att.Res.Error = "no second connection: " + lastLine(string(out))
			}
			return nil
		}}
}
