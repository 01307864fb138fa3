package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/client"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/gateway"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/join"
)

// egressConfig reads the [egress] table (defaults when the file is missing).
func egressConfig() (egress.Config, error) {
	cfg, err := config.LoadOrDefault(configPath)
	if err != nil {
		return egress.Config{}, err
	}
	return cfg.Egress, nil
}

func gatewayConfig(e egress.Config) (gateway.Config, error) {
	pool, err := netip.ParsePrefix(e.Pool)
	if err != nil {
		return gateway.Config{}, fmt.Errorf("egress.pool: %v", err)
	}
	ttl, err := time.ParseDuration(e.LeaseTTL)
	if err != nil {
		return gateway.Config{}, fmt.Errorf("egress.lease_ttl: %v", err)
	}
	var deny []netip.Prefix
	for _, d := range e.Deny {
		p, err := netip.ParsePrefix(d)
		if err != nil {
			return gateway.Config{}, fmt.Errorf("egress.deny: %v", err)
		}
		deny = append(deny, p.Masked())
	}
	return gateway.Config{Deny: deny, StateDir: e.StateDir, ListenPort: e.ListenPort, Pool: pool, Mode: e.Mode,
		TunName: e.TunName, Domain: e.Domain, Upstream: e.UpstreamDNS, MTU: e.MTU, LeaseTTL: ttl,
		UserRate: e.UserRate, GlobalRate: e.GlobalRate}, nil
}

