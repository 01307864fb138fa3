package testbed

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The directory of `testbed up --directory ldap`: a real OpenLDAP server
// (Debian's slapd, config and data in <dir>/ldap) in the router's namespace,
// and one SSSD per node as the node's NSS source for passwd and group. The
// testbed's users then exist only in the directory as far as the nodes can
// tell: each node's /etc/passwd, /etc/group, /etc/shadow and /etc/gshadow
// are instance copies without them, its /etc/nsswitch.conf says "files
// sss", and /var/lib/sss (SSSD's compiled-in pipes and caches) is the
// node's own. The host's files are never touched: the copies are bound over
// /etc by `ip netns exec` (the /etc/netns overlay) and /var/lib/sss by the
// node wrapper, both in the private mount namespace every node process
// lives in.
//
// One SSSD per node, not one per instance: a real site runs one per node,
// so each node has its own cache and expiry (the membership bound is per
// node) and its own LDAP connection (slapd's log attributes the directory
// load to each node's address). It costs ~4 processes and ~40 MB per node.

// DirectoryLDAP is the only directory kind.
const DirectoryLDAP = "ldap"

// Directory layout and timing.
const (
	LDAPBase  = "dc=pal,dc=test"
	LDAPAdmin = "cn=admin," + LDAPBase
	LDAPPort  = 389
	// SSSDCacheTimeout is the testbed's SSSD entry_cache_timeout (shipped
	// default 5400 s): how long a node may answer from its cache after the
	// directory changed. It is part of the membership bound (docs/policy.md).
	SSSDCacheTimeout = 10 * time.Second
	// SSSDMemcacheTimeout is sssd_nss's memcache_timeout (shipped 300 s);
	// the agent bypasses the memory cache (SSS_NSS_USE_MEMCACHE=NO).
	SSSDMemcacheTimeout = 10 * time.Second
	// HPCPortalGroup is a directory group (svc) for exemptions by group.
	HPCPortalGroup = "hpc-portal"
	HPCPortalGID   = 2300
	// Synthetic users of --directory-users N: "u<i>" with uid and private
	// gid SynthUIDBase+i, groups "g<j>" with gid SynthGIDBase+j.
	SynthUIDBase = 100000
	SynthGIDBase = 300000
	// SynthGroupsPerUser is each synthetic user's number of supplementary
	// groups: 10,000 users give 100,000 memberships in 2,000 groups.
	SynthGroupsPerUser = 10
)

// testbedNames are the accounts the nodes' files view must not show.
func testbedNames() map[string]bool {
	m := map[string]bool{ProjectGroup: true, HPCPortalGroup: true}
	for _, u := range Users {
		m[u.Name] = true
	}
	return m
}

// LDAPDir holds slapd's configuration, database, socket and log.
func (tb *Testbed) LDAPDir() string { return filepath.Join(tb.Dir, "ldap") }

// LDAPI is the URL of slapd's Unix socket (root maps to the admin DN).
func (tb *Testbed) LDAPI() string {
	return "ldapi://" + url.PathEscape(filepath.Join(tb.LDAPDir(), "ldapi"))
}

// LDAPURL is the directory as the nodes reach it.
func LDAPURL() string { return fmt.Sprintf("ldap://%s:%d", RouterEth0V4, LDAPPort) }

// SSSDir is the node's own /var/lib/sss.
func (tb *Testbed) SSSDir(node string) string { return filepath.Join(tb.Dir, "nodes", node, "sss") }

// SlapdLog is slapd's log (loglevel stats: one line per operation, with the
// connection's source address at ACCEPT).
func (tb *Testbed) SlapdLog() string { return filepath.Join(tb.LogDir(), "slapd.log") }

// LDAPModify applies an LDIF change (ldapmodify as the admin over ldapi).
func (tb *Testbed) LDAPModify(ctx context.Context, ldif string) error {
	_, err := run(ctx, ldif, "ldapmodify", "-Q", "-Y", "EXTERNAL", "-H", tb.LDAPI())
	return err
}

