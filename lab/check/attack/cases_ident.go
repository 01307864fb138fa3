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
		ephemeralCoBind("bind0"), ephemeralCoBind("connect"), ephemeralCoBind("sendto"), ephemeralCoBind("failedsend"),
		deviceBoundHolder(4), deviceBoundHolder(6), deviceBoundFirst()}
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
			switch how {
			case "bind0":
				att.Bind = ap(wild(4), 0)
				what += "binds " + att.Bind
			case "connect":
				att.Connect = x
				what += "connects to " + x + " unbound"
			case "sendto":
				// The autobind of sendto() runs before any hook (inet_sendmsg).
				att.SendFirst = []string{ap(e.B.Eth0V4, 9)}
				what += "sends to " + att.SendFirst[0] + " unbound"
			case "failedsend":
				// ... and of a send the kernel then refuses (no destination).
				att.FailedSend = "noaddr"
				what += "sends without a destination unbound"
			}
			b, err := e.Sink(r, e.A.Name, Attacker, att)
			var se *SinkError
			if errors.As(err, &se) && se.Errno == "ENOPROTOOPT" {
				r.NA = "no IP_LOCAL_PORT_RANGE (Linux < 6.3): the attacker would retry until the kernel picks P"
				return nil
			}
			if err == nil && how == "failedsend" && strings.HasSuffix(b.Addr, ":0") {
				// The failed send's autobind found no port: P was not
				// given to bob.
				r.Note("%s: the kernel gave it no port (%s)", what, b.Addr)
				r.Judged(true, e.A.Name, Attacker, what, false, "no port: "+b.Addr)
				r.Control(e, s, e.B.Name, "svc", "svc's datagram from "+x+" to alice's "+ap(e.A.Eth0V4, p),
					ActSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: x, ReuseAddr: true}, Dst: ap(e.A.Eth0V4, p), Count: 3})
				return nil
			}
			if err == nil && !strings.HasSuffix(b.Addr, ":"+strconv.Itoa(p)) {
				return fmt.Errorf("bob's socket got %s, not port %d: IP_LOCAL_PORT_RANGE ignored", b.Addr, p)
			}
			return bobTakes(e, r, s, b, err, e.B.Name, what,
				ActSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: x, ReuseAddr: true}, Dst: ap(e.A.Eth0V4, p), Count: 3})
		}}
}

// deviceBoundHolder: the socket lookups of bind and connect programs pass
// no device, so a device-bound socket (SO_BINDTODEVICE, unprivileged) was
// invisible to the co-bind and connect checks: bob bound the wildcard of a
// port alice's eth0-bound socket holds (both SO_REUSEADDR) and connected
// it to X, where it outscores hers for X's datagrams. Now a user's
// SO_REUSEADDR is SO_REUSEPORT, which the kernel shares only between
// sockets of one owner: bob's bind is refused (EADDRINUSE). Controls: svc's
// datagram reaches alice's socket; alice's own wildcard co-bound over her
// device-bound socket on P+2, connected to X, gets X's datagram.
func deviceBoundHolder(fam int) *Case {
	return &Case{Name: fmt.Sprintf("reuseaddr-device-bound-holder-cross-v%d", fam), Class: "port-reuse",
		Why: "alice's UDP socket holds the wildcard of P bound to eth0 (SO_BINDTODEVICE, SO_REUSEADDR), which no lookup of the bind and connect checks sees; bob binds the wildcard of P and connects it to the exempt service svc at X:Q: svc's datagrams to alice go to bob",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			x := ap(eth(e.B, fam), q)
			victim := func(port int) (*Sink, error) {
				return e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), port), Device: "eth0", ReuseAddr: true}})
			}
			thief := func(user string, port int) (*Sink, error) {
				return e.Sink(r, e.A.Name, user, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), port), ReuseAddr: true}, Connect: x})
			}
			answer := func(port int) ActSpec {
				return ActSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: x, ReuseAddr: true}, Dst: ap(eth(e.A, fam), port), Count: 3}
			}
			s, err := victim(p)
			if err != nil {
				return err
			}
			b, err := thief(Attacker, p)
			if err := bobTakes(e, r, s, b, err, e.B.Name, "bob binds "+ap(wild(fam), p)+" and connects it to "+x, answer(p)); err != nil {
				return err
			}
			if _, err := victim(p + 2); err != nil {
				return err
			}
			own, err := thief(Victim, p+2)
			if err != nil {
				return err
			}
			r.Control(e, own, e.B.Name, "svc", "svc's datagram from "+x+" to alice's "+ap(eth(e.A, fam), p+2)+", her connected wildcard over her eth0-bound socket", answer(p+2))
			return nil
		}}
}

