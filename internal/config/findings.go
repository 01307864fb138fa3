package config

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/uvnconfig"
	"github.com/palisade-hpc/palisade/internal/identity"
)

// Severity ranks a Finding.
type Severity int

const (
	// Warning: a risky but working setting; the file is applied.
	Warning Severity = iota
	// Problem: the file is valid, but the node will not work as the site
	// expects (Slurm's accounts not exempt, an exempt name that does not
	// resolve, no address of the node in the cluster subnets): `config
	// check` exits 1 and a reload is refused. An agent that starts with it
	// still enforces (it never refuses to start over one), and `palisade
	// status`, the metrics and the log report it.
	Problem
)

func (s Severity) String() string {
	if s == Problem {
		return "ERROR"
	}
	return "WARNING"
}

// Finding is something `config check` reports about a valid configuration.
type Finding struct {
	Severity Severity `json:"-"`
	Level    string   `json:"level"`
	Key      string   `json:"key"`
	Line     int      `json:"line,omitempty"`
	Msg      string   `json:"message"`
}

// String reads "FILE:LINE: KEY: message", like a ConfigError.
func (f Finding) String(file string) string {
	return (&ConfigError{File: file, Line: f.Line, Key: f.Key, Msg: f.Msg}).Error()
}

// DefaultSlurmConf is where Slurm's configuration is looked for when
// SLURM_CONF is not set (Debian, RHEL and Slurm's own default).
const DefaultSlurmConf = "/etc/slurm/slurm.conf"

// SlurmConfPath is the slurm.conf Slurm's commands read: $SLURM_CONF, else
// DefaultSlurmConf.
func SlurmConfPath() string {
	if p := os.Getenv("SLURM_CONF"); p != "" {
		return p
	}
	return DefaultSlurmConf
}

// CheckOptions tune Findings.
type CheckOptions struct {
	// SlurmConf is Slurm's configuration ("" = none: Slurm not checked).
	// A file that does not exist means Slurm is not installed.
	SlurmConf string
	// Resolver resolves Slurm's account names (nil = identity.System()).
	Resolver identity.Resolver
	// LocalAddrs are the node's addresses, checked against the cluster
	// subnets (nil: not checked).
	LocalAddrs []netip.Addr
	// Elsewhere: the file is checked for other nodes (a configuration
	// management host): names that do not resolve here are warnings, and
	// neither Slurm's accounts nor this host's addresses are checked.
	Elsewhere bool
}

