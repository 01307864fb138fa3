package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/portal"
	"github.com/palisade-hpc/palisade/internal/sys/unixserve"
)

func portalCommand() *cobra.Command {
	var sock string
	cmd := &cobra.Command{
		Use:   "portal",
		Short: "Connections on a user's behalf for web portals (Open OnDemand, JupyterHub)",
		Long: `A web portal's proxy runs as a service account. Instead of making that account
an exempt connector (then every portal user reaches every other user's apps), the
agent opens each connection as the user the portal authenticated: the proxy
account must be listed in [portal] proxies, and the user must have a session with
it, which only her own process can register (palisade portal session).
docs/portals.md has the configuration for Open OnDemand and the threat model.`,
	}
	cmd.PersistentFlags().StringVar(&sock, "socket", "", "the agent's delegation socket (default: [portal] socket)")
	path := func(c *cobra.Command) (string, error) {
		if sock != "" {
			return sock, nil
		}
		cfg, err := loadConfig(c)
		if err != nil {
			return "", err
		}
		if cfg.Portal.Socket == "" {
			return "", errors.New("[portal] socket is off in the configuration")
		}
		return cfg.Portal.Socket, nil
	}
	cmd.AddCommand(portalSessionCommand(path), portalEndCommand(path), portalSessionsCommand(path),
		portalConnectCommand(path), portalForwardCommand(path))
	return cmd
}

func portalSessionCommand(path func(*cobra.Command) (string, error)) *cobra.Command {
	var (
		proxy, group string
		ttl          time.Duration
		hold         bool
	)
	cmd := &cobra.Command{
		Use:   "session --proxy ACCOUNT",
		Short: "Let a portal's proxy open connections as you (run by the user, e.g. at the start of her portal session)",
		Long: `Registers a session: the proxy account may open connections as you until the
session expires (--ttl, at most [portal] max_session), you end it (palisade
portal end), or, with --hold, this command ends. The connections carry your
primary group, or --group (you must be a member).`,
		Example: "  palisade portal session --proxy www-data --ttl 8h\n  palisade portal session --proxy ood --hold   # for as long as it runs",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := path(cmd)
			if err != nil {
				return err
			}
			if proxy == "" {
				return errors.New("--proxy: which proxy account the session is for")
			}
			if !hold {
				r, err := portal.Register(cmd.Context(), p, proxy, group, ttl)
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "session with %s until %s (uid %d, gid %d)\n", proxy, r.Expires.Local().Format(time.RFC3339), r.UID, r.GID)
				return nil
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
			defer stop()
			return portal.Hold(ctx, p, proxy, group, ttl, func(r *portal.Response) {
				fmt.Fprintf(cmd.OutOrStdout(), "session with %s held until this ends or %s (uid %d, gid %d)\n", proxy, r.Expires.Local().Format(time.RFC3339), r.UID, r.GID)
			})
		},
	}
	cmd.Flags().StringVar(&proxy, "proxy", "", "the proxy account (name or uid)")
	cmd.Flags().StringVar(&group, "group", "", "the group its connections carry (default: your primary group)")
	cmd.Flags().DurationVar(&ttl, "ttl", 0, "how long the session lasts (default: [portal] max_session)")
	cmd.Flags().BoolVar(&hold, "hold", false, "stay running; the session ends when this command does")
	return cmd
}

func portalEndCommand(path func(*cobra.Command) (string, error)) *cobra.Command {
	var proxy string
	cmd := &cobra.Command{
		Use:   "end",
		Short: "End your portal sessions (with --proxy, or all)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := path(cmd)
			if err != nil {
				return err
			}
			n, err := portal.EndSessions(cmd.Context(), p, proxy)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d session(s) ended\n", n)
			return nil
		},
	}
	cmd.Flags().StringVar(&proxy, "proxy", "", "only the session with this proxy account")
	return cmd
}

func portalSessionsCommand(path func(*cobra.Command) (string, error)) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "sessions",
		Short: "List portal sessions (root: all; a proxy: those naming it; a user: hers)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := path(cmd)
			if err != nil {
				return err
			}
			ss, err := portal.Sessions(cmd.Context(), p)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), ss)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "USER\tPROXY\tGID\tEXPIRES\tHELD")
			for _, s := range ss {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%v\n", s.User, s.Proxy, s.GID, s.Expires.Local().Format(time.RFC3339), s.Held)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func portalConnectCommand(path func(*cobra.Command) (string, error)) *cobra.Command {
	var user string
	cmd := &cobra.Command{
		Use:     "connect --user USER HOST:PORT",
		Short:   "As a proxy account: connect to HOST:PORT as USER and relay stdin/stdout (like nc)",
		Example: "  printf 'GET /api HTTP/1.0\\r\\n\\r\\n' | palisade portal connect --user alice node2:8888",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := path(cmd)
			if err != nil {
				return err
			}
			if user == "" {
				return errors.New("--user: whom the connection is for")
			}
			c, err := portal.Dial(cmd.Context(), p, user, args[0])
			if err != nil {
				return err
			}
			defer c.Close()
			go func() {
				io.Copy(c, cmd.InOrStdin())
				if cw, ok := c.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite() // the relay passes the half-close on
				}
			}()
			_, err = io.Copy(cmd.OutOrStdout(), c)
			return err
		},
	}
	cmd.Flags().StringVar(&user, "user", "", "the user the connection is for")
	return cmd
}