// deviceBoundFirst: the other direction. bob's eth0-bound socket holds the
// wildcard of P (SO_REUSEADDR) first; alice's service binds the wildcard of
// P (SO_REUSEADDR) later: her bind check did not see his socket, and for
// datagrams arriving on eth0 his device-bound socket outscores hers: svc's
// datagrams to alice went to bob. Now her bind is refused (the port is
// his). Control: alice's own wildcard and her eth0-bound socket co-bound on
// P+2: svc's datagram reaches her eth0-bound socket.
func deviceBoundFirst() *Case {
	return &Case{Name: "reuseaddr-device-bound-first-cross-v4", Class: "port-reuse",
		Why: "bob's UDP socket holds the wildcard of P bound to eth0 (SO_BINDTODEVICE, SO_REUSEADDR), invisible to alice's bind check; alice binds the wildcard of P (SO_REUSEADDR): svc's datagrams to her arriving on eth0 go to bob's socket",
		Run: func(e *Env, r *Run) error {
			p, q := e.Port, e.Port+1
			x := ap(e.B.Eth0V4, q)
			dev := func(user string, port int) (*Sink, error) {
				return e.Sink(r, e.A.Name, user, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), port), Device: "eth0", ReuseAddr: true}})
			}
			plain := func(port int) (*Sink, error) {
				return e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), port), ReuseAddr: true}})
			}
			answer := func(port int) ActSpec {
				return ActSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: x, ReuseAddr: true}, Dst: ap(e.A.Eth0V4, port), Count: 3}
			}
			b, err := dev(Attacker, p)
			if err != nil {
				return err
			}
			desc := "svc's datagram from " + x + " to alice's " + ap(e.A.Eth0V4, p)
			if s, err := plain(p); err != nil {
				var se *SinkError
				if !errors.As(err, &se) || (se.Errno != "EPERM" && se.Errno != "EADDRINUSE") {
					return err
				}
				r.Note("alice's bind of %s refused: %v", ap(wild(4), p), err)
				r.Judged(true, e.A.Name, Attacker, "bob's eth0-bound socket on "+ap(wild(4), p)+" beside alice's", false, "her bind refused: "+se.Errno)
			} else {
				r.Note("alice bound %s beside bob's eth0-bound socket", ap(wild(4), p))
				r.Attack(e, b, e.B.Name, "svc", desc+", taken by bob's eth0-bound socket", answer(p))
				r.Control(e, s, e.B.Name, "svc", desc, answer(p))
			}
			// Her wildcard first: among sockets of one owner on one address
			// (SO_REUSEPORT), the kernel's lookup takes the first it finds
			// (the latest bound), not the best-scoring (docs/userwall.md).
			if _, err := plain(p + 2); err != nil {
				return err
			}
			own, err := dev(Victim, p+2)
			if err != nil {
				return err
			}
			r.Control(e, own, e.B.Name, "svc", "svc's datagram from "+x+" to alice's "+ap(e.A.Eth0V4, p+2)+", her eth0-bound socket beside her wildcard", answer(p+2))
			return nil
		}}
}
