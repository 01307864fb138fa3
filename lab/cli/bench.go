package cli

import (
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/lab/bench"
)

func benchCommand() *cobra.Command {
	var (
		o          bench.Options
		modes      string
		suites     string
		setupUsers string
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure every mode's overhead against its baseline on the testbed",
		Long: `Runs interleaved rounds (baseline, mode, baseline, mode, ...) of bulk
throughput (iperf3), request/response latency, connection setup, MPI, scale
and egress benchmarks on the testbed (brought up if it is not running), and
writes results.json, results.md and PNG plots to --out. Every figure is the
median over rounds with min-max, and its ratio to the baseline.
A mode whose data plane is not available is reported as skipped.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("bench drives the testbed and needs root")
			}
			if modes != "" {
				o.Modes = splitList(modes)
			}
			if suites != "" {
				o.Suites = splitList(suites)
			}
			if setupUsers != "" {
				us, err := bench.ParseInts(setupUsers)
				if err != nil {
					return err
				}
				p := bench.FullPlan()
				if o.Quick {
					p = bench.QuickPlan()
				}
				p.SetupUsers = us
				o.Plan = &p
			}
			o.Log = os.Stderr
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			t0 := time.Now()
			res, err := bench.Run(ctx, o)
			if res != nil {
				fmt.Printf("bench: %d figures in %s; results in %s\n", len(res.Figures), time.Since(t0).Round(time.Second), o.Out)
				for _, m := range res.Modes {
					line := fmt.Sprintf("  %-9s %s", m.Name, m.Status)
					if m.Reason != "" {
						line += ": " + m.Reason
					}
					fmt.Println(line)
				}
				for _, t := range res.Targets() {
					if t.Verdict != "not measured" {
						fmt.Printf("  target #%d %s: %s — %s\n", t.Issue, t.Goal, t.Verdict, t.Measured)
					}
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.BoolVar(&o.Quick, "quick", false, "fewer points, shorter runs (about 2 minutes)")
	f.StringVar(&modes, "modes", strings.Join(bench.DefaultModes, ","), "modes to measure (comma-separated): "+strings.Join(bench.ModeNames(), ", "))
	f.StringVar(&o.Out, "out", filepath.Join("docs", "benchmarks"), "output directory")
	f.StringVar(&o.Name, "name", "", "testbed instance (default $PALISADE_TESTBED or pal)")
	f.StringVar(&o.VMName, "vm-name", bench.DefaultVMName, "VM testbed instance for the uvn mode")
	f.IntVar(&o.Rounds, "rounds", 0, "rounds per mode (default: 5, or 2 with --quick)")
	f.StringVar(&suites, "suites", "", "run only these suites: throughput,latency,conn,mpi,scale,setup,egress")
	f.StringVar(&setupUsers, "setup-users", "", "uvn scale test: user counts (default 10,100; 5 with --quick)")
	f.BoolVar(&o.Merge, "merge", false, "keep the other modes of --out's results.json (re-run some modes only)")
	f.BoolVar(&o.Keep, "keep", false, "leave a testbed the bench brought up running")

	report := &cobra.Command{
		Use:   "report",
		Short: "Re-render tables and plots from a results.json",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			from, _ := cmd.Flags().GetString("from")
			out, _ := cmd.Flags().GetString("out")
			merge, _ := cmd.Flags().GetString("merge")
			r, err := bench.LoadResults(from)
			if err != nil {
				return err
			}
			if merge != "" {
				// Fail on a bad file (MergeInto skips one silently).
				if _, err := bench.LoadResults(merge); err != nil {
					return err
				}
				bench.Remerge(r, merge)
			}
			if out == "" {
				out = filepath.Dir(from)
			}
			return bench.WriteOutputs(r, out)
		},
	}
	report.Flags().String("from", filepath.Join("docs", "benchmarks", "results.json"), "results file")
	report.Flags().String("out", "", "output directory (default: the results file's)")
	report.Flags().String("merge", "", "keep only the modes --from's own run measured and take the others from this results file (two runs landing one after the other)")

	cmd.AddCommand(report, benchServeCmd(), benchConnCmd(), benchRRCmd(), benchHoldCmd(), benchUVNSetupCmd(), benchProgStatsCmd(), benchUDPCmd())
	return cmd
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// privFlags are the scale test's identity switch: start as root in the
// node, raise the descriptor limit, become an arbitrary uid.
type privFlags struct {
	uid, gid int
	nofile   uint64
}

func (p *privFlags) add(cmd *cobra.Command) {
	cmd.Flags().IntVar(&p.uid, "uid", -1, "drop to this uid first (root only)")
	cmd.Flags().IntVar(&p.gid, "gid", -1, "with --uid: this gid (default = uid)")
	cmd.Flags().Uint64Var(&p.nofile, "nofile", 0, "raise RLIMIT_NOFILE first (root only)")
}

func (p *privFlags) apply() error {
	if p.uid < 0 && p.nofile == 0 {
		return nil
	}
	return bench.DropPrivileges(p.uid, p.gid, p.nofile)
}

// nodeCmd is a hidden command the bench runs inside a node. With priv, it
// adds the identity switch flags and applies them before run.
func nodeCmd(use, short string, priv *privFlags, run func(cmd *cobra.Command) error) *cobra.Command {
	cmd := &cobra.Command{
		Use:    use,
		Short:  short,
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if priv != nil {
				if err := priv.apply(); err != nil {
					return err
				}
			}
			return run(cmd)
		},
	}
	if priv != nil {
		priv.add(cmd)
	}
	return cmd
}

// printJSON writes a node command's result on stdout, for the bench to read.
func printJSON(v any, err error) error {
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(v)
}

// forEach runs f on each of a comma-separated list of integers and collects
// the results.
func forEach[R any](list string, f func(int) (R, error)) ([]R, error) {
	ns, err := bench.ParseInts(list)
	if err != nil {
		return nil, err
	}
	var out []R
	for _, n := range ns {
		r, err := f(n)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

func benchServeCmd() *cobra.Command {
	var (
		cfg   bench.ServeConfig
		iperf string
		conn  string
		priv  privFlags
	)
	cmd := nodeCmd("serve", "bench servers in a node (until stdin closes)", &priv, func(cmd *cobra.Command) error {
		var err error
		if conn != "" {
			if cfg.ConnPorts, err = bench.ParseInts(conn); err != nil {
				return err
			}
		}
		if iperf != "" {
			if cfg.IperfPorts, err = bench.ParseInts(iperf); err != nil {
				return err
			}
		}
		return bench.Serve(cmd.Context(), cfg, os.Stdin, os.Stdout)
	})
	cmd.Flags().StringVar(&cfg.Addr, "addr", "", "bind address (default all)")
	cmd.Flags().StringVar(&conn, "conn", "", "connection-setup server ports (comma-separated)")
	cmd.Flags().IntVar(&cfg.RRPort, "rr", 0, "echo server port")
	cmd.Flags().StringVar(&iperf, "iperf", "", "iperf3 server ports (comma-separated)")
	cmd.Flags().IntVar(&cfg.UDPSink, "udp-sink", 0, "UDP port counting datagrams (v4 and v6)")
	cmd.Flags().IntVar(&cfg.UDPEcho, "udp-echo", 0, "UDP echo port (v4 and v6)")
	return cmd
}

func benchConnCmd() *cobra.Command {
	var (
		addr, threads string
		conns         int
		startAt       int64
		priv          privFlags
	)
	cmd := nodeCmd("conn", "connection-setup load generator (JSON on stdout)", &priv, func(*cobra.Command) error {
		if _, err := bench.ParseInts(threads); err != nil {
			return err // before waiting for the start
		}
		if startAt > 0 {
			time.Sleep(time.Until(time.Unix(0, startAt)))
		}
		return printJSON(forEach(threads, func(t int) (bench.ConnResult, error) { return bench.ConnRun(addr, t, conns) }))
	})
	cmd.Flags().StringVar(&addr, "addr", "", "server IP:port")
	cmd.Flags().StringVar(&threads, "threads", "1", "thread counts, run one after another")
	cmd.Flags().IntVar(&conns, "conns", 1000, "connections per thread")
	cmd.Flags().Int64Var(&startAt, "start-at", 0, "start at this Unix time (ns)")
	return cmd
}

func benchRRCmd() *cobra.Command {
	var (
		addr, sizes string
		iters       int
	)
	cmd := nodeCmd("rr", "request/response latency client (JSON on stdout)", nil, func(*cobra.Command) error {
		ss, err := bench.ParseInts(sizes)
		if err != nil {
			return err
		}
		return printJSON(bench.RRRun(addr, ss, iters))
	})
	cmd.Flags().StringVar(&addr, "addr", "", "echo server IP:port")
	cmd.Flags().StringVar(&sizes, "sizes", "1,64,1024,65536", "message sizes in bytes")
	cmd.Flags().IntVar(&iters, "iters", 1000, "round trips per size")
	return cmd
}

func benchHoldCmd() *cobra.Command {
	var (
		addr string
		n    int
		priv privFlags
	)
	cmd := nodeCmd("hold", "hold N idle connections open (until stdin closes)", &priv, func(*cobra.Command) error {
		return bench.Hold(addr, n, os.Stdin, os.Stdout)
	})
	cmd.Flags().StringVar(&addr, "addr", "", "server IP:port")
	cmd.Flags().IntVarP(&n, "n", "n", 100, "connections")
	return cmd
}

func benchUVNSetupCmd() *cobra.Command {
	var (
		first uint32
		n     int
	)
	cmd := nodeCmd("uvnsetup", "uvn per-user setup/teardown times as users fill a node (JSON on stdout)", nil, func(*cobra.Command) error {
		return printJSON(bench.UVNScale(configPath, first, n))
	})
	cmd.Flags().Uint32Var(&first, "first", bench.UVNScaleUIDBase, "first uid")
	cmd.Flags().IntVarP(&n, "n", "n", 10, "users")
	return cmd
}

func benchProgStatsCmd() *cobra.Command {
	var set string
	cmd := nodeCmd("progstats", "uvn: this node's eBPF programs with their run-time statistics (JSON on stdout)", nil, func(*cobra.Command) error {
		return printJSON(bench.ReadGuestProgs(configPath, set))
	})
	cmd.Flags().StringVar(&set, "set-stats", "", "first write this to kernel.bpf_stats_enabled (the previous value is reported)")
	return cmd
}

func benchUDPCmd() *cobra.Command {
	var (
		addr, sizes string
		seconds     float64
		rr          bool
		iters       int
	)
	cmd := nodeCmd("udp", "UDP datagram-rate or round-trip client (JSON on stdout)", nil, func(*cobra.Command) error {
		return printJSON(forEach(sizes, func(size int) (r bench.UDPResult, err error) {
			if rr {
				r, err = bench.UDPRoundTrips(addr, size, iters)
			} else {
				r, err = bench.UDPRate(addr, size, time.Duration(seconds*float64(time.Second)))
			}
			if err != nil {
				return r, fmt.Errorf("%d B: %w", size, err)
			}
			return r, nil
		}))
	})
	cmd.Flags().StringVar(&addr, "addr", "", "server IP:port")
	cmd.Flags().StringVar(&sizes, "sizes", "64", "datagram sizes in bytes")
	cmd.Flags().Float64Var(&seconds, "seconds", 1, "rate test: sending time per size")
	cmd.Flags().BoolVar(&rr, "rr", false, "round trips to an echo server instead of a rate test")
	cmd.Flags().IntVar(&iters, "iters", 1000, "round trips per size")
	return cmd
}
