package policy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/palisade-hpc/palisade/internal/identity"
)

// Explain is ExplainWith without names: uids and gids are printed as numbers.
func (p *Policy) Explain(c Conn) string { return p.ExplainWith(c, nil) }

// ExplainWith returns one paragraph saying which rule decides c and why, in
// the terms an administrator configures (for `palisade explain`). res, if not
// nil, names uids and gids ("alice(2001)"). The verdict is Decide's.
func (p *Policy) ExplainWith(c Conn, res identity.Resolver) string {
	v := p.Decide(c)
	user := func(uid uint32) string { return "uid " + identity.UserName(res, uid) }
	group := func(gid uint32) string { return "gid " + identity.GroupName(res, gid) }
	groups := func(id Identity) string {
		s := "effective " + group(id.GID)
		if len(id.Groups) > 0 {
			var g []string
			for _, x := range id.Groups {
				g = append(g, identity.GroupName(res, x))
			}
			s += ", supplementary " + strings.Join(g, " ")
		} else {
			s += ", no supplementary groups"
		}
		return s
	}
	port := fmt.Sprintf("port %d/%s", c.Port, c.Proto)
	system := fmt.Sprintf("the system ports (<= %d)", p.SystemPortMax)
	verdict := "Denied"
	if v.Allow {
		verdict = "Allowed"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s by rule %s: ", verdict, v.Rule)
	if r := p.SiteRule(v.Rule); r != nil {
		fmt.Fprintf(&b, "site rule %q", r.Name)
		if w := r.Where(); w != "" {
			fmt.Fprintf(&b, " (%s)", w)
		}
		fmt.Fprintf(&b, ", the first that matches %s, %s it: %s", port, map[bool]string{true: "allows", false: "denies"}[r.Allow], r.Describe(res))
		if i := slices.IndexFunc(p.Rules, func(x SiteRule) bool { return x.Name == r.Name }); i > 0 {
			fmt.Fprintf(&b, " (%d site rule(s) before it did not match)", i)
		}
		fmt.Fprintf(&b, "; %s is above %s and %s.", port, system, p.trust(c.Source))
		return b.String()
	}
	switch v.Rule {
	case RuleSystemPort:
		fmt.Fprintf(&b, "%s is one of %s, which every user reaches from anywhere; identities are not consulted.", port, system)
		return b.String()
	case RuleOffClusterPort, RuleOffClusterDenied:
		fmt.Fprintf(&b, "the source %s is outside the cluster subnets (%s), so the identity it claims is not trusted", c.Source, p.subnets())
		if v.Allow {
			r := p.OffClusterPorts[slices.IndexFunc(p.OffClusterPorts, func(r PortRange) bool { return r.Contains(c.Port) })]
			fmt.Fprintf(&b, "; %s is opened to off-cluster sources by offcluster.allow_ports (%s).", port, r)
		} else {
			fmt.Fprintf(&b, ", and %s is neither one of %s nor in offcluster.allow_ports (%s).", port, system, p.offPorts())
		}
		return b.String()
	case RuleSameUser:
		fmt.Fprintf(&b, "the connector and the listener are the same user (%s)", user(c.Listener.UID))
	case RuleSharedGroup:
		how := "its effective group"
		if c.Connector.GID != c.Listener.GID {
			how = "one of its supplementary groups"
		}
		fmt.Fprintf(&b, "the listener (%s) runs with %s, which the connector (%s) holds as %s",
			user(c.Listener.UID), group(c.Listener.GID), user(c.Connector.UID), how)
	case RuleExemptConnector:
		fmt.Fprintf(&b, "the connector (%s) is listed in policy.exempt_connectors (by name, uid or @group), so it may reach any listener", user(c.Connector.UID))
	case RuleExemptListener:
		fmt.Fprintf(&b, "the listener (%s) is listed in policy.exempt_listeners (by name, uid or @group), so anyone in the cluster may reach it", user(c.Listener.UID))
	case RuleUserGrant:
		fmt.Fprintf(&b, "%s: the connector (%s) is not the listener's user, holds none of its groups and neither is exempt, but the listener's owner shared the port (palisade share)",
			p.GrantFor(c).Describe(res), user(c.Connector.UID))
	case RuleDenied:
		fmt.Fprintf(&b, "the connector (%s; %s) is not the listener's user (%s), does not hold the listener's group (%s), neither is exempt, and %s is above %s",
			user(c.Connector.UID), groups(c.Connector), user(c.Listener.UID), group(c.Listener.GID), port, system)
		switch {
		case p.Grants.Disabled:
			b.WriteString("; user grants are disabled by the site (policy.user_grants)")
		case len(c.Grants) > 0:
			fmt.Fprintf(&b, "; none of the %d user grant(s) on this node admits it", len(c.Grants))
		}
	}
	if len(p.Rules) > 0 {
		fmt.Fprintf(&b, "; none of the %d site rules matched", len(p.Rules))
	}
	if v.Rule == RuleDenied {
		fmt.Fprintf(&b, "; %s.", p.trust(c.Source))
	} else {
		fmt.Fprintf(&b, "; %s is above %s and %s.", port, system, p.trust(c.Source))
	}
	return b.String()
}

// trust says why the source's identity is believed.
func (p *Policy) trust(src netip.Addr) string {
	switch {
	case !src.IsValid():
		return "the connection is local to this node, so both identities are known"
	case src.Unmap().IsLoopback():
		return fmt.Sprintf("the source %s is loopback, so both identities are known", src)
	}
	for _, s := range p.ClusterSubnets {
		if s.Contains(src.Unmap()) {
			return fmt.Sprintf("the source %s is in cluster subnet %s, so its identity is trusted", src, s)
		}
	}
	return fmt.Sprintf("the source %s is trusted", src)
}

func (p *Policy) subnets() string { return spaced(p.ClusterSubnets, "none configured") }

func (p *Policy) offPorts() string { return spaced(p.OffClusterPorts, "empty") }

// spaced lists xs separated by spaces, or says none.
func spaced[T fmt.Stringer](xs []T, none string) string {
	if len(xs) == 0 {
		return none
	}
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = x.String()
	}
	return strings.Join(s, " ")
}

