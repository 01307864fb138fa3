package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sockowner"
)

func identCommand() *cobra.Command {
	// identCmd groups the ident service's own commands; the agent normally runs
	// the service, `ident serve` runs it alone (e.g. on a node without the
	// eBPF data plane, or on a portal host).
	identCmd := &cobra.Command{
		Use:   "ident",
		Short: "The ident service: who owns a socket, for peers and local portals",
	}
	var (
		port     uint16
		sock     string
		group    string
		subnets  []string
		logLevel string
	)
	serve := &cobra.Command{
		Use:   "serve",
		Short: "Run the ident service alone (UDP from privileged ports in cluster subnets, plus the Unix-socket API)",
		Long: `Run the ident service without the agent. Settings come from --config
([cluster] subnets; [agent] ident_port, ident_socket, ident_socket_group) and
may be overridden by flags. --port 0 turns UDP off, --socket "" the Unix API.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			pol, err := withSubnets(cfg.Policy, subnets)
			if err != nil {
				return err
			}
			sc := identServerConfig(cfg)
			if cmd.Flags().Changed("port") {
				sc.UDPPort, sc.DisableUDP = port, port == 0
			}
			if cmd.Flags().Changed("socket") {
				sc.SocketPath, sc.DisableUnix = sock, sock == ""
			}
			if cmd.Flags().Changed("socket-group") {
				sc.SocketGroup = group
			}
			if sc.DisableUDP && sc.DisableUnix {
				return fmt.Errorf("both the UDP service and the Unix API are off: nothing to serve")
			}
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			sc.Policy = pol
			sc.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
			srv, err := sockowner.NewServer(sc)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			if cfg.Default {
				sc.Logger.Warn("no configuration file: no cluster subnets, only this node's own queries are answered", "config", cfg.Path)
			}
			// The sockets are bound: ready for systemd (Type=notify).
			daemon.SdNotify(false, daemon.SdNotifyReady)
			return srv.Run(ctx)
		},
	}
	f := serve.Flags()
	f.Uint16Var(&port, "port", sockowner.DefaultPort, "UDP port, privileged (default: [agent] ident_port)")
	f.StringVar(&sock, "socket", sockowner.DefaultSocketPath, "Unix API socket (default: [agent] ident_socket)")
	f.StringVar(&group, "socket-group", "", "group (name or gid) allowed to use the Unix API (default: [agent] ident_socket_group; empty = root only)")
	f.StringSliceVar(&subnets, "cluster-subnet", nil, "cluster subnet to answer, repeatable (default: [cluster] subnets)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	identCmd.AddCommand(serve)
	return identCmd
}

// identServerConfig maps the [agent] ident keys of cfg onto the ident
// service's configuration (policy included); the agent and `ident serve`
// share it.
func identServerConfig(cfg *config.Config) sockowner.ServerConfig {
	a := cfg.Agent
	return sockowner.ServerConfig{
		UDPPort:     uint16(a.IdentPort),
		DisableUDP:  a.IdentPort == 0,
		SocketPath:  a.IdentSocket,
		DisableUnix: a.IdentSocket == "",
		SocketGroup: a.IdentSocketGroup,
		Policy:      cfg.Policy,
	}
}

// loadConfig reads --config: a missing file is an error only when --config
// was given explicitly (the operator commands work on an unconfigured node
// with the built-in defaults).
func loadConfig(cmd *cobra.Command) (*config.Config, error) {
	if cmd.Flags().Changed("config") {
		return config.Load(configPath)
	}
	return config.LoadOrDefault(configPath)
}

// withSubnets returns p with its cluster subnets replaced by subnets (if
// any are given).
func withSubnets(p *policy.Policy, subnets []string) (*policy.Policy, error) {
	if len(subnets) == 0 {
		return p, nil
	}
	c := *p
	c.ClusterSubnets = nil
	for _, s := range subnets {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("--cluster-subnet %q: %w", s, err)
		}
		c.ClusterSubnets = append(c.ClusterSubnets, pfx.Masked())
	}
	return &c, nil
}

// identAccess is how operator commands reach ident: the node's Unix API
// socket and the peers' UDP port, from the configuration.
type identAccess struct {
	socket  string
	port    uint16
	timeout time.Duration
}

func newIdentAccess(cfg *config.Config, sockFlag string, sockChanged bool, timeout time.Duration) identAccess {
	a := identAccess{socket: cfg.Agent.IdentSocket, port: uint16(cfg.Agent.IdentPort), timeout: timeout}
	if sockChanged || a.socket == "" {
		a.socket = sockFlag
	}
	return a
}

// ownerOf finds the owner of target: locally when target (or node) is this
// node, else by asking the owning node's ident service — directly from a
// privileged port when root, through the local Unix API otherwise. It
// returns the node that answered (zero = this node).
func (ia identAccess) ownerOf(ctx context.Context, node netip.Addr, target netip.AddrPort, proto policy.Proto) (sockowner.Owner, netip.Addr, error) {
	if !node.IsValid() && !sockowner.IsLocalAddr(target.Addr()) {
		node = target.Addr()
	}
	if !node.IsValid() || sockowner.IsLocalAddr(node) {
		if os.Geteuid() != 0 {
			// Other users' /proc/PID/fd are unreadable: prefer the
			// service, which runs as root, if it is there.
			if o, _, err := sockowner.QueryLocalAPI(ctx, ia.socket, netip.Addr{}, target, proto); err == nil || errors.Is(err, sockowner.ErrNoSocket) {
				return o, netip.Addr{}, err
			}
		}
		o, err := sockowner.LookupLocal(target, proto)
		return o, netip.Addr{}, err
	}
	if os.Geteuid() != 0 {
		o, _, err := sockowner.QueryLocalAPI(ctx, ia.socket, node, target, proto)
		if err != nil && !errors.Is(err, sockowner.ErrNoSocket) && !errors.Is(err, sockowner.ErrTimeout) {
			err = fmt.Errorf("asking node %v needs root (a privileged source port) or this node's ident service: %w", node, err)
		}
		return o, node, err
	}
	o, err := sockowner.Client{Port: ia.port, Timeout: ia.timeout}.Query(ctx, node, target, netip.AddrPort{}, proto)
	return o, node, err
}
