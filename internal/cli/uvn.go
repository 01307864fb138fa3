package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

func uvnCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "uvn",
		Short: "Per-user VRF + VXLAN networks (reference 000): setup, release, teardown, status, PAM and SPANK entry points",
		Long: `uvn gives each user a VRF on every node and a VXLAN per underlay network, so a
user's processes reach only the user's own listeners (locally and on other
nodes), system services in the default VRF, and off-subnet hosts through a
per-user NAT address. See docs/uvn.md.`,
	}
	cmd.AddCommand(uvnSetupCmd(), uvnReleaseCmd(), uvnTeardownCmd(), uvnStatusCmd(), uvnPAMCmd(), uvnJobCmd(), uvnLoginCmd(), uvnLeftoversCmd())
	return cmd
}

// uvnManager loads the configuration and builds a manager.
func uvnManager(cmd *cobra.Command, needEnabled bool) (*uvn.Manager, *policy.Config, error) {
	cfg, err := policy.Load(configPath)
	if err != nil {
		return nil, nil, err
	}
	if needEnabled && !cfg.UVN.Enable {
		return nil, cfg, nil
	}
	if len(cfg.UVN.Underlays) == 0 {
		return nil, nil, fmt.Errorf("%s: [uvn] has no [[uvn.underlay]]", cfg.Path)
	}
	var nodes []netip.Addr
	for _, n := range cfg.Nodes {
		nodes = append(nodes, n.Addr)
	}
	m := uvn.New(&cfg.UVN, nodes)
	m.Logf = func(format string, args ...any) {
		if v, _ := cmd.Flags().GetBool("verbose"); v {
			fmt.Fprintf(cmd.ErrOrStderr(), format+"\n", args...)
		}
	}
	return m, cfg, nil
}

func uidFlag(cmd *cobra.Command, s string) (uint32, error) {
	if s == "" {
		return 0, errors.New("--uid is required")
	}
	return identity.UID(identity.System(), s)
}

func uvnSetupCmd() *cobra.Command {
	var uid string
	var pid, holder int
	c := &cobra.Command{
		Use:   "setup --uid UID [--pid PID [--holder PID]]",
		Short: "Create the user's VRF, VXLANs, NAT and guards (idempotent); with --pid move that process's session into the VRF",
		Long: `Create uid's network on this node: VRF palv<uid> (table = uid) with 127.0.0.1
and ::1, one VXLAN pal<i>x<uid> per configured underlay this node is on (VNI =
uid mod 2^24, port = underlay port + uid>>24, the NIC's addresses mirrored), a
NAT address from nat_pool with SNAT on every uplink, and the node-wide nftables
guard. Idempotent; same-user runs serialise, other users run in parallel; a
failure half-way removes everything this run made.

With --pid, the VRF socket program is attached to that process's own cgroup
(or a child of it, when the cgroup is shared), and --holder (default: --pid)
is recorded as a live user of the network.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			u, err := uidFlag(cmd, uid)
			if err != nil {
				return err
			}
			m, _, err := uvnManager(cmd, false)
			if err != nil {
				return err
			}
			st, err := m.Setup(u, pid, holder)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "uid %d: VRF %s (table %d), VXLANs %s, NAT %s, holders %d\n",
				st.UID, st.VRF, st.Table, strings.Join(st.Links, ","), st.NAT, len(st.Holders))
			return nil
		},
	}
	c.Flags().StringVar(&uid, "uid", "", "user (uid or name)")
	c.Flags().IntVar(&pid, "pid", 0, "process whose session moves into the VRF")
	c.Flags().IntVar(&holder, "holder", 0, "process that keeps the network alive (default --pid)")
	c.Flags().BoolP("verbose", "v", false, "log each step")
	return c
}

func uvnReleaseCmd() *cobra.Command {
	var uid string
	var holder int
	c := &cobra.Command{
		Use:   "release --uid UID [--holder PID]",
		Short: "Drop a holder (and dead ones); tear the user's network down when none is left",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			u, err := uidFlag(cmd, uid)
			if err != nil {
				return err
			}
			m, _, err := uvnManager(cmd, false)
			if err != nil {
				return err
			}
			down, err := m.Release(u, holder)
			if err != nil {
				return err
			}
			if down {
				fmt.Fprintf(cmd.OutOrStdout(), "uid %d: last holder gone, network removed\n", u)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "uid %d: still held\n", u)
			}
			return nil
		},
	}
	c.Flags().StringVar(&uid, "uid", "", "user (uid or name)")
	c.Flags().IntVar(&holder, "holder", 0, "holder to drop (0: only prune dead holders)")
	c.Flags().BoolP("verbose", "v", false, "log each step")
	return c
}

func uvnTeardownCmd() *cobra.Command {
	var uid string
	var all bool
	c := &cobra.Command{
		Use:   "teardown --uid UID | --all",
		Short: "Remove the user's network on this node now (whatever its holders); --all: every user and the node-wide objects",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			m, _, err := uvnManager(cmd, false)
			if err != nil {
				return err
			}
			if all {
				return m.TeardownAll()
			}
			u, err := uidFlag(cmd, uid)
			if err != nil {
				return err
			}
			return m.Teardown(u)
		},
	}
	c.Flags().StringVar(&uid, "uid", "", "user (uid or name)")
	c.Flags().BoolVar(&all, "all", false, "every user")
	c.Flags().BoolP("verbose", "v", false, "log each step")
	return c
}

func uvnStatusCmd() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "status",
		Short: "List the users with a network on this node, their holders and objects",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			m, _, err := uvnManager(cmd, false)
			if err != nil {
				return err
			}
			users, node, err := m.Status()
			if err != nil {
				return err
			}
			if asJSON {
				e := json.NewEncoder(cmd.OutOrStdout())
				e.SetIndent("", "  ")
				return e.Encode(map[string]any{"users": users, "node": node})
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "UID\tVRF\tTABLE\tVXLANS\tNAT\tHOLDERS\tCGROUPS\tSTATE")
			for _, u := range users {
				state := "ok"
				switch {
				case !u.Complete:
					state = "incomplete"
				case !u.Intact:
					state = "damaged"
				}
				fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%d/%d\t%d\t%s\n", u.UID, u.VRF, u.Table, strings.Join(u.Links, ","),
					u.NAT, u.LiveHolders, len(u.Holders), len(u.Attach), state)
			}
			w.Flush()
			if node == nil {
				fmt.Fprintln(cmd.OutOrStdout(), "node: no node-wide objects")
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "node: complete=%v, %d journal records (state %s)\n", node.Complete, len(node.Undo), m.StateDir())
			}
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "JSON output")
	return c
}

// systemAccount reports root and accounts below the default min_uid: when
// the configuration cannot be read, the PAM and SPANK entry points let them
// through, so a broken configuration never locks out administrators or
// system services (users fail closed).
func systemAccount(name string) bool {
	uid, err := identity.UID(identity.System(), name)
	if err != nil {
		return false
	}
	var d policy.UVNConfig
	d.SetDefaults()
	return int64(uid) < d.MinUID
}

// serveUID resolves a user and says whether uvn applies to it.
func serveUID(m *uvn.Manager, name string) (uint32, bool, error) {
	uid, err := identity.UID(identity.System(), name)
	if err != nil {
		return 0, false, err
	}
	if m.CheckUID(uid) != nil {
		return uid, false, nil // system account (or beyond uid_max): not served
	}
	return uid, true, nil
}

func uvnPAMCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "pam",
		Short: "pam_exec entry point: open_session sets up and moves the session, close_session releases it",
		Long: `Run from pam_exec (session, required — fail closed):

  session required pam_exec.so /usr/bin/palisade --config /etc/palisade/palisade.toml uvn pam

Reads PAM_TYPE and PAM_USER. open_session: set up the user's network and move
the calling process (pam_exec's parent, e.g. sshd's session process) into the
VRF; it is the session's holder. close_session: release that holder. Other
PAM types, uvn disabled, and uids below min_uid: success, nothing done.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			typ, user := os.Getenv("PAM_TYPE"), os.Getenv("PAM_USER")
			if typ != "open_session" && typ != "close_session" {
				return nil
			}
			m, _, err := uvnManager(cmd, true)
			if err != nil || m == nil {
				if systemAccount(user) {
					return nil // a broken config never locks out root or system accounts
				}
				return err
			}
			uid, served, err := serveUID(m, user)
			if err != nil || !served {
				return err
			}
			ppid := os.Getppid()
			if typ == "open_session" {
				_, err = m.Setup(uid, ppid, ppid)
				return err
			}
			_, err = m.Release(uid, ppid)
			return err
		},
	}
	c.Flags().BoolP("verbose", "v", false, "log each step")
	return c
}

