package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/lab/probe"
	"github.com/spf13/cobra"
)

// `palisade-lab probe` is the traffic generator behind `palisade-lab check` and the
// benchmarks. It is hidden: operators never need it, but it must be in the
// one binary that the testbed copies to every node.
func probeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:    "probe",
		Short:  "Real listener and connector used by check and bench",
		Hidden: true,
	}
	cmd.AddCommand(probeListenCmd(), probeConnectCmd(), probeSinkCmd(), probeActCmd(), probeSentinelCmd(), probeFuzzCmd())
	return cmd
}

func probeListenCmd() *cobra.Command {
	var (
		ports, protos, families string
		stdinEOF                bool
		lifetime                time.Duration
	)
	c := &cobra.Command{
		Use:   "listen --ports P[,P...]",
		Short: "Serve probe requests on TCP/UDP, IPv4/IPv6, answering with a nonce echo and this process's identity",
		Long: `Binds a separate IPv4 and IPv6 (v6-only) socket per port and protocol and answers
every request with its nonce and the listener's uid, effective gid and hostname. Prints one
JSON line {"type":"ready",...} on stdout once every socket is bound, then serves until
SIGTERM/SIGINT, --lifetime, or (with --exit-on-stdin-eof) until stdin closes.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := probe.ListenConfig{}
			for _, s := range probeList(ports) {
				// Ranges "a-b" keep command lines short for many ports.
				lo, hi, isRange := strings.Cut(s, "-")
				a, err := strconv.ParseUint(lo, 10, 16)
				b := a
				if err == nil && isRange {
					b, err = strconv.ParseUint(hi, 10, 16)
				}
				if err != nil || a == 0 || b < a || b-a > 4096 {
					return fmt.Errorf("bad port %q", s)
				}
				for p := a; p <= b; p++ {
					cfg.Ports = append(cfg.Ports, uint16(p))
				}
			}
			for _, s := range probeList(protos) {
				switch s {
				case "tcp":
					cfg.TCP = true
				case "udp":
					cfg.UDP = true
				case "unix":
					cfg.Unix = true // abstract stream and datagram sockets
				default:
					return fmt.Errorf("bad protocol %q (want tcp, udp, unix)", s)
				}
			}
			for _, s := range probeList(families) {
				switch s {
				case "4", "6":
					cfg.Families = append(cfg.Families, int(s[0]-'0'))
				default:
					return fmt.Errorf("bad family %q (want 4, 6)", s)
				}
			}
			l, err := probe.Listen(cfg)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if lifetime > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, lifetime)
				defer cancel()
			}
			if stdinEOF {
				// The starter holds our stdin: when it dies, so do we.
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				go func() { io.Copy(io.Discard, os.Stdin); cancel() }()
			}
			self := l.Self()
			ready, _ := json.Marshal(map[string]any{"type": "ready", "pid": os.Getpid(),
				"uid": self.UID, "gid": self.GID, "host": self.Host, "ports": l.Ports()})
			fmt.Fprintf(cmd.OutOrStdout(), "%s\n", ready)
			l.Serve(ctx)
			return nil
		},
	}
	c.Flags().StringVar(&ports, "ports", "", "ports to serve: list and ranges, e.g. 29101,29110-29120")
	c.Flags().StringVar(&protos, "proto", "tcp,udp", "protocols: tcp, udp, unix (abstract @palprobe-PORT stream and @palprobe-PORT-dg datagram sockets)")
	c.Flags().StringVar(&families, "family", "4,6", "address families: 4, 6")
	c.Flags().BoolVar(&stdinEOF, "exit-on-stdin-eof", false, "exit when stdin reaches EOF (the starter died)")
	c.Flags().DurationVar(&lifetime, "lifetime", 0, "exit after this long (0 = never)")
	return c
}

func probeConnectCmd() *cobra.Command {
	var (
		planPath, host, outPath string
		deadline                time.Duration
	)
	c := &cobra.Command{
		Use:   "connect (--plan FILE | proto:host:port ...)",
		Short: "Probe targets concurrently; one JSON line per case",
		Long: `Probes the plan's targets for this host (its hostname, or --host) concurrently:
TCP connect with a short timeout, UDP over a connected socket (so ICMP errors surface) with a
few short retries. Prints a "start" line (this process's uid, gid, groups, host), one "result"
line per case (allowed with the answering listener's identity, or refused with the error
kind) and a "done" line. Targets can also be given as arguments: tcp:127.0.0.1:29101.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			var plan *probe.Plan
			var err error
			switch {
			case planPath == "-":
				plan, err = probe.ReadPlan(os.Stdin)
			case planPath != "":
				f, ferr := os.Open(planPath)
				if ferr != nil {
					return ferr
				}
				plan, err = probe.ReadPlan(f)
				f.Close()
			default:
				plan = &probe.Plan{Hosts: map[string][]probe.Target{}}
			}
			if err != nil {
				return err
			}
			for i, a := range args {
				t, err := probe.ParseTarget(a, i)
				if err != nil {
					return err
				}
				plan.Hosts["*"] = append(plan.Hosts["*"], t)
			}
			if host == "" {
				host = probe.Self().Host
			}
			targets := plan.For(host)
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			ctx, cancel := context.WithTimeout(ctx, deadline)
			defer cancel()

			out := cmd.OutOrStdout()
			if outPath != "" {
				// A file per host: MPI ranks share one command line, and
				// launchers (mpirun, srun) may split stdout lines.
				f, err := os.OpenFile(strings.ReplaceAll(outPath, "{host}", host),
					os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
				if err != nil {
					return err
				}
				defer f.Close()
				out = f
			}
			w := bufio.NewWriter(out)
			enc := json.NewEncoder(w)
			enc.Encode(probe.StartLine(host, len(targets)))
			w.Flush()
			probe.NewConnector(plan).Run(ctx, targets, func(r probe.Result) {
				enc.Encode(probe.ResultLine(host, r))
			})
			enc.Encode(probe.Line{Type: "done", Host: host, PID: os.Getpid(), Cases: len(targets)})
			if err := w.Flush(); err != nil {
				return err
			}
			if f, ok := out.(*os.File); ok && outPath != "" {
				if err := f.Close(); err != nil {
					return err
				}
				// The done line also goes through the launcher's own
				// I/O path (ssh channel, srun/slurmstepd, Open MPI's
				// forwarding, the batch output file): a launcher whose
				// I/O breaks while the job still runs is caught there.
				b, _ := json.Marshal(probe.Line{Type: "done", Host: host, PID: os.Getpid(), Cases: len(targets)})
				_, err := cmd.OutOrStdout().Write(append(b, '\n'))
				return err
			}
			return nil
		},
	}
	c.Flags().StringVar(&planPath, "plan", "", "plan file (JSON; - for stdin)")
	c.Flags().StringVar(&host, "host", "", "use this host's targets (default: hostname)")
	c.Flags().StringVar(&outPath, "out", "", "write the JSON lines to this file instead of stdout ({host} = hostname)")
	c.Flags().DurationVar(&deadline, "deadline", 60*time.Second, "give up on every case still running after this long")
	return c
}

func probeList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