// LDAPSearch runs ldapsearch as the admin over ldapi and returns its LDIF.
func (tb *Testbed) LDAPSearch(ctx context.Context, filter string, attrs ...string) (string, error) {
	args := append([]string{"-Q", "-LLL", "-Y", "EXTERNAL", "-H", tb.LDAPI(), "-b", LDAPBase, filter}, attrs...)
	return run(ctx, "", "ldapsearch", args...)
}

var directoryCommands = []string{"/usr/sbin/slapd", "/usr/sbin/slapadd", "/usr/sbin/sssd", "ldapmodify", "ldapsearch"}

func validateDirectory(opts *Options) error {
	switch opts.Directory {
	case "", "none":
		opts.Directory = ""
		if opts.DirectoryUsers != 0 {
			return fmt.Errorf("--directory-users needs --directory %s", DirectoryLDAP)
		}
		return nil
	case DirectoryLDAP:
	default:
		return fmt.Errorf("unknown directory %q (known: %s)", opts.Directory, DirectoryLDAP)
	}
	if opts.DirectoryUsers < 0 || opts.DirectoryUsers > 1000000 {
		return fmt.Errorf("invalid --directory-users %d: want 0..1000000", opts.DirectoryUsers)
	}
	if opts.VM {
		return fmt.Errorf("--directory is not supported with --vm")
	}
	for _, c := range directoryCommands {
		if _, err := exec.LookPath(c); err != nil {
			return fmt.Errorf("%s not found: install the packages listed in .ci/deps (slapd, ldap-utils, sssd-ldap, libnss-sss)", c)
		}
	}
	// Mount points the node overlays need; they come with the packages.
	for _, p := range []string{"/var/lib/sss", "/etc/sssd"} {
		if st, err := os.Stat(p); err != nil || !st.IsDir() {
			return fmt.Errorf("%s missing: install sssd-common and libnss-sss (.ci/deps)", p)
		}
	}
	if m, _ := filepath.Glob("/usr/lib/*/libnss_sss.so.2"); len(m) == 0 {
		return fmt.Errorf("libnss_sss.so.2 not found: install libnss-sss (.ci/deps)")
	}
	return nil
}

// filterEntries drops the lines of an /etc database whose first field is
// one of names.
func filterEntries(data string, names map[string]bool) string {
	var b strings.Builder
	for _, l := range strings.SplitAfter(data, "\n") {
		if l == "" {
			continue
		}
		if f, _, ok := strings.Cut(l, ":"); ok && names[f] {
			continue
		}
		b.WriteString(l)
	}
	return b.String()
}

// nsswitch is the host's nsswitch.conf with passwd, group and shadow from
// "files sss" (gshadow stays files: sg needs no password from members).
func nsswitch(host string) string {
	var b strings.Builder
	b.WriteString("# testbed directory node (written by palisade-lab testbed up): accounts from the directory via SSSD\n")
	for _, l := range strings.SplitAfter(host, "\n") {
		db, _, _ := strings.Cut(strings.TrimSpace(l), ":")
		switch db {
		case "passwd", "group", "shadow":
			fmt.Fprintf(&b, "%-15s files sss\n", db+":")
		default:
			b.WriteString(l)
		}
	}
	return b.String()
}

func (tb *Testbed) sssdConf(node string) string {
	t := int(SSSDCacheTimeout.Seconds())
	return fmt.Sprintf(`# SSSD of %[1]s in testbed %[2]s (written by palisade-lab testbed up)
[sssd]
services = nss
domains = pal

[nss]
# Shipped: 300 s. The agent bypasses it (SSS_NSS_USE_MEMCACHE=NO).
memcache_timeout = %[5]d

[domain/pal]
id_provider = ldap
auth_provider = none
ldap_uri = %[3]s
ldap_search_base = %[4]s
ldap_schema = rfc2307
ldap_id_use_start_tls = false
# What real sites run: no enumeration of the directory.
enumerate = false
cache_credentials = false
# Shipped: 5400 s. Part of the membership bound (docs/policy.md).
entry_cache_timeout = %[6]d
`, node, tb.Name, LDAPURL(), LDAPBase, int(SSSDMemcacheTimeout.Seconds()), t)
}

