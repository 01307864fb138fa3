package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
)

// Exit codes of `palisade status` (also with --check and --json).
const (
	statusOK          = 0 // enforcing, no warnings
	statusWarnings    = 1 // enforcing (or auditing) with warnings, e.g. agent down
	statusNotEnforced = 2 // no userwall on this node, or unknown
)

func statusCommand() *cobra.Command {
	var (
		asJSON, check, all bool
		verbose, enforcing bool
		pidFile            string
		timeout            time.Duration
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the data plane of this node: mode, agent, version, configuration, programs, counters, warnings",
		Long: `Show what enforces on this node. The first line says whether the node
enforces and the worst of what is wrong (an ERROR breaks users' or Slurm's
traffic: no cluster key, an exempt name that does not resolve, ...);
--verbose adds every program attached and the kernel's features. As root
the pinned kernel objects are
inspected; other users see what the running agent reports (its state file),
as the kernel objects are root's. Warnings include an agent that is not
running, audit mode, a refused or pending reload, and config check's findings
for the running configuration.

Exit status: 0 enforcing without warnings, 1 with warnings, 2 not enforcing
(or unknown). --check prints nothing, for scripts and monitoring.

--all asks every node of [cluster] nodes over the ident service (UDP
ident_port, from a privileged port: root) for its status, each within
--timeout: agent up, mode, enforcing or audit, version, configuration
hashes, generation, last reload, warnings. A node that does not answer is
"down"; one whose cluster-wide configuration ([policy], [cluster],
[offcluster]) differs from this node's file is "drift". Exit status: 0 all
enforcing without warnings, 1 warnings or audit somewhere, 2 a node down,
drifting or not enforcing.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if all {
				return clusterStatus(cmd, pidFile, timeout, asJSON, check)
			}
			s, err := control.GetStatus(control.Options{ConfigPath: configPath, PidFile: pidFile}, true)
			if err != nil {
				if enforcing {
					return &ExitError{statusNotEnforced, "status: " + err.Error()}
				}
				return err
			}
			if enforcing {
				// The programs in force decide, not the agent: a node whose
				// agent restarts still isolates its users.
				if s.Mode == "userwall" && (s.Enabled || s.Source == "agent") {
					return nil
				}
				return &ExitError{statusNotEnforced, "this node does not enforce userwall: " + s.Headline}
			}
			code := statusOK
			switch {
			case s.Mode != "userwall":
				code = statusNotEnforced
			case len(s.Warnings) > 0 || len(s.Errors) > 0:
				code = statusWarnings
			}
			out := cmd.OutOrStdout()
			return statusOutput(out, check, asJSON, s, func() { printStatus(out, s, verbose) }, code)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&check, "check", false, "print nothing; only the exit status (0 enforcing, 1 warnings, 2 not enforcing)")
	cmd.Flags().StringVar(&pidFile, "pid-file", "", "agent pid file (default: [agent] pid_file)")
	cmd.Flags().BoolVar(&enforcing, "enforcing", false, "print nothing; exit 0 if the node's userwall programs are in force (warnings and audit mode included), 2 if not: for ExecStartPre= of units that must not start on an unprotected node")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "also list every program attached and the kernel's features")
	cmd.Flags().BoolVar(&all, "all", false, "every node of [cluster] nodes, over the ident service (root)")
	cmd.Flags().DurationVar(&timeout, "timeout", 2*time.Second, "with --all: how long to wait for each node")
	return cmd
}

// clusterStatus is `palisade status --all`.
func clusterStatus(cmd *cobra.Command, pidFile string, timeout time.Duration, asJSON, check bool) error {
	cfg, err := (&control.Options{ConfigPath: configPath, PidFile: pidFile}).LoadConfig()
	if err != nil {
		return err
	}
	// Hostlist names are resolved now; one that does not resolve is
	// reported as down, with why.
	unresolved := cfg.ResolveNodes(nil)
	if len(cfg.Nodes) == 0 && len(unresolved) == 0 {
		return fmt.Errorf("%s lists no [cluster] nodes: the cluster view asks each of them (or use the Prometheus queries of docs/deploy.md)", cfg.Path)
	}
	if cfg.Agent.IdentPort == 0 {
		return fmt.Errorf("%s: ident_port = 0 (the UDP ident service is off): no cluster view", cfg.Path)
	}
	want := cfg.SharedSHA256()
	views, err := control.ClusterView(cmd.Context(), cfg.Nodes, uint16(cfg.Agent.IdentPort), timeout, want)
	if err != nil {
		return &ExitError{statusNotEnforced, "status --all: " + err.Error()}
	}
	for _, pn := range cfg.PendingNodes {
		why := "not resolvable"
		for _, f := range unresolved {
			if strings.HasPrefix(f.Msg, "node "+pn.Name+" ") || strings.HasPrefix(f.Msg, "node "+pn.Name+":") {
				why = f.Msg
			}
		}
		views = append(views, control.NodeView{Name: pn.Name, State: control.NodeDown, Error: why})
	}
	code := statusOK
	for _, v := range views {
		switch v.State {
		case control.NodeOK:
		case control.NodeWarnings, control.NodeErrors, control.NodeAudit:
			code = max(code, statusWarnings)
		default:
			code = statusNotEnforced
		}
	}
	out := cmd.OutOrStdout()
	all := struct {
		SharedSHA string             `json:"shared_sha256"`
		Nodes     []control.NodeView `json:"nodes"`
	}{want, views}
	return statusOutput(out, check, asJSON, all, func() { printCluster(out, want, views) }, code)
}

// statusOutput prints a status report (nothing with --check, JSON with
// --json, else text) and exits with code.
func statusOutput(out io.Writer, check, asJSON bool, v any, text func(), code int) error {
	switch {
	case check:
	case asJSON:
		if err := writeJSON(out, v); err != nil {
			return err
		}
	default:
		text()
	}
	if code != statusOK {
		return &ExitError{code, ""}
	}
	return nil
}

func printCluster(out io.Writer, want string, views []control.NodeView) {
	fmt.Fprintf(out, "expected cluster-wide configuration: %.12s (this node's file)\n\n", want)
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tADDRESS\tSTATE\tMODE\tVERSION\tCONFIG\tSHARED\tGEN\tLAST RELOAD\tWARNINGS")
	var notes []string
	for _, v := range views {
		r := v.Report
		addr := "-"
		if v.Addr.IsValid() {
			addr = v.Addr.String()
		}
		if r == nil {
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\t-\t-\t-\t-\t-\n", v.Name, addr, v.State)
			notes = append(notes, fmt.Sprintf("%s: %s", v.Name, v.Error))
			continue
		}
		mode := r.Mode
		if r.Audit {
			mode += " (audit)"
		}
		last := "-"
		if !r.LastReload.IsZero() {
			last = r.LastReload.Local().Format(time.RFC3339)
			if r.LastReloadError != "" {
				last += " REFUSED"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.12s\t%.12s\t%d\t%s\t%d\n", v.Name, addr, v.State, mode, r.Version,
			r.ConfigSHA, r.SharedSHA, r.Generation, last, len(r.Warnings)+len(r.Errors))
		if v.Error != "" {
			notes = append(notes, fmt.Sprintf("%s: %s", v.Name, v.Error))
		}
		for _, e := range r.Errors {
			notes = append(notes, fmt.Sprintf("%s: ERROR: %s", v.Name, e))
		}
		for _, w := range r.Warnings {
			notes = append(notes, fmt.Sprintf("%s: WARNING: %s", v.Name, w))
		}
	}
	tw.Flush()
	if len(notes) > 0 {
		fmt.Fprintln(out)
		for _, n := range notes {
			fmt.Fprintln(out, n)
		}
	}
}

func printStatus(out io.Writer, s *control.Status, verbose bool) {
	fmt.Fprintf(out, "palisade:    %s\n", s.Headline)
	mode := s.Mode
	if s.Mode == "userwall" && s.Audit {
		mode += " (AUDIT: nothing is refused)"
	}
	fmt.Fprintf(out, "mode:        %s\n", mode)
	defer func() {
		for _, e := range s.Errors {
			fmt.Fprintf(out, "ERROR: %s\n", e)
		}
		for _, w := range s.Warnings {
			fmt.Fprintf(out, "WARNING: %s\n", w)
		}
	}()
	if s.Mode == "none" {
		fmt.Fprintf(out, "no userwall programs pinned in %s (netns cookie %d)\n", s.PinDir, s.NetnsCookie)
		if s.Kernel != nil {
			fmt.Fprintln(out)
			writeProbe(out, s.Kernel)
		}
		return
	}
	agent := "not running"
	if s.AgentPID != 0 {
		agent = fmt.Sprintf("running (pid %d)", s.AgentPID)
	}
	fmt.Fprintf(out, "agent:       %s\n", agent)
	if a := s.Agent; a != nil {
		fmt.Fprintf(out, "version:     %s (commit %.12s)\n", a.Version, a.Commit)
		fmt.Fprintf(out, "config:      %s sha256 %s\n", a.Config, a.ConfigSHA)
		reload := "none since start " + a.Started.Local().Format(time.RFC3339)
		if !a.LastReload.IsZero() {
			reload = "last " + a.LastReload.Local().Format(time.RFC3339)
			if a.LastReloadError != "" {
				reload += " REFUSED"
			}
		}
		fmt.Fprintf(out, "generation:  %d (%s)\n", a.Generation, reload)
	}
	if s.Source == "agent" {
		fmt.Fprintf(out, "source:      the agent's state (the kernel objects are not readable or not visible from here)\n")
		fmt.Fprintf(out, "unix (LSM):  %v\n", s.UnixLSM)
		return
	}
	fmt.Fprintf(out, "enforcing:   %v\npins:        %s\nnft table:   %v\nunix (LSM):  %v\ntc attach:   %s\n",
		s.Enabled, s.PinDir, s.Nft, s.UnixLSM, s.Attach)
	if !verbose {
		fmt.Fprintf(out, "programs:    %d attached (--verbose lists them and the kernel's features)\n", len(s.Links))
	} else {
		fmt.Fprintf(out, "\nprograms attached (%d):\n", len(s.Links))
		tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
		for _, l := range s.Links {
			fmt.Fprintf(tw, "  %s\t%s\t%s\tprog %d\n", l.Name, l.Type, l.Program, l.ProgID)
		}
		tw.Flush()
	}
	fmt.Fprintln(out, "\ndecisions:")
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	for _, c := range s.Counters {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\n", c.Path, c.Rule, c.Verdict(), c.Count)
	}
	tw.Flush()
	if verbose && s.Kernel != nil {
		fmt.Fprintln(out)
		writeProbe(out, s.Kernel)
	}
	fmt.Fprintln(out)
}
