// Package config loads /etc/palisade/palisade.toml: the decoder, the
// loader's errors with file and line, findings, and Config, which composes
// the sections. The policy core's tables ([policy], [cluster], [offcluster])
// are built into a policy.Policy here; every data plane owns its own table's
// type next to its code ([agent]: dataplane/userwall/agentconfig, [uvn]:
// dataplane/uvn/uvnconfig, [egress]: dataplane/egress, [portal]:
// portal/portalconfig) and validates it; none of them is a data path.
package config

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/agentconfig"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/uvnconfig"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/portal/portalconfig"
)

// Config is the whole configuration file, decoded and validated. The [policy],
// [cluster] and [offcluster] tables are combined into Policy; the other tables
// belong to the data planes that read them.
type Config struct {
	// Path is the file the configuration came from.
	Path string
	// Default is true when the file did not exist and LoadOrDefault used
	// the built-in defaults.
	Default bool
	// SHA256 is the hex SHA-256 of the file's bytes (what sha256sum prints;
	// of the empty input for the defaults): the configuration's identity in
	// status and metrics, equal on nodes that run the same file.
	SHA256 string
	// data is the file's text (for the lines of Findings).
	data []byte
	// included are the files [policy] include named, as read.
	included []includedFile

	// Policy is the validated rule set built from Rules, Cluster and OffCluster.
	Policy *policy.Policy
	// Nodes is [cluster] nodes, parsed (may be empty): those listed with
	// their addresses, and those of hostlist entries once ResolveNodes
	// resolved them.
	Nodes []Node
	// PendingNodes are the names of [cluster] nodes given as a hostlist
	// ("node[001-500]") not yet resolved: they are looked up lazily
	// (ResolveNodes), when a command needs their addresses.
	PendingNodes []PendingNode
	// nodeFindings are ResolveNodes' findings (part of Findings).
	nodeFindings []Finding
	// Unresolved are the exempt names NSS could not resolve (an unknown
	// account, or the directory unreachable): ERROR findings, left out of
	// Policy (which only makes fewer things exempt: nothing opens). A
	// daemon runs with the rest and resolves them again (Resolve) instead
	// of refusing to start over one name.
	Unresolved []Finding

	Rules      PolicyConfig        `toml:"policy"`
	Cluster    ClusterConfig       `toml:"cluster"`
	OffCluster OffClusterConfig    `toml:"offcluster"`
	Agent      agentconfig.Config  `toml:"agent"`
	UVN        uvnconfig.Config    `toml:"uvn"`
	Egress     egress.Config       `toml:"egress"`
	Portal     portalconfig.Config `toml:"portal"`
	// SiteRules and Tests are the [[rule]] and [[test]] entries of the file
	// and of the files [policy] include names, in order.
	SiteRules []RuleConfig `toml:"rule"`
	Tests     []TestConfig `toml:"test"`
}

// PolicyConfig is the [policy] table as written.
type PolicyConfig struct {
	// SystemPortMax: ports <= it are system ports, reachable by everyone
	// (default 1023). Nil when the key is absent.
	SystemPortMax *int64 `toml:"system_port_max"`
	// ExemptConnectors and ExemptListeners are user names or uids, or
	// "@group" (the group's members).
	ExemptConnectors []policy.Principal `toml:"exempt_connectors"`
	ExemptListeners  []policy.Principal `toml:"exempt_listeners"`
	// Include names files (globs, relative to this file's directory) whose
	// [[rule]] and [[test]] entries follow this file's, e.g. "policy.d/*.toml".
	Include []string `toml:"include,omitempty"`
	// UserGrants is the site's switch for user grants (`palisade share`),
	// default on; GrantMax bounds a user's active grants per node;
	// GrantDefault and GrantMaxDuration are durations ("8h", "30m").
	UserGrants       *bool  `toml:"user_grants"`
	GrantMax         *int64 `toml:"grant_max"`
	GrantDefault     string `toml:"grant_default"`
	GrantMaxDuration string `toml:"grant_max_duration"`
}

