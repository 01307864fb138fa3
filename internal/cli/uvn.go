package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/slurmconf"
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
	cmd.AddCommand(uvnSetupCmd(), uvnReleaseCmd(), uvnTeardownCmd(), uvnStatusCmd(), uvnPAMCmd(), uvnJobCmd(), uvnLoginCmd(), uvnLeftoversCmd(), uvnReloadCmd())
	return cmd
}

// uvnManager loads the configuration and builds a manager.
func uvnManager(cmd *cobra.Command, needEnabled bool) (*uvn.Manager, *config.Config, error) {
	cfg, err := config.Load(configPath)
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
	sc, err := readSlurmConf(cfg.UVN.SlurmConf)
	if err != nil {
		return nil, nil, err
	}
	m.Srun = cfg.UVN.SrunRange
	if m.Srun == (policy.PortRange{}) && sc != nil && sc.SrunPortRange != "" {
		m.Srun = policy.PortRange{First: sc.SrunFirst, Last: sc.SrunLast}
		if err := uvn.CheckSrunRange(m.Srun, cfg.UVN.UnderlayRanges); err != nil {
			return nil, nil, fmt.Errorf("%s: SrunPortRange: %w", cfg.UVN.SlurmConf, err)
		}
	}
	// Exempt accounts' sockets may serve every VRF (an account that does
	// not resolve here has no sockets here either).
	res := identity.System()
	names := append([]string{}, principals(cfg.UVN.ExemptUsers)...)
	// Slurm's accounts (slurmctld calls srun's listeners as SlurmUser):
	// from the configured slurm.conf, else the default one.
	if sc == nil {
		sc, _ = slurmconf.Read(slurmconf.DefaultPath)
	}
	if sc != nil {
		names = append(names, sc.Accounts()...)
	}
	for _, n := range names {
		if uid, err := identity.UID(res, n); err == nil {
			m.Exempt = append(m.Exempt, uid)
		}
	}
	host, _ := os.Hostname()
	m.Site = &uvn.SiteConfig{Policy: cfg.Policy, Node: host, Groups: groupsOfUID(res),
		Vet: func() error { _, err := cfg.RunTests(nil); return err }}
	return m, cfg, nil
}

// groupsOfUID looks a uid's groups up (NSS): what site rules' "@group"
// conditions test in uvn.
func groupsOfUID(res identity.Resolver) func(uint32) ([]uint32, error) {
	return func(uid uint32) ([]uint32, error) {
		name, err := res.LookupUID(uid)
		if err != nil {
			return nil, err
		}
		return res.GroupsOf(name)
	}
}

func uvnReloadCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "reload",
		Short: "Apply the configuration's site rules ([[rule]]) to every user's network on this node, atomically",
		Long: `Compile the site rules of the configuration for every user with a network on
this node and replace the nftables table palisade_uvn_site in one transaction
(docs/uvn.md, "Site rules"). A configuration that is invalid or whose policy
tests ([[test]]) fail is refused and the running rules stay; so does a
transaction the kernel refuses. The policy reload applies is the node's
accepted one (in the state directory): a user's network made later (a login,
a job step) and every teardown compile it, never the file on disk, so an edit
applies only through reload. Reload also restores the table if something
removed it (nft flush ruleset).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			m, cfg, err := uvnManager(cmd, false)
			if err != nil {
				return err
			}
			if results, err := cfg.RunTests(nil); err != nil {
				for _, r := range results {
					if r.Err != nil {
						fmt.Fprintf(cmd.ErrOrStderr(), "%s: test %q: %v\n", r.Where(), r.Name, r.Err)
					}
				}
				return &ExitError{1, fmt.Sprintf("%s: policy tests fail: refused, the running site rules stay", cfg.Path)}
			}
			n, err := m.ReloadSite()
			if err != nil {
				return fmt.Errorf("site rules not applied (the running ones stay): %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "site rules applied: %d rule(s), %d user(s) on this node\n", len(cfg.Policy.Rules), n)
			return nil
		},
	}
	verboseFlag(c)
	return c
}

func principals(ps []policy.Principal) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = string(p)
	}
	return out
}

// readSlurmConf reads slurm.conf; a node without one (no Slurm) is fine.
func readSlurmConf(path string) (*slurmconf.Conf, error) {
	if path == "" {
		return nil, nil
	}
	sc, err := slurmconf.Read(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return sc, err
}

func uidFlag(s string) (uint32, error) {
	if s == "" {
		return 0, errors.New("--uid is required")
	}
	return identity.UID(identity.System(), s)
}

// uvnForUID is the manager and the user of an administrator's command that
// names one with --uid.
func uvnForUID(cmd *cobra.Command, uid string) (*uvn.Manager, uint32, error) {
	u, err := uidFlag(uid)
	if err != nil {
		return nil, 0, err
	}
	m, _, err := uvnManager(cmd, false)
	return m, u, err
}

// verboseFlag is -v: uvnManager's Logf prints each step.
func verboseFlag(c *cobra.Command) {
	c.Flags().BoolP("verbose", "v", false, "log each step")
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
			m, u, err := uvnForUID(cmd, uid)
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
	verboseFlag(c)
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
			m, u, err := uvnForUID(cmd, uid)
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
	verboseFlag(c)
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
			u, err := uidFlag(uid)
			if err != nil {
				return err
			}
			return m.Teardown(u)
		},
	}
	c.Flags().StringVar(&uid, "uid", "", "user (uid or name)")
	c.Flags().BoolVar(&all, "all", false, "every user")
	verboseFlag(c)
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
				return writeJSON(cmd.OutOrStdout(), map[string]any{"users": users, "node": node})
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "UID\tVRF\tTABLE\tVXLANS\tNAT\tHOLDERS\tCGROUPS\tSTATE\tSRUN PORTS")
			for _, u := range users {
				state := "ok"
				switch {
				case !u.Complete:
					state = "incomplete"
				case !u.Intact:
					state = "damaged"
				}
				srun := "-"
				if u.SrunBudget > 0 {
					srun = fmt.Sprintf("%d/%d", u.SrunClaims, u.SrunBudget)
					if u.SrunClaims >= u.SrunBudget {
						srun += " (budget used up: srun finds no port)"
					}
				}
				fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%d/%d\t%d\t%s\t%s\n", u.UID, u.VRF, u.Table, strings.Join(u.Links, ","),
					u.NAT, u.LiveHolders, len(u.Holders), len(u.Attach), state, srun)
			}
			w.Flush()
			if node == nil {
				fmt.Fprintln(cmd.OutOrStdout(), "node: no node-wide objects")
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "node: complete=%v, %d journal records (state %s)\n", node.Complete, len(node.Undo), m.StateDir())
			}
			// A used-up srun budget is a finding (exit 1): the user's srun
			// says only "all ports in range exhausted".
			warned := false
			for _, u := range users {
				if msg := u.SrunExhausted(identity.UserName(identity.System(), u.UID)); msg != "" {
					fmt.Fprintf(cmd.OutOrStdout(), "WARNING: %s\n", msg)
					warned = true
				}
			}
			if warned {
				return &ExitError{1, ""}
			}
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "JSON output")
	return c
}

// uvnUser resolves the user of a PAM session or job step and decides
// whether uvn serves it: m == nil means "leave this user in the default VRF"
// (root, Slurm's daemon accounts, [uvn] exempt_users, uvn disabled). Which
// accounts are exempt comes from configuration only, never from a uid
// threshold; an account that cannot get a VRF and is not exempt is refused.
// A configuration that cannot be read fails closed for users but never
// for root or Slurm's accounts (read from the default slurm.conf then).
func uvnUser(cmd *cobra.Command, name string) (m *uvn.Manager, uid uint32, err error) {
	res := identity.System()
	uid, err = identity.UID(res, name)
	if err != nil {
		return nil, 0, fmt.Errorf("user %q: %w", name, err)
	}
	if uid == 0 {
		return nil, uid, nil
	}
	m, cfg, err := uvnManager(cmd, true)
	if err != nil {
		if slurmAccount(res, slurmconf.DefaultPath, uid) {
			return nil, uid, nil
		}
		return nil, uid, fmt.Errorf("configuration: %w", err)
	}
	if m == nil {
		return nil, uid, nil // uvn disabled
	}
	if slurmAccount(res, cfg.UVN.SlurmConf, uid) {
		return nil, uid, nil
	}
	for _, p := range cfg.UVN.ExemptUsers {
		if u, err := identity.UID(res, string(p)); err == nil && u == uid {
			return nil, uid, nil
		}
	}
	if err := m.CheckUID(uid); err != nil {
		return nil, uid, fmt.Errorf("%s (uid %d) cannot get a network: %w; list system accounts in [uvn] exempt_users", name, uid, err)
	}
	return m, uid, nil
}

// slurmAccount reports whether uid is SlurmUser or SlurmdUser of the
// slurm.conf at path.
func slurmAccount(res identity.Resolver, path string, uid uint32) bool {
	sc, err := slurmconf.Read(path)
	if err != nil {
		return false
	}
	for _, a := range sc.Accounts() {
		if u, err := identity.UID(res, a); err == nil && u == uid {
			return true
		}
	}
	return false
}

// ignoreStopSignals keeps a release running when its caller's session ends:
// slurmstepd signals everything it started at step end, sshd its session.
// (The Go runtime would otherwise turn an inherited SIG_IGN for SIGTERM back
// into "exit".)
func ignoreStopSignals() {
	signal.Ignore(syscall.SIGTERM, syscall.SIGHUP, syscall.SIGINT, syscall.SIGPIPE)
}

// uvnLog appends one line to the entry point's log file (if any).
func uvnLog(path, format string, args ...any) {
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%s %s\n", time.Now().Format(time.RFC3339), fmt.Sprintf(format, args...))
}

func uvnPAMCmd() *cobra.Command {
	var logPath string
	c := &cobra.Command{
		Use:   "pam",
		Short: "pam_exec entry point: open_session sets up and moves the session, close_session releases it",
		Long: `Run from pam_exec (session, required — fail closed), with stdout so the user
