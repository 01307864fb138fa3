package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"strings"
)

// Ports the bench listens on inside nodes (announced in the team notes;
// above the system ports, below the ephemeral range).
const (
	PortIperf = 29201
	// iperfServers: iperf3 servers on PortIperf, PortIperf+10, …; clients
	// take them in turn. An iperf3 server runs one test at a time and,
	// on a loaded machine, is still finishing the last one when the next
	// client connects ("the server is busy running a test").
	iperfServers = 3
	PortRR       = 29202
	PortConn     = 29203
	// PortCheck serves only the enforcement check, so that the measured
	// connections' TIME_WAIT sockets never share its 4-tuples.
	PortCheck = 29204
	// PortUDPSink counts datagrams (rate); PortUDPEcho echoes them.
	PortUDPSink = 29205
	PortUDPEcho = 29206
	// PortScaleBase + i is the server of scale user i.
	PortScaleBase = 29300
	// ScaleUIDBase + i is scale user i (no passwd entry needed).
	ScaleUIDBase = 3900000
)

// BenchUser runs every measured client and server: the same user on both
// ends, so the allowed path is measured with the data plane's full check.
const BenchUser = "alice"

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

// startServers starts `palisade-lab bench serve` as the bench user on node1
// (localhost tests) and node2 (cross-node tests).
func (s *session) startServers() error {
	for i := 0; i < 2; i++ {
		n, err := s.env.node(i)
		if err != nil {
			return err
		}
		srv, err := s.startAs(n.Name, BenchUser, s.env.LabBinary, "bench", "serve",
			"--iperf", joinInts(iperfPorts()), "--rr", strconv.Itoa(PortRR), "--conn", joinInts([]int{PortConn, PortCheck}),
			"--udp-sink", strconv.Itoa(PortUDPSink), "--udp-echo", strconv.Itoa(PortUDPEcho))
		if err != nil {
			s.stopServers()
			return fmt.Errorf("servers: %w", err)
		}
		s.servers = append(s.servers, srv)
	}
	return nil
}

func (s *session) stopServers() {
	for _, srv := range s.servers {
		_ = srv.stop()
	}
	s.servers = nil
}

func iperfPorts() []int {
	var ps []int
	for i := range iperfServers {
		ps = append(ps, PortIperf+10*i)
	}
	return ps
}

// route is one measured series and the address its client talks to.
type route struct {
	series string
	target netip.Addr
}

// joinErrs is a suite's failures as one error (nil for none): a suite goes
// on past a failed unit and reports every one.
func joinErrs(errs []string) error {
	if len(errs) == 0 {
		return nil
	}
	return errors.New(strings.Join(errs, "; "))
}

// paths returns the client node and the (localhost, cross-node) targets.
func (s *session) paths() (client Node, local, cross netip.Addr, err error) {
	n1, err := s.env.node(0)
	if err != nil {
		return
	}
	n2, err := s.env.node(1)
	if err != nil {
		return
	}
	return n1, netip.MustParseAddr("127.0.0.1"), n2.Eth0, nil
}

// iperfJSON is the part of iperf3 -J output the bench reads.
type iperfJSON struct {
	Error     string `json:"error"`
	Intervals []struct {
		Sum struct {
			Bytes   float64 `json:"bytes"`
			Seconds float64 `json:"seconds"`
		} `json:"sum"`
	} `json:"intervals"`
	End struct {
		CPU struct {
			Host   float64 `json:"host_total"`
			Remote float64 `json:"remote_total"`
		} `json:"cpu_utilization_percent"`
		SumReceived struct {
			BPS         float64 `json:"bits_per_second"`
			LostPercent float64 `json:"lost_percent"`
		} `json:"sum_received"`
		SumSent struct {
			BPS float64 `json:"bits_per_second"`
		} `json:"sum_sent"`
		Sum struct {
			BPS         float64 `json:"bits_per_second"`
			LostPercent float64 `json:"lost_percent"`
		} `json:"sum"`
	} `json:"end"`
}