func egressCommands() []*cobra.Command {
	var e egress.Config
	var flagsSet func(cmd *cobra.Command) error
	gw := &cobra.Command{
		Use:   "gateway",
		Short: "Run the egress gateway (WireGuard, lease pool, overlay DNS) as root or as a user",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := flagsSet(cmd); err != nil {
				return err
			}
			gc, err := gatewayConfig(e)
			if err != nil {
				return err
			}
			g, err := gateway.Start(gc)
			if err != nil {
				return err
			}
			defer g.Close()
			// Listening and routing: ready for systemd (Type=notify).
			daemon.SdNotify(false, daemon.SdNotifyReady)
			if p := os.Getenv("PALISADE_EGRESS_CPUPROFILE"); p != "" {
				if f, err := os.Create(p); err == nil && pprof.StartCPUProfile(f) == nil {
					defer pprof.StopCPUProfile()
				}
			}
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
			<-sig
			return nil
		},
	}
	// Flags override the config file; they are bound to a scratch copy and
	// applied after the file is loaded.
	var fl egress.Config
	fl.SetDefaults()
	pf := gw.PersistentFlags()
	pf.StringVar(&fl.StateDir, "state", fl.StateDir, "state directory (key, leases, revocations)")
	f := gw.Flags()
	f.IntVar(&fl.ListenPort, "port", fl.ListenPort, "WireGuard UDP port (joins on port+1)")
	f.StringVar(&fl.Pool, "pool", fl.Pool, "client address pool")
	f.StringVar(&fl.Mode, "mode", fl.Mode, "data path: auto, tun (root) or netstack (unprivileged)")
	f.StringVar(&fl.TunName, "tun", fl.TunName, "tun device name (tun mode)")
	f.StringVar(&fl.Domain, "domain", fl.Domain, "overlay DNS zone")
	f.StringVar(&fl.UpstreamDNS, "upstream-dns", fl.UpstreamDNS, "DNS server for other names (ip:port)")
	f.IntVar(&fl.MTU, "mtu", fl.MTU, "tunnel MTU")
	f.StringVar(&fl.LeaseTTL, "lease-ttl", fl.LeaseTTL, "lease duration")
	f.Int64Var(&fl.UserRate, "user-rate", 0, "bandwidth limit per user, bytes/s (0 = none)")
	f.Int64Var(&fl.GlobalRate, "global-rate", 0, "bandwidth limit for all clients, bytes/s (0 = none)")
	flagsSet = func(cmd *cobra.Command) error {
		var err error
		if e, err = egressConfig(); err != nil {
			return err
		}
		set := func(name string, dst, src any) {
			if cmd.Flags().Changed(name) {
				switch d := dst.(type) {
				case *string:
					*d = *src.(*string)
				case *int:
					*d = *src.(*int)
				case *int64:
					*d = *src.(*int64)
				}
			}
		}
		set("state", &e.StateDir, &fl.StateDir)
		set("port", &e.ListenPort, &fl.ListenPort)
		set("pool", &e.Pool, &fl.Pool)
		set("mode", &e.Mode, &fl.Mode)
		set("tun", &e.TunName, &fl.TunName)
		set("domain", &e.Domain, &fl.Domain)
		set("upstream-dns", &e.UpstreamDNS, &fl.UpstreamDNS)
		set("mtu", &e.MTU, &fl.MTU)
		set("lease-ttl", &e.LeaseTTL, &fl.LeaseTTL)
		set("user-rate", &e.UserRate, &fl.UserRate)
		set("global-rate", &e.GlobalRate, &fl.GlobalRate)
		set("endpoint", &e.Endpoint, &fl.Endpoint)
		set("ttl", &e.TokenTTL, &fl.TokenTTL)
		return e.Validate()
	}

	var user, job string
	token := &cobra.Command{
		Use:   "token --user U --job J",
		Short: "Issue a join token (pass it to the job as " + client.TokenEnv + ")",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := flagsSet(cmd); err != nil {
				return err
			}
			if e.Endpoint == "" {
				return errors.New("no endpoint: set [egress] endpoint or --endpoint host:port (the join port, listen_port+1)")
			}
			ttl, err := time.ParseDuration(e.TokenTTL)
			if err != nil {
				return fmt.Errorf("--ttl: %v", err)
			}
			k, err := gateway.LoadOrCreateKey(e.StateDir)
			if err != nil {
				return err
			}
			t, err := join.IssueToken(k, join.Claims{User: user, Job: job, Expires: time.Now().Add(ttl).Unix(), Gateway: e.Endpoint})
			if err != nil {
				return err
			}
			fmt.Println(t)
			return nil
		},
	}
	token.Flags().StringVar(&user, "user", "", "user name")
	token.Flags().StringVar(&job, "job", "", "job id")
	token.Flags().StringVar(&fl.Endpoint, "endpoint", "", "join endpoint host:port written into the token")
	token.Flags().StringVar(&fl.TokenTTL, "ttl", fl.TokenTTL, "token lifetime")

	var revUser, revJob, revKey string
	revoke := &cobra.Command{
		Use:   "revoke (--user U | --job U/J | --key K)",
		Short: "Revoke a user, a job or a client key; a running gateway drops them within a second",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := flagsSet(cmd); err != nil {
				return err
			}
			var what []string
			if revUser != "" {
				what = append(what, revUser)
			}
			if revJob != "" {
				what = append(what, revJob)
			}
			if revKey != "" {
				if _, err := join.ParseKey(revKey); err != nil {
					return err
				}
				what = append(what, "key:"+revKey)
			}
			if len(what) == 0 {
				return errors.New("nothing to revoke: give --user, --job or --key")
			}
			return gateway.Revoke(e.StateDir, what...)
		},
	}
	revoke.Flags().StringVar(&revUser, "user", "", "user name")
	revoke.Flags().StringVar(&revJob, "job", "", "user/job")
	revoke.Flags().StringVar(&revKey, "key", "", "client public key (base64)")

	status := &cobra.Command{
		Use:   "status",
		Short: "Show the gateway's key, leases and counters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := flagsSet(cmd); err != nil {
				return err
			}
			b, err := os.ReadFile(filepath.Join(e.StateDir, "stats.json"))
			if err != nil {
				return fmt.Errorf("no running gateway state in %s: %v", e.StateDir, err)
			}
			var s gateway.Stats
			if err := json.Unmarshal(b, &s); err != nil {
				return err
			}
			fmt.Printf("mode %s  key %s\nfrom clients %d B, to clients %d B, isolation drops %d, rate drops %d\njoin datagrams dropped %d (rate limit or not for this gateway), replayed %d\n",
				s.Mode, s.PublicKey, s.FromClients, s.ToClients, s.IsolationDrop, s.RateDrop, s.JoinDrop, s.JoinReplay)
			for _, l := range s.Leases {
				fmt.Printf("%-16s %-32s until %s\n", l.Addr, l.Name(), l.Expires.UTC().Format(time.RFC3339))
			}
			return nil
		},
	}
	gw.AddCommand(token, revoke, status)

	var o client.Options
	eg := &cobra.Command{
		Use:   "egress [flags] [--] CMD [ARGS...]",
		Short: "Run CMD with all its traffic (TCP, UDP, DNS) leaving through the egress gateway",
		Long: "Joins the gateway with the token in $" + client.TokenEnv + " (or --token) and runs CMD in an\n" +
			"unprivileged network namespace whose only route is a WireGuard tunnel (--path tun), or\n" +
			"behind a local SOCKS5 proxy given to CMD as ALL_PROXY (--path socks; without CMD it only\n" +
			"serves the proxy). --path auto tries tun first.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ec, err := egressConfig()
			if err != nil {
				return err
			}
			if o.Token == "" {
				o.Token = os.Getenv(client.TokenEnv)
			}
			if o.GatewayKey == "" {
				o.GatewayKey = ec.GatewayKey
			}
			o.Cmd = args
			if p := os.Getenv("PALISADE_EGRESS_CPUPROFILE"); p != "" {
				if f, err := os.Create(p); err == nil && pprof.StartCPUProfile(f) == nil {
					defer pprof.StopCPUProfile()
				}
			}
			code, err := client.Run(o)
			if err != nil {
				return err
			}
			if code != 0 {
				return &ExitError{Code: code, Msg: fmt.Sprintf("command exited with status %d", code)}
			}
			return nil
		},
	}
	eg.Flags().SetInterspersed(false)
	eg.Flags().StringVar(&o.Path, "path", "auto", "client data path: auto, tun, netstack or socks")
	eg.Flags().StringVar(&o.Token, "token", "", "join token (default $"+client.TokenEnv+")")
	eg.Flags().StringVar(&o.GatewayKey, "gateway-key", "", "pin the gateway's public key (base64)")
	eg.Flags().StringVar(&o.Node, "node", "", "node name in the overlay name (default hostname)")
	eg.Flags().StringVar(&o.SocksListen, "socks-listen", "", "socks path: listen address (default 127.0.0.1:0)")

	ns := &cobra.Command{
		Use:                client.NSHelperArg,
		Hidden:             true,
		DisableFlagParsing: true,
		RunE:               func(*cobra.Command, []string) error { return client.NSMain() },
	}
	return []*cobra.Command{gw, eg, ns}
}