// Describe says what the rule matches, in the configuration's terms.
func (r *SiteRule) Describe(res identity.Resolver) string {
	var parts []string
	who := func(uids, gids []uint32, name func(identity.Resolver, uint32) string) string {
		var s []string
		for _, u := range uids {
			s = append(s, name(res, u))
		}
		for _, g := range gids {
			s = append(s, "@"+identity.GroupName(res, g))
		}
		return strings.Join(s, " ")
	}
	if len(r.From) > 0 || len(r.FromGroups) > 0 {
		parts = append(parts, "from "+who(r.From, r.FromGroups, identity.UserName))
	}
	if len(r.Sources) > 0 {
		var s []string
		for _, p := range r.Sources {
			s = append(s, p.String())
		}
		parts = append(parts, "from sources "+strings.Join(s, " "))
	}
	if len(r.To) > 0 || len(r.ToGroups) > 0 {
		parts = append(parts, "to listeners of "+who(r.To, r.ToGroups, identity.UserName))
	}
	if len(r.Nodes) > 0 {
		parts = append(parts, "on nodes "+strings.Join(r.Nodes, " "))
	}
	if len(r.Ports) > 0 {
		var s []string
		for _, p := range r.Ports {
			s = append(s, p.String())
		}
		parts = append(parts, "ports "+strings.Join(s, " "))
	}
	if r.Proto != 0 {
		parts = append(parts, r.Proto.String()+" only")
	}
	if r.Relation != NoRelation {
		parts = append(parts, "when "+r.Relation.String())
	}
	if len(parts) == 0 {
		return "every connection above the system ports from a trusted source"
	}
	return strings.Join(parts, ", ")
}