// iperfRun is what the bench reads from one iperf3 run.
type iperfRun struct {
	gbit, loss float64
	bytes      float64 // sent by the client, omitted intervals included
	clientCPU  float64 // ns, iperf3's own CPU figure × its duration
}

// iperf runs one iperf3 client and returns received Gbit/s (TCP) or
// received Gbit/s and loss (UDP).
func (s *session) iperf(node string, target netip.Addr, extra ...string) (gbit, loss float64, err error) {
	r, err := s.iperfFull(node, target, extra...)
	return r.gbit, r.loss, err
}

func (s *session) iperfFull(node string, target netip.Addr, extra ...string) (ir iperfRun, err error) {
	port := PortIperf + 10*(s.iperfRuns%iperfServers)
	s.iperfRuns++
	argv := []string{"iperf3", "-c", target.String(), "-p", strconv.Itoa(port), "-J",
		"-t", strconv.Itoa(s.plan.IperfSeconds)}
	if s.plan.IperfOmit > 0 {
		argv = append(argv, "-O", strconv.Itoa(s.plan.IperfOmit))
	}
	argv = append(argv, extra...)
	out, runErr := s.runAs(node, BenchUser, argv...)
	var j iperfJSON
	if jerr := json.Unmarshal([]byte(out), &j); jerr != nil {
		if runErr != nil {
			return ir, runErr
		}
		return ir, fmt.Errorf("iperf3 output: %w", jerr)
	}
	if j.Error != "" {
		return ir, fmt.Errorf("iperf3: %s", j.Error)
	}
	if runErr != nil {
		return ir, runErr
	}
	bps := j.End.SumReceived.BPS
	if bps == 0 {
		bps = j.End.Sum.BPS // UDP
	}
	if bps <= 0 {
		return ir, fmt.Errorf("iperf3 reported no throughput")
	}
	ir.loss = j.End.SumReceived.LostPercent
	if ir.loss == 0 {
		ir.loss = j.End.Sum.LostPercent
	}
	ir.gbit = bps / 1e9
	secs := 0.0
	for _, iv := range j.Intervals {
		ir.bytes += iv.Sum.Bytes
		secs += iv.Sum.Seconds
	}
	ir.clientCPU = j.End.CPU.Host / 100 * secs * 1e9
	return ir, nil
}

// work lists the nodes an operation from client to target runs on.
func (s *session) work(client Node, target netip.Addr) ([]string, *server) {
	if target.IsLoopback() {
		return []string{client.Name}, s.srv(0)
	}
	n2, _ := s.env.node(1)
	return []string{client.Name, n2.Name}, s.srv(1)
}

// srv returns the bench server of node i (0: localhost tests, 1: cross).
func (s *session) srv(i int) *server {
	if i < len(s.servers) {
		return s.servers[i]
	}
	return nil
}

// throughput: iperf3 TCP with 1..8 streams across nodes and on localhost,
// and UDP at a fixed offered load (reference 000 §5.2.1, 002 Table 1).
func (s *session) throughput() error {
	client, local, cross, err := s.paths()
	if err != nil {
		return err
	}
	var errs []string
	tcp := func(series string, target netip.Addr, streams []int) {
		work, srv := s.work(client, target)
		for _, p := range streams {
			var ir iperfRun
			_, err := s.measure(unit{bench: SuiteThroughput, series: series, x: float64(p), opUnit: OpMiB, work: work, srv: srv},
				func() (unitResult, error) {
					var err error
					ir, err = s.iperfFull(client.Name, target, "-P", strconv.Itoa(p))
					return unitResult{ops: ir.bytes / (1 << 20), clientCPU: ir.clientCPU}, err
				})
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d streams: %v", series, p, err))
				continue
			}
			s.emit(SuiteThroughput, series, float64(p), "gbit_s", ir.gbit, "")
		}
	}
	tcp("tcp-cross", cross, s.plan.Streams)
	tcp("tcp-local", local, s.plan.LocalStreams)
	udp := []route{{"udp-cross", cross}, {"udp-local", local}}
	if s.plan.UDPRate == "" {
		udp = nil
	}
	for _, p := range udp {
		g, loss, err := s.iperf(client.Name, p.target, "-u", "-b", s.plan.UDPRate, "-l", strconv.Itoa(s.plan.UDPLen))
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", p.series, err))
			continue
		}
		s.emit(SuiteThroughput, p.series, 1, "gbit_s", g, "")
		s.emit(SuiteThroughput, p.series, 1, "loss_pct", loss, "")
	}
	return joinErrs(errs)
}

