package attack

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Cases of port exclusivity between users (issue 20 item 2, round 4).
func casesIdent() []*Case {
	return []*Case{wildOverSpecific("v4"), wildOverSpecific("v6"), wildOverSpecific("dual"),
		wildOverSpecific("mapped"), wildOverSpecific("lo"), overConnected(4), overConnected(6),
		ephemeralCoBind("bind0"), ephemeralCoBind("connect")}
}

// wildOverSpecific: the co-bind check looked up only the address a bind
// names, so bob could bind the wildcard of a port alice holds on a specific
// address of the node (both SO_REUSEADDR). Datagrams to her address still
// go to her (an exact address comes first) — until bob connects his
// wildcard socket to a peer X: the kernel rehashes it onto the source
// address the route picks (hers) and scores it above her unconnected
// socket for X's datagrams. X, an exempt service (svc) answering alice,
// answers bob. Variants: IPv4; IPv6 (V6ONLY); bob's dual-stack [::] and
// ::ffff:0.0.0.0 over her IPv4 address; loopback (127.0.0.1, X on the node
// itself). Controls: svc's datagram reaches alice's socket; alice herself
// co-binds the wildcard of a port she holds on her address, connects it to
// X and gets X's datagram on it.
func wildOverSpecific(v string) *Case {
	return &Case{Name: "reuseaddr-wild-over-specific-" + v, Class: "port-reuse",
		Why: "alice's UDP socket holds <her address>:P (SO_REUSEADDR); bob binds the wildcard of P and connects it to the exempt service svc at X:Q: svc's datagrams to alice's address go to bob",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			fam, bobFam := 4, 4
			xNode := e.B
			var aAddr, xAddr, bobWild netip.Addr
			dual := false
			switch v {
			case "v4":
				aAddr, xAddr, bobWild = e.A.Eth0V4, e.B.Eth0V4, wild(4)
			case "v6":
				fam, bobFam = 6, 6
				aAddr, xAddr, bobWild = e.A.Eth0V6, e.B.Eth0V6, wild(6)
			case "dual":
				bobFam, dual = 6, true
				aAddr, xAddr, bobWild = e.A.Eth0V4, e.B.Eth0V4, wild(6)
			case "mapped":
				bobFam, dual = 6, true
				aAddr, xAddr, bobWild = e.A.Eth0V4, e.B.Eth0V4, netip.AddrFrom16(wild(4).As16())
			case "lo":
				xNode = e.A
				aAddr, xAddr, bobWild = lo(4), lo(4), wild(4)
			}
			peer := func(f int) string {
				if f == 6 && xAddr.Is4() {
					return ap(netip.AddrFrom16(xAddr.As16()), q)
				}
				return ap(xAddr, q)
			}
			thief := func(user string, port int) (*Sink, error) {
				return e.Sink(r, e.A.Name, user, SinkSpec{Sock: Sock{Proto: "udp", Family: bobFam, Dual: dual,
					Bind: ap(bobWild, port), ReuseAddr: true}, Connect: peer(bobFam)})
			}
			// svc's service answers from X:Q (bound to X's address, so
			// the source is the one the connected sockets expect).
			answer := func(port int) ActSpec {
				return ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(xAddr, q), ReuseAddr: true},
					Dst: ap(aAddr, port), Count: 3}
			}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(aAddr, p), ReuseAddr: true}})
			if err != nil {
				return err
			}
			desc := "svc's datagram from " + ap(xAddr, q) + " to alice's " + ap(aAddr, p)
			if b, err := thief(Attacker, p); err != nil {
				var se *SinkError
				if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EACCES") {
					return err
				}
				r.Note("bob's bind of %s refused: %v", ap(bobWild, p), err)
				r.Judged(true, e.A.Name, Attacker, "bob binds "+ap(bobWild, p)+" and connects it to "+peer(bobFam), false, "bind refused: "+se.Errno)
			} else {
				r.Note("bob bound %s, connected to %s (%s)", ap(bobWild, p), peer(bobFam), b.Addr)
				r.Attack(e, b, xNode.Name, "svc", desc+", taken by bob's connected wildcard socket", answer(p))
			}
			r.Control(e, s, xNode.Name, "svc", desc, answer(p))
			// alice's own: her address and her wildcard on P+2, the
			// wildcard connected to X.
			if _, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(aAddr, p+2), ReuseAddr: true}}); err != nil {
				return err
			}
			own, err := thief(Victim, p+2)
			if err != nil {
				return err
			}
			r.Control(e, own, xNode.Name, "svc", "svc's datagram from "+ap(xAddr, q)+" to "+ap(aAddr, p+2)+", alice's connected wildcard", answer(p+2))
			return nil
		}}
}

