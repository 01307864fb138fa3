package bench

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/h3"
)

// The real-application suite (issue 25 item 3): unmodified applications
// across nodes, as the bench user on both ends, each a figure of its own so
// that the report gives its ratio to the baseline with the 95 % interval of
// the paired rounds. Servers run on node2, clients on node1.

// Ports of the applications' servers (beside the bench's own, above).
const (
	PortRedis    = 29207
	PortPostgres = 29208
	PortH3       = 29209
)

// Series of the suite (bench "apps").
const (
	appIperfTCP    = "iperf3-tcp"
	appIperfUDP    = "iperf3-udp-" // + datagram bytes
	appRedis       = "redis-get-c10"
	appRedisNew    = "redis-get-c10-new-conn"
	appPgbench     = "pgbench-select"
	appPgbenchNew  = "pgbench-select-new-conn"
	appMPIAllreduc = "mpi-allreduce-np2"
	appH3          = "http3-get"
)

// postgresBin is the newest installed PostgreSQL server's bin directory.
func postgresBin() (string, error) {
	ds, _ := filepath.Glob("/usr/lib/postgresql/*/bin/postgres")
	if len(ds) == 0 {
		return "", fmt.Errorf("no PostgreSQL server (/usr/lib/postgresql/*/bin/postgres): run .ci/deps")
	}
	slices.SortFunc(ds, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(a))))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(b))))
		return va - vb
	})
	return filepath.Dir(ds[len(ds)-1]), nil
}

// Units of the applications' operations (the in-kernel and CPU accounting).
const (
	opRequest = "request"
	opTx      = "transaction"
)

