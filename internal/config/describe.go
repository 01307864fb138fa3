package config

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/palisade-hpc/palisade/internal/identity"
)

// Describe renders the effective configuration as TOML (valid input for Parse),
// with names resolved in comments when res is not nil. `palisade config
// check` prints it.
func (c *Config) Describe(res identity.Resolver) string {
	p := c.Policy
	var b strings.Builder
	if c.Default {
		fmt.Fprintf(&b, "# %s does not exist: built-in defaults\n", c.Path)
	} else {
		fmt.Fprintf(&b, "# effective policy from %s\n", c.Path)
	}
	uids := func(list, groups []uint32) string {
		var ids, names []string
		for _, u := range list {
			ids = append(ids, strconv.FormatUint(uint64(u), 10))
			names = append(names, identity.UserName(res, u))
		}
		for _, g := range groups {
			ids = append(ids, strconv.Quote("@"+strconv.FormatUint(uint64(g), 10)))
			names = append(names, "@"+identity.GroupName(res, g))
		}
		s := "[" + strings.Join(ids, ", ") + "]"
		if res != nil && len(ids) > 0 {
			s += "  # " + strings.Join(names, " ")
		}
		return s
	}
	quoted := func(items []string) string {
		for i, s := range items {
			items[i] = strconv.Quote(s)
		}
		return "[" + strings.Join(items, ", ") + "]"
	}
	fmt.Fprintf(&b, "[policy]\nsystem_port_max   = %d\n", p.SystemPortMax)
	fmt.Fprintf(&b, "exempt_connectors = %s\n", uids(p.ExemptConnectors, p.ExemptConnectorGroups))
	fmt.Fprintf(&b, "exempt_listeners  = %s\n", uids(p.ExemptListeners, p.ExemptListenerGroups))
	fmt.Fprintf(&b, "user_grants       = %t\ngrant_max         = %d\ngrant_default     = %q\ngrant_max_duration = %q\n",
		!p.Grants.Disabled, p.Grants.MaxPerUser, p.Grants.Default, p.Grants.Max)
	var subnets, nodes, ports []string
	for _, s := range p.ClusterSubnets {
		subnets = append(subnets, s.String())
	}
	for _, n := range c.Nodes {
		var as []string
		for _, a := range n.Addrs {
			as = append(as, a.String())
		}
		nodes = append(nodes, n.Name+"="+strings.Join(as, ","))
	}
	for _, n := range c.PendingNodes {
		nodes = append(nodes, n.Name) // not resolved (yet): by name
	}
	for _, r := range p.OffClusterPorts {
		ports = append(ports, r.String())
	}
	fmt.Fprintf(&b, "\n[cluster]\nsubnets = %s\n", quoted(subnets))
	if len(subnets) == 0 {
		b.WriteString("# no cluster subnets: only connections from this node are trusted\n")
	}
	if len(nodes) > 0 {
		fmt.Fprintf(&b, "nodes   = %s\n", quoted(nodes))
	}
	fmt.Fprintf(&b, "\n[offcluster]\nallow_ports = %s\n", quoted(ports))
	// The data planes' tables, defaults filled in, as their owners typed them.
	for _, s := range c.planeSections() {
		// Encoded under its name, so that nested tables read
		// [[uvn.underlay]], as the file has them.
		var t strings.Builder
		enc := toml.NewEncoder(&t)
		enc.Indent = ""
		if err := enc.Encode(map[string]any{s.name: s.v}); err != nil {
			fmt.Fprintf(&b, "\n# [%s]: cannot render: %v\n", s.name, err)
			continue
		}
		fmt.Fprintf(&b, "\n%s", t.String())
	}
	// Site rules and tests, the included files' too (no include key: they
	// are here already).
	for _, t := range []struct {
		name string
		v    any
		n    int
	}{{"rule", c.SiteRules, len(c.SiteRules)}, {"test", c.Tests, len(c.Tests)}} {
		if t.n == 0 {
			continue
		}
		var tb strings.Builder
		enc := toml.NewEncoder(&tb)
		enc.Indent = ""
		if err := enc.Encode(map[string]any{t.name: t.v}); err != nil {
			fmt.Fprintf(&b, "\n# [[%s]]: cannot render: %v\n", t.name, err)
			continue
		}
		fmt.Fprintf(&b, "\n%s", tb.String())
	}
	return b.String()
}
