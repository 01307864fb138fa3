package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/ident"
	"github.com/palisade-hpc/palisade/policy"
)

// identCmd groups the ident service's own commands; the agent normally runs
// the service, `ident serve` runs it alone (e.g. on a node without the
// eBPF data plane, or for a portal host).
var identCmd = &cobra.Command{
	Use:   "ident",
	Short: "The ident service: who owns a socket, for peers and local portals",
}

func init() {
	var (
		port     uint16
		sock     string
		group    string
		noUDP    bool
		noUnix   bool
		subnets  []string
		logLevel string
	)
	serve := &cobra.Command{
		Use:   "serve",
		Short: "Run the ident service (UDP from privileged ports in cluster subnets, plus the Unix-socket API)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			pol, err := identPolicy(cmd, subnets)
			if err != nil {
				return err
			}
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
			srv, err := ident.NewServer(ident.ServerConfig{
				UDPPort: port, DisableUDP: noUDP,
				SocketPath: sock, SocketGroup: group, DisableUnix: noUnix,
				Policy: pol, Logger: log,
			})
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return srv.Run(ctx)
		},
	}
	f := serve.Flags()
	f.Uint16Var(&port, "port", ident.DefaultPort, "UDP port (privileged)")
	f.StringVar(&sock, "socket", ident.DefaultSocketPath, "Unix API socket path")
	f.StringVar(&group, "socket-group", "", "group (name or gid) allowed to use the Unix API (default: root only)")
	f.BoolVar(&noUDP, "no-udp", false, "serve only the Unix API")
	f.BoolVar(&noUnix, "no-unix", false, "serve only UDP")
	f.StringSliceVar(&subnets, "cluster-subnet", nil, "cluster subnet to answer (repeatable; default: [cluster] subnets of --config)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	identCmd.AddCommand(serve)
	register(identCmd)
}

// identPolicy is the policy from --config, with --cluster-subnet flags
// (if any) replacing its cluster subnets. A missing default config file is
// not an error (policy.Default: only loopback is trusted); a named one is.
func identPolicy(cmd *cobra.Command, subnets []string) (*policy.Policy, error) {
	pol, err := loadPolicyFile(configPath, cmd.Flags().Changed("config"))
	if err != nil {
		return nil, err
	}
	if len(subnets) > 0 {
		p := *pol
		p.ClusterSubnets = nil
		for _, s := range subnets {
			pfx, err := netip.ParsePrefix(s)
			if err != nil {
				return nil, fmt.Errorf("--cluster-subnet %q: %w", s, err)
			}
			p.ClusterSubnets = append(p.ClusterSubnets, pfx.Masked())
		}
		pol = &p
	}
	return pol, nil
}

// isLocalAddr reports whether a is loopback or assigned to an interface in
// this network namespace.
func isLocalAddr(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() || a.IsUnspecified() {
		return true
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, x := range addrs {
		if n, ok := x.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a {
				return true
			}
		}
	}
	return false
}

// ownerOf finds the owner of target: locally when target (or node) is this
// node, else by asking the owning node's ident service — directly from a
// privileged port when root, through the local Unix API otherwise. It
// returns the node that answered (zero = this node).
func ownerOf(ctx context.Context, node netip.Addr, target netip.AddrPort, proto policy.Proto, sock string, timeout time.Duration) (ident.Owner, netip.Addr, error) {
	if !node.IsValid() && !isLocalAddr(target.Addr()) {
		node = target.Addr()
	}
	if !node.IsValid() || isLocalAddr(node) {
		if os.Geteuid() != 0 {
			// Other users' /proc/PID/fd are unreadable: prefer the
			// service, which runs as root, if it is there.
			if o, _, err := ident.QueryLocalAPI(ctx, sock, netip.Addr{}, target, proto); err == nil || err == ident.ErrNoSocket {
				return o, netip.Addr{}, err
			}
		}
		o, err := ident.LookupLocal(target, proto)
		return o, netip.Addr{}, err
	}
	if os.Geteuid() != 0 {
		o, _, err := ident.QueryLocalAPI(ctx, sock, node, target, proto)
		return o, node, err
	}
	o, err := ident.Client{Timeout: timeout}.Query(ctx, node, target, netip.AddrPort{}, proto)
	return o, node, err
}
