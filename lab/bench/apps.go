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

//go:embed apps/h3bench.py
var h3BenchScript []byte

// quicPython is the Python with aioquic that .ci/deps installs.
const quicPython = "/opt/pal-quic/bin/python"

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

// apps runs every application once and emits one figure each.
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
	var errs []string
	fail := func(series string, err error) { errs = append(errs, fmt.Sprintf("%s: %v", series, err)) }
	secs := strconv.Itoa(s.plan.AppSeconds)

	// iperf3: one TCP stream, and UDP unlimited at two datagram sizes
	// (1,400 fits the route; 8,000 is fragmented, stamped on its first
	// fragment). Received throughput.
	if g, _, err := s.iperf(client.Name, cross); err != nil {
		fail(appIperfTCP, err)
	} else {
		s.emit(SuiteApps, appIperfTCP, 1, "gbit_s", g, "")
	}
	for _, l := range s.plan.AppUDPLens {
		series := appIperfUDP + strconv.Itoa(l)
		g, loss, err := s.iperf(client.Name, cross, "-u", "-b", "0", "-l", strconv.Itoa(l))
		if err != nil {
			fail(series, err)
			continue
		}
		s.emit(SuiteApps, series, float64(l), "gbit_s", g, "")
		s.emit(SuiteApps, series, float64(l), "loss_pct", loss, "")
	}

	// redis-benchmark GET, 10 clients, keep-alive and a new connection per
	// request (-k 0).
	if srv, err := s.startRedis(n2.Name, cross); err != nil {
		fail("redis", err)
	} else {
		// A connection per request is two orders of magnitude slower:
		// a tenth of the requests.
		for _, c := range []struct {
			series, keep string
			n            int
		}{{appRedis, "1", s.plan.AppRedisRequests}, {appRedisNew, "0", max(s.plan.AppRedisRequests/10, 100)}} {
			out, err := s.runAs(client.Name, BenchUser, "redis-benchmark", "-h", cross.String(), "-p", strconv.Itoa(PortRedis),
				"-t", "get", "-c", "10", "-n", strconv.Itoa(c.n), "-k", c.keep, "--csv")
			if err == nil {
				var rps float64
				rps, err = redisRPS(out)
				if err == nil {
					s.emit(SuiteApps, c.series, 10, "ops_s", rps, "")
				}
			}
			if err != nil {
				fail(c.series, err)
			}
		}
		_ = srv.stop()
	}

	// pgbench select-only, 4 clients, persistent and -C (a connection per
	// transaction).
	if srv, err := s.startPostgres(n2.Name, cross); err != nil {
		fail("postgres", err)
	} else {
		bin, _ := postgresBin()
		for _, c := range []struct {
			series string
			extra  []string
		}{{appPgbench, nil}, {appPgbenchNew, []string{"-C"}}} {
			argv := append([]string{filepath.Join(bin, "pgbench"), "-h", cross.String(), "-p", strconv.Itoa(PortPostgres),
				"-U", BenchUser, "-n", "-S", "-c", "4", "-j", "1", "-T", secs}, c.extra...)
			out, err := s.runAs(client.Name, BenchUser, append(argv, "postgres")...)
			if err == nil {
				var tps float64
				tps, err = pgbenchTPS(out)
				if err == nil {
					s.emit(SuiteApps, c.series, 4, "tps", tps, "")
				}
			}
			if err != nil {
				fail(c.series, err)
			}
		}
		_ = srv.stop()
	}

	// MPI allreduce, one rank on each of two nodes.
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
	if err := s.h3(client.Name, n2.Name, cross); err != nil {
		fail(appH3, err)
	}
	return joinErrs(errs)
}

// startRedis starts a redis-server as the bench user on node, on addr only,
// without persistence.
func (s *session) startRedis(node string, addr netip.Addr) (*server, error) {
	a, p := addr.String(), strconv.Itoa(PortRedis)
	script := `redis-server --bind "$1" --port "$2" --save '' --appendonly no --protected-mode no --daemonize no --dir /tmp --logfile '' >/dev/null &
pid=$!
i=0
until redis-cli -h "$1" -p "$2" ping 2>/dev/null | grep -q PONG; do
  i=$((i+1)); [ $i -gt 300 ] && { kill $pid; exit 1; }; sleep 0.1
done
echo ready
read _
kill $pid; wait $pid 2>/dev/null; exit 0`
	return s.startAs(node, BenchUser, "sh", "-c", script, "redis", a, p)
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
func (s *session) h3(client, srvNode string, addr netip.Addr) error {
	if _, err := os.Stat(quicPython); err != nil {
		return fmt.Errorf("%s: %w (run .ci/deps)", quicPython, err)
	}
	script := filepath.Join(s.env.Dir, "bench", "h3bench.py")
	if err := os.MkdirAll(filepath.Dir(script), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(script, h3BenchScript, 0o644); err != nil {
		return err
	}
	port := strconv.Itoa(PortH3)
	srv, err := s.startAs(srvNode, BenchUser, quicPython, script, "server", addr.String(), port)
	if err != nil {
		return err
	}
	defer func() { _ = srv.stop() }()
	out, err := s.runAs(client, BenchUser, quicPython, script, "client", addr.String(), port, strconv.Itoa(s.plan.AppH3Bytes))
	if err != nil {
		return err
	}
	var r struct {
		Bytes   int     `json:"bytes"`
		Seconds float64 `json:"seconds"`
		Error   string  `json:"error"`
	}
	if err := json.Unmarshal([]byte(lastLine(out)), &r); err != nil {
		return fmt.Errorf("h3 client output: %w: %s", err, tail(out, 300))
	}
	if r.Error != "" || r.Bytes != s.plan.AppH3Bytes || r.Seconds <= 0 {
		return fmt.Errorf("h3 client: %d of %d bytes in %.3fs: %s", r.Bytes, s.plan.AppH3Bytes, r.Seconds, r.Error)
	}
	s.emit(SuiteApps, appH3, float64(r.Bytes), "mbit_s", float64(r.Bytes)*8/r.Seconds/1e6, "")
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

var tpsRe = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)

// pgbenchTPS reads pgbench's "tps = N (...)" line.
func pgbenchTPS(out string) (float64, error) {
	m := tpsRe.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("no tps line in pgbench output: %s", tail(out, 300))
	}
	return strconv.ParseFloat(m[1], 64)
}
