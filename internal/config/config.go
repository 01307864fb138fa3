// Package config loads /etc/palisade/palisade.toml: the decoder, the
// loader's errors with file and line, findings, and Config, which composes
// the sections. The policy core's tables ([policy], [cluster], [offcluster])
// are built into a policy.Policy here; every data plane owns its own table's
// type next to its code ([agent]: dataplane/userwall/agentconfig, [uvn]:
// dataplane/uvn, [egress]: dataplane/egress) and validates it.
package config

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/agentconfig"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
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

	// Policy is the validated rule set built from Rules, Cluster and OffCluster.
	Policy *policy.Policy
	// Nodes is [cluster] nodes, parsed (may be empty).
	Nodes []Node
	// Unresolved are the exempt names NSS could not resolve (an unknown
	// account, or the directory unreachable): ERROR findings, left out of
	// Policy (which only makes fewer things exempt: nothing opens). A
	// daemon runs with the rest and resolves them again (Resolve) instead
	// of refusing to start over one name.
	Unresolved []Finding

	Rules      PolicyConfig       `toml:"policy"`
	Cluster    ClusterConfig      `toml:"cluster"`
	OffCluster OffClusterConfig   `toml:"offcluster"`
	Agent      agentconfig.Config `toml:"agent"`
	UVN        uvn.Config         `toml:"uvn"`
	Egress     egress.Config      `toml:"egress"`
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
		{"agent", &c.Agent}, {"uvn", &c.UVN}, {"egress", &c.Egress},
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
	if res == nil {
		res = identity.System()
	}
	sum := sha256.Sum256(data)
	c := &Config{Path: name, SHA256: hex.EncodeToString(sum[:]), data: data}
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
		fail(loc.line(k, ""), k, "unknown section or key (known sections: policy, cluster, offcluster, agent, uvn, egress, rule, test)")
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
		c.Unresolved = append(c.Unresolved, Finding{Severity: Problem, Level: Problem.String(), Key: key, Line: loc.line(key, value),
			Msg: fmt.Sprintf("%v: not exempt until it resolves (the agent retries at every group refresh, [agent] group_refresh)", err)})
	})
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
		for _, d := range incl {
			h.Write(d)
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
	n, err := Parse(c.Path, c.data, res)
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
	return c.sections()[3:6]
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
