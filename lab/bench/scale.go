package bench

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"sync"
	"time"
)

// scale measures how the data plane's per-connection verdict cost grows
// with the number of concurrent users (each with its own listener and
// client, all connecting at once) and with the number of live connections
// already on the node. Scale users are arbitrary uids without passwd
// entries: the helpers start as root in the node and drop to the uid.
func (s *session) scale() error {
	var errs []string
	if err := s.scaleUsers(); err != nil {
		errs = append(errs, err.Error())
	}
	if err := s.scaleHeld(); err != nil {
		errs = append(errs, err.Error())
	}
	if err := s.bigMaps(); err != nil {
		errs = append(errs, err.Error())
	}
	return joinErrs(errs)
}

func (s *session) scaleUsers() error {
	client, _, cross, err := s.paths()
	if err != nil {
		return err
	}
	n2 := s.env.Nodes[1]
	for _, k := range s.plan.ScaleUsers {
		var srvs []*server
		stopAll := func() {
			for _, sv := range srvs {
				_ = sv.stop()
			}
		}
		for i := 0; i < k; i++ {
			uid := ScaleUIDBase + i
			sv, err := s.startAs(n2.Name, "", s.env.LabBinary, "bench", "serve", "--conn", strconv.Itoa(PortScaleBase+i),
				"--uid", strconv.Itoa(uid), "--gid", strconv.Itoa(uid))
			if err != nil {
				stopAll()
				return fmt.Errorf("scale %d users: %w", k, err)
			}
			srvs = append(srvs, sv)
		}
		// Every client sleeps until the same instant, so the users really
		// connect concurrently despite staggered process start-up.
		startAt := time.Now().Add(time.Second + time.Duration(k)*40*time.Millisecond)
		results := make([][]ConnResult, k)
		runErrs := make([]error, k)
		var wg sync.WaitGroup
		for i := 0; i < k; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				uid := ScaleUIDBase + i
				results[i], runErrs[i] = s.connRun(client.Name, "", netip.AddrPortFrom(cross, uint16(PortScaleBase+i)),
					[]int{1}, s.plan.ScaleConns,
					"--uid", strconv.Itoa(uid), "--gid", strconv.Itoa(uid),
					"--start-at", strconv.FormatInt(startAt.UnixNano(), 10))
			}(i)
		}
		wg.Wait()
		stopAll()
		var (
			first, last int64 = math.MaxInt64, 0
			total       int
			connects    []float64
			failed      int
			why         string
		)
		for i, rs := range results {
			if runErrs[i] != nil {
				return fmt.Errorf("scale %d users: user %d: %w", k, i, runErrs[i])
			}
			for _, r := range rs {
				first = min(first, r.StartUnix)
				last = max(last, r.EndUnix)
				total += r.OK
				connects = append(connects, r.ConnectUS)
				if r.Errors > 0 {
					failed += r.Errors
					why = r.FirstErr
				}
			}
		}
		note := ""
		if failed > 0 {
			note = fmt.Sprintf("%d failed connections (%s)", failed, why)
		}
		secs := float64(last-first) / 1e9
		if secs > 0 {
			s.emit(SuiteScale, "users-cross", float64(k), "conn_rate", float64(total)/secs, note)
		}
		s.emit(SuiteScale, "users-cross", float64(k), "connect_us", medianOf(connects), note)
		if failed > 0 {
			return fmt.Errorf("scale %d users: %s", k, note)
		}
	}
	return nil
}

// scaleHeld measures connection setup with many idle connections open.
func (s *session) scaleHeld() error {
	client, _, cross, err := s.paths()
	if err != nil {
		return err
	}
	threads := 4
	for _, held := range s.plan.HoldConns {
		var h *server
		if held > 0 {
			h, err = s.startAs(client.Name, BenchUser, s.env.LabBinary, "bench", "hold",
				"--addr", netip.AddrPortFrom(cross, PortConn).String(), "-n", strconv.Itoa(held))
			if err != nil {
				return fmt.Errorf("hold %d connections: %w", held, err)
			}
		}
		rs, err := s.connRun(client.Name, BenchUser, netip.AddrPortFrom(cross, PortConn), []int{threads}, s.plan.ScaleConns)
		_ = h.stop()
		if err != nil {
			return fmt.Errorf("with %d held connections: %w", held, err)
		}
		for _, r := range rs {
			note := ""
			if r.Errors > 0 {
				note = fmt.Sprintf("%d failed connections (%s)", r.Errors, r.FirstErr)
			}
			s.emit(SuiteScale, "held-cross", float64(held), "conn_rate", r.Rate, note)
			s.emit(SuiteScale, "held-cross", float64(held), "connect_us", r.ConnectUS, note)
		}
	}
	return nil
}

// SetupDriver is implemented by modes with per-user state (uvn): set up
// and tear down n users on a node, timing each.
type SetupDriver interface {
	// SetupUsers sets up n users on node and tears them down again,
	// returning the per-user setup and teardown times in milliseconds
	// and the number of objects left behind afterwards.
	// A setup that fails part-way is reported in failed (with the
	// times of the users set up before it), not as err.
	SetupUsers(ctx context.Context, env *Env, node string, n int) (setupMS, teardownMS []float64, leftover int, failed string, err error)
}