// bobTakes runs svc's datagram from X:Q to alice's address and port: an
// attack at bob's socket b when he got one (else judged: refused, with
// err's errno), and the control at alice's socket s.
func bobTakes(e *Env, r *Run, s, b *Sink, err error, xNode, what string, spec ActSpec) error {
	desc := "svc's datagram from " + spec.Sock.Bind + " to alice's " + spec.Dst
	if err != nil {
		var se *SinkError
		if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE" && se.Errno != "EAGAIN") {
			return err
		}
		r.Note("%s refused: %v", what, err)
		r.Judged(true, e.A.Name, Attacker, what, false, "refused: "+se.Errno)
	} else {
		r.Note("%s: %s", what, b.Addr)
		r.Attack(e, b, xNode, "svc", desc+", taken by bob's socket", spec)
	}
	r.Control(e, s, xNode, "svc", desc, spec)
	return nil
}

// overConnected: a connected socket is found by no lookup that does not
// name its peer, so the co-bind check let bob bind the wildcard of a port
// alice's socket uses connected to X:Q (both SO_REUSEADDR); bob then
// connected his to X:Q too: rehashed onto her address, ahead of hers, it
// took X's answers to her. Refused at his connect: the socket that gets
// X:Q's datagrams to that address and port is alice's.
func overConnected(fam int) *Case {
	return &Case{Name: fmt.Sprintf("reuseaddr-wild-over-connected-cross-v%d", fam), Class: "port-reuse",
		Why: "alice's UDP socket on the wildcard of P (SO_REUSEADDR) is connected to the exempt service svc at X:Q; bob binds the wildcard of P (her socket, connected, is invisible to the bind check) and connects to X:Q too: X's datagrams to alice go to bob",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			x := ap(eth(e.B, fam), q)
			mk := func(user string) (*Sink, error) {
				return e.Sink(r, e.A.Name, user, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), p), ReuseAddr: true}, Connect: x})
			}
			s, err := mk(Victim)
			if err != nil {
				return err
			}
			b, err := mk(Attacker)
			return bobTakes(e, r, s, b, err, e.B.Name, "bob binds "+ap(wild(fam), p)+" and connects it to "+x,
				ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: x, ReuseAddr: true}, Dst: ap(eth(e.A, fam), p), Count: 3})
		}}
}

// ephemeralCoBind: the kernel picks a port for bind(port 0) and for the
// autobind of connect() without counting a holder that has SO_REUSEADDR
// as in use when the new socket has it too, and no bind hook sees the
// port. bob narrows his socket's ephemeral range to alice's port P
// (IP_LOCAL_PORT_RANGE; before Linux 6.3 he retries until the kernel picks
// it) and co-binds her wildcard: unconnected, his socket (hashed last)
// takes all her unicast; connected to X, X's. The hooks clear a user's
// SO_REUSEADDR before the kernel picks a port.
func ephemeralCoBind(how string) *Case {
	return &Case{Name: "reuseaddr-ephemeral-cobind-" + how + "-cross-v4", Class: "port-reuse",
		Why: "alice's UDP socket holds the wildcard of an ephemeral-range port P (SO_REUSEADDR); bob's socket with SO_REUSEADDR and an ephemeral range of P alone gets P from the kernel (" + how + "), which no bind check sees: svc's datagrams to alice go to bob",
		Run: func(e *Env, r *Run) error {
			p, q := 40000+e.Port%20000, e.Port+1
			x := ap(e.B.Eth0V4, q)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), p), ReuseAddr: true}})
			if err != nil {
				return err
			}
			att := SinkSpec{Sock: Sock{Proto: "udp", Family: 4, ReuseAddr: true, LocalPort: p}}
			what := "bob's socket, ephemeral range " + strconv.Itoa(p) + ", "
			if how == "bind0" {
				att.Bind = ap(wild(4), 0)
				what += "binds " + att.Bind
			} else {
				att.Connect = x
				what += "connects to " + x + " unbound"
			}
			b, err := e.Sink(r, e.A.Name, Attacker, att)
			var se *SinkError
			if errors.As(err, &se) && se.Errno == "ENOPROTOOPT" {
				r.NA = "no IP_LOCAL_PORT_RANGE (Linux < 6.3): the attacker would retry until the kernel picks P"
				return nil
			}
			if err == nil && !strings.HasSuffix(b.Addr, ":"+strconv.Itoa(p)) {
				return fmt.Errorf("bob's socket got %s, not port %d: IP_LOCAL_PORT_RANGE ignored", b.Addr, p)
			}
			return bobTakes(e, r, s, b, err, e.B.Name, what,
				ActSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: x, ReuseAddr: true}, Dst: ap(e.A.Eth0V4, p), Count: 3})
		}}
}