// GroupRefresh is the agent's group_refresh with a directory: with SSSD's
// cache time, the bound on a membership change (docs/policy.md).
const GroupRefresh = 5 * time.Second

// directoryPolicy ends the node's [agent] table with a directory.
func (tb *Testbed) directoryPolicy() string {
	if tb.Directory == "" {
		return ""
	}
	return fmt.Sprintf("# Membership bound: group_refresh + SSSD entry_cache_timeout (%v).\ngroup_refresh = %q\n",
		SSSDCacheTimeout, GroupRefresh.String())
}

// directoryExempt adds the directory group hpc-portal (svc) to the exempt
// connectors by gid: a number, so the policy also loads where the group
// does not resolve (check reads every node's policy on the host).
func (tb *Testbed) directoryExempt() string {
	if tb.Directory == "" {
		return ""
	}
	return fmt.Sprintf(`, "@%d"`, HPCPortalGID)
}

// writeDirectoryConfig writes each node's files view, nsswitch.conf,
// sssd.conf and SSSD state directory, and slapd's configuration.
func (tb *Testbed) writeDirectoryConfig() error {
	names := testbedNames()
	files := map[string]os.FileMode{"passwd": 0o644, "group": 0o644, "shadow": 0o640, "gshadow": 0o640}
	content := map[string]string{}
	for f := range files {
		b, err := os.ReadFile("/etc/" + f)
		if err != nil {
			return err
		}
		content[f] = filterEntries(string(b), names)
	}
	ns, err := os.ReadFile("/etc/nsswitch.conf")
	if err != nil {
		return err
	}
	shadowGID := -1
	if st, err := os.Stat("/etc/shadow"); err == nil {
		shadowGID = int(st.Sys().(*syscall.Stat_t).Gid)
	}
	for _, n := range tb.Nodes {
		etc := tb.NodeEtc(n.Name)
		for f, mode := range files {
			p := filepath.Join(etc, f)
			if err := writeFile(p, content[f], mode); err != nil {
				return err
			}
			if mode == 0o640 && shadowGID >= 0 {
				if err := os.Chown(p, 0, shadowGID); err != nil {
					return err
				}
			}
		}
		if err := writeFile(filepath.Join(etc, "nsswitch.conf"), nsswitch(string(ns)), 0o644); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(etc, "sssd", "conf.d"), 0o711); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(etc, "sssd", "sssd.conf"), tb.sssdConf(n.Name), 0o600); err != nil {
			return err
		}
		sss := tb.SSSDir(n.Name)
		for p, mode := range map[string]os.FileMode{"": 0o755, "db": 0o700, "mc": 0o775, "pipes": 0o755,
			"pipes/private": 0o750, "pubconf": 0o755, "pubconf/krb5.include.d": 0o755, "gpo_cache": 0o755,
			"secrets": 0o700, "deskprofile": 0o751, "run": 0o755} {
			if err := mkdirOwned(filepath.Join(sss, p), mode, 0, 0); err != nil {
				return err
			}
		}
	}
	if err := tb.opaqueDirs(); err != nil {
		return err
	}
	return tb.writeSlapdConfig()
}

// opaqueDirs marks every directory of the node's /etc layer opaque to the
// overlay (nodeView), so that it replaces the host's directory as the
// `ip netns exec` bind would (/etc/ssh is the node's alone, not merged).
// Called once the node's /etc is complete.
func (tb *Testbed) opaqueDirs() error {
	for _, n := range tb.Nodes {
		ents, err := os.ReadDir(tb.NodeEtc(n.Name))
		if err != nil {
			return err
		}
		for _, e := range ents {
			if e.IsDir() {
				if err := unix.Setxattr(filepath.Join(tb.NodeEtc(n.Name), e.Name()), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
					return fmt.Errorf("overlay layer of %s: %w", n.Name, err)
				}
			}
		}
	}
	return nil
}

