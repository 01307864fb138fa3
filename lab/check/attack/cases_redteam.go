package attack

import (
	"errors"
	"runtime"
)

// Cases of the redteam pass on round 3.
func casesRedteam() []*Case {
	return []*Case{coBindDualWild()}
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