// apps runs every application once and emits one figure each. Each run is
// a measured unit (account.go): in the mode rounds it runs once more with
// the kernel's statistics on, which gives the eBPF time per operation; its
// CPU per operation is the client's (`times` of its shell) and the
// server's (its process, and reaped children: PostgreSQL's backends).
func (s *session) apps() error {
	if s.plan.AppSeconds <= 0 {
		return nil // --quick: not measured
	}
	client, _, cross, err := s.paths()
	if err != nil {
		return err
	}
	n2, err := s.env.node(1)
	if err != nil {
		return err
	}
	work, iperfSrv := s.work(client, cross)
	runDir := filepath.Join(s.env.Dir, "bench", "run")
	if _, err := s.env.run(s.ctx, n2.Name, "", "sh", "-c", fmt.Sprintf("set -e; mkdir -p %[1]s; chmod 755 %[2]s; chown %[3]s %[1]s", runDir, filepath.Dir(runDir), BenchUser)); err != nil {
		return err
	}
	var errs []string
	fail := func(series string, err error) { errs = append(errs, fmt.Sprintf("%s: %v", series, err)) }
	secs := strconv.Itoa(s.plan.AppSeconds)

	// iperf3: one TCP stream, and UDP unlimited at two datagram sizes
	// (1,400 fits the route; 8,000 is fragmented, stamped on its first
	// fragment). Received throughput.
	iperf := func(series string, x float64, extra ...string) {
		var ir iperfRun
		_, err := s.measure(unit{bench: SuiteApps, series: series, x: x, opUnit: OpMiB, work: work, srv: iperfSrv},
			func() (unitResult, error) {
				var err error
				ir, err = s.iperfFull(client.Name, cross, extra...)
				return unitResult{ops: ir.bytes / (1 << 20), clientCPU: ir.clientCPU}, err
			})
		if err != nil {
			fail(series, err)
			return
		}
		s.emit(SuiteApps, series, x, "gbit_s", ir.gbit, "")
		if len(extra) > 0 {
			s.emit(SuiteApps, series, x, "loss_pct", ir.loss, "")
		}
	}
	iperf(appIperfTCP, 1)
	for _, l := range s.plan.AppUDPLens {
		iperf(appIperfUDP+strconv.Itoa(l), float64(l), "-u", "-b", "0", "-l", strconv.Itoa(l))
	}

	// redis-benchmark GET, 10 clients, keep-alive and a new connection per
	// request (-k 0).
	redisPid := filepath.Join(runDir, "redis.pid")
	if srv, err := s.startRedis(n2.Name, cross, redisPid); err != nil {
		fail("redis", err)
	} else {
		// A connection per request is two orders of magnitude slower:
		// a tenth of the requests.
		for _, c := range []struct {
			series, keep string
			n            int
		}{{appRedis, "1", s.plan.AppRedisRequests}, {appRedisNew, "0", max(s.plan.AppRedisRequests/10, 100)}} {
			var rps float64
			_, err := s.measure(unit{bench: SuiteApps, series: c.series, x: 10, opUnit: opRequest, work: work},
				func() (unitResult, error) {
					cpu0 := pidFileCPU(redisPid)
					out, cpu, err := s.runTimed(client.Name, "redis-benchmark", "-h", cross.String(), "-p", strconv.Itoa(PortRedis),
						"-t", "get", "-c", "10", "-n", strconv.Itoa(c.n), "-k", c.keep, "--csv")
					if err == nil {
						rps, err = redisRPS(out)
					}
					return unitResult{ops: float64(c.n), clientCPU: cpu, serverCPU: pidFileCPU(redisPid) - cpu0}, err
				})
			if err != nil {
				fail(c.series, err)
				continue
			}
			s.emit(SuiteApps, c.series, 10, "ops_s", rps, "")
		}
		_ = srv.stop()
	}

	// pgbench select-only, 4 clients, persistent and -C (a connection per
	// transaction).
	if srv, err := s.startPostgres(n2.Name, cross); err != nil {
		fail("postgres", err)
	} else {
		bin, _ := postgresBin()
		pgPid := filepath.Join(s.env.Dir, "bench", "pg", "postmaster.pid")
		for _, c := range []struct {
			series string
			extra  []string
		}{{appPgbench, nil}, {appPgbenchNew, []string{"-C"}}} {
			argv := append([]string{filepath.Join(bin, "pgbench"), "-h", cross.String(), "-p", strconv.Itoa(PortPostgres),
				"-U", BenchUser, "-n", "-S", "-c", "4", "-j", "1", "-T", secs}, c.extra...)
			argv = append(argv, "postgres")
			var tps float64
			_, err := s.measure(unit{bench: SuiteApps, series: c.series, x: 4, opUnit: opTx, work: work},
				func() (unitResult, error) {
					cpu0 := pidFileCPU(pgPid)
					out, cpu, err := s.runTimed(client.Name, argv...)
					var txs float64
					if err == nil {
						tps, txs, err = pgbenchTPS(out)
					}
					return unitResult{ops: txs, clientCPU: cpu, serverCPU: pidFileCPU(pgPid) - cpu0}, err
				})
			if err != nil {
				fail(c.series, err)
				continue
			}
			s.emit(SuiteApps, c.series, 4, "tps", tps, "")
		}
		_ = srv.stop()
	}

	// MPI allreduce, one rank on each of two nodes (wall clock only: a run
	// mixes start-up and every size).
	if s.mpiProg == "" {
		fail(appMPIAllreduc, fmt.Errorf("no MPI program (mpicc failed; see errors)"))
	} else {
		lines, err := s.mpiRun(2, s.plan.AppMPISizes)
		if err != nil {
			fail(appMPIAllreduc, err) // the checked lines still count
		}
		for _, l := range lines {
			if l.Test == "allreduce" {
				s.emit(SuiteApps, appMPIAllreduc, float64(l.Size), "allreduce_us", l.US, "")
			}
		}
	}

	// HTTP/3 (aioquic): one GET of AppH3Bytes over QUIC.
	if err := s.h3(client.Name, n2.Name, cross, work, runDir); err != nil {
		fail(appH3, err)
	}
	return joinErrs(errs)
}

