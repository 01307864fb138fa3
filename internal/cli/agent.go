package cli

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
)

func agentCommand() *cobra.Command {
	var (
		o         control.Options
		uninstall bool
		reload    bool
		reopen    bool
	)
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the userwall agent: the identity firewall in eBPF for this node (network namespace)",
		Long: `Load the userwall eBPF programs for this node's network namespace, attach them
to the root of the cgroup v2 hierarchy and to the cluster interfaces, and keep
their maps in step with the configuration, the node's addresses and NSS group
membership. Denials are logged as JSON lines and to syslog; metrics are served
for Prometheus. The agent also runs the ident service.

Programs, links and maps are pinned: they keep enforcing while the agent is
stopped or restarting, and a restarted agent adopts them without a gap.
SIGHUP reloads the configuration and applies every setting: policy and audit
mode (maps updated in place, no gap), cluster keys, event log (reopened),
metrics address, ident port and socket, group refresh. A file that is
invalid, that config check calls an ERROR (no usable cluster key, an exempt
name that does not resolve, Slurm's accounts not exempt, this node outside
the cluster subnets) or that changes a setting fixed for the agent's life
(bpffs, pid_file, unix_sockets) is refused whole and the running
configuration stays. At start the agent never refuses over such an ERROR:
it enforces the rest and reports it (status, metrics, log). SIGUSR1
(--reopen-logs) only reopens the event log: what logrotate sends.
--reload checks the file, signals the agent and waits for its answer: exit 0
once applied, 1 with the agent's reason when refused. --uninstall stops the
agent and removes everything it made.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.ConfigPath = configPath
			o.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
			if uninstall {
				if err := control.Uninstall(o); err != nil {
					return fmt.Errorf("uninstall: %w", err)
				}
				fmt.Fprintln(cmd.OutOrStdout(), "userwall removed from this node")
				return nil
			}
			if reopen {
				if err := control.SignalReopen(o); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), "event log reopened")
				return nil
			}
			if reload {
				if err := control.SignalReload(o); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), "configuration reloaded")
				return nil
			}
			return userwall.RunAgent(context.Background(), o)
		},
	}
	f := cmd.Flags()
	f.BoolVar(&uninstall, "uninstall", false, "stop the agent and remove every program, pin and nft table it made")
	f.BoolVar(&reload, "reload", false, "ask the running agent to reload its configuration (SIGHUP) and wait until it is applied or refused")
	f.BoolVar(&reopen, "reopen-logs", false, "ask the running agent to reopen its event log (SIGUSR1, for logrotate) and wait; nothing is reloaded")
	f.StringVar(&o.PidFile, "pid-file", "", "pid file (default: [agent] pid_file)")
	f.StringVar(&o.EventLog, "event-log", "", "JSON-lines denial log (default: [agent] event_log)")
	f.StringVar(&o.MetricsAddress, "metrics-address", "", "Prometheus listen address (default: [agent] metrics_address)")
	f.StringVar(&o.IdentSocket, "ident-socket", "", "ident Unix API socket (default: [agent] ident_socket)")
	return cmd
}