// latency: request/response round trips over one TCP connection for each
// message size (reference 004, Figures 5–8).
func (s *session) latency() error {
	client, local, cross, err := s.paths()
	if err != nil {
		return err
	}
	var errs []string
	for _, p := range []route{{"rr-local", local}, {"rr-cross", cross}} {
		work, srv := s.work(client, p.target)
		// One run per size, so that each size is accounted on its own.
		for _, size := range s.plan.RRSizes {
			var r RRResult
			_, err := s.measure(unit{bench: SuiteLatency, series: p.series, x: float64(size), opUnit: OpRT, work: work, srv: srv},
				func() (unitResult, error) {
					out, err := s.runAs(client.Name, BenchUser, s.env.LabBinary, "bench", "rr",
						"--addr", netip.AddrPortFrom(p.target, PortRR).String(),
						"--sizes", strconv.Itoa(size), "--iters", strconv.Itoa(s.plan.RRIters))
					if err != nil {
						return unitResult{}, err
					}
					var rs []RRResult
					if err := json.Unmarshal([]byte(out), &rs); err != nil || len(rs) != 1 {
						return unitResult{}, fmt.Errorf("output: %v (%d results)", err, len(rs))
					}
					r = rs[0]
					return unitResult{ops: float64(r.Trips), clientCPU: r.CPUNS}, nil
				})
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d B: %v", p.series, size, err))
				continue
			}
			s.emit(SuiteLatency, p.series, float64(r.Size), "rtt_us", r.MedUS, "")
		}
	}
	return joinErrs(errs)
}

// conn: N threads × new TCP connections sending one byte each (reference
// 001, Figure 2), on localhost and across nodes.
func (s *session) conn() error {
	client, local, cross, err := s.paths()
	if err != nil {
		return err
	}
	var errs []string
	for _, p := range []route{{"conn-local", local}, {"conn-cross", cross}} {
		work, srv := s.work(client, p.target)
		for _, th := range s.plan.ConnThreads {
			var r ConnResult
			_, err := s.measure(unit{bench: SuiteConn, series: p.series, x: float64(th), opUnit: OpConn, work: work, srv: srv},
				func() (unitResult, error) {
					rs, err := s.connRun(client.Name, BenchUser, netip.AddrPortFrom(p.target, PortConn), []int{th}, s.plan.ConnPerThr)
					if err != nil {
						return unitResult{}, err
					}
					if len(rs) != 1 {
						return unitResult{}, fmt.Errorf("%d results for one thread count", len(rs))
					}
					r = rs[0]
					// Failed attempts run the programs too: count every try.
					return unitResult{ops: float64(r.OK + r.Errors), clientCPU: r.CPUNS}, nil
				})
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d threads: %v", p.series, th, err))
				continue
			}
			note := ""
			if r.Errors > 0 {
				note = fmt.Sprintf("%d failed connections (%s)", r.Errors, r.FirstErr)
				errs = append(errs, fmt.Sprintf("%s %d threads: %s", p.series, r.Threads, note))
			}
			s.emit(SuiteConn, p.series, float64(r.Threads), "seconds", r.Seconds, note)
			s.emit(SuiteConn, p.series, float64(r.Threads), "conn_rate", r.Rate, note)
			s.emit(SuiteConn, p.series, float64(r.Threads), "connect_us", r.ConnectUS, note)
		}
	}
	return joinErrs(errs)
}

