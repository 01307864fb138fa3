package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/agentconfig"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/sockowner"
)

// flowFlags are the filters `flows` and `audit report` share.
type flowFlags struct {
	user, listener, connector, proto, rule, since, output string
	port                                                  uint16
	verdicts, nodes                                       []string
	limit                                                 int
}

func (f *flowFlags) add(cmd *cobra.Command, limitDefault int, limitHelp string) {
	fl := cmd.Flags()
	fl.StringVar(&f.user, "user", "", "flows with this user (name or uid) at either end")
	fl.StringVar(&f.listener, "listener-user", "", "flows to listeners of this user")
	fl.StringVar(&f.connector, "connector-user", "", "flows from connectors of this user")
	fl.Uint16Var(&f.port, "port", 0, "flows to this port")
	fl.StringVar(&f.proto, "proto", "", "flows of this protocol (tcp, udp, unix, ...)")
	fl.StringVar(&f.rule, "rule", "", "flows decided by this rule (same-user, default-deny, ...)")
	fl.StringSliceVar(&f.verdicts, "verdict", nil, "flows with these verdicts: allow, deny, audit (repeat or comma-separate)")
	fl.StringSliceVar(&f.nodes, "node", nil, "ask these nodes (names from [cluster] nodes, or addresses; default: every node)")
	fl.StringVar(&f.since, "since", "", "only since then: a duration (10m, 24h) or a time (RFC 3339)")
	fl.StringVarP(&f.output, "output", "o", "text", "output: text or json")
	fl.IntVar(&f.limit, "limit", limitDefault, limitHelp)
}

func (f *flowFlags) filter() (userwall.FlowFilter, error) {
	var ff userwall.FlowFilter
	for _, u := range []struct {
		flag, v string
		dst     **uint32
	}{{"--user", f.user, &ff.User}, {"--listener-user", f.listener, &ff.ListenerUser}, {"--connector-user", f.connector, &ff.ConnectorUser}} {
		if u.v == "" {
			continue
		}
		uid, err := identity.UID(identity.System(), u.v)
		if err != nil {
			return ff, fmt.Errorf("%s: %w", u.flag, err)
		}
		*u.dst = &uid
	}
	ff.Port, ff.Proto, ff.Rule = f.port, strings.ToLower(f.proto), f.rule
	for _, v := range f.verdicts {
		v = strings.ToLower(strings.TrimSpace(v))
		if v != "allow" && v != "deny" && v != "audit" {
			return ff, fmt.Errorf("--verdict %q: want allow, deny or audit", v)
		}
		ff.Verdicts = append(ff.Verdicts, v)
	}
	if f.since != "" {
		t, err := parseSince(f.since, time.Now())
		if err != nil {
			return ff, err
		}
		ff.Since = t
	}
	if f.output != "text" && f.output != "json" {
		return ff, fmt.Errorf("--output %q: want text or json", f.output)
	}
	return ff, nil
}

func parseSince(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("--since %q: want a duration (10m, 24h) or an RFC 3339 time", s)
}

func (f *flowFlags) targets() []string {
	if len(f.nodes) == 0 {
		return []string{"all"}
	}
	return f.nodes
}

// flowsSocket is the running agent's flows socket, from the pid file the
// configuration names (the default one if it cannot be read).
func flowsSocket(cmd *cobra.Command) string {
	pid := agentconfig.DefaultAgentPidFile
	if cfg, err := loadConfig(cmd); err == nil && cfg.Agent.PidFile != "" {
		pid = cfg.Agent.PidFile
	}
	return userwall.FlowsSocketPath(pid)
}

func flowsCommand() *cobra.Command {
	var (
		f      flowFlags
		follow bool
	)
	cmd := &cobra.Command{
		Use:   "flows",
		Short: "Show recent and live verdicts (allowed and refused) on every node, with both ends' users and processes",
		Long: `Show the verdicts the nodes' agents recorded: refusals, would-be refusals of
audit mode (AUDIT), unverified admissions of the staged rollout, and allowed
connections (ALLOW*: sampled, at most [agent] flow_samples a second per CPU
are recorded, system ports never). Each line names both ends: user, group,
process (command[pid], where the kernel still knew it) and node.

Every node of [cluster] nodes is asked through this node's agent (--node to
choose); root sees every flow, other users the flows they are at one end of.
--follow keeps printing new verdicts as they come (Ctrl-C ends).`,
		Example: "  palisade flows --since 10m\n  palisade flows --follow --verdict deny,audit\n  palisade flows --listener-user alice --port 8888 -o json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ff, err := f.filter()
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runFlows(ctx, cmd.OutOrStdout(), cmd.ErrOrStderr(), flowsSocket(cmd), f, ff, follow)
		},
	}
	f.add(cmd, 100, "most flows shown per node (the newest)")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing new verdicts")
	return cmd
}

