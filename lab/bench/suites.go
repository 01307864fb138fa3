package bench

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Ports the bench listens on inside nodes (announced in the team notes;
// above the system ports, below the ephemeral range).
const (
	PortIperf = 29201
	PortRR    = 29202
	PortConn  = 29203
	// PortCheck serves only the enforcement check, so that the measured
	// connections' TIME_WAIT sockets never share its 4-tuples.
	PortCheck = 29204
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
			"--iperf", strconv.Itoa(PortIperf), "--rr", strconv.Itoa(PortRR), "--conn", joinInts([]int{PortConn, PortCheck}))
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
	Error string `json:"error"`
	End   struct {
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

// iperf runs one iperf3 client and returns received Gbit/s (TCP) or
// received Gbit/s and loss (UDP).
func (s *session) iperf(node string, target netip.Addr, extra ...string) (gbit, loss float64, err error) {
	argv := []string{"iperf3", "-c", target.String(), "-p", strconv.Itoa(PortIperf), "-J",
		"-t", strconv.Itoa(s.plan.IperfSeconds)}
	if s.plan.IperfOmit > 0 {
		argv = append(argv, "-O", strconv.Itoa(s.plan.IperfOmit))
	}
	argv = append(argv, extra...)
	out, runErr := s.runAs(node, BenchUser, argv...)
	var j iperfJSON
	if jerr := json.Unmarshal([]byte(out), &j); jerr != nil {
		if runErr != nil {
			return 0, 0, runErr
		}
		return 0, 0, fmt.Errorf("iperf3 output: %w", jerr)
	}
	if j.Error != "" {
		return 0, 0, fmt.Errorf("iperf3: %s", j.Error)
	}
	if runErr != nil {
		return 0, 0, runErr
	}
	bps := j.End.SumReceived.BPS
	if bps == 0 {
		bps = j.End.Sum.BPS // UDP
	}
	if bps <= 0 {
		return 0, 0, fmt.Errorf("iperf3 reported no throughput")
	}
	loss = j.End.SumReceived.LostPercent
	if loss == 0 {
		loss = j.End.Sum.LostPercent
	}
	return bps / 1e9, loss, nil
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
		for _, p := range streams {
			g, _, err := s.iperf(client.Name, target, "-P", strconv.Itoa(p))
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s %d streams: %v", series, p, err))
				continue
			}
			s.emit(SuiteThroughput, series, float64(p), "gbit_s", g, "")
		}
	}
	tcp("tcp-cross", cross, s.plan.Streams)
	tcp("tcp-local", local, s.plan.LocalStreams)
	udp := []struct {
		series string
		target netip.Addr
	}{{"udp-cross", cross}, {"udp-local", local}}
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
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

// latency: request/response round trips over one TCP connection for each
// message size (reference 004, Figures 5–8).
func (s *session) latency() error {
	client, local, cross, err := s.paths()
	if err != nil {
		return err
	}
	var errs []string
	for _, p := range []struct {
		series string
		target netip.Addr
	}{{"rr-local", local}, {"rr-cross", cross}} {
		out, err := s.runAs(client.Name, BenchUser, s.env.LabBinary, "bench", "rr",
			"--addr", netip.AddrPortFrom(p.target, PortRR).String(),
			"--sizes", joinInts(s.plan.RRSizes), "--iters", strconv.Itoa(s.plan.RRIters))
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", p.series, err))
			continue
		}
		var rs []RRResult
		if err := json.Unmarshal([]byte(out), &rs); err != nil {
			errs = append(errs, fmt.Sprintf("%s: output: %v", p.series, err))
			continue
		}
		for _, r := range rs {
			s.emit(SuiteLatency, p.series, float64(r.Size), "rtt_us", r.MedUS, "")
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

// conn: N threads × new TCP connections sending one byte each (reference
// 001, Figure 2), on localhost and across nodes.
func (s *session) conn() error {
	client, local, cross, err := s.paths()
	if err != nil {
		return err
	}
	var errs []string
	for _, p := range []struct {
		series string
		target netip.Addr
	}{{"conn-local", local}, {"conn-cross", cross}} {
		rs, err := s.connRun(client.Name, BenchUser, netip.AddrPortFrom(p.target, PortConn), s.plan.ConnThreads, s.plan.ConnPerThr)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", p.series, err))
			continue
		}
		for _, r := range rs {
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
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
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
