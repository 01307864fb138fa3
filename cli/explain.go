package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/user"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/BurntSushi/toml"
	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/ident"
	"github.com/palisade-hpc/palisade/policy"
)

func init() {
	var (
		from, group, nodeFlag, to, sock string
		quiet                           bool
		timeout                         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "explain --from USER [--group G] [--node N] --to ADDR:PORT[/udp]",
		Short: "Explain which rule allows or denies USER's connection to a listener, and why",
		Long: `Resolve the connecting user's identity (uid, effective gid — --group as after
newgrp/sg — and groups), find the listener's owner at ADDR:PORT (locally, or by
asking its node's ident service), and apply the policy from --config. --node is
the node the connector runs on (default: this node); it decides whether the
connection is local, from the cluster, or from off-cluster.
Exits 0 whatever the verdict; with --quiet prints nothing and exits 1 on deny.`,
		Example: "  palisade explain --from alice --node node1 --to 198.18.0.2:5000\n" +
			"  palisade explain --from bob --group proj1 --to 127.0.0.1:6000/udp",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if from == "" || to == "" {
				return errors.New("--from USER and --to ADDR:PORT[/udp] are required")
			}
			pol, err := loadPolicyFile(configPath, cmd.Flags().Changed("config"))
			if err != nil {
				return err
			}
			target, proto, err := ident.ParseTarget(to)
			if err != nil {
				return err
			}
			conn, err := connectorIdentity(from, group)
			if err != nil {
				return err
			}
			src, srcDesc, err := connectorSource(nodeFlag, target)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout+time.Second)
			defer cancel()
			lis, answered, lerr := ownerOf(ctx, netip.Addr{}, target, proto, sock, timeout)
			c := policy.Conn{Source: src, Connector: conn.id, Listener: lis.Identity(), Port: target.Port(), Proto: proto}
			v := pol.Decide(c)

			if quiet {
				if lerr != nil || !v.Allow {
					return &exitError{1, ""}
				}
				return nil
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintf(w, "from\t%s, uid %d, effective gid %s, groups %s\n", conn.name, conn.id.UID, idName(lookupGroupName(conn.id.GID), conn.id.GID), groupList(conn.id.Groups))
			fmt.Fprintf(w, "on\t%s\n", srcDesc)
			fmt.Fprintf(w, "to\t%v/%v\n", target, proto)
			switch {
			case errors.Is(lerr, ident.ErrNoSocket):
				fmt.Fprintf(w, "listener\tnone: nothing is bound to %v/%v — the kernel refuses the connection whatever the policy\n", target, proto)
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
				fmt.Fprintf(w, "listener\t%s, effective gid %s%s (on %s)\n", idName(lis.User, lis.UID), idName(lis.Group, lis.GID), proc, where)
			}
			if lerr != nil {
				// Without the listener's identity only identity-free rules
				// can decide; say which, or that it cannot be known.
				if v.Rule == policy.RuleSystemPort || v.Rule == policy.RuleOffClusterPort || v.Rule == policy.RuleOffClusterDenied {
					fmt.Fprintf(w, "verdict\t%s (%s)\n", verdictWord(v), v.Rule)
					fmt.Fprintf(w, "why\t%s\n", reason(pol, c, v, conn.name, lis))
				} else {
					fmt.Fprintf(w, "verdict\tundecided: the rule depends on the listener's owner\n")
				}
				return w.Flush()
			}
			fmt.Fprintf(w, "verdict\t%s (%s)\n", verdictWord(v), v.Rule)
			fmt.Fprintf(w, "why\t%s\n", reason(pol, c, v, conn.name, lis))
			return w.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "connecting user (name or uid)")
	f.StringVar(&group, "group", "", "connector's effective group, as after newgrp/sg (default: primary group)")
	f.StringVar(&nodeFlag, "node", "", "node the connector runs on (name or address; default: this node)")
	f.StringVar(&to, "to", "", "listener ADDR:PORT[/udp]")
	f.BoolVar(&quiet, "quiet", false, "print nothing; exit 1 on deny")
	f.StringVar(&sock, "socket", ident.DefaultSocketPath, "ident service Unix socket (used when not root)")
	f.DurationVar(&timeout, "timeout", time.Second, "how long to wait for a remote node")
	register(cmd)
}

