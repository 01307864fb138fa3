package bench

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
)

//go:embed mpi/mpibench.c
var mpiSource []byte

// buildMPI compiles the MPI program with mpicc on node1 (so it matches the
// node's OpenMPI, also inside the VM) into <Dir>/bench/mpibench.
func buildMPI(ctx context.Context, env *Env) (string, error) {
	n, err := env.node(0)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(env.Dir, "bench")
	prog := filepath.Join(dir, "mpibench")
	script := fmt.Sprintf("set -e; mkdir -p %[1]s; chmod 755 %[1]s; cat > %[1]s/mpibench.c; mpicc -O2 -o %[2]s %[1]s/mpibench.c; chmod 755 %[2]s", dir, prog)
	cmd := env.Command(ctx, n.Name, "", "sh", "-c", script)
	cmd.Stdin = bytes.NewReader(mpiSource)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("mpicc: %w: %s", err, tail(string(out), 400))
	}
	return prog, nil
}

type mpiLine struct {
	Test  string  `json:"test"`
	Size  int     `json:"size"`
	Lat   float64 `json:"lat_us"`
	BW    float64 `json:"bw_mb_s"`
	US    float64 `json:"us"`
	OK    bool    `json:"ok"`
	Ranks int     `json:"ranks"`
}

// mpi: OpenMPI ping-pong and allreduce across 2 and 3 nodes, one rank per
// node, TCP over the eth0 network (the spirit of reference 000 §5.2.2).
func (s *session) mpi() error {
	if s.mpiProg == "" {
		return fmt.Errorf("no MPI program (mpicc failed; see errors)")
	}
	var errs []string
	for _, np := range s.plan.MPINodes {
		series := fmt.Sprintf("np%d", np)
		lines, err := s.mpiRun(np, s.plan.MPISizes)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", series, err)) // the checked lines still count
		}
		for _, l := range lines {
			switch l.Test {
			case "pingpong":
				s.emit(SuiteMPI, series+"-pingpong", float64(l.Size), "lat_us", l.Lat, "")
				// Bandwidth from the latency (bytes per µs = MB/s): the
				// program prints it with three decimals, which reads 0.000
				// for small messages once a one-way trip takes over 16 ms —
				// as it does for 8 B on a loaded machine, where the ranks
				// (mpi_yield_when_idle) wait for the scheduler in every mode.
				bw := l.BW
				if l.Lat > 0 {
					bw = float64(l.Size) / l.Lat
				}
				s.emit(SuiteMPI, series+"-pingpong", float64(l.Size), "bw_mb_s", bw, "")
			case "allreduce":
				s.emit(SuiteMPI, series+"-allreduce", float64(l.Size), "allreduce_us", l.US, "")
			}
		}
	}
	return joinErrs(errs)
}

// mpiRun runs the MPI program on the first np nodes with the given message
// sizes and returns its checked result lines.
func (s *session) mpiRun(np int, sizes []int) ([]mpiLine, error) {
	if np > len(s.env.Nodes) {
		return nil, fmt.Errorf("%d nodes: testbed has only %d", np, len(s.env.Nodes))
	}
	var hosts []string
	for i := 0; i < np; i++ {
		hosts = append(hosts, s.env.Nodes[i].Name+":1")
	}
	net := netipPrefix24(s.env.Nodes[0].Eth0)
	argv := []string{"mpirun", "-np", strconv.Itoa(np), "--host", strings.Join(hosts, ","),
		"--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", net,
		"--mca", "oob_tcp_if_include", net, "--mca", "pml", "ob1",
		// Ranks share two oversubscribed cores with everything else:
		// busy polling would measure scheduler quanta (ms), not the
		// network (µs).
		"--mca", "mpi_yield_when_idle", "1",
		s.mpiProg, strconv.Itoa(s.plan.MPIIters)}
	for _, sz := range sizes {
		argv = append(argv, strconv.Itoa(sz))
	}
	out, err := s.runAs(s.env.Nodes[0].Name, BenchUser, argv...)
	if err != nil {
		return nil, err
	}
	var lines []mpiLine
	var errs []string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var l mpiLine
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			continue
		}
		if !l.OK {
			errs = append(errs, fmt.Sprintf("%s size %d: data check failed", l.Test, l.Size))
			continue
		}
		lines = append(lines, l)
	}
	if len(lines) == 0 {
		errs = append(errs, fmt.Sprintf("no results in output: %s", tail(out, 300)))
	}
	return lines, joinErrs(errs)
}

// netipPrefix24 is the /24 of a node address (the testbed's node nets).
func netipPrefix24(a netip.Addr) string {
	p, err := a.Prefix(24)
	if err != nil {
		return a.String()
	}
	return p.String()
}
