package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/ident"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

func explainCommand() *cobra.Command {
	var (
		from, group, nodeFlag, to, sock string
		quiet                           bool
		timeout                         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "explain --from USER [--group G] [--node N] --to ADDR:PORT[/udp]",
		Short: "Explain which rule allows or denies USER's connection to a listener, and why",
		Long: `Resolve the connecting user's identity (uid, effective gid — --group as after
newgrp/sg — and groups) through NSS, find the listener's owner at ADDR:PORT
(locally, or by asking its node's ident service), and apply the policy of
--config. --node is the node the connector runs on (default: this node); it
decides whether the connection is local, from the cluster, or off-cluster.
Exits 0 whatever the verdict; with --quiet prints nothing and exits 1 unless
the connection is allowed.`,
		Example: "  palisade explain --from alice --node node1 --to 198.18.0.2:5000\n" +
			"  palisade explain --from bob --group proj1 --to 127.0.0.1:6000/udp",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if from == "" || to == "" {
				return errors.New("--from USER and --to ADDR:PORT[/udp] are required")
			}
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			pol := cfg.Policy
			target, proto, err := ident.ParseTarget(to)
			if err != nil {
				return err
			}
			res := identity.System()
			conn, err := connectorIdentity(res, from, group)
			if err != nil {
				return err
			}
			src, srcDesc, err := connectorSource(cfg, nodeFlag, target)
			if err != nil {
				return err
			}
			ia := newIdentAccess(cfg, sock, cmd.Flags().Changed("socket"), timeout)
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout+time.Second)
			defer cancel()
			lis, answered, lerr := ia.ownerOf(ctx, netip.Addr{}, target, proto)
			c := policy.Conn{Source: src, Connector: conn, Listener: lis.Identity(), Port: target.Port(), Proto: proto}
			v := pol.Decide(c)
			// Without the listener's owner only the identity-free rules
			// (system port, off-cluster) can decide.
			decided := lerr == nil || v.Rule == policy.RuleSystemPort ||
				v.Rule == policy.RuleOffClusterPort || v.Rule == policy.RuleOffClusterDenied

			if quiet {
				if !decided || !v.Allow {
					return &ExitError{1, ""}
				}
				return nil
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			if cfg.Default {
				fmt.Fprintf(w, "policy\tbuilt-in defaults (%s does not exist)\n", cfg.Path)
			} else {
				fmt.Fprintf(w, "policy\t%s\n", cfg.Path)
			}
			fmt.Fprintf(w, "from\t%s, effective gid %s, groups %s\n",
				identity.UserName(res, conn.UID), identity.GroupName(res, conn.GID), groupList(conn.Groups))
			fmt.Fprintf(w, "on\t%s\n", srcDesc)
			fmt.Fprintf(w, "to\t%v/%v\n", target, proto)
			switch {
			case errors.Is(lerr, ident.ErrNoSocket):
				fmt.Fprintf(w, "listener\tnone: nothing is bound to %v/%v, so the connection fails whatever the policy\n", target, proto)
			case lerr != nil:
				fmt.Fprintf(w, "listener\tunknown: %v\n", lerr)
			default:
				where := "this node"
				if answered.IsValid() {
					where = "node " + answered.String()
				}
				proc := ""
				if lis.PID != 0 {
					proc = fmt.Sprintf(", pid %d %s", lis.PID, lis.Command)
				}
				fmt.Fprintf(w, "listener\t%s, effective gid %s%s (on %s)\n",
					identity.UserName(res, lis.UID), identity.GroupName(res, lis.GID), proc, where)
			}
			if !decided {
				fmt.Fprintf(w, "verdict\tundecided: the rule depends on the listener's owner\n")
				return w.Flush()
			}
			word := "DENY"
			if v.Allow {
				word = "ALLOW"
			}
			fmt.Fprintf(w, "verdict\t%s (rule %s)\n", word, v.Rule)
			fmt.Fprintf(w, "why\t%s\n", pol.ExplainWith(c, res))
			return w.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "connecting user (name or uid)")
	f.StringVar(&group, "group", "", "connector's effective group, as after newgrp/sg (default: primary group)")
	f.StringVar(&nodeFlag, "node", "", "node the connector runs on: name ([cluster] nodes or hosts) or address (default: this node)")
	f.StringVar(&to, "to", "", "listener ADDR:PORT[/udp]")
	f.BoolVar(&quiet, "quiet", false, "print nothing; exit 1 unless allowed")
	f.StringVar(&sock, "socket", ident.DefaultSocketPath, "ident service Unix socket, used when not root (default: [agent] ident_socket)")
	f.DurationVar(&timeout, "timeout", time.Second, "how long to wait for a remote node")
	return cmd
}

// connectorIdentity resolves USER (name or uid) through NSS: uid, effective
// gid (the primary group, or --group after checking membership, as sg
// would) and the groups held at login (supplementary, primary included —
// what the kernel's group list holds after login).
func connectorIdentity(res identity.Resolver, name, group string) (policy.Identity, error) {
	uid, err := identity.UID(res, name)
	if err != nil {
		return policy.Identity{}, fmt.Errorf("--from %q: %w", name, err)
	}
	uname, err := res.LookupUID(uid)
	if err != nil {
		return policy.Identity{}, fmt.Errorf("--from %q: no such user on this node (%v)", name, err)
	}
	_, gid, err := res.LookupUser(uname)
	if err != nil {
		return policy.Identity{}, fmt.Errorf("--from %q: %w", name, err)
	}
	groups, err := res.GroupsOf(uname)
	if err != nil {
		return policy.Identity{}, fmt.Errorf("groups of %s: %w", uname, err)
	}
	id := policy.Identity{UID: uid, GID: gid, Groups: groups}
	if group != "" {
		g, err := identity.GID(res, group)
		if err != nil {
			return policy.Identity{}, fmt.Errorf("--group %q: %w", group, err)
		}
		if !id.HasGroup(g) {
			return policy.Identity{}, fmt.Errorf("--group %s: %s is not a member (sg/newgrp would ask for a group password)", identity.GroupName(res, g), uname)
		}
		id.GID = g
	}
	return id, nil
}

// connectorSource returns the connection's source address as the
// listener's node sees it: zero for a local connection, else the
// connector node's address (the one routing towards target picks).
func connectorSource(cfg *policy.Config, node string, target netip.AddrPort) (netip.Addr, string, error) {
	if node == "" {
		if ident.IsLocalAddr(target.Addr()) {
			return netip.Addr{}, "this node (a local connection)", nil
		}
		// Connecting a UDP socket only routes; it sends nothing.
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(target))
		if err != nil {
			return netip.Addr{}, "", fmt.Errorf("no route from this node to %v: %w", target, err)
		}
		defer c.Close()
		src := c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
		return src, fmt.Sprintf("this node, source %v", src), nil
	}
	a, err := resolveNode(cfg, node)
	if err != nil {
		return netip.Addr{}, "", err
	}
	// The listener's node itself (any of its addresses, when we run there).
	if a == target.Addr() || (ident.IsLocalAddr(a) && ident.IsLocalAddr(target.Addr())) {
		return netip.Addr{}, fmt.Sprintf("%s (%v), the listener's node: a local connection", node, a), nil
	}
	return a, fmt.Sprintf("%s, source %v", node, a), nil
}

func lookupHost(name string) ([]netip.Addr, error) {
	ss, err := net.LookupHost(name)
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, s := range ss {
		if a, err := netip.ParseAddr(s); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out, nil
}