func verdictWord(v policy.Verdict) string {
	if v.Allow {
		return "ALLOW"
	}
	return "DENY"
}

// reason says in words why rule v.Rule decided c.
func reason(p *policy.Policy, c policy.Conn, v policy.Verdict, who string, lis ident.Owner) string {
	lisName := idName(lis.User, lis.UID)
	switch v.Rule {
	case policy.RuleSystemPort:
		return fmt.Sprintf("port %d is a system port (<= %d): always reachable", c.Port, p.SystemPortMax)
	case policy.RuleOffClusterPort:
		return fmt.Sprintf("the source %v is off-cluster, and the site opens port %d to off-cluster sources", c.Source, c.Port)
	case policy.RuleOffClusterDenied:
		return fmt.Sprintf("the source %v is outside the cluster subnets, so its identity is not trusted; off-cluster sources reach only system ports and [offcluster] allow_ports", c.Source)
	case policy.RuleSameUser:
		return fmt.Sprintf("%s owns the listener", who)
	case policy.RuleSharedGroup:
		return fmt.Sprintf("the listener's effective group %s is one of %s's groups (shared with newgrp/sg)", idName(lis.Group, c.Listener.GID), who)
	case policy.RuleExemptConnector:
		return fmt.Sprintf("%s is an exempt connector ([policy] exempt_connectors)", who)
	case policy.RuleExemptListener:
		return fmt.Sprintf("the listener's owner %s is an exempt listener ([policy] exempt_listeners)", lisName)
	case policy.RuleDenied:
		return fmt.Sprintf("%s is not %s, is not in the listener's effective group %s, and neither is exempt", who, lisName, idName(lis.Group, c.Listener.GID))
	}
	return string(v.Rule)
}

type connector struct {
	name string
	id   policy.Identity
}

// connectorIdentity resolves USER (name or uid) through NSS: uid, effective
// gid (primary, or --group after checking membership) and groups.
func connectorIdentity(name, group string) (connector, error) {
	u, err := user.Lookup(name)
	if err != nil {
		if _, nerr := strconv.ParseUint(name, 10, 32); nerr == nil {
			u, err = user.LookupId(name)
		}
	}
	if err != nil {
		return connector{}, fmt.Errorf("--from %q: unknown user", name)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	id := policy.Identity{UID: uint32(uid), GID: uint32(gid)}
	gids, err := u.GroupIds()
	if err != nil {
		return connector{}, fmt.Errorf("groups of %s: %w", u.Username, err)
	}
	for _, g := range gids {
		if n, err := strconv.ParseUint(g, 10, 32); err == nil && n != gid {
			id.Groups = append(id.Groups, uint32(n))
		}
	}
	id.Groups = append([]uint32{uint32(gid)}, id.Groups...)
	if group != "" {
		g, err := user.LookupGroup(group)
		if err != nil {
			g, err = user.LookupGroupId(group)
		}
		if err != nil {
			return connector{}, fmt.Errorf("--group %q: unknown group", group)
		}
		n, _ := strconv.ParseUint(g.Gid, 10, 32)
		if !id.HasGroup(uint32(n)) {
			return connector{}, fmt.Errorf("--group %s: %s is not a member (newgrp/sg would ask for a group password)", g.Name, u.Username)
		}
		id.GID = uint32(n)
	}
	return connector{name: u.Username, id: id}, nil
}

// connectorSource returns the connection's source address as the
// listener's node sees it: zero for a local connection, else the
// connector node's address (the one routing towards target uses).
func connectorSource(node string, target netip.AddrPort) (netip.Addr, string, error) {
	if node == "" {
		if isLocalAddr(target.Addr()) {
			return netip.Addr{}, "this node (local connection)", nil
		}
		// The address the kernel would pick: connecting a UDP socket only
		// routes, it sends nothing.
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(target))
		if err != nil {
			return netip.Addr{}, "", fmt.Errorf("no route from this node to %v: %w", target, err)
		}
		defer c.Close()
		src := c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
		return src, fmt.Sprintf("this node, source %v", src), nil
	}
	a, err := resolveNode(node)
	if err != nil {
		return netip.Addr{}, "", err
	}
	if a == target.Addr() || (a.IsLoopback() && isLocalAddr(target.Addr())) {
		return netip.Addr{}, fmt.Sprintf("%s (%v): the listener's node, a local connection", node, a), nil
	}
	return a, fmt.Sprintf("%s, source %v", node, a), nil
}

