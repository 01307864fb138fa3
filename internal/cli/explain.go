package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/vishvananda/netlink"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sockowner"
)

func explainCommand() *cobra.Command {
	var (
		from, group, nodeFlag, to, sock string
		lisUser, lisGroup, portFlag     string
		quiet                           bool
		timeout                         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "explain [--from USER [--group G]] [--node N] (--to HOST:PORT[/udp] | [--to HOST] --port PORT[/udp]) [--listener-user U [--listener-group G]]",
		Short: "Explain which rule allows or denies a connection to a listener, why, and how to fix it",
		Long: `Decide a connection as the kernel would and say why. The connector is you, with
the credentials of this process (uid, effective gid, supplementary groups, as
the kernel sees them), unless --from names a user: then their identity comes
from NSS (--group as after newgrp/sg). The listener's owner at ADDR:PORT is
found locally or by asking its node's ident service; when its group cannot be
known (another user's process, no access to the ident service) the verdict is
"undecided", never a guess. --node is the node the connector runs on (default:
this node); it decides whether the connection is local, from the cluster, or
off-cluster. A refused connection comes with the fix when one exists (ask the
owner to share under a common group with sg). Exits 0 whatever the verdict;
with --quiet prints nothing and exits 1 unless the connection is allowed.

HOST is an address, a name of [cluster] nodes, a Slurm node name (its
NodeAddr, from scontrol) or a host name. What-if: --listener-user (and
--listener-group, default the user's primary group: what sg would start it
with) stands for the listener, which need not exist; --port gives the port,
on --to HOST or on this node. When the listener cannot be looked up (a user
without access to another node's ident service), explain says what you would
get if it is your own, and how to ask about someone else's.`,
		Example: "  palisade explain --to node2:8888\n" +
			"  palisade explain --from alice --node node1 --to 198.18.0.2:5000\n" +
			"  palisade explain --from bob --group proj1 --to 127.0.0.1:6000/udp\n" +
			"  palisade explain --from bob --to node2 --port 8888 --listener-user alice --listener-group proj1",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if to == "" && portFlag == "" {
				return errors.New("--to HOST:PORT[/udp] (or --port PORT[/udp], with --to HOST for another node) is required")
			}
			if lisGroup != "" && lisUser == "" {
				return errors.New("--listener-group needs --listener-user")
			}
			if from == "" && group != "" {
				return errors.New("--group needs --from (your own effective group is the one you run with: use sg GROUP -c 'palisade explain ...')")
			}
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			pol := cfg.Policy
			target, proto, toName, err := explainTarget(cfg, to, portFlag)
			if err != nil {
				return err
			}
			res := identity.System()
			var conn policy.Identity
			if from == "" {
				conn = callerIdentity()
			} else if conn, err = connectorIdentity(res, from, group); err != nil {
				return err
			}
			src, srcDesc, err := connectorSource(cfg, nodeFlag, target)
			if err != nil {
				return err
			}
			ia := newIdentAccess(cfg, sock, cmd.Flags().Changed("socket"), timeout)
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout+time.Second)
			defer cancel()
			var (
				lis      sockowner.Owner
				answered netip.Addr
				lerr     error
			)
			whatIf := lisUser != ""
			if whatIf {
				if lis, err = whatIfListener(res, lisUser, lisGroup); err != nil {
					return err
				}
			} else {
				lis, answered, lerr = ia.ownerOf(ctx, netip.Addr{}, target, proto)
			}
			if !src.IsValid() {
				// Within a node the kernel sends from the dialled
				// address: what site rules' sources see.
				src = target.Addr().Unmap()
			}
			node := listenerNode(cfg, target.Addr())
			if node == "" {
				node = toName
			}
			c := policy.Conn{Source: src, Connector: conn, Listener: lis.Identity(), Port: target.Port(), Proto: proto, Node: node}
			var grantsErr error
			if proto == policy.TCP && lerr == nil && !whatIf && !pol.Grants.Disabled {
				// The listener's node holds the grants (palisade share).
				c.Grants, grantsErr = nodeGrants(ctx, flowsSocket(cmd), answered)
				c.At = time.Now()
			}
			v := pol.Decide(c)
			// Without the listener's owner only the identity-free rules
			// (system port, off-cluster) can decide; without its group, a
			// verdict that the group could change is no verdict.
			identityFree := v.Rule == policy.RuleSystemPort || v.Rule == policy.RuleOffClusterPort || v.Rule == policy.RuleOffClusterDenied
			gidUnknown := lerr == nil && lis.GID == sockowner.UnknownGID && !v.Allow
			decided := (lerr == nil && !gidUnknown) || identityFree

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
			if toName != "" {
				fmt.Fprintf(w, "to\t%v/%v (%s)\n", target, proto, toName)
			} else {
				fmt.Fprintf(w, "to\t%v/%v\n", target, proto)
			}
			switch {
			case whatIf:
				fmt.Fprintf(w, "listener\t%s, effective gid %s (what-if: not looked up)\n",
					identity.UserName(res, lis.UID), identity.GroupName(res, lis.GID))
			case errors.Is(lerr, sockowner.ErrNoSocket):
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
				if gidUnknown {
					fmt.Fprintf(w, "verdict\tundecided: the listener's group is unknown here (its process is another user's, and this node's ident service is not open to you: [agent] ident_socket_group); the kernel knows it — try the connection, or ask root to run explain\n")
				} else {
					fmt.Fprintf(w, "verdict\tundecided: the rule depends on the listener's owner\n")
					// What the user can know without the owner: their own
					// listener there, and how to ask about another's.
					own := c
					own.Listener = policy.Identity{UID: conn.UID, GID: conn.GID, Groups: conn.Groups}
					ov := pol.Decide(own)
					word := "DENY"
					if ov.Allow {
						word = "ALLOW"
					}
					fmt.Fprintf(w, "if yours\t%s (rule %s): %s\n", word, ov.Rule, pol.ExplainWith(own, res))
					fmt.Fprintf(w, "else\tif it is another user's: palisade explain ... --listener-user THEM [--listener-group GROUP] (what-if), or try the connection\n")
				}
				if l := stampLimits(pol, nodeFlag, target.Addr(), proto); l != "" {
					fmt.Fprintf(w, "limits\t%s\n", l)
				}
				return w.Flush()
			}
			word := "DENY"
			if v.Allow {
				word = "ALLOW"
			}
			fmt.Fprintf(w, "verdict\t%s (rule %s)\n", word, v.Rule)
			if grantsErr != nil && !v.Allow {
				fmt.Fprintf(w, "grants\tnot known (%v): a user grant (palisade share) could still allow it\n", grantsErr)
			}
			fmt.Fprintf(w, "why\t%s\n", pol.ExplainWith(c, res))
			if cfg.UVN.Enable {
				fmt.Fprintf(w, "uvn\t%s\n", uvnExplain(cfg, res, c))
			}
			if !v.Allow {
				for _, f := range fixes(res, c, v, lis, !pol.Grants.Disabled) {
					fmt.Fprintf(w, "fix\t%s\n", f)
				}
			}
			if l := stampLimits(pol, nodeFlag, target.Addr(), proto); l != "" {
				fmt.Fprintf(w, "limits\t%s\n", l)
			}
			return w.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "connecting user (name or uid; default: you, with this process's credentials)")
	f.StringVar(&group, "group", "", "connector's effective group, as after newgrp/sg (default: primary group)")
	f.StringVar(&nodeFlag, "node", "", "node the connector runs on: name ([cluster] nodes or hosts) or address (default: this node)")
	f.StringVar(&to, "to", "", "listener HOST:PORT[/udp] (HOST: address, [cluster] node, Slurm node or host name), or HOST with --port")
	f.StringVar(&portFlag, "port", "", "listener port PORT[/udp], on --to HOST or this node")
	f.StringVar(&lisUser, "listener-user", "", "what-if: the listener's owner (name or uid); no live listener is looked up")
	f.StringVar(&lisGroup, "listener-group", "", "what-if: the group the listener runs with (default: the owner's primary group)")
	f.BoolVar(&quiet, "quiet", false, "print nothing; exit 1 unless allowed")
	f.StringVar(&sock, "socket", sockowner.DefaultSocketPath, "ident service Unix socket, used when not root (default: [agent] ident_socket)")
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
func connectorSource(cfg *config.Config, node string, target netip.AddrPort) (netip.Addr, string, error) {
	if node == "" {
		if sockowner.IsLocalAddr(target.Addr()) {
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
	if a == target.Addr() || (sockowner.IsLocalAddr(a) && sockowner.IsLocalAddr(target.Addr())) {
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

// callerIdentity is this process's identity as the kernel sees it: what a
// connection made from here would carry (not what NSS says the user has —
// a session started before a group was added lacks it).
func callerIdentity() policy.Identity {
	id := policy.Identity{UID: uint32(os.Geteuid()), GID: uint32(os.Getegid())}
	groups, _ := os.Getgroups()
	for _, g := range groups {
		id.Groups = append(id.Groups, uint32(g))
	}
	if !id.HasGroup(id.GID) {
		id.Groups = append(id.Groups, id.GID)
	}
	return id
}

// fixes are what the users can do about a refused connection: share the
// listener under a group both hold (the listener's owner starts it with
// sg), or start a new session when the directory has a group the
// connector's session lacks.
func fixes(res identity.Resolver, c policy.Conn, v policy.Verdict, lis sockowner.Owner, grants bool) []string {
	if r := policy.Rule(v.Rule); v.Rule != policy.RuleDenied && !slices.Contains(policy.BuiltinRules, r) {
		return []string{fmt.Sprintf("site rule %s refuses it on purpose: ask the administrators (palisade policy test shows the site's tests)", r)}
	}
	if v.Rule != policy.RuleDenied {
		if v.Rule == policy.RuleOffClusterDenied {
			return []string{"connect from a cluster node (ssh to a login node first), or ask the administrators to open the port to off-cluster sources ([offcluster] allow_ports)"}
		}
		return nil
	}
	user := func(uid uint32) string {
		if n, err := res.LookupUID(uid); err == nil {
			return n
		}
		return fmt.Sprint(uid)
	}
	group := func(gid uint32) string {
		if n, err := res.LookupGID(gid); err == nil {
			return n
		}
		return fmt.Sprint(gid)
	}
	owner, cname := user(lis.UID), user(c.Connector.UID)
	var out []string
	// Groups the connector's account holds in the directory.
	var dirGroups []uint32
	if name, err := res.LookupUID(c.Connector.UID); err == nil {
		dirGroups, _ = res.GroupsOf(name)
	}
	if slices.Contains(dirGroups, lis.GID) && !c.Connector.HasGroup(lis.GID) {
		out = append(out, fmt.Sprintf("%s is a member of %s in the directory, but this session does not carry it: log in again (or run newgrp %s) and retry",
			cname, group(lis.GID), group(lis.GID)))
	}
	// Groups the listener's owner and the connector share.
	var lisGroups []uint32
	if name, err := res.LookupUID(lis.UID); err == nil {
		lisGroups, _ = res.GroupsOf(name)
	}
	var shared []string
	for _, g := range lisGroups {
		if c.Connector.HasGroup(g) && g != lis.GID {
			if _, primary, err := res.LookupUser(owner); err == nil && primary == g {
				continue // a private primary group shares nothing
			}
			shared = append(shared, group(g))
		}
	}
	if len(shared) > 0 {
		out = append(out, fmt.Sprintf("ask %s to share the service with a group you both hold: sg %s -c '<command>' (restart it under the group: only the group it starts with counts)",
			owner, shared[0]))
	} else if len(out) == 0 {
		out = append(out, fmt.Sprintf("%s and %s share no group: a project group both belong to would let %s share it (sg GROUP), or ask the administrators", owner, cname, owner))
	}
	if c.Proto == policy.TCP && grants {
		out = append(out, fmt.Sprintf("%s can let %s in for a while: palisade share %d --with %s (on the listener's node)", owner, cname, c.Port, cname))
	}
	return out
}

// listenerNode names the listener's node for site rules limited to some
// nodes: this host for a local address, else the [cluster] nodes entry
// holding the address ("" if none).
func listenerNode(cfg *config.Config, addr netip.Addr) string {
	if sockowner.IsLocalAddr(addr) {
		h, _ := os.Hostname()
		return h
	}
	for _, n := range cfg.Nodes {
		if slices.Contains(n.Addrs, addr.Unmap()) {
			return n.Name
		}
	}
	return ""
}

// stampLimits says what the identity stamp costs a datagram to dst sent
// from this node: the route's MTU (lowered by the agent by the stamp's
// room), the largest datagram that leaves whole, and what happens to larger
// ones (docs/users.md, "Large datagrams"). "" when nothing applies.
func stampLimits(pol *policy.Policy, node string, dst netip.Addr, proto policy.Proto) string {
	if proto != policy.UDP || node != "" {
		return "" // TCP carries the stamp on its SYN only; another node's routes are not known here
	}
	dst = dst.Unmap()
	routes, err := netlink.RouteGet(dst.AsSlice())
	if err != nil || len(routes) == 0 {
		return ""
	}
	r := routes[0]
	link, err := netlink.LinkByIndex(r.LinkIndex)
	if err != nil {
		return ""
	}
	room, hdr, max := kernel.StampRoom4, 28, 65507
	if dst.Is6() {
		room, hdr, max = kernel.StampRoom6, 48, 65527
	}
	if link.Attrs().Flags&net.FlagLoopback != 0 {
		return fmt.Sprintf("on this node every datagram size (up to %d bytes) carries your identity (a stamp, or a loopback token where a stamp does not fit)", max)
	}
	if !pol.InCluster(dst) && !dst.IsLinkLocalUnicast() {
		return "" // off-cluster: no stamp is added
	}
	mtu := r.MTU
	if mtu == 0 {
		mtu = link.Attrs().MTU
	}
	if want := kernel.StampMTU(link.Attrs().MTU, 0, dst.Is6()); mtu > want {
		return fmt.Sprintf("the route to %s has MTU %d: not lowered for the identity stamp (is the agent running here? route changed?); datagrams of more than %d bytes are sent without your identity and refused", dst, mtu, mtu-hdr-room)
	}
	return fmt.Sprintf("datagrams leave whole up to %d bytes (route MTU %d via %s, %d bytes kept for the identity stamp); larger ones are fragmented and delivered, or refused at once with EMSGSIZE where fragmenting is forbidden (IP_PMTUDISC_DO, IPV6_DONTFRAG, QUIC), as are UDP_SEGMENT sizes above %d; IP options or IPv6 extension headers get EPERM",
		mtu-hdr, mtu, link.Attrs().Name, room, mtu-hdr)
}

// explainTarget is the listener's address, protocol and node name (if given
// by name) from --to HOST[:PORT][/udp] and --port PORT[/udp].
func explainTarget(cfg *config.Config, to, port string) (netip.AddrPort, policy.Proto, string, error) {
	if port != "" {
		host := to
		if host == "" {
			host = "127.0.0.1"
		}
		if strings.Contains(host, "/") || (strings.Count(host, ":") == 1) {
			return netip.AddrPort{}, 0, "", fmt.Errorf("--to %q with --port: give the host alone", to)
		}
		to = net.JoinHostPort(strings.Trim(host, "[]"), port) // PORT[/udp] stays last
	}
	if t, p, err := sockowner.ParseTarget(to); err == nil {
		return t, p, "", nil
	}
	hostPort, proto := to, "tcp"
	if i := strings.LastIndexByte(to, '/'); i >= 0 {
		hostPort, proto = to[:i], to[i+1:]
	}
	host, ps, err := net.SplitHostPort(hostPort)
	if err != nil {
		return netip.AddrPort{}, 0, "", fmt.Errorf("bad target %q: want HOST:PORT[/udp] (HOST an address or a node name), IPv6 as [ADDR]:PORT", to)
	}
	a, err := resolveNode(cfg, host)
	if err != nil {
		return netip.AddrPort{}, 0, "", err
	}
	t, p, err := sockowner.ParseTarget(net.JoinHostPort(a.String(), ps) + "/" + proto)
	return t, p, host, err
}

// whatIfListener is --listener-user (and --listener-group): the identity a
// listener started by that user would have. A group the user does not hold
// is refused, as sg would.
func whatIfListener(res identity.Resolver, user, group string) (sockowner.Owner, error) {
	uid, err := identity.UID(res, user)
	if err != nil {
		return sockowner.Owner{}, fmt.Errorf("--listener-user %q: %w", user, err)
	}
	o := sockowner.Owner{UID: uid, GID: uid}
	name, nerr := res.LookupUID(uid)
	if nerr == nil {
		if _, gid, err := res.LookupUser(name); err == nil {
			o.GID = gid
		}
		o.Groups, _ = res.GroupsOf(name)
	}
	if group != "" {
		g, err := identity.GID(res, group)
		if err != nil {
			return sockowner.Owner{}, fmt.Errorf("--listener-group %q: %w", group, err)
		}
		if nerr == nil && g != o.GID && !slices.Contains(o.Groups, g) {
			return sockowner.Owner{}, fmt.Errorf("--listener-group %s: %s is not a member (sg could not start the listener under it)", identity.GroupName(res, g), name)
		}
		o.GID = g
	}
	return o, nil
}

// nodeGrants returns the user grants the caller may see on the listener's
// node (node: its address, zero for this node), through this node's agent.
func nodeGrants(ctx context.Context, sock string, node netip.Addr) ([]policy.Grant, error) {
	req := userwall.FlowsRequest{Kind: userwall.KindGrant, Grant: &userwall.GrantRequest{Op: "list"}}
	if node.IsValid() {
		req.Nodes = []string{node.String()}
	}
	resp, err := userwall.AskFlows(ctx, sock, req)
	if err != nil {
		return nil, err
	}
	var out []policy.Grant
	for _, n := range resp.Nodes {
		if n.Error != "" {
			return nil, errors.New(n.Error)
		}
		if n.Grant != nil {
			for _, g := range n.Grant.Grants {
				out = append(out, g.Grant)
			}
		}
	}
	return out, nil
}
