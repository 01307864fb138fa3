package bench

import (
	"fmt"
	"time"
)

// Operation units of the accounting.
const (
	OpConn  = "connection"
	OpRT    = "round trip"
	OpDgram = "datagram"
	OpMiB   = "MiB"
)

// unit is one accounted measurement: a series point run on some nodes,
// talking to one of the bench's servers.
type unit struct {
	bench, series string
	x             float64
	opUnit        string
	work          []string // nodes the operation runs on (client, server)
	srv           *server  // the server involved (nil: none of ours)
}

// unitResult is what the load generator reports for a unit.
type unitResult struct {
	ops       float64 // operations done, in opUnit
	clientCPU float64 // ns
	// serverCPU overrides the server's own report (ns; 0 = use it).
	serverCPU float64
}

// measure runs one unit between two readings of the data plane's eBPF
// counters and of the server's CPU time, records its Cost and emits the
// per-operation figures. It returns the server's stats delta (what the UDP
// sink received).
func (s *session) measure(u unit, run func() (unitResult, error)) (ServeStats, error) {
	var st0, st1 ServeStats
	var serr error
	if u.srv != nil {
		st0, serr = u.srv.stats()
	}
	c0 := s.progs.snap()
	t0 := time.Now()
	r, err := run()
	wall := time.Since(t0).Seconds()
	c1 := s.progs.snap()
	if u.srv != nil && serr == nil {
		st1, serr = u.srv.stats()
	}
	d := ServeStats{CPUNS: st1.CPUNS - st0.CPUNS, ChildCPUNS: st1.ChildCPUNS - st0.ChildCPUNS,
		UDPRx: st1.UDPRx - st0.UDPRx, UDPRxBytes: st1.UDPRxBytes - st0.UDPRxBytes}
	if err != nil {
		return d, err
	}
	if r.ops <= 0 {
		return d, nil
	}
	c := Cost{Mode: s.mode, Variant: s.variant, Round: s.round, Bench: u.bench, Series: u.series, X: u.x,
		Ops: r.ops, OpUnit: u.opUnit, WallSec: wall, Progs: s.progs.delta(c0, c1, u.work)}
	client := ""
	if len(u.work) > 0 {
		client = u.work[0]
	}
	c.CPU = append(c.CPU, ProcCPU{Node: client, Process: "client", CPUNS: r.clientCPU})
	if u.srv != nil {
		if serr != nil {
			s.res.Errors = append(s.res.Errors, fmt.Sprintf("%s round %d %s: %s %s %g: %v", s.mode, s.round, s.variant, u.bench, u.series, u.x, serr))
		} else {
			srvCPU := d.CPUNS + d.ChildCPUNS
			if r.serverCPU > 0 {
				srvCPU = r.serverCPU
			}
			c.CPU = append(c.CPU, ProcCPU{Node: u.work[len(u.work)-1], Process: "server", CPUNS: srvCPU})
		}
	}
	s.res.Costs = append(s.res.Costs, c)
	s.emit(u.bench, u.series, u.x, "cpu_us_op", c.CPUNS()/r.ops/1e3, "")
	if s.progs != nil {
		s.emit(u.bench, u.series, u.x, "bpf_ns_op", c.WorkNS(false)/r.ops, "")
		s.emit(u.bench, u.series, u.x, "bpf_other_ns_op", c.WorkNS(true)/r.ops, "")
	}
	return d, nil
}