// ClusterConfig is the [cluster] table as written.
type ClusterConfig struct {
	// Subnets are the networks identity is trusted from (CIDR).
	Subnets []string `toml:"subnets"`
	// Nodes is an optional static node list, "name=address".
	Nodes []string `toml:"nodes"`
	// KeyFile holds the cluster key that seals every identity stamp (root
	// only, like munge.key; `palisade key generate`). Without it, identity
	// from other nodes is never trusted.
	KeyFile string `toml:"key_file"`
	// UnenforcedNodes are cluster nodes (CIDR) not yet running the agent
	// during a staged rollout: their traffic, which carries no identity, is
	// admitted as "unverified" and reported instead of refused.
	UnenforcedNodes []string `toml:"unenforced_nodes"`
}

// DefaultKeyFile is where the cluster key is read from.
const DefaultKeyFile = "/etc/palisade/cluster.key"

// OffClusterConfig is the [offcluster] table as written.
type OffClusterConfig struct {
	// AllowPorts are ports ("8443", 8443) or ranges ("9000-9100") above the
	// system ports that off-cluster sources may reach. Default none.
	AllowPorts []policy.PortSpec `toml:"allow_ports"`
}

// Node is one entry of [cluster] nodes.
type Node struct {
	Name string
	// Addr is the node's first address (peers, tools); Addrs all of them
	// ("name=addr,addr,...": every address its traffic may come from, for
	// the site rules' from_nodes).
	Addr  netip.Addr
	Addrs []netip.Addr
}

// PendingNode is a node name from a hostlist entry of [cluster] nodes.
type PendingNode struct {
	Name  string
	Line  int
	entry string // the hostlist it came from (for Line)
}

// LookupHost resolves a node name (hosts file, DNS): the default lookup of
// ResolveNodes and of unenforced node names.
func LookupHost(name string) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	as, err := net.DefaultResolver.LookupNetIP(ctx, "ip", name)
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(as))
	for _, a := range as {
		if a = a.Unmap(); !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	// IPv4 first (a node's Addr, what tools reach it at), as resolvers'
	// order varies.
	slices.SortStableFunc(out, func(a, b netip.Addr) int {
		switch {
		case a.Is4() == b.Is4():
			return 0
		case a.Is4():
			return -1
		}
		return 1
	})
	return out, nil
}

// ResolveNodes resolves the pending hostlist names (lookup nil: LookupHost,
// in parallel) into Nodes. Each name that does not resolve, or resolves
// outside the cluster subnets, is a finding (and stays pending); the
// others become nodes with all their addresses.
func (c *Config) ResolveNodes(lookup func(string) ([]netip.Addr, error)) []Finding {
	if lookup == nil {
		lookup = LookupHost
	}
	type result struct {
		addrs []netip.Addr
		err   error
	}
	res := make([]result, len(c.PendingNodes))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i, pn := range c.PendingNodes {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			res[i].addrs, res[i].err = lookup(pn.Name)
		}()
	}
	wg.Wait()
	var out []Finding
	var still []PendingNode
	for i, pn := range c.PendingNodes {
		r := res[i]
		f := Finding{Severity: Warning, Level: Warning.String(), Key: "cluster.nodes", Line: pn.Line}
		switch {
		case r.err != nil || len(r.addrs) == 0:
			f.Msg = fmt.Sprintf("node %s: not resolvable (%v): status --all, explain and flows cannot reach it (fix the hosts file or DNS, or list it as name=address)", pn.Name, r.err)
		case len(c.Policy.ClusterSubnets) > 0 && slices.ContainsFunc(r.addrs, func(a netip.Addr) bool { return !c.Policy.InCluster(a) }):
			out := r.addrs[slices.IndexFunc(r.addrs, func(a netip.Addr) bool { return !c.Policy.InCluster(a) })]
			f.Severity, f.Level = Problem, Problem.String()
			f.Msg = fmt.Sprintf("node %s resolves to %s, outside cluster.subnets", pn.Name, out)
		default:
			c.Nodes = append(c.Nodes, Node{Name: pn.Name, Addr: r.addrs[0], Addrs: r.addrs})
			continue
		}
		out = append(out, f)
		still = append(still, pn)
	}
	c.PendingNodes = still
	c.nodeFindings = out
	return out
}