// nodeView is the argv that gives a node process the node's accounts view
// and execs the rest: a read-only overlay on /etc whose top layer is the
// node's /etc directory (passwd, group, shadow, gshadow, nsswitch.conf,
// sssd/ and everything `ip netns exec` would bind) over the host's /etc,
// and the node's own /var/lib/sss. It runs inside the node's private mount
// namespace, so neither the host nor other nodes see these mounts.
//
// Not per-file bind mounts (as `ip netns exec` makes): when the host
// rewrites /etc/passwd or /etc/group (useradd, groupadd, userdel: another
// testbed instance creating or removing the shared users), the kernel
// detaches every mount on the replaced file in all other mount namespaces
// (Linux ≥ 3.18), and the node would silently fall back to the host's
// files, test users included. A mount on the /etc directory itself stays.
func nodeView(etc, sss string) []string {
	if sss == "" {
		return nil
	}
	return []string{"/bin/sh", "-c", `mount -t overlay pal-etc -o "lowerdir=$0:/etc" /etc && mount --bind "$1" /var/lib/sss && shift && exec "$@"`, etc, sss}
}

// IdentityPrefix is the argv prefix (exec'ing the rest) that gives a
// process run in the host's mount namespace (as the userwall agent is, to
// see bpffs and cgroup2) the node's accounts view (nodeView) in a mount
// namespace of its own. Nil without a directory (the host's files are the
// nodes' files then).
func (tb *Testbed) IdentityPrefix(node string) []string {
	if tb.Directory == "" {
		return nil
	}
	return append([]string{"unshare", "--mount", "--propagation", "slave", "--"}, nodeView(tb.NodeEtc(node), tb.SSSDir(node))...)
}

func (tb *Testbed) writeSlapdConfig() error {
	d := tb.LDAPDir()
	for p, mode := range map[string]os.FileMode{"": 0o755, "db": 0o700} {
		if err := os.MkdirAll(filepath.Join(d, p), mode); err != nil {
			return err
		}
	}
	conf := fmt.Sprintf(`# slapd of testbed %[1]s (written by palisade-lab testbed up)
include /etc/ldap/schema/core.schema
include /etc/ldap/schema/cosine.schema
include /etc/ldap/schema/nis.schema
include /etc/ldap/schema/inetorgperson.schema
pidfile %[2]s/slapd.pid
argsfile %[2]s/slapd.args
modulepath /usr/lib/ldap
moduleload back_mdb
# root over the instance's ldapi socket is the admin: no password anywhere.
authz-regexp "^gidNumber=0[+]uidNumber=0,cn=peercred,cn=external,cn=auth$" "%[4]s"
sizelimit unlimited

database mdb
maxsize 4294967296
suffix "%[3]s"
rootdn "%[4]s"
directory %[2]s/db
index objectClass eq
index uid,uidNumber,gidNumber,memberUid,cn eq
access to * by * read
`, tb.Name, d, LDAPBase, LDAPAdmin)
	return writeFile(filepath.Join(d, "slapd.conf"), conf, 0o644)
}