// Findings lists what `config check` reports about a valid configuration
// beyond its validity: settings that weaken isolation or break Slurm.
func (c *Config) Findings(o CheckOptions) []Finding {
	if o.Resolver == nil {
		o.Resolver = identity.System()
	}
	loc := newLocator(c.data)
	var out []Finding
	add := func(sev Severity, key, format string, args ...any) {
		out = append(out, Finding{Severity: sev, Level: sev.String(), Key: key, Line: loc.line(key, ""), Msg: fmt.Sprintf(format, args...)})
	}
	p := c.Policy
	for _, f := range c.Unresolved {
		if o.Elsewhere {
			f.Severity, f.Level = Warning, Warning.String()
			f.Msg += " (not resolvable on this host: check on a node)"
		}
		out = append(out, f)
	}
	out = append(out, c.nodeFindings...)
	if !o.Elsewhere {
		c.addrFindings(o.LocalAddrs, add)
	}

	switch max := p.SystemPortMax; {
	case max == 65535:
		add(Warning, "policy.system_port_max", "65535 makes every port a system port: nothing is isolated")
	case max > 1023:
		add(Warning, "policy.system_port_max", "%d opens users' listeners on ports 1024-%d to every user and every host", max, max)
	}
	for _, px := range c.Portal.Proxies {
		uid, err := identity.UID(o.Resolver, px)
		switch {
		case err != nil:
			add(Warning, "portal.proxies", "%s: %v (nothing can act through it)", px, err)
		case slices.Contains(p.ExemptConnectors, uid):
			add(Warning, "portal.proxies", "%s is also an exempt connector: it reaches every user's listeners by itself, whatever the delegation refuses (docs/portals.md)", px)
		case slices.Contains(p.ExemptListeners, uid):
			// Its forwarder's port is then open to every user, who names
			// whichever user he likes in the path (--user-in-path).
			add(Warning, "portal.proxies", "%s is also an exempt listener: every user reaches its forwarder and can ask it to act for anyone (docs/portals.md)", px)
		}
	}
	if c.Rules.ExemptConnectors != nil && len(p.ExemptConnectors) == 0 {
		add(Warning, "policy.exempt_connectors", "empty: not even root may reach users' listeners (monitoring, debugging); the default is [\"root\"]")
	}
	if c.Rules.ExemptListeners != nil && len(p.ExemptListeners) == 0 {
		add(Warning, "policy.exempt_listeners", "empty: root's own services above port %d are refused to users; the default is [\"root\"]", p.SystemPortMax)
	}
	if len(p.ClusterSubnets) == 0 && !c.Default {
		add(Warning, "cluster.subnets", "empty: no other node is trusted, so users' cross-node traffic (MPI, srun, their own services) is refused")
	}
	for _, s := range p.ClusterSubnets {
		if s.Bits() < 8 || (s.Addr().Is6() && s.Bits() < 32) {
			add(Warning, "cluster.subnets", "%s is very wide: every host in it is trusted as a cluster node", s)
		}
	}
	var open int
	for _, r := range p.OffClusterPorts {
		open += int(r.Last) - int(r.First) + 1
	}
	if open > 1000 {
		add(Warning, "offcluster.allow_ports", "%d ports open to any host outside the cluster", open)
	}
	a := c.Agent
	if a.MetricsAddress != "" {
		if msg := metricsAddrProblem(a.MetricsAddress); msg != "" {
			add(Warning, "agent.metrics_address", "%s", msg)
		}
	}
	if a.EventLog == "" && !a.Syslog {
		add(Warning, "agent.event_log", "refusals are logged nowhere (event_log empty and syslog off)")
	}
	if a.EventRate == 0 && (a.EventLog != "" || a.Syslog) {
		add(Warning, "agent.event_rate", "0: no refusal is logged, only counted")
	}
	if a.IdentPort == 0 && len(p.ClusterSubnets) > 0 {
		add(Warning, "agent.ident_port", "0: `palisade explain` and `who` on other nodes cannot ask this node who owns a socket")
	}
	if !o.Elsewhere {
		c.slurmFindings(o, add)
	}
	if c.UVN.Enable {
		for _, n := range uvnconfig.SiteNotes(p, c.UVN.MinUID, c.UVN.SrunRange, c.uvnCallers(o)) {
			r := &p.Rules[n.Rule]
			out = append(out, Finding{Severity: Warning, Level: Warning.String(), Key: "rule " + strconv.Quote(r.Name), Line: r.Line, Msg: n.Msg})
		}
	}
	return out
}

// addrFindings checks the node's own addresses against the cluster: a node
// outside every cluster subnet (a typo such as 198.81.0.0/24 for
// 198.18.0.0/24) takes the other nodes, on its own networks, for
// off-cluster hosts and refuses its users' cross-node traffic.
func (c *Config) addrFindings(local []netip.Addr, add func(Severity, string, string, ...any)) {
	p := c.Policy
	if local == nil || len(p.ClusterSubnets) == 0 {
		return
	}
	var mine []netip.Addr
	for _, a := range local {
		a = a.Unmap()
		if a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsMulticast() || a.IsUnspecified() {
			continue
		}
		mine = append(mine, a)
	}
	if len(mine) == 0 {
		return
	}
	var in []netip.Addr
	for _, a := range mine {
		if p.InCluster(a) {
			in = append(in, a)
		}
	}
	if len(in) == 0 {
		var subnets []string
		for _, s := range p.ClusterSubnets {
			subnets = append(subnets, s.String())
		}
		add(Problem, "cluster.subnets", "none of this node's addresses (%s) is in the cluster subnets (%s): the other nodes on its networks are "+
			"off-cluster to it, and users' cross-node traffic is refused both ways (a typo in cluster.subnets?)",
			joinAddrs(mine), strings.Join(subnets, ", "))
		return
	}
	if len(c.Nodes) == 0 {
		return
	}
	for _, n := range c.Nodes {
		if slices.Contains(in, n.Addr) {
			return
		}
	}
	add(Warning, "cluster.nodes", "this node (%s) is not in the node list: status --all and explain do not know it by name", joinAddrs(in))
}

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}