func uvnJobCmd() *cobra.Command {
	var pid, holder int
	c := &cobra.Command{
		Use:    "job start|end UID",
		Short:  "SPANK entry point: start = set up and move task PID (holder = slurmstepd); end = release holder",
		Hidden: true,
		Args:   cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, _, err := uvnManager(cmd, true)
			if err != nil || m == nil {
				if systemAccount(args[1]) {
					return nil
				}
				return err
			}
			uid, served, err := serveUID(m, args[1])
			if err != nil || !served {
				return err
			}
			switch args[0] {
			case "start":
				if pid <= 0 {
					return errors.New("job start needs --pid")
				}
				_, err = m.Setup(uid, pid, holder)
			case "end":
				_, err = m.Release(uid, holder)
			default:
				err = fmt.Errorf("unknown job action %q", args[0])
			}
			return err
		},
	}
	c.Flags().IntVar(&pid, "pid", 0, "task to move into the VRF")
	c.Flags().IntVar(&holder, "holder", 0, "slurmstepd pid (holder)")
	c.Flags().BoolP("verbose", "v", false, "log each step")
	return c
}

func uvnLeftoversCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "leftovers",
		Short:  "List uvn kernel objects in this network namespace (tests: must be empty after the last teardown)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := uvn.Leftovers()
			if err != nil {
				return err
			}
			for _, s := range l {
				fmt.Fprintln(cmd.OutOrStdout(), s)
			}
			if len(l) > 0 {
				return &ExitError{1, strconv.Itoa(len(l)) + " uvn objects left"}
			}
			return nil
		},
	}
}

func uvnLoginCmd() *cobra.Command {
	var uid string
	c := &cobra.Command{
		Use:    "login --uid USER -- ARGV...",
		Short:  "Set up USER's network, move this process into the VRF and exec ARGV (as root; ARGV drops privileges)",
		Hidden: true,
		Args:   cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, _, err := uvnManager(cmd, true)
			if err != nil {
				return err
			}
			if m != nil {
				u, served, err := serveUID(m, uid)
				if err != nil {
					return err
				}
				if served {
					if _, err := m.Setup(u, os.Getpid(), os.Getpid()); err != nil {
						return err
					}
				}
			}
			path, err := exec.LookPath(args[0])
			if err != nil {
				return err
			}
			return syscall.Exec(path, args, os.Environ())
		},
	}
	c.Flags().StringVar(&uid, "uid", "", "user (uid or name)")
	return c
}