func runFlows(ctx context.Context, out, errOut io.Writer, sock string, f flowFlags, ff userwall.FlowFilter, follow bool) error {
	req := userwall.FlowsRequest{Kind: sockowner.KindFlows, Nodes: f.targets(), Filter: ff, Limit: f.limit, Cursors: map[string]uint64{}}
	// Followed lines come a few at a time: columns of fixed widths keep
	// them aligned (a tabwriter aligns only what it sees at once).
	var tw interface {
		io.Writer
		Flush() error
	} = tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	if follow {
		tw = &fixedColumns{w: out, widths: []int{12, 7, 16, 5, 30, 22, 2, 34}}
	}
	header := f.output == "text"
	lastErr := map[string]string{}
	for first := true; ; first = false {
		resp, err := userwall.AskFlows(ctx, sock, req)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		var flows []userwall.Flow
		for _, n := range resp.Nodes {
			if n.Error != "" {
				if lastErr[n.Name] != n.Error {
					fmt.Fprintf(errOut, "%s: %s\n", n.Name, n.Error)
				}
				lastErr[n.Name] = n.Error
				continue
			}
			delete(lastErr, n.Name)
			a := n.Flows
			if a == nil {
				continue
			}
			req.Cursors[n.Name] = a.Next
			flows = append(flows, a.Flows...)
			if first && !follow && a.Omitted > 0 && f.output == "text" {
				fmt.Fprintf(errOut, "%s: %d older matching flows not shown (--limit)\n", n.Name, a.Omitted)
			}
		}
		// After the first answer only what is new; since stays as given.
		slices.SortStableFunc(flows, func(a, b userwall.Flow) int { return a.Time.Compare(b.Time) })
		if f.output == "json" {
			for _, x := range flows {
				if err := writeJSONLine(out, x); err != nil {
					return err
				}
			}
		} else {
			if header && (len(flows) > 0 || !follow) {
				fmt.Fprintln(tw, "TIME\tVERDICT\tRULE\tPROTO\tCONNECTOR\tSOURCE\t\tLISTENER\tDESTINATION")
				header = false
			}
			for _, x := range flows {
				fmt.Fprintln(tw, flowLine(&x))
			}
			tw.Flush()
		}
		if !follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// fixedColumns writes tab-separated lines as columns of fixed widths.
type fixedColumns struct {
	w      io.Writer
	widths []int
}

func (c *fixedColumns) Write(b []byte) (int, error) {
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if line == "" {
			continue
		}
		cols := strings.Split(strings.TrimSuffix(line, "\n"), "\t")
		var sb strings.Builder
		for i, col := range cols {
			if i < len(c.widths) && i < len(cols)-1 {
				fmt.Fprintf(&sb, "%-*s  ", c.widths[i], col)
			} else {
				sb.WriteString(col)
			}
		}
		sb.WriteString("\n")
		if _, err := io.WriteString(c.w, sb.String()); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

func (c *fixedColumns) Flush() error { return nil }

func writeJSONLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// endText is "user/group command[pid]@node".
func endText(e *userwall.FlowEnd) string {
	s := nameOrID(e.User, e.UID)
	if e.GID != 4294967295 {
		s += "/" + nameOrID(e.Group, e.GID)
	}
	if e.Comm != "" {
		s += " " + e.Comm
		if e.PID != 0 {
			s += "[" + strconv.Itoa(e.PID) + "]"
		}
	}
	if e.Node != "" {
		s += "@" + e.Node
	}
	return s
}

func nameOrID(name string, id uint32) string {
	if name != "" {
		return name
	}
	return strconv.FormatUint(uint64(id), 10)
}

func flowLine(x *userwall.Flow) string {
	conn := "(no identity)"
	if x.Connector != nil {
		conn = endText(x.Connector)
	} else if x.SrcNode != "" {
		conn = "(no identity)@" + x.SrcNode
	}
	verdict := strings.ToUpper(x.Verdict)
	if x.Sampled {
		verdict += "*"
	}
	line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%s\t->\t%s\t%s", x.Time.Local().Format("15:04:05.000"), verdict, x.Rule,
		x.Proto, conn, dash(x.Src), endText(&x.Listener), x.Dst)
	if x.Grant != "" {
		line += "\t(" + x.Grant + ")"
	}
	return line
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func auditCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "What enforcement would refuse (audit mode)",
	}
	cmd.AddCommand(auditReportCommand())
	return cmd
}

func auditReportCommand() *cobra.Command {
	var f flowFlags
	cmd := &cobra.Command{
		Use:   "report",
		Short: "Group what enforcing would refuse by listener user, port, connector and rule, across nodes",
		Long: `Group the refusals the nodes' agents recorded over a time window (--since,
at minute granularity; default: everything they hold) by listener user, port,
connector and rule: would-be refusals of nodes in audit mode (verdict audit)
and refusals of enforcing nodes (deny). Each line has the count, when it was
first and last seen, the nodes and the processes of both ends: read it before
switching a site from audit to enforcement. Every node of [cluster] nodes is
asked through this node's agent (--node to choose); root sees everything,
other users the groups they are at one end of.`,
		Example: "  palisade audit report --since 24h\n  palisade audit report --listener-user alice -o json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ff, err := f.filter()
			if err != nil {
				return err
			}
			if len(ff.Verdicts) == 0 {
				ff.Verdicts = []string{"audit", "deny"}
			}
			req := userwall.FlowsRequest{Kind: sockowner.KindAudit, Nodes: f.targets(), Filter: ff, Limit: f.limit}
			resp, err := userwall.AskFlows(cmd.Context(), flowsSocket(cmd), req)
			if err != nil {
				return err
			}
			return writeAuditReport(cmd.OutOrStdout(), cmd.ErrOrStderr(), resp, f.output == "json")
		},
	}
	f.add(cmd, 500, "most groups per node (the largest)")
	return cmd
}

