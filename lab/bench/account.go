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

// measure runs one unit and records its Cost, emitting the per-operation
// figures; it returns the server's stats delta of the measured pass (what
// the UDP sink received). In the mode rounds of a data plane with programs,
// the unit runs twice: first an accounting pass, between two readings of
// the programs' counters with the kernel's statistics on and the floor
// probes attached (its wall-clock figures are not kept), then the measured
// pass with both off, which gives the wall-clock figures and the CPU time —
// so that neither pays for the accounting. The caller emits its figures
// after measure returns, from the last (measured) run.
func (s *session) measure(u unit, run func() (unitResult, error)) (ServeStats, error) {
	var progs []ProgCost
	acctOps := 0.0
	if s.progs != nil {
		problems, err := s.progs.begin()
		if err != nil {
			s.progs.end()
			return ServeStats{}, fmt.Errorf("accounting pass: statistics: %w", err)
		}
		for _, p := range problems {
			noteOnce(s.res, "bpf_floor", p)
		}
		c0 := s.progs.snap()
		r, err := run()
		c1 := s.progs.snap()
		if err == nil && r.ops > 0 {
			progs, acctOps = s.progs.delta(c0, c1, u.work), r.ops
		}
		s.progs.end()
		if err != nil {
			return ServeStats{}, fmt.Errorf("accounting pass: %w", err)
		}
	}
	if statsOn() {
		// Another process holds the machine-wide switch on.
		noteOnce(s.res, "bpf_stats_measured", fmt.Sprintf("%s: on during some measured passes (held by another process)", s.mode))
	}
	var st0, st1 ServeStats
	var serr error
	if u.srv != nil {
		st0, serr = u.srv.stats()
	}
	t0 := time.Now()
	r, err := run()
	wall := time.Since(t0).Seconds()
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
		Ops: r.ops, OpUnit: u.opUnit, WallSec: wall, Progs: progs, AcctOps: acctOps}
	client := ""
	if len(u.work) > 0 {
		client = u.work[0]
	}
	c.CPU = append(c.CPU, ProcCPU{Node: client, Process: "client", CPUNS: r.clientCPU})
	if u.srv == nil && r.serverCPU > 0 { // a server that is not ours (apps): its CPU read by the caller
		c.CPU = append(c.CPU, ProcCPU{Node: u.work[len(u.work)-1], Process: "server", CPUNS: r.serverCPU})
	}
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
	if len(progs) > 0 {
		s.emit(u.bench, u.series, u.x, "bpf_ns_op", c.WorkNS(false)/acctOps, "")
		s.emit(u.bench, u.series, u.x, "bpf_other_ns_op", c.WorkNS(true)/acctOps, "")
	}
	return d, nil
}
