package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/spf13/cobra"
)

func testbedCommand() *cobra.Command {
	var name string
	tb := &cobra.Command{
		Use:   "testbed",
		Short: "A real simulated cluster (netns nodes, Slurm, sshd, MPI) on this machine",
	}
	tb.PersistentFlags().StringVar(&name, "name", "", "instance name (default $PALISADE_TESTBED or "+testbed.DefaultName+")")

	var opts testbed.Options
	up := &cobra.Command{
		Use:   "up",
		Short: "Bring the testbed up (idempotent)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("nodes") && opts.Nodes == 0 {
				return fmt.Errorf("invalid node count 0: want 1..%d", testbed.MaxNodes)
			}
			if !cmd.Flags().Changed("nodes") {
				opts.Nodes = 0 // default for a new instance, any size for a running one
			}
			opts.Name = name
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			start := time.Now()
			t, err := testbed.Up(ctx, opts)
			if err != nil {
				return err
			}
			if t.AlreadyUp {
				fmt.Printf("testbed %s is already up (%d nodes, mode %s)\n", t.Name, len(t.Nodes), t.Mode)
				return nil
			}
			fmt.Printf("testbed %s is up: %d nodes, mode %s, in %.1fs (dir %s)\n", t.Name, len(t.Nodes), t.Mode,
				time.Since(start).Seconds(), t.Dir)
			flag := ""
			if t.Name != testbed.DefaultName {
				flag = " --name " + t.Name
			}
			fmt.Printf("  palisade-lab testbed status%s\n  palisade-lab testbed exec%s node1 --user alice -- srun -N%d hostname\n  palisade-lab check%s\n  palisade-lab testbed down%s\n",
				flag, flag, len(t.Nodes), flag, flag)
			return nil
		},
	}
	up.Flags().IntVar(&opts.Nodes, "nodes", testbed.DefaultNodes, fmt.Sprintf("number of compute nodes (1..%d)", testbed.MaxNodes))
	up.Flags().StringVar(&opts.Mode, "mode", "", "data-plane mode brought up after the cluster (none, or a registered mode)")
	up.Flags().BoolVar(&opts.Egress, "egress", false, "also bring up the egress extension")
	up.Flags().BoolVar(&opts.Audit, "audit", false, "with --mode userwall: audit mode on every node (decide and log, refuse nothing)")
	up.Flags().StringSliceVar(&opts.Agents, "agents", nil, "with --mode userwall: staged rollout, the agent on these nodes only (e.g. node1,node2); the others are [cluster] unenforced_nodes")
	up.Flags().BoolVar(&opts.VM, "vm", false, "run the testbed inside a VM (VRF-capable kernel)")
	up.Flags().StringVar(&opts.Directory, "directory", "", "where the nodes' accounts come from: \"\" (the host's /etc files) or \"ldap\" (slapd + SSSD per node, no enumeration)")
	up.Flags().IntVar(&opts.DirectoryUsers, "directory-users", 0, "with --directory ldap: add N synthetic users in N/5 groups (10 memberships each)")
	up.Flags().StringVar(&opts.Kernel, "kernel", "", "with --vm: the guest's Debian kernel series, 6.1 (default) or 6.12 (`palisade-lab vm kernel --version`)")

	down := &cobra.Command{
		Use:   "down",
		Short: "Take the testbed down, removing everything it created",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			n := testbed.ResolveName(name)
			if !testbed.Exists(n) {
				fmt.Printf("testbed %s is not up\n", n)
				return nil
			}
			// Half a teardown helps nobody: finish it (it takes a second).
			signal.Ignore(os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
			start := time.Now()
			if err := testbed.Down(context.WithoutCancel(cmd.Context()), n); err != nil {
				return err
			}
			fmt.Printf("testbed %s is down (%.1fs)\n", n, time.Since(start).Seconds())
			return nil
		},
	}

	status := &cobra.Command{
		Use:   "status",
		Short: "Show nodes, addresses, daemons, Slurm state and mode",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			t, err := testbed.Open(name)
			if err != nil {
				if errors.Is(err, testbed.ErrNotUp) {
					return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("testbed %s is not up", testbed.ResolveName(name))}
				}
				return err
			}
			fmt.Print(t.Status(cmd.Context()))
			return nil
		},
	}

	var user string
	execCmd := &cobra.Command{
		Use:   "exec NODE [--user U] -- CMD...",
		Short: "Run a command as a user on a node (login-like environment)",
		Long: "Run CMD as USER (default root) on NODE (node1..nodeN or outside) in a login-like\n" +
			"environment; stdio passes through and CMD's exit status is palisade's.\n" +
			"Without CMD, the user's login shell.",
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			t, err := testbed.Open(name)
			if err != nil {
				return err
			}
			c := t.Command(context.Background(), args[0], user, args[1:]...)
			c.Stdin, c.Stdout, c.Stderr = os.Stdin, os.Stdout, os.Stderr
			// Stay in the terminal's foreground process group.
			c.SysProcAttr, c.Cancel = nil, nil
			// The child gets terminal signals itself; don't die before it.
			// TERM and HUP sent to palisade are passed on.
			signal.Ignore(os.Interrupt, syscall.SIGQUIT)
			if err := c.Start(); err != nil {
				return err
			}
			fwd := make(chan os.Signal, 1)
			signal.Notify(fwd, syscall.SIGTERM, syscall.SIGHUP)
			go func() {
				for s := range fwd {
					c.Process.Signal(s)
				}
			}()
			err = c.Wait()
			signal.Stop(fwd)
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code := ee.ExitCode()
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					code = 128 + int(ws.Signal())
				}
				return &cli.ExitError{Code: code, Msg: ""}
			}
			return err
		},
	}
	execCmd.Flags().StringVarP(&user, "user", "u", "", "user to run as (default root)")

	tb.AddCommand(up, down, status, execCmd)
	return tb
}