sees why a login was refused:

  session required pam_exec.so stdout /usr/bin/palisade --config /etc/palisade/palisade.toml uvn pam --log /var/log/palisade-uvn-pam.log

Reads PAM_TYPE and PAM_USER. open_session: set up the user's network and move
the calling process (pam_exec's parent, e.g. sshd's session process) into the
VRF; it is the session's holder. close_session: release that holder. Other
PAM types, uvn disabled, root, Slurm's accounts and [uvn] exempt_users:
success, nothing done. A failure prints one line for the user and exits 1.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ignoreStopSignals()
			typ, user := os.Getenv("PAM_TYPE"), os.Getenv("PAM_USER")
			if typ != "open_session" && typ != "close_session" {
				return nil
			}
			ppid := os.Getppid()
			err := func() error {
				m, uid, err := uvnUser(cmd, user)
				if err != nil || m == nil {
					return err
				}
				if typ == "open_session" {
					if _, err = m.Setup(uid, ppid, ppid); err == nil {
						srunWarning(m, uid, func(msg string) {
							host, _ := os.Hostname()
							fmt.Fprintf(cmd.OutOrStdout(), "Palisade: %s: %s\n", host, msg)
							uvnLog(logPath, "open_session %s session %d on %s: WARNING: %s", user, ppid, host, msg)
						})
					}
					return err
				}
				_, err = m.Release(uid, ppid)
				return err
			}()
			host, _ := os.Hostname()
			if err != nil {
				uvnLog(logPath, "%s %s session %d on %s: FAILED: %v", typ, user, ppid, host, err)
				// pam_exec's stdout reaches the user (PAM conversation).
				fmt.Fprintf(cmd.OutOrStdout(), "Palisade: %s: %v\n", host, err)
				return &ExitError{1, ""}
			}
			uvnLog(logPath, "%s %s session %d on %s: ok", typ, user, ppid, host)
			return nil
		},
	}
	c.Flags().StringVar(&logPath, "log", "", "append one line per session event to this file")
	verboseFlag(c)
	return c
}

// srunWarning passes say the message of a user whose srun claims are used
// up on this node (uvn.UserStatus.SrunExhausted), if they are.
func srunWarning(m *uvn.Manager, uid uint32, say func(string)) {
	st := m.SrunStatus(uid)
	if msg := st.SrunExhausted(identity.UserName(identity.System(), uid)); msg != "" {
		say(msg)
	}
}

// JobOK is the last line `uvn job` prints on success. The SPANK plugin
// runs it detached from slurmstepd (so the end-of-step kill cannot reach
// it) and therefore cannot wait for its exit status: it reads this line.
const JobOK = "palisade-uvn-job: ok"

func uvnJobCmd() *cobra.Command {
	var pid, holder int
	c := &cobra.Command{
		Use:    "job start|end UID",
		Short:  "SPANK entry point: start = set up and move task PID (holder = slurmstepd); end = release holder",
		Hidden: true,
		Args:   cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ignoreStopSignals()
			m, uid, err := uvnUser(cmd, args[1])
			if err == nil && m != nil {
				switch args[0] {
				case "start":
					if pid <= 0 {
						return errors.New("job start needs --pid")
					}
					if _, err = m.Setup(uid, pid, holder); err == nil {
						// Printed: the SPANK plugin logs this output in
						// slurmd's log.
						srunWarning(m, uid, func(msg string) { fmt.Fprintln(cmd.OutOrStdout(), "WARNING: "+msg) })
					}
				case "end":
					_, err = m.Release(uid, holder)
				default:
					err = fmt.Errorf("unknown job action %q", args[0])
				}
			}
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), JobOK)
			return nil
		},
	}
	c.Flags().IntVar(&pid, "pid", 0, "task to move into the VRF")
	c.Flags().IntVar(&holder, "holder", 0, "slurmstepd pid (holder)")
	verboseFlag(c)
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
			m, u, err := uvnUser(cmd, uid)
			if err != nil {
				return err
			}
			if m != nil {
				if _, err := m.Setup(u, os.Getpid(), os.Getpid()); err != nil {
					return err
				}
				srunWarning(m, u, func(msg string) { fmt.Fprintln(cmd.ErrOrStderr(), "palisade: WARNING: "+msg) })
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