// DirectoryLDIF is the directory's content: the testbed's users, their
// private groups, proj1 (alice, bob) and hpc-portal (svc), then n
// synthetic users in n/5 groups with SynthGroupsPerUser memberships each.
func DirectoryLDIF(n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "dn: %s\nobjectClass: dcObject\nobjectClass: organization\ndc: pal\no: palisade testbed\n\n", LDAPBase)
	for _, ou := range []string{"people", "groups"} {
		fmt.Fprintf(&b, "dn: ou=%s,%s\nobjectClass: organizationalUnit\nou: %s\n\n", ou, LDAPBase, ou)
	}
	user := func(name string, id int, home, shell string) {
		fmt.Fprintf(&b, "dn: uid=%[1]s,ou=people,%[2]s\nobjectClass: account\nobjectClass: posixAccount\nuid: %[1]s\ncn: %[1]s\n"+
			"uidNumber: %[3]d\ngidNumber: %[3]d\nhomeDirectory: %[4]s\nloginShell: %[5]s\nuserPassword: *\n\n", name, LDAPBase, id, home, shell)
	}
	group := func(name string, gid int, members []string) {
		fmt.Fprintf(&b, "dn: cn=%s,ou=groups,%s\nobjectClass: posixGroup\ncn: %s\ngidNumber: %d\n", name, LDAPBase, name, gid)
		for _, m := range members {
			fmt.Fprintf(&b, "memberUid: %s\n", m)
		}
		b.WriteString("\n")
	}
	for _, u := range Users {
		user(u.Name, int(u.UID), filepath.Join(HomeDir, u.Name), "/bin/bash")
		group(u.Name, int(u.UID), nil)
	}
	group(ProjectGroup, ProjectGID, strings.Split(projectMembers, ","))
	group(HPCPortalGroup, HPCPortalGID, []string{"svc"})
	if n <= 0 {
		return b.String()
	}
	groups := max(1, n/5)
	members := make([][]string, groups)
	for i := range n {
		name := "u" + strconv.Itoa(i)
		user(name, SynthUIDBase+i, "/nonexistent", "/usr/sbin/nologin")
		group(name, SynthUIDBase+i, nil)
		for k := range min(SynthGroupsPerUser, groups) {
			// Spread: user i is in groups i, i+step, ... (mod groups).
			g := (i + k*(groups/min(SynthGroupsPerUser, groups))) % groups
			members[g] = append(members[g], name)
		}
	}
	for j := range groups {
		group("g"+strconv.Itoa(j), SynthGIDBase+j, members[j])
	}
	return b.String()
}

// startDirectory loads the directory (slapadd, offline and in bulk), starts
// slapd in the router's namespace and an SSSD on every node, and waits
// until every node resolves alice through SSSD.
func (tb *Testbed) startDirectory(ctx context.Context, users int) error {
	d := tb.LDAPDir()
	conf := filepath.Join(d, "slapd.conf")
	if _, err := run(ctx, DirectoryLDIF(users), "/usr/sbin/slapadd", "-q", "-f", conf); err != nil {
		return err
	}
	uid, gid, err := lookupIDs("openldap")
	if err != nil {
		return err
	}
	if err := filepath.Walk(d, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	}); err != nil {
		return err
	}
	logf, err := os.OpenFile(tb.SlapdLog(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	// -d stats: foreground, one log line per operation (the load per node
	// is measured from it). Started through the router's namespace; it
	// ends with the instance (every process in its namespaces is killed).
	urls := fmt.Sprintf("%s %s", LDAPURL(), tb.LDAPI())
	cmd := exec.Command("ip", "netns", "exec", tb.Router, "/usr/sbin/slapd", "-d", "stats", "-u", "openldap", "-g", "openldap",
		"-f", conf, "-h", urls)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	go cmd.Wait() // reaped whenever it ends (teardown kills it)
	if err := waitPort(ctx, tb.Nodes[0].NetNS, net.JoinHostPort(RouterEth0V4.String(), strconv.Itoa(LDAPPort)), 30*time.Second); err != nil {
		return fmt.Errorf("slapd not listening (log %s): %w", tb.SlapdLog(), err)
	}
	var jobs []func() error
	for _, n := range tb.Nodes {
		jobs = append(jobs, func() error { return tb.startSSSD(ctx, n) })
	}
	return parallel(jobs...)
}

// startSSSD runs SSSD on node n in the foreground (its pid file is
// compiled in as /run/sssd.pid: its own /run keeps nodes apart) and waits
// until the node resolves alice through it.
func (tb *Testbed) startSSSD(ctx context.Context, n Node) error {
	logf, err := os.OpenFile(filepath.Join(tb.LogDir(), "sssd-"+n.Name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	argv := append(n.enter(), "/bin/sh", "-c", `mount --bind "$0" /run && exec "$@"`, filepath.Join(tb.SSSDir(n.Name), "run"),
		"/usr/sbin/sssd", "-i", "--logger=stderr")
	cmd := exec.Command("ip", argv...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	go cmd.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := tb.onNode(ctx, n, "getent", "-s", "sss", "passwd", "alice")
		if err == nil && strings.HasPrefix(out, "alice:") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: SSSD does not resolve alice after 30 s (log %s/sssd-%s.log): %v", n.Name, tb.LogDir(), n.Name, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
