package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func checkCommand() *cobra.Command {
	var (
		mode, name, launchers string
		unix                  string
		connectors, listeners string
		asJSON, quick, quiet  bool
		maxMismatches         int
		timeout               time.Duration
		attacks, verbose      bool
		kernelDependent       bool
		only                  string
		actors                bool
		repeat                int
		churn                 time.Duration
		fuzzFor               time.Duration
		seed                  uint64
		fuzzReplay, fuzzNodes string
	)
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Run the isolation matrix on the running testbed",
		Long: `Starts real listeners (alice, bob, carol, svc, alice under sg proj1, root on a system
port) on every node and the outside host, and real connectors (alice, bob, carol, svc, root)
as plain processes, over ssh, in srun steps, in sbatch jobs and as mpirun ranks on two
nodes; every connector probes TCP and UDP over IPv4 and IPv6 via loopback, the node's own
address, another node's eth0 and ib0, and the outside host (plus outside host → node).
Each observed outcome is compared with what the mode expects: "none" expects everything
open (today's shared cluster), "userwall" expects the policy core's verdict (and, on a
staged testbed — testbed up --agents — everything open on nodes without the agent, and
traffic from them admitted as "unverified"), "audit" (testbed up --audit) expects every
case open and an audit event in the listener node's event log for every case the policy
refuses. Prints a table
and "N passed, M failed"; exits 1 on any mismatch. See docs/check.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return errors.New("check needs root: it starts processes as the testbed's users inside its namespaces")
			}
			tb, err := testbed.Open(name)
			if err != nil {
				return err
			}
			if tb.VM {
				// The matrix runs next to the nodes: inside the guest.
				r := check.Relay()
				if r == nil {
					return fmt.Errorf("testbed %s runs in a VM and no VM relay is registered: run `palisade-lab check` inside the VM", tb.Name)
				}
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
				defer stop()
				// The same flags, except --name: the guest has its own testbed.
				args := []string{"check"}
				cmd.Flags().Visit(func(f *pflag.Flag) {
					if f.Name != "name" {
						args = append(args, "--"+f.Name+"="+f.Value.String())
					}
				})
				code, err := r(ctx, tb, args, cmd.OutOrStdout(), cmd.ErrOrStderr())
				if err != nil {
					return err
				}
				if code != 0 {
					return &cli.ExitError{Code: code, Msg: fmt.Sprintf("check in VM testbed %s exited %d", tb.Name, code)}
				}
				return nil
			}
			if attacks {
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
				defer stop()
				if !cmd.Flags().Changed("actors") {
					// Default: on for uvn, whose every step is a login
					// (measured in the VM, docs/check.md); userwall's
					// suite keeps a process per step unless asked.
					actors = mode == "uvn" || (mode == "" && tb.Mode == "uvn")
				}
				return runAttacks(ctx, tb, mode, only, actors, kernelDependent, verbose, quiet)
			}
			if cmd.Flags().Changed("fuzz") || fuzzReplay != "" {
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
				defer stop()
				return runFuzz(ctx, tb, fuzzFor, seed, cmd.Flags().Changed("seed"), mode, fuzzReplay, fuzzNodes, quiet)
			}
			if cmd.Flags().Changed("churn") {
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
				defer stop()
				return runChurn(ctx, tb, churn, quiet)
			}
			if mode == "" {
				mode = tb.Mode
				if mode == "" {
					mode = "none"
				}
			}
			opts := check.Options{Mode: mode, Quick: quick, Timeout: timeout,
				Connectors: splitList(connectors), Listeners: splitList(listeners), Unix: unix}
			for _, l := range splitList(launchers) {
				opts.Launchers = append(opts.Launchers, check.Launcher(l))
			}
			if !quiet {
				opts.Log = os.Stderr
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if repeat > 1 {
				reps, err := check.RunRepeat(ctx, tb, opts, repeat, func(i int, r *check.Report) {
					check.WriteRepeatRun(cmd.OutOrStdout(), i, repeat, r, maxMismatches)
				})
				if err != nil {
					return err
				}
				_, failed := check.WriteRepeatSummary(cmd.OutOrStdout(), reps)
				if ctx.Err() != nil {
					return &cli.ExitError{Code: 130, Msg: "interrupted"}
				}
				if failed > 0 {
					return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("%d mismatches in %d runs of mode %s", failed, len(reps), mode)}
				}
				return nil
			}
			rep, err := check.Run(ctx, tb, opts)
			if err != nil {
				return err
			}
			if asJSON {
				if err := rep.WriteJSON(cmd.OutOrStdout()); err != nil {
					return err
				}
			} else {
				rep.MaxMismatches = maxMismatches
				rep.WriteTable(cmd.OutOrStdout())
			}
			if ctx.Err() != nil {
				return &cli.ExitError{Code: 130, Msg: "interrupted"}
			}
			if _, failed := rep.Counts(); failed > 0 {
				return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("%d of %d cases did not match mode %s", failed, len(rep.Cases), mode)}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&mode, "mode", "", "expectation: "+strings.Join(check.Modes(), ", ")+" (default: the testbed's mode)")
	f.StringVar(&name, "name", "", "testbed instance (default $PALISADE_TESTBED or pal)")
	f.StringVar(&launchers, "launchers", "", "comma-separated subset of plain,ssh,srun,sbatch,mpirun (default all)")
	f.BoolVar(&asJSON, "json", false, "print every case as JSON")
	f.StringVar(&connectors, "connectors", "", "comma-separated subset of connectors alice,bob,carol,svc,root (default all, or --quick's)")
	f.StringVar(&listeners, "listeners", "", "comma-separated subset of listeners alice,bob,carol,svc,alice+proj1,root (default all, or --quick's)")
	f.BoolVar(&quick, "quick", false, "fewer identities (bob, carol, root → alice, bob, svc, alice+proj1, root): every launcher, path, protocol, family and policy rule")
	f.IntVar(&maxMismatches, "max-mismatches", 0, "list at most this many mismatches in the table (0 = all)")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	f.DurationVar(&timeout, "timeout", 0, "give up on the run after this long (default 5m; 30m inside the uvn VM)")
	f.StringVar(&unix, "unix", "auto", "abstract Unix socket cases: on, off, or auto (mode userwall where node1's agent enforces them)")
	f.BoolVar(&attacks, "attacks", false, "run the attack suite of the testbed's mode (userwall; uvn in its VM): real attacks, each with a control; see docs/check.md")
	f.StringVar(&only, "only", "", "with --attacks: run only the cases whose name contains one of these comma-separated strings")
	f.BoolVar(&kernelDependent, "kernel-dependent", false, "with --attacks (userwall): run only the cases whose outcome can depend on the kernel version (lab/kernels runs these on the other kernels; docs/check.md)")
	f.BoolVar(&verbose, "verbose", false, "with --attacks: print every case's rationale and steps, not only the failures'")
	f.BoolVar(&actors, "actors", false, "with --attacks: run each user's steps in one long-lived process per node (uvn: a login per user, not per step); default on in uvn, off in userwall")
	f.IntVar(&repeat, "repeat", 1, "run the matrix this many times; report every run's mismatches and the total (flakes show as mismatches in some runs)")
	f.DurationVar(&churn, "churn", 10*time.Minute, "run the churn test for this long (userwall testbed): legitimate traffic and attacks while agents are killed, restarted, reloaded, their nft objects flushed and addresses added")
	f.DurationVar(&fuzzFor, "fuzz", 0, "run the attack fuzzer for this long: random programs of unprivileged system calls as bob and carol against alice's sentinels on every node, judged by --mode's expectation; see docs/fuzz.md")
	f.Uint64Var(&seed, "seed", 0, "with --fuzz: the seed (default random; printed); the same seed draws the same programs")
	f.StringVar(&fuzzReplay, "fuzz-replay", "", "run one fuzzer program (JSON, or a file holding it) as printed with a finding, once")
	f.StringVar(&fuzzNodes, "fuzz-nodes", "", "with --fuzz: comma-separated nodes to use (default all)")
	return cmd
}