// ConfigError is one problem in a configuration file. Error() reads
// "file:line: key: message" (line and key omitted when unknown).
type ConfigError struct {
	File string
	Line int
	Key  string // full dotted key, e.g. "policy.exempt_connectors"
	Msg  string
}

func (e *ConfigError) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Key != "" {
		b.WriteString(e.Key + ": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// section is what a data plane's table type implements: Validate runs after
// decoding (also when the table is absent, to check defaults) and returns a
// *policy.KeyError, or several joined with errors.Join, to name the bad keys.
type section interface{ Validate() error }

// clusterSection is a section whose validation needs the validated cluster
// subnets (e.g. addresses that must lie inside or outside the cluster).
type clusterSection interface {
	Validate(cluster []netip.Prefix) error
}

// defaulter is optionally implemented by a section to set defaults before
// the file's values are decoded over them.
type defaulter interface{ SetDefaults() }

// sections lists the tables in file order of the documentation. The three
// policy tables are validated by the loader itself (they need the resolver).
func (c *Config) sections() []struct {
	name string
	v    any
} {
	return []struct {
		name string
		v    any
	}{
		{"policy", &c.Rules}, {"cluster", &c.Cluster}, {"offcluster", &c.OffCluster},
		{"agent", &c.Agent}, {"uvn", &c.UVN}, {"egress", &c.Egress}, {"portal", &c.Portal},
		{"rule", &c.SiteRules}, {"test", &c.Tests},
	}
}

// Load reads and validates the configuration file at path, resolving user
// names through the node's NSS (identity.System). A missing file is an error:
// a typo in --config must not silently mean "default policy".
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%s: configuration file does not exist", path)
		}
		return nil, err
	}
	return Parse(path, data, identity.System())
}

// LoadOrDefault is Load, except that a missing file yields the built-in
// defaults (Config.Default is set): system ports below 1024 open, root exempt
// both ways, no cluster subnets (only the node itself is trusted), nothing
// open to off-cluster sources. It is for daemons that must start on a node
// not yet configured; the defaults are strict for users and never block
// system services. Any other error (unreadable or invalid file) is returned.
func LoadOrDefault(path string) (*Config, error) {
	c, err := Load(path)
	if err == nil {
		return c, nil
	}
	if _, serr := os.Stat(path); !errors.Is(serr, fs.ErrNotExist) {
		return nil, err
	}
	c, err = Parse(path, nil, identity.System())
	if err != nil {
		return nil, err
	}
	c.Default = true
	return c, nil
}

// Parse decodes and validates configuration data; name is used in errors
// (usually the path). res resolves user names (nil: identity.System()).
// Every problem found is reported (joined), each as a *ConfigError.
func Parse(name string, data []byte, res identity.Resolver) (cfg *Config, err error) {
	return parse(name, data, res, nil)
}