func lookupGroupName(gid uint32) string {
	if g, err := user.LookupGroupId(strconv.FormatUint(uint64(gid), 10)); err == nil {
		return g.Name
	}
	return ""
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

// loadPolicyFile reads the [policy], [cluster] and [offcluster] tables.
// Stand-in until the policy engineer's policy.Load lands (which also
// validates every other table); unknown tables are ignored here. A missing
// file is policy.Default() unless the path was given explicitly.
func loadPolicyFile(path string, explicit bool) (*policy.Policy, error) {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) && !explicit {
		return policy.Default(), nil
	}
	var raw struct {
		Policy struct {
			SystemPortMax    *uint16  `toml:"system_port_max"`
			ExemptConnectors []string `toml:"exempt_connectors"`
			ExemptListeners  []string `toml:"exempt_listeners"`
		} `toml:"policy"`
		Cluster struct {
			Subnets []string `toml:"subnets"`
		} `toml:"cluster"`
		OffCluster struct {
			AllowPorts []string `toml:"allow_ports"`
		} `toml:"offcluster"`
	}
	if _, err := toml.DecodeFile(path, &raw); err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	p := policy.Default()
	if raw.Policy.SystemPortMax != nil {
		p.SystemPortMax = *raw.Policy.SystemPortMax
	}
	uids := func(key string, names []string) ([]uint32, error) {
		if names == nil {
			return nil, nil
		}
		out := []uint32{}
		for _, n := range names {
			u, err := user.Lookup(n)
			if err != nil {
				if _, nerr := strconv.ParseUint(n, 10, 32); nerr == nil {
					u, err = &user.User{Uid: n}, nil
				}
			}
			if err != nil {
				return nil, fmt.Errorf("config %s: [policy] %s: unknown user %q", path, key, n)
			}
			v, _ := strconv.ParseUint(u.Uid, 10, 32)
			out = append(out, uint32(v))
		}
		return out, nil
	}
	var err error
	if l, e := uids("exempt_connectors", raw.Policy.ExemptConnectors); e != nil {
		return nil, e
	} else if l != nil {
		p.ExemptConnectors = l
	}
	if l, e := uids("exempt_listeners", raw.Policy.ExemptListeners); e != nil {
		return nil, e
	} else if l != nil {
		p.ExemptListeners = l
	}
	for _, s := range raw.Cluster.Subnets {
		pfx, e := netip.ParsePrefix(s)
		if e != nil {
			return nil, fmt.Errorf("config %s: [cluster] subnets: %w", path, e)
		}
		p.ClusterSubnets = append(p.ClusterSubnets, pfx.Masked())
	}
	for _, s := range raw.OffCluster.AllowPorts {
		var r policy.PortRange
		if _, e := fmt.Sscanf(s, "%d-%d", &r.First, &r.Last); e != nil {
			if _, e = fmt.Sscanf(s, "%d", &r.First); e != nil {
				return nil, fmt.Errorf("config %s: [offcluster] allow_ports: bad range %q", path, s)
			}
			r.Last = r.First
		}
		p.OffClusterPorts = append(p.OffClusterPorts, r)
	}
	return p, err
}