func portalForwardCommand(path func(*cobra.Command) (string, error)) *cobra.Command {
	var (
		listen, header, hostRE, mode, group string
		pathUser                            bool
	)
	cmd := &cobra.Command{
		Use:   "forward --listen unix:PATH|127.0.0.1:PORT",
		Short: "As a proxy account: an HTTP reverse proxy for /rnode/<host>/<port>/ over connections made as the authenticated user",
		Long: `Runs as the proxy account, behind the portal's web server (Apache, nginx), which
authenticates users and sets --user-header (replacing any header of that name a
client sent). Routes as Open OnDemand's: /rnode/<host>/<port>/<rest> is
forwarded to <host>:<port> as /<rest>, /node/<host>/<port>/... unchanged. Each
request goes over a connection the agent made as the user (never reused for
another request). With --user-in-path the user is instead the first segment of
/as/<user>/..., for routers that write it into the target (JupyterHub's proxy).
Listen on a Unix socket only the web server can open (--mode, --group), or on a
loopback port above [policy] system_port_max (userwall lets only this account
connect to it).`,
		Example: "  palisade portal forward --listen unix:/run/palisade/portal-forward.sock --group www-data",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := path(cmd)
			if err != nil {
				return err
			}
			f := &portal.Forwarder{Agent: p, UserHeader: header, Log: slog.Default()}
			if pathUser {
				f.UserHeader = ""
			}
			if hostRE != "" {
				if f.HostRE, err = regexp.Compile("^(?:" + hostRE + ")$"); err != nil {
					return fmt.Errorf("--host-regex: %w", err)
				}
			}
			l, cleanup, err := forwardListener(listen, mode, group)
			if err != nil {
				return err
			}
			defer cleanup()
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			srv := &http.Server{Handler: f, ReadHeaderTimeout: 30 * time.Second}
			go func() {
				<-ctx.Done()
				sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				srv.Shutdown(sctx)
			}()
			fmt.Fprintf(cmd.OutOrStdout(), "forwarding on %s\n", l.Addr())
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&listen, "listen", "", "unix:PATH, or 127.0.0.1:PORT / [::1]:PORT")
	fl.StringVar(&header, "user-header", "X-Palisade-User", "the header the web server sets to the authenticated user")
	fl.BoolVar(&pathUser, "user-in-path", false, "the user is the path's /as/<user>/ segment instead of a header")
	fl.StringVar(&hostRE, "host-regex", "", "hosts the portal may forward to (a regular expression matched in full; default any)")
	fl.StringVar(&mode, "mode", "0660", "mode of the Unix socket")
	fl.StringVar(&group, "group", "", "group of the Unix socket (the web server's)")
	cmd.MarkFlagRequired("listen")
	return cmd
}

// forwardListener listens on unix:PATH (mode, group) or a loopback TCP
// address.
func forwardListener(listen, mode, group string) (net.Listener, func(), error) {
	if p, ok := strings.CutPrefix(listen, "unix:"); ok {
		m, err := strconv.ParseUint(mode, 8, 32)
		if err != nil {
			return nil, nil, fmt.Errorf("--mode %q: %w", mode, err)
		}
		gid := -1
		if group != "" {
			g, err := identity.GID(identity.System(), group)
			if err != nil {
				return nil, nil, fmt.Errorf("--group %s: %w", group, err)
			}
			gid = int(g)
		}
		// Made under a temporary name with its mode and group, then
		// renamed: never reachable by more than those it is for.
		l, err := unixserve.Listen(p, os.FileMode(m), gid)
		if err != nil {
			return nil, nil, err
		}
		return l, func() { l.Close() }, nil
	}
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, nil, fmt.Errorf("--listen %q: want unix:PATH or HOST:PORT", listen)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, nil, fmt.Errorf("--listen %q: a TCP listener must be on a loopback address (the forwarder trusts its user header)", listen)
	}
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, nil, err
	}
	return l, func() { l.Close() }, nil
}