// parse is Parse; included, when not nil, stands for the files [policy]
// include names (Resolve: the files as first read).
func parse(name string, data []byte, res identity.Resolver, included []includedFile) (cfg *Config, err error) {
	if res == nil {
		res = identity.System()
	}
	sum := sha256.Sum256(data)
	c := &Config{Path: name, SHA256: hex.EncodeToString(sum[:]), data: data, included: included}
	loc := newLocator(data)
	var errs []error
	fail := func(line int, key, format string, args ...any) {
		errs = append(errs, &ConfigError{File: name, Line: line, Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	// blame turns a section's error into ConfigErrors with lines.
	var blame func(sec string, err error)
	blame = func(sec string, err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				blame(sec, e)
			}
			return
		}
		var ke *policy.KeyError
		if errors.As(err, &ke) {
			key := sec + "." + ke.Key
			fail(loc.line(key, ke.Value), key, "%v", ke.Err)
			return
		}
		fail(loc.line(sec, ""), sec, "%v", err)
	}

	var raw map[string]toml.Primitive
	md, err := toml.Decode(string(data), &raw)
	if err != nil {
		return nil, decodeError(name, err)
	}
	known := map[string]bool{}
	for _, s := range c.sections() {
		known[s.name] = true
		if d, ok := s.v.(defaulter); ok {
			d.SetDefaults()
		}
		p, present := raw[s.name]
		if !present {
			continue
		}
		if err := md.PrimitiveDecode(p, s.v); err != nil {
			errs = append(errs, decodeError(name, err))
		}
	}
	// Keys of unknown sections are marked decoded by the Primitive map, so
	// check the top level by name; Undecoded catches the rest.
	var unknown []string
	for k := range raw {
		if !known[k] {
			unknown = append(unknown, k)
		}
	}
	slices.SortFunc(unknown, func(a, b string) int { return loc.line(a, "") - loc.line(b, "") })
	for _, k := range unknown {
		fail(loc.line(k, ""), k, "unknown section or key (known sections: policy, cluster, offcluster, agent, uvn, egress, portal, rule, test)")
	}
	if len(errs) > 0 {
		// Values failed to decode: validating the rest would only add noise.
		return nil, joinByLine(errs)
	}
	var reported []tomlKey
	for _, k := range md.Undecoded() {
		if !known[k[0]] || slices.ContainsFunc(reported, func(r tomlKey) bool { return hasPrefix(k, r) }) {
			continue // one error for an unknown table, not one per key in it
		}
		reported = append(reported, k)
		fail(loc.line(k.String(), ""), k.String(), "unknown key")
	}
	// Unknown keys do not stop validation: the report lists every problem.

	c.Policy = &policy.Policy{SystemPortMax: 1023}
	c.buildPolicy(res, func(key, value string, err error) {
		blame(strings.Split(key, ".")[0], &policy.KeyError{Key: strings.SplitN(key, ".", 2)[1], Value: value, Err: err})
	}, func(key, value string, err error) {
		msg := fmt.Sprintf("%v: not exempt until it resolves (the agent retries at every group refresh, [agent] group_refresh)", err)
		if key == "cluster.unenforced_nodes" {
			msg = fmt.Sprintf("%v (the agent retries at every group refresh)", err)
		}
		c.Unresolved = append(c.Unresolved, Finding{Severity: Problem, Level: Problem.String(), Key: key, Line: loc.line(key, value), Msg: msg})
	})
	for i := range c.PendingNodes {
		c.PendingNodes[i].Line = loc.line("cluster.nodes", c.PendingNodes[i].entry)
	}
	for _, s := range c.planeSections() {
		var err error
		switch v := s.v.(type) {
		case clusterSection:
			err = v.Validate(c.Policy.ClusterSubnets)
		case section:
			err = v.Validate()
		}
		if err != nil {
			blame(s.name, err)
		}
	}
	if len(errs) > 0 {
		return nil, joinByLine(errs)
	}
	// Site rules and tests: this file's, then the included files'.
	for i := range c.SiteRules {
		c.SiteRules[i].file, c.SiteRules[i].line = name, loc.arrayLine("rule", i, "", "")
	}
	for i := range c.Tests {
		c.Tests[i].file, c.Tests[i].line = name, loc.arrayLine("test", i, "", "")
	}
	failAt := func(file string, line int, key, format string, args ...any) {
		errs = append(errs, &ConfigError{File: file, Line: line, Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	if incl := c.loadIncludes(failAt); len(incl) > 0 {
		// The configuration's identity covers the included files too.
		h := sha256.New()
		h.Write(data)
		for _, f := range incl {
			h.Write(f.data)
		}
		c.SHA256 = hex.EncodeToString(h.Sum(nil))
	}
	if len(errs) == 0 {
		c.buildRules(res, failAt)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return c, nil
}

// Resolve resolves the file's names again (Unresolved ones may resolve
// now): the policy built from it and the names that still do not resolve.
// The file is not read again: this is the configuration in force.
func (c *Config) Resolve(res identity.Resolver) (*policy.Policy, []Finding, error) {
	// The included files as they were read: not again from disk, where
	// they may have changed untested.
	n, err := parse(c.Path, c.data, res, append([]includedFile{}, c.included...))
	if err != nil {
		return nil, nil, err
	}
	return n.Policy, n.Unresolved, nil
}

// isName: a principal to look up in NSS (not a number, not empty); a
// lookup failure of a name is "unresolved", not invalid.
func isName(s string) bool {
	s = strings.TrimPrefix(s, "@")
	return s != "" && strings.ContainsFunc(s, func(r rune) bool { return r < '0' || r > '9' })
}

// planeSections are the data planes' tables.
func (c *Config) planeSections() []struct {
	name string
	v    any
} {
	return c.sections()[3:7]
}

// buildPolicy validates the three policy tables into c.Policy and c.Nodes,
// reporting each problem through bad and each exempt name NSS cannot
// resolve through unresolved (key is "section.key").
func (c *Config) buildPolicy(res identity.Resolver, bad, unresolved func(key, value string, err error)) {
	p := c.Policy
	if v := c.Rules.SystemPortMax; v != nil {
		if *v < 0 || *v > 65535 {
			bad("policy.system_port_max", "", fmt.Errorf("port %d out of range (0-65535)", *v))
		} else {
			p.SystemPortMax = uint16(*v)
		}
	}
	exempt := func(key string, list []policy.Principal) (uids, gids []uint32) {
		seen := map[uint32]string{}
		seenGroup := map[uint32]string{}
		for _, pr := range list {
			if g, ok := strings.CutPrefix(string(pr), "@"); ok {
				gid, err := identity.GID(res, g)
				if err != nil && isName(g) {
					unresolved(key, string(pr), err)
					continue
				}
				if err != nil {
					bad(key, string(pr), err)
					continue
				}
				if prev, dup := seenGroup[gid]; dup {
					bad(key, string(pr), fmt.Errorf("duplicate: %q is gid %d, already listed as %q", pr, gid, prev))
					continue
				}
				seenGroup[gid] = string(pr)
				gids = append(gids, gid)
				continue
			}
			uid, err := identity.UID(res, string(pr))
			if err != nil && isName(string(pr)) {
				unresolved(key, string(pr), err)
				continue
			}
			if err != nil {
				bad(key, string(pr), err)
				continue
			}
			if prev, dup := seen[uid]; dup {
				bad(key, string(pr), fmt.Errorf("duplicate: %q is uid %d, already listed as %q", pr, uid, prev))
				continue
			}
			seen[uid] = string(pr)
			uids = append(uids, uid)
		}
		return uids, gids
	}
	p.Grants = policy.DefaultGrantPolicy()
	if v := c.Rules.UserGrants; v != nil {
		p.Grants.Disabled = !*v
	}
	if v := c.Rules.GrantMax; v != nil {
		if *v < 0 || *v > 1024 {
			bad("policy.grant_max", "", fmt.Errorf("%d out of range (0-1024)", *v))
		} else {
			p.Grants.MaxPerUser = int(*v)
		}
	}
	dur := func(key, s string, into *time.Duration) {
		if s == "" {
			return
		}
		d, err := time.ParseDuration(s)
		if err != nil || d < time.Minute {
			bad(key, "", fmt.Errorf("bad duration %q: want a Go duration of at least 1m (\"30m\", \"8h\")", s))
			return
		}
		*into = d
	}
	dur("policy.grant_default", c.Rules.GrantDefault, &p.Grants.Default)
	dur("policy.grant_max_duration", c.Rules.GrantMaxDuration, &p.Grants.Max)
	if p.Grants.Default > p.Grants.Max {
		bad("policy.grant_default", "", fmt.Errorf("%v exceeds policy.grant_max_duration (%v)", p.Grants.Default, p.Grants.Max))
	}
	// Absent lists keep the default (root exempt); an explicit empty list
	// means no exemptions at all.
	p.ExemptConnectors, p.ExemptListeners = []uint32{0}, []uint32{0}
	if c.Rules.ExemptConnectors != nil {
		p.ExemptConnectors, p.ExemptConnectorGroups = exempt("policy.exempt_connectors", c.Rules.ExemptConnectors)
	}
	if c.Rules.ExemptListeners != nil {
		p.ExemptListeners, p.ExemptListenerGroups = exempt("policy.exempt_listeners", c.Rules.ExemptListeners)
	}

	for _, s := range c.Cluster.Subnets {
		pfx, err := parseSubnet(s)
		if err != nil {
			bad("cluster.subnets", s, err)
			continue
		}
		if i := slices.Index(p.ClusterSubnets, pfx); i >= 0 {
			bad("cluster.subnets", s, fmt.Errorf("duplicate subnet %s", pfx))
			continue
		}
		p.ClusterSubnets = append(p.ClusterSubnets, pfx)
	}
	names, addrs := map[string]bool{}, map[netip.Addr]string{}
	for _, s := range c.Cluster.Nodes {
		if !strings.Contains(s, "=") {
			// A hostlist of names ("node[001-500]"): resolved lazily.
			hosts, err := policy.ExpandHostlist(strings.TrimSpace(s))
			if err == nil {
				if i := slices.IndexFunc(hosts, func(h string) bool { return !nodeName.MatchString(h) }); i >= 0 {
					err = fmt.Errorf("bad node name %q in %q", hosts[i], s)
				}
			}
			if err != nil {
				bad("cluster.nodes", s, fmt.Errorf("%v (want name=address[,address...] or a hostlist such as node[01-16,20])", err))
				continue
			}
			for _, h := range hosts {
				if names[h] {
					bad("cluster.nodes", s, fmt.Errorf("duplicate node name %q", h))
					break
				}
				names[h] = true
				c.PendingNodes = append(c.PendingNodes, PendingNode{Name: h, entry: s})
			}
			continue
		}
		n, err := parseNode(s)
		switch {
		case err != nil:
		case names[n.Name]:
			err = fmt.Errorf("duplicate node name %q", n.Name)
		case addrs[n.Addr] != "":
			err = fmt.Errorf("duplicate address %s (also %s)", n.Addr, addrs[n.Addr])
		case len(p.ClusterSubnets) > 0 && slices.ContainsFunc(n.Addrs, func(a netip.Addr) bool { return !p.InCluster(a) }):
			out := n.Addrs[slices.IndexFunc(n.Addrs, func(a netip.Addr) bool { return !p.InCluster(a) })]
			err = fmt.Errorf("node %s address %s is outside cluster.subnets", n.Name, out)
		}
		if err != nil {
			bad("cluster.nodes", s, err)
			continue
		}
		if a := slices.IndexFunc(n.Addrs, func(a netip.Addr) bool { return addrs[a] != "" }); a >= 0 && err == nil {
			bad("cluster.nodes", s, fmt.Errorf("duplicate address %s (also %s)", n.Addrs[a], addrs[n.Addrs[a]]))
			continue
		}
		names[n.Name] = true
		for _, a := range n.Addrs {
			addrs[a] = n.Name
		}
		c.Nodes = append(c.Nodes, n)
	}

	for _, s := range c.Cluster.UnenforcedNodes {
		if _, err := netip.ParsePrefix(strings.TrimSpace(s)); err != nil && !strings.ContainsAny(s, "/:") {
			c.unenforcedNames(s, bad, unresolved)
			continue
		}
		pfx, err := parseSubnet(s)
		if err == nil && len(p.ClusterSubnets) > 0 && !p.InCluster(pfx.Addr()) {
			err = fmt.Errorf("%s is outside cluster.subnets", pfx)
		}
		if err != nil {
			bad("cluster.unenforced_nodes", s, err)
			continue
		}
		p.UnenforcedNodes = append(p.UnenforcedNodes, pfx)
	}

	for _, s := range c.OffCluster.AllowPorts {
		r, err := policy.ParsePortRange(string(s))
		if err != nil {
			bad("offcluster.allow_ports", string(s), err)
			continue
		}
		if i := slices.IndexFunc(p.OffClusterPorts, r.Overlaps); i >= 0 {
			bad("offcluster.allow_ports", string(s), fmt.Errorf("duplicate: %s overlaps %s", r, p.OffClusterPorts[i]))
			continue
		}
		p.OffClusterPorts = append(p.OffClusterPorts, r)
	}
}

// unenforcedNames adds the addresses of the [cluster] nodes a hostlist of
// unenforced_nodes names: listed ones from [cluster] nodes, hostlist ones
// looked up now. A name that does not resolve is unresolved (its
// identity-less traffic is refused, not admitted, until it does: the
// agent retries).
func (c *Config) unenforcedNames(s string, bad, unresolved func(key, value string, err error)) {
	const key = "cluster.unenforced_nodes"
	hosts, err := policy.ExpandHostlist(strings.TrimSpace(s))
	if err != nil {
		bad(key, s, fmt.Errorf("%v (want CIDR or a hostlist of [cluster] nodes such as node[01-16])", err))
		return
	}
	p := c.Policy
	for _, h := range hosts {
		var addrs []netip.Addr
		if i := slices.IndexFunc(c.Nodes, func(n Node) bool { return n.Name == h }); i >= 0 {
			addrs = c.Nodes[i].Addrs
		} else if slices.ContainsFunc(c.PendingNodes, func(n PendingNode) bool { return n.Name == h }) {
			as, err := lookupNode(h)
			if err != nil || len(as) == 0 {
				unresolved(key, s, fmt.Errorf("node %s: not resolvable (%v): its identity-less traffic is refused, not admitted as unverified", h, err))
				continue
			}
			addrs = as
		} else {
			bad(key, s, fmt.Errorf("node %q is not in [cluster] nodes (its addresses come from there)", h))
			return
		}
		for _, a := range addrs {
			if len(p.ClusterSubnets) > 0 && !p.InCluster(a) {
				bad(key, s, fmt.Errorf("node %s address %s is outside cluster.subnets", h, a))
				return
			}
			if pfx := netip.PrefixFrom(a, a.BitLen()); !slices.Contains(p.UnenforcedNodes, pfx) {
				p.UnenforcedNodes = append(p.UnenforcedNodes, pfx)
			}
		}
	}
}

// lookupNode resolves node names for unenforced_nodes (a variable for tests).
var lookupNode = LookupHost

func parseSubnet(s string) (netip.Prefix, error) {
	pfx, err := netip.ParsePrefix(strings.TrimSpace(s))
	if err != nil {
		return pfx, fmt.Errorf("bad subnet %q: want an address/prefix-length such as 198.18.0.0/24 or 2001:2::/64", s)
	}
	if pfx.Addr().Is4In6() {
		return pfx, fmt.Errorf("bad subnet %q: write IPv4-mapped networks as IPv4", s)
	}
	if pfx.Addr().Zone() != "" {
		return pfx, fmt.Errorf("bad subnet %q: zones are not allowed", s)
	}
	if m := pfx.Masked(); m != pfx {
		return pfx, fmt.Errorf("bad subnet %q: host bits set (did you mean %s?)", s, m)
	}
	return pfx, nil
}

var nodeName = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$`)

func parseNode(s string) (Node, error) {
	name, list, ok := strings.Cut(s, "=")
	name = strings.TrimSpace(name)
	if !ok || !nodeName.MatchString(name) {
		return Node{}, fmt.Errorf("bad node %q: want name=address[,address...]", s)
	}
	n := Node{Name: name}
	for _, addr := range strings.Split(list, ",") {
		addr = strings.TrimSpace(addr)
		a, err := netip.ParseAddr(addr)
		if err != nil || a.Zone() != "" {
			return Node{}, fmt.Errorf("bad node %q: %q is not an IP address", s, addr)
		}
		a = a.Unmap()
		if slices.Contains(n.Addrs, a) {
			return Node{}, fmt.Errorf("bad node %q: %s listed twice", s, a)
		}
		n.Addrs = append(n.Addrs, a)
	}
	n.Addr = n.Addrs[0]
	return n, nil
}

// decodeErrLine matches the plain errors toml returns for type mismatches.
var decodeErrLine = regexp.MustCompile(`^toml: (?:line (\d+) )?\(last key "([^"]*)"\): (.*)$`)

var (
	badTypeRe   = regexp.MustCompile(`^incompatible types: TOML value has type (\S+); destination has type (.+)$`)
	tableTypeRe = regexp.MustCompile(`^type mismatch for \S+: expected table but found (\S+)$`)
)

// goTypeName names the Go type toml decoded a value to as its TOML kind.
func goTypeName(t string) string {
	switch {
	case t == "string":
		return "a string"
	case t == "int64":
		return "an integer"
	case t == "float64":
		return "a float"
	case t == "bool":
		return "a boolean"
	case strings.HasPrefix(t, "[]map"):
		return "an array of tables"
	case strings.HasPrefix(t, "[]"):
		return "an array"
	case strings.HasPrefix(t, "map"):
		return "a table"
	}
	return "a date/time"
}

// decodeError rewrites a toml error into our file:line: key: message form.
func decodeError(file string, err error) error {
	var pe toml.ParseError
	if errors.As(err, &pe) {
		msg := strings.TrimPrefix(pe.Message, "toml: ")
		return &ConfigError{File: file, Line: pe.Position.Line, Key: pe.LastKey, Msg: msg}
	}
	if m := decodeErrLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1])
		msg := m[3]
		if t := badTypeRe.FindStringSubmatch(msg); t != nil {
			want := map[string]string{"slice": "an array", "map": "a table", "integer": "an integer",
				"string": "a string", "float": "a float", "boolean": "a boolean"}[t[2]]
			if want == "" {
				want = t[2]
			}
			msg = fmt.Sprintf("wrong type: got %s, want %s", goTypeName(t[1]), want)
		} else if t := tableTypeRe.FindStringSubmatch(msg); t != nil {
			msg = fmt.Sprintf("wrong type: got %s, want a table", goTypeName(t[1]))
		}
		return &ConfigError{File: file, Line: line, Key: m[2], Msg: msg}
	}
	return &ConfigError{File: file, Msg: strings.TrimPrefix(err.Error(), "toml: ")}
}

// tomlKey is a dotted TOML key split into its parts.
type tomlKey = toml.Key

func hasPrefix(k, prefix tomlKey) bool {
	return len(k) > len(prefix) && slices.Equal(k[:len(prefix)], prefix)
}

// joinByLine joins errors in file order, so the report reads top to bottom.
func joinByLine(errs []error) error {
	line := func(e error) int {
		var ce *ConfigError
		if errors.As(e, &ce) {
			return ce.Line
		}
		return 0
	}
	slices.SortStableFunc(errs, func(a, b error) int { return line(a) - line(b) })
	return errors.Join(errs...)
}