// runTimed runs argv as the bench user on node and returns its output and
// the CPU time (ns, user + system) it and its children used.
func (s *session) runTimed(node string, argv ...string) (string, float64, error) {
	sh := []string{"sh", "-c", `"$@"; rc=$?; echo; echo @cpu; times; exit $rc`, "sh"}
	out, err := s.runAs(node, BenchUser, append(sh, argv...)...)
	app, t, _ := strings.Cut(out, "\n@cpu\n")
	return app, childTimes(t), err
}

var timesRe = regexp.MustCompile(`(\d+)m([0-9.]+)s`)

// childTimes reads the second line of the shell's `times` (its children's
// user and system time) in ns.
func childTimes(t string) float64 {
	lines := strings.Split(strings.TrimSpace(t), "\n")
	if len(lines) < 2 {
		return 0
	}
	ns := 0.0
	for _, m := range timesRe.FindAllStringSubmatch(lines[1], 2) {
		mins, _ := strconv.ParseFloat(m[1], 64)
		sec, _ := strconv.ParseFloat(m[2], 64)
		ns += (mins*60 + sec) * 1e9
	}
	return ns
}

// pidFileCPU is the CPU time (ns) of the process named by the first line
// of a pid file, its reaped children included; 0 if it cannot be read.
func pidFileCPU(path string) float64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil {
		return 0
	}
	st, ok := procfs.Read(pid)
	if !ok {
		return 0
	}
	return (st.CPU + st.ChildCPU) * 1e9
}

// startRedis starts a redis-server as the bench user on node, on addr only,
// without persistence.
func (s *session) startRedis(node string, addr netip.Addr, pidFile string) (*server, error) {
	a, p := addr.String(), strconv.Itoa(PortRedis)
	script := `redis-server --bind "$1" --port "$2" --save '' --appendonly no --protected-mode no --daemonize no --dir /tmp --logfile '' >/dev/null &
pid=$!
echo $pid > "$3"
i=0
until redis-cli -h "$1" -p "$2" ping 2>/dev/null | grep -q PONG; do
  i=$((i+1)); [ $i -gt 300 ] && { kill $pid; exit 1; }; sleep 0.1
done
echo ready
read _
kill $pid; wait $pid 2>/dev/null; exit 0`
	return s.startAs(node, BenchUser, "sh", "-c", script, "redis", a, p, pidFile)
}

// startPostgres starts PostgreSQL as the bench user on node, listening on
// addr only (TCP, trust for the testbed's nodes), with a database made
// once per testbed under <Dir>/bench/pg and pgbench's tables (scale 1).
func (s *session) startPostgres(node string, addr netip.Addr) (*server, error) {
	bin, err := postgresBin()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(s.env.Dir, "bench", "pg")
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		setup := fmt.Sprintf(`set -e; rm -rf %[1]s; mkdir -p %[1]s; chmod 755 %[2]s; chown %[3]s %[1]s; chmod 700 %[1]s`,
			dir, filepath.Dir(dir), BenchUser)
		if _, err := s.env.run(s.ctx, node, "", "sh", "-c", setup); err != nil {
			return nil, err
		}
		initdb := fmt.Sprintf(`set -e; %s/initdb -D %s -A trust -U %s --no-sync >/dev/null
printf 'host all all 0.0.0.0/0 trust\nhost all all ::/0 trust\n' >> %[2]s/pg_hba.conf`, bin, dir, BenchUser)
		if _, err := s.env.run(s.ctx, node, BenchUser, "sh", "-c", initdb); err != nil {
			return nil, fmt.Errorf("initdb: %w", err)
		}
	}
	script := `"$1/postgres" -D "$2" -h "$3" -p "$4" -c unix_socket_directories= -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=40 >"$2/log" 2>&1 &
pid=$!
i=0
until "$1/pg_isready" -q -h "$3" -p "$4"; do
  i=$((i+1)); [ $i -gt 300 ] && { kill $pid; exit 1; }; sleep 0.1
done
if [ ! -f "$2/pgbench-ready" ]; then "$1/pgbench" -i -q -s 1 -h "$3" -p "$4" -U "$5" postgres >/dev/null 2>&1 && touch "$2/pgbench-ready"; fi
echo ready
read _
kill -INT $pid; wait $pid 2>/dev/null; exit 0`
	return s.startAs(node, BenchUser, "sh", "-c", script, "postgres", bin, dir, addr.String(), strconv.Itoa(PortPostgres), BenchUser)
}