// setup: per-user setup time as the number of users on a node grows.
func (s *session) setup() error {
	sd, ok := s.drv.(SetupDriver)
	if !ok {
		return nil
	}
	n, err := s.env.node(0)
	if err != nil {
		return err
	}
	for _, users := range s.plan.SetupUsers {
		setup, teardown, left, failed, err := sd.SetupUsers(s.ctx, s.env, n.Name, users)
		if err != nil {
			return fmt.Errorf("%d users: %w", users, err)
		}
		// Report the median and the last tenth (the users added when the
		// node already holds most of them): flat means no growth.
		if len(setup) > 0 {
			s.emit(SuiteSetup, "setup", float64(users), "setup_ms", medianOf(setup), failed)
		}
		if len(setup) >= 10 {
			s.emit(SuiteSetup, "setup-last10pct", float64(users), "setup_ms", medianOf(setup[len(setup)*9/10:]), failed)
		}
		if len(teardown) > 0 {
			s.emit(SuiteSetup, "teardown", float64(users), "teardown_ms", medianOf(teardown), "")
		}
		s.emit(SuiteSetup, "leftover", float64(users), "leftover", float64(left), "")
		s.emit(SuiteSetup, "reached", float64(users), "users_reached", float64(len(setup)), failed)
		if failed != "" {
			return fmt.Errorf("%d users: %s", users, failed)
		}
	}
	return nil
}

// EgressDriver is implemented by the egress mode: iperf3 throughput from a
// compute node to the outside host through a client data path of the
// gateway, or directly ("") for the baseline.
type EgressDriver interface {
	// EgressPaths lists the client data paths to measure (e.g. "tun",
	// "socks", "openconnect" — the reference's own stack).
	EgressPaths() []string
	// EgressThroughput runs xfers parallel transfers for dur and returns
	// the received Mbit/s.
	EgressThroughput(ctx context.Context, env *Env, path string, xfers int, dur time.Duration) (float64, error)
}

// EgressTransferDriver also reports the CPU time of the client's process
// tree for a transfer (NaN when the client's data path runs apart).
type EgressTransferDriver interface {
	EgressTransfer(ctx context.Context, env *Env, path string, xfers int, dur time.Duration) (mbit, clientCPU float64, err error)
}

// EgressRSSDriver measures the gateway's resident memory with n clients.
type EgressRSSDriver interface {
	EgressGatewayRSS(ctx context.Context, env *Env, clients int) (mb float64, err error)
}

// egress: iperf3 through the gateway against direct, with 1..20 parallel
// transfers (reference 002, Table 1). The baseline variant runs direct;
// the mode variant runs every client data path, each compared with it.
func (s *session) egress() error {
	ed, ok := s.drv.(EgressDriver)
	if !ok {
		return nil
	}
	baseOf := func(p string) string { return "" }
	if eb, ok := s.drv.(interface{ EgressBaseline(string) string }); ok {
		baseOf = eb.EgressBaseline
	}
	// Baseline rounds measure each distinct baseline path once; its
	// samples are the baseline of every path compared with it.
	type job struct {
		path   string
		series []string
	}
	var jobs []job
	if s.variant == Enforced {
		for _, p := range ed.EgressPaths() {
			jobs = append(jobs, job{p, []string{p}})
		}
	} else {
		idx := map[string]int{}
		for _, p := range ed.EgressPaths() {
			b := baseOf(p)
			if i, ok := idx[b]; ok {
				jobs[i].series = append(jobs[i].series, p)
				continue
			}
			idx[b] = len(jobs)
			jobs = append(jobs, job{b, []string{p}})
		}
	}
	dur := time.Duration(s.plan.IperfSeconds) * time.Second
	// CPU per GB carried: the gateways' (whichever serves the path) and
	// the client's process tree; robust where Mbit/s are not.
	et, hasCPU := s.drv.(EgressTransferDriver)
	gws := s.drv.Processes(s.ctx, s.env)
	gwCPU := func() float64 {
		t := 0.0
		for _, p := range gws {
			if c := procCPU(p.PID); c > 0 {
				t += c
			}
		}
		return t
	}
	var errs []string
	for _, j := range jobs {
		for _, x := range s.plan.EgressXfers {
			var mbit, client float64
			var err error
			g0 := gwCPU()
			if hasCPU {
				mbit, client, err = et.EgressTransfer(s.ctx, s.env, j.path, x, dur)
			} else {
				mbit, err = ed.EgressThroughput(s.ctx, s.env, j.path, x, dur)
			}
			gw := gwCPU() - g0
			if err == nil && hasCPU && mbit > 0 {
				gb := mbit * dur.Seconds() / 8000
				for _, ser := range j.series {
					if !math.IsNaN(client) {
						s.emit(SuiteEgress, ser, float64(x), "client_cpu_s_gb", client/gb, "")
					}
					// Direct traffic is forwarded by the kernel: no gateway
					// process carries it, so the baseline has no such figure.
					if len(gws) > 0 && s.variant == Enforced {
						s.emit(SuiteEgress, ser, float64(x), "gw_cpu_s_gb", gw/gb, "")
					}
				}
			}
			if err != nil {
				name := j.path
				if name == "" {
					name = "direct"
				}
				errs = append(errs, fmt.Sprintf("%s %d transfers: %v", name, x, err))
				continue
			}
			for _, ser := range j.series {
				s.emit(SuiteEgress, ser, float64(x), "mbit_s", mbit, "")
			}
		}
	}
	if rd, ok := s.drv.(EgressRSSDriver); ok && s.variant == Enforced && s.round == 1 {
		clients := 100
		if len(s.plan.EgressXfers) > 0 && s.plan.EgressXfers[len(s.plan.EgressXfers)-1] < 10 {
			clients = 10 // quick
		}
		mb, err := rd.EgressGatewayRSS(s.ctx, s.env, clients)
		if err != nil {
			errs = append(errs, fmt.Sprintf("gateway RSS with %d clients: %v", clients, err))
		} else {
			s.res.Foot = append(s.res.Foot, Footprint{Mode: s.mode, Round: s.round, Node: fmt.Sprintf("gateway, %d clients", clients),
				Process: "gateway", RSSMB: mb, HWMMB: mb})
		}
	}
	return joinErrs(errs)
}
