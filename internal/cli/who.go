package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/sockowner"
)

func whoCommand() *cobra.Command {
	var (
		nodeFlag string
		asJSON   bool
		sock     string
		timeout  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "who ADDR:PORT[/udp]",
		Short: "Show who owns a socket (uid, user, gid, groups, pid, command), here or on another node",
		Long: `Show the owner of the socket bound to ADDR:PORT: its user, effective group,
supplementary groups, pid and command. If ADDR is not an address of this node
(or --node names another node) the node that owns it is asked through its ident
service, from a privileged port (root) or through the local ident service's
Unix socket (other users).`,
		Example: "  palisade who 198.18.0.2:5000\n  palisade who [2001:2::1]:6000/udp",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			target, proto, err := sockowner.ParseTarget(args[0])
			if err != nil {
				return err
			}
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			var node netip.Addr
			if nodeFlag != "" {
				if node, err = resolveNode(cfg, nodeFlag); err != nil {
					return err
				}
			}
			ia := newIdentAccess(cfg, sock, cmd.Flags().Changed("socket"), timeout)
			o, answered, err := ia.ownerOf(cmd.Context(), node, target, proto)
			where := "this node"
			if answered.IsValid() {
				where = "node " + answered.String()
			}
			if errors.Is(err, sockowner.ErrNoSocket) {
				return &ExitError{1, fmt.Sprintf("no socket at %v/%v on %s", target, proto, where)}
			}
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				return enc.Encode(struct {
					Socket string          `json:"socket"`
					Node   string          `json:"node,omitempty"`
					Owner  sockowner.Owner `json:"owner"`
				}{fmt.Sprintf("%v/%v", target, proto), answeredString(answered), o})
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintf(w, "socket\t%v/%v on %s\n", target, proto, where)
			fmt.Fprintf(w, "user\t%s\n", idName(o.User, o.UID))
			if o.PID != 0 {
				fmt.Fprintf(w, "group\t%s\n", idName(o.Group, o.GID))
				fmt.Fprintf(w, "groups\t%s\n", groupList(o.Groups))
				fmt.Fprintf(w, "process\t%d %s\n", o.PID, o.Command)
			} else {
				fmt.Fprintf(w, "process\tnot visible (no process holds it, or run as root to see other users' processes)\n")
			}
			return w.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&nodeFlag, "node", "", "ask this node (name or address) instead of the one owning ADDR")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	f.StringVar(&sock, "socket", sockowner.DefaultSocketPath, "ident service Unix socket, used when not root (default: [agent] ident_socket)")
	f.DurationVar(&timeout, "timeout", time.Second, "how long to wait for a remote node")
	return cmd
}

func answeredString(a netip.Addr) string {
	if a.IsValid() {
		return a.String()
	}
	return ""
}

// idName formats "name (id)" or just the id when NSS does not know it.
func idName(name string, id uint32) string {
	if name == "" {
		return fmt.Sprint(id)
	}
	return fmt.Sprintf("%s (%d)", name, id)
}

// groupList formats gids with their names from this node's NSS.
func groupList(gids []uint32) string {
	if len(gids) == 0 {
		return "-"
	}
	parts := make([]string, len(gids))
	for i, g := range gids {
		if n, err := identity.System().LookupGID(g); err == nil {
			parts[i] = fmt.Sprintf("%s(%d)", n, g)
		} else {
			parts[i] = fmt.Sprint(g)
		}
	}
	return strings.Join(parts, " ")
}

// resolveNode accepts an address, a name from [cluster] nodes, or a host
// name (sites and the testbed list nodes in /etc/hosts); a name resolving to
// several addresses takes the first IPv4 one.
func resolveNode(cfg *config.Config, s string) (netip.Addr, error) {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap(), nil
	}
	for _, n := range cfg.Nodes {
		if n.Name == s {
			return n.Addr.Unmap(), nil
		}
	}
	// A Slurm node name: its NodeAddr (may differ from its host name).
	if a, ok := slurmNodeAddr(s); ok {
		return a, nil
	}
	addrs, err := lookupHost(s)
	if err != nil || len(addrs) == 0 {
		return netip.Addr{}, fmt.Errorf("node %q: not an address, a [cluster] node, a Slurm node or a resolvable name: %v", s, err)
	}
	for _, a := range addrs {
		if a.Is4() {
			return a, nil
		}
	}
	return addrs[0], nil
}

// slurmNodeAddr asks Slurm for a node's NodeAddr (scontrol, if installed and
// Slurm answers within 2 s); its host name's address when NodeAddr is a name.
func slurmNodeAddr(name string) (netip.Addr, bool) {
	if _, err := exec.LookPath("scontrol"); err != nil {
		return netip.Addr{}, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "scontrol", "show", "node", "-o", name).Output()
	if err != nil {
		return netip.Addr{}, false
	}
	for _, f := range strings.Fields(string(out)) {
		v, ok := strings.CutPrefix(f, "NodeAddr=")
		if !ok {
			continue
		}
		if a, err := netip.ParseAddr(v); err == nil {
			return a.Unmap(), true
		}
		if v != name {
			if as, err := lookupHost(v); err == nil && len(as) > 0 {
				return as[0], true
			}
		}
	}
	return netip.Addr{}, false
}