// connRun runs `palisade-lab bench conn` on node as user.
func (s *session) connRun(node, user string, addr netip.AddrPort, threads []int, conns int, extra ...string) ([]ConnResult, error) {
	argv := append([]string{s.env.LabBinary, "bench", "conn", "--addr", addr.String(),
		"--threads", joinInts(threads), "--conns", strconv.Itoa(conns)}, extra...)
	out, err := s.runAs(node, user, argv...)
	if err != nil {
		return nil, err
	}
	var rs []ConnResult
	if err := json.Unmarshal([]byte(out), &rs); err != nil {
		return nil, fmt.Errorf("conn output: %w", err)
	}
	return rs, nil
}

// udp: small-datagram rate of one sender (unconnected sendto, so every
// datagram passes the send hooks) and UDP round trips, v4 and v6, on
// localhost and across nodes. The rate is what the sink received; the
// round trips give an exact datagram count on both ends for the accounting.
func (s *session) udp() error {
	client, _, _, err := s.paths()
	if err != nil {
		return err
	}
	n2, err := s.env.node(1)
	if err != nil {
		return err
	}
	var errs []string
	paths := []route{
		{"udp4-local", netip.MustParseAddr("127.0.0.1")},
		{"udp4-cross", n2.Eth0},
		{"udp6-local", netip.IPv6Loopback()},
		{"udp6-cross", n2.Eth0V6},
	}
	for _, p := range paths {
		if !p.target.IsValid() {
			continue
		}
		work, srv := s.work(client, p.target)
		for _, size := range s.plan.DgramSizes {
			// Rate: datagrams the sink received per second of sending.
			var r UDPResult
			d, err := s.measure(unit{bench: SuiteUDP, series: p.series, x: float64(size), opUnit: OpDgram, work: work, srv: srv},
				func() (unitResult, error) {
					rs, err := s.udpRun(client.Name, netip.AddrPortFrom(p.target, PortUDPSink), size,
						"--seconds", strconv.FormatFloat(s.plan.DgramSeconds, 'f', -1, 64))
					if err != nil {
						return unitResult{}, err
					}
					r = rs
					return unitResult{ops: float64(r.Sent), clientCPU: r.CPUNS}, nil
				})
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d B: %v", p.series, size, err))
				continue
			}
			if srv != nil && r.Seconds > 0 {
				s.emit(SuiteUDP, p.series, float64(size), "dgram_rate", float64(d.UDPRx)/r.Seconds/1e3, "")
				if r.Sent > 0 {
					s.emit(SuiteUDP, p.series, float64(size), "loss_pct", 100*math.Max(0, 1-float64(d.UDPRx)/float64(r.Sent)), "")
				}
			}
			// Round trips: every datagram accounted on both ends.
			rr := strings.Replace(p.series, "udp", "udprr", 1)
			_, err = s.measure(unit{bench: SuiteUDP, series: rr, x: float64(size), opUnit: OpDgram, work: work, srv: srv},
				func() (unitResult, error) {
					rs, err := s.udpRun(client.Name, netip.AddrPortFrom(p.target, PortUDPEcho), size,
						"--rr", "--iters", strconv.Itoa(s.plan.DgramIters))
					if err != nil {
						return unitResult{}, err
					}
					r = rs
					// Each round trip is two datagrams, each passing both ends.
					return unitResult{ops: 2 * float64(r.Sent), clientCPU: r.CPUNS}, nil
				})
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d B: %v", rr, size, err))
				continue
			}
			s.emit(SuiteUDP, rr, float64(size), "rtt_us", r.MedUS, "")
		}
	}
	return joinErrs(errs)
}

// udpRun runs `palisade bench udp` for one size.
func (s *session) udpRun(node string, addr netip.AddrPort, size int, extra ...string) (UDPResult, error) {
	argv := append([]string{s.env.LabBinary, "bench", "udp", "--addr", addr.String(), "--sizes", strconv.Itoa(size)}, extra...)
	out, err := s.runAs(node, BenchUser, argv...)
	if err != nil {
		return UDPResult{}, err
	}
	var rs []UDPResult
	if err := json.Unmarshal([]byte(out), &rs); err != nil || len(rs) != 1 {
		return UDPResult{}, fmt.Errorf("udp output: %v (%d results)", err, len(rs))
	}
	return rs[0], nil
}