// metricsAddrProblem says what is risky about a metrics address ("" = nothing).
func metricsAddrProblem(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Sprintf("%q: not host:port", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Sprintf("%q: port %q out of range 1-65535: metrics will not be served", addr, port)
	}
	if host == "" {
		return fmt.Sprintf("%q listens on every address: the metrics name users; bind it to 127.0.0.1 or a management address", addr)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return "" // a host name: the site's choice
	}
	switch {
	case ip.IsUnspecified():
		return fmt.Sprintf("%q listens on every address: the metrics name users; bind it to 127.0.0.1 or a management address", addr)
	case ip.IsLoopback(), ip.IsPrivate(), ip.IsLinkLocalUnicast():
		return ""
	}
	return fmt.Sprintf("%q is a public address: the metrics name users", addr)
}

// slurmFindings: Slurm's accounts must be exempt both ways, or srun, sinfo
// and squeue fail with "Unable to contact slurm controller" (they call
// slurmctld, which runs as SlurmUser on a port above the system ports) and
// interactive steps die (slurmctld calls srun's listeners back).
func (c *Config) slurmFindings(o CheckOptions, add func(Severity, string, string, ...any)) {
	if o.SlurmConf == "" {
		return
	}
	accts, err := ReadSlurmAccounts(o.SlurmConf)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		add(Warning, "policy.exempt_listeners", "Slurm's accounts not checked: %v", err)
		return
	}
	p := c.Policy
	for _, acct := range accts {
		uid, err := identity.UID(o.Resolver, acct.User)
		if err != nil {
			add(Problem, "policy.exempt_listeners", "%s %q (%s:%d) is not a user on this node: %v", acct.Key, acct.User, o.SlurmConf, acct.Line, err)
			continue
		}
		var missing []string
		if !slices.Contains(p.ExemptConnectors, uid) {
			missing = append(missing, "exempt_connectors")
		}
		if !slices.Contains(p.ExemptListeners, uid) {
			missing = append(missing, "exempt_listeners")
		}
		if len(missing) == 0 {
			continue
		}
		key := "policy." + missing[0]
		add(Problem, key, "%s %q (%s:%d) is not in %s: srun, sinfo and squeue fail with "+
			"\"Unable to contact slurm controller\" and steps cannot reach srun; add %q to [policy] exempt_connectors and exempt_listeners",
			acct.Key, acct.User, o.SlurmConf, acct.Line, strings.Join(missing, " and "), acct.User)
	}
}

// SlurmAccount is a Slurm daemon's account from slurm.conf.
type SlurmAccount struct {
	Key  string // SlurmUser or SlurmdUser
	User string
	Line int // 0: Slurm's default (root)
}

// ReadSlurmAccounts reads SlurmUser (slurmctld) and SlurmdUser (slurmd) from
// a slurm.conf, with Slurm's defaults (root) for absent keys. Keys are
// case-insensitive, as Slurm reads them; "Include" files are not followed
// (Slurm's daemons' accounts are set in the main file in practice).
func ReadSlurmAccounts(path string) ([]SlurmAccount, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	accts := []SlurmAccount{{Key: "SlurmUser", User: "root"}, {Key: "SlurmdUser", User: "root"}}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		for _, field := range strings.Fields(line) {
			k, v, ok := strings.Cut(field, "=")
			if !ok {
				continue
			}
			for i := range accts {
				if strings.EqualFold(k, accts[i].Key) {
					accts[i].User, accts[i].Line = strings.Trim(v, `"'`), n
				}
			}
		}
	}
	return accts, sc.Err()
}

// KeyLine is the line of a dotted key in the file (0 if absent), for
// findings made outside this package.
func (c *Config) KeyLine(key string) int { return newLocator(c.data).line(key, "") }

// uvnCallers are the accounts that may call back into SrunPortRange besides
// root and those below min_uid: Slurm's (o.SlurmConf, else [uvn]
// slurm_conf) and [uvn] exempt_users, as far as they resolve here.
func (c *Config) uvnCallers(o CheckOptions) []uint32 {
	var out []uint32
	for _, u := range c.UVN.ExemptUsers {
		if uid, err := identity.UID(o.Resolver, string(u)); err == nil {
			out = append(out, uid)
		}
	}
	path := o.SlurmConf
	if path == "" {
		path = c.UVN.SlurmConf
	}
	if path == "" {
		return out
	}
	accts, _ := ReadSlurmAccounts(path)
	for _, a := range accts {
		if uid, err := identity.UID(o.Resolver, a.User); err == nil {
			out = append(out, uid)
		}
	}
	return out
}
