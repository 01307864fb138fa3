package cli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
)

// shareCommand: `palisade share PORT --with USER|@GROUP [--for D] [--node N]`
// and `palisade share --list`.
func shareCommand() *cobra.Command {
	var (
		with, nodes []string
		dur, output string
		list        bool
	)
	cmd := &cobra.Command{
		Use:   "share PORT --with USER|@GROUP [--for DURATION] [--node NODES]",
		Short: "Let another user or a group reach one of your TCP listeners (a user grant), for a while",
		Long: `Open a TCP port you listen on to another user or group, without an
administrator: a user grant. The agent of the listener's node decides who
asks (the kernel names the caller of its socket) and accepts the grant only
if the caller holds a TCP listener on the port there — nobody grants access
to another user's port. The grant admits the grantee to your listeners on
that port on that node, until it expires (--for; the site's default and
maximum apply) or you unshare it, or you stop listening on the port. It is
keyed on you: whoever binds the port after you is not reached through it.

--node names the nodes whose listeners you share (hostlist syntax; default:
this node): the grant lives on the listener's node, which decides every
connection to it. Each node checks on its own that you listen there.

--list shows your grants and those made to you (root: every grant).
Grants are logged and visible to administrators (palisade flows names the
grant that allowed a flow; metric palisade_user_grants_active). A site may
disable them (policy.user_grants = false).`,
		Example: "  palisade share 8888 --with bob --for 4h\n  palisade share 8888 --with @proj2\n" +
			"  palisade share 8888 --with bob --node gpu07\n  palisade share --list",
		Args: func(cmd *cobra.Command, args []string) error {
			if list {
				return cobra.NoArgs(cmd, args)
			}
			return cobra.ExactArgs(1)(cmd, args)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			req := userwall.GrantRequest{Op: "list"}
			if !list {
				port, err := parsePort(args[0])
				if err != nil {
					return err
				}
				if len(with) == 0 {
					return fmt.Errorf("share: --with USER|@GROUP is required")
				}
				req = userwall.GrantRequest{Op: "share", Port: port, With: with, For: dur}
			}
			return askGrant(cmd, req, nodes, output)
		},
	}
	cmd.Flags().StringSliceVar(&with, "with", nil, "user or @group to let in (repeat or comma-separate)")
	cmd.Flags().StringVar(&dur, "for", "", "how long (30m, 4h; default: the site's policy.grant_default)")
	cmd.Flags().StringSliceVar(&nodes, "node", nil, "the listener's nodes (hostlist; default: this node)")
	cmd.Flags().BoolVar(&list, "list", false, "list your grants and those made to you")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json")
	return cmd
}

func unshareCommand() *cobra.Command {
	var (
		with, nodes []string
		output      string
	)
	cmd := &cobra.Command{
		Use:   "unshare PORT [--with USER|@GROUP] [--node NODES]",
		Short: "Revoke your grants on a port (all of them, or those --with names)",
		Long: `Revoke user grants made with palisade share: every grant on PORT, or
only those to the users and groups --with names. Root revokes anyone's.`,
		Example: "  palisade unshare 8888\n  palisade unshare 8888 --with bob",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			port, err := parsePort(args[0])
			if err != nil {
				return err
			}
			return askGrant(cmd, userwall.GrantRequest{Op: "unshare", Port: port, With: with}, nodes, output)
		},
	}
	cmd.Flags().StringSliceVar(&with, "with", nil, "only the grants to this user or @group (repeat or comma-separate)")
	cmd.Flags().StringSliceVar(&nodes, "node", nil, "the listener's nodes (hostlist; default: this node)")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json")
	return cmd
}

func parsePort(s string) (uint16, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil || p == 0 {
		return 0, fmt.Errorf("port %q: want a number 1-65535", s)
	}
	return uint16(p), nil
}

// askGrant sends req to this node's agent (which forwards to --node's).
func askGrant(cmd *cobra.Command, req userwall.GrantRequest, nodes []string, output string) error {
	if output != "text" && output != "json" {
		return fmt.Errorf("--output %q: want text or json", output)
	}
	resp, err := userwall.AskFlows(cmd.Context(), flowsSocket(cmd), userwall.FlowsRequest{Kind: userwall.KindGrant, Nodes: nodes, Grant: &req})
	if err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	var failed []string
	var grants []userwall.GrantInfo
	for _, n := range resp.Nodes {
		if n.Error != "" {
			fmt.Fprintf(cmd.ErrOrStderr(), "%s: %s\n", n.Name, n.Error)
			failed = append(failed, n.Name)
			continue
		}
		if n.Grant != nil {
			for _, g := range n.Grant.Grants {
				if g.Node == "" {
					g.Node = n.Name
				}
				grants = append(grants, g)
			}
		}
	}
	if output == "json" {
		for _, g := range grants {
			if err := writeJSONLine(out, g); err != nil {
				return err
			}
		}
	} else {
		printGrants(out, req.Op, grants)
	}
	if len(failed) > 0 {
		return fmt.Errorf("%s failed on %s", req.Op, strings.Join(failed, ", "))
	}
	return nil
}

func printGrants(out io.Writer, op string, gs []userwall.GrantInfo) {
	switch op {
	case "share":
		fmt.Fprintln(out, "shared:")
	case "unshare":
		fmt.Fprintln(out, "revoked:")
	}
	if len(gs) == 0 {
		fmt.Fprintln(out, "no grants")
		return
	}
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tOWNER\tPORT\tWITH\tEXPIRES\tLEFT")
	for _, g := range gs {
		to := nameOrID(g.GranteeName, g.Grantee)
		if g.Group {
			to = "@" + to
		}
		left := time.Until(g.Expires).Round(time.Second)
		if left < 0 {
			left = 0
		}
		fmt.Fprintf(tw, "%s\t%s\t%d/tcp\t%s\t%s\t%s\n", g.Node, nameOrID(g.OwnerName, g.Owner), g.Port, to,
			g.Expires.Local().Format("2006-01-02 15:04:05"), left)
	}
	tw.Flush()
}