// h3 serves AppH3Bytes over HTTP/3 on srvNode and fetches it once from
// client, emitting the transfer's throughput.
func (s *session) h3(client, srvNode string, addr netip.Addr, work []string, runDir string) error {
	if _, err := os.Stat(h3.Python); err != nil {
		return fmt.Errorf("%s: %w (run .ci/deps)", h3.Python, err)
	}
	script := filepath.Join(s.env.Dir, "bench", "h3.py")
	if err := h3.Write(script); err != nil {
		return err
	}
	port := strconv.Itoa(PortH3)
	pidFile := filepath.Join(runDir, "h3.pid")
	srv, err := s.startAs(srvNode, BenchUser, "sh", "-c", `echo $$ > "$1"; shift; exec "$@"`, "h3", pidFile,
		h3.Python, script, "server", addr.String(), port)
	if err != nil {
		return err
	}
	defer func() { _ = srv.stop() }()
	var mbit float64
	_, err = s.measure(unit{bench: SuiteApps, series: appH3, x: float64(s.plan.AppH3Bytes), opUnit: OpMiB, work: work},
		func() (unitResult, error) {
			cpu0 := pidFileCPU(pidFile)
			out, cpu, err := s.runTimed(client, h3.Python, script, "client", addr.String(), port, "size", strconv.Itoa(s.plan.AppH3Bytes))
			if err != nil {
				return unitResult{}, err
			}
			var r struct {
				Bytes   int     `json:"bytes"`
				Seconds float64 `json:"seconds"`
				Error   string  `json:"error"`
			}
			if err := json.Unmarshal([]byte(lastLine(out)), &r); err != nil {
				return unitResult{}, fmt.Errorf("h3 client output: %w: %s", err, tail(out, 300))
			}
			if r.Error != "" || r.Bytes != s.plan.AppH3Bytes || r.Seconds <= 0 {
				return unitResult{}, fmt.Errorf("h3 client: %d of %d bytes in %.3fs: %s", r.Bytes, s.plan.AppH3Bytes, r.Seconds, r.Error)
			}
			mbit = float64(r.Bytes) * 8 / r.Seconds / 1e6
			return unitResult{ops: float64(r.Bytes) / (1 << 20), clientCPU: cpu, serverCPU: pidFileCPU(pidFile) - cpu0}, nil
		})
	if err != nil {
		return err
	}
	s.emit(SuiteApps, appH3, float64(s.plan.AppH3Bytes), "mbit_s", mbit, "")
	return nil
}

func lastLine(out string) string {
	l := strings.Split(strings.TrimSpace(out), "\n")
	return l[len(l)-1]
}

// redisRPS reads the GET line of redis-benchmark --csv.
func redisRPS(out string) (float64, error) {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Split(strings.TrimSpace(line), ",")
		if len(f) >= 2 && strings.Trim(f[0], `"`) == "GET" {
			return strconv.ParseFloat(strings.Trim(f[1], `"`), 64)
		}
	}
	return 0, fmt.Errorf("no GET line in redis-benchmark output: %s", tail(out, 300))
}

var (
	tpsRe = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)
	txRe  = regexp.MustCompile(`(?m)^number of transactions actually processed: ([0-9]+)`)
)

// pgbenchTPS reads pgbench's "tps = N (...)" line and the number of
// transactions done.
func pgbenchTPS(out string) (tps, txs float64, err error) {
	m, n := tpsRe.FindStringSubmatch(out), txRe.FindStringSubmatch(out)
	if m == nil || n == nil {
		return 0, 0, fmt.Errorf("no tps or transaction count in pgbench output: %s", tail(out, 300))
	}
	if tps, err = strconv.ParseFloat(m[1], 64); err == nil {
		txs, err = strconv.ParseFloat(n[1], 64)
	}
	return tps, txs, err
}