// AuditReport is `audit report -o json`.
type AuditReport struct {
	Groups []userwall.AuditGroup `json:"groups"`
	Nodes  []AuditReportNode     `json:"nodes"`
}

// AuditReportNode says what one node contributed.
type AuditReportNode struct {
	Name    string    `json:"name"`
	Error   string    `json:"error,omitempty"`
	Audit   bool      `json:"audit"`
	Covered time.Time `json:"covered,omitzero"`
	Omitted int       `json:"omitted,omitempty"`
	Dropped uint64    `json:"dropped,omitempty"`
}

func writeAuditReport(out, errOut io.Writer, resp *userwall.FlowsResponse, asJSON bool) error {
	var answers []userwall.AuditAnswer
	var rep AuditReport
	for _, n := range resp.Nodes {
		rn := AuditReportNode{Name: n.Name, Error: n.Error}
		if a := n.Audit; a != nil {
			// A node names itself by host name; the report uses the
			// name it was asked by.
			for i := range a.Groups {
				a.Groups[i].Nodes = []string{n.Name}
			}
			answers = append(answers, *a)
			rn.Audit, rn.Covered, rn.Omitted, rn.Dropped = a.Audit, a.Covered, a.Omitted, a.Dropped
		}
		rep.Nodes = append(rep.Nodes, rn)
	}
	rep.Groups = userwall.MergeAuditGroups(answers)
	if asJSON {
		return writeJSON(out, rep)
	}
	for _, n := range rep.Nodes {
		switch {
		case n.Error != "":
			fmt.Fprintf(errOut, "%s: not counted: %s\n", n.Name, n.Error)
		case n.Omitted > 0:
			fmt.Fprintf(errOut, "%s: %d smaller groups not shown (--limit, answer size)\n", n.Name, n.Omitted)
		}
		if n.Dropped > 0 {
			fmt.Fprintf(errOut, "%s: %d verdicts were not recorded (the agent could not keep up)\n", n.Name, n.Dropped)
		}
	}
	var audit, enforce []string
	for _, n := range rep.Nodes {
		if n.Error != "" {
			continue
		}
		s := n.Name
		if !n.Covered.IsZero() {
			s += " (since " + n.Covered.Local().Format("2006-01-02 15:04") + ")"
		}
		if n.Audit {
			audit = append(audit, s)
		} else {
			enforce = append(enforce, s)
		}
	}
	if len(audit) > 0 {
		fmt.Fprintf(out, "audit mode:  %s\n", strings.Join(audit, ", "))
	}
	if len(enforce) > 0 {
		fmt.Fprintf(out, "enforcing:   %s\n", strings.Join(enforce, ", "))
	}
	fmt.Fprintln(out)
	if len(rep.Groups) == 0 {
		fmt.Fprintln(out, "nothing refused or would-be refused")
		return nil
	}
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tVERDICT\tLISTENER\tPORT\tCONNECTOR\tRULE\tNODES\tFIRST\tLAST\tLISTENER PROCS\tCONNECTOR PROCS")
	for _, g := range rep.Groups {
		conn := "(no identity) " + g.Src
		if g.Connector != nil {
			conn = nameOrID(g.Connector.User, g.Connector.UID)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s/%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Count, g.Verdict,
			nameOrID(g.Listener.User, g.Listener.UID), g.Proto, g.Port, conn, g.Rule, strings.Join(g.Nodes, ","),
			g.First.Local().Format("01-02 15:04:05"), g.Last.Local().Format("01-02 15:04:05"),
			dash(strings.Join(g.ListenerProcs, ",")), dash(strings.Join(g.ConnectorProcs, ",")))
	}
	return tw.Flush()
}
