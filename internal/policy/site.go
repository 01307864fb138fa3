package policy

import (
	"fmt"
	"net/netip"
	"slices"
)

// MaxSiteRules bounds the site's [[rule]] entries: userwall decides with
// fixed-width rule bitmaps of this many bits (one bit per rule), so its
// per-packet cost does not grow with the rules a site writes.
const MaxSiteRules = 1024

// Relation is a condition between the two ends of a connection.
type Relation uint8

const (
	// NoRelation: the rule does not relate the two ends.
	NoRelation Relation = iota
	// SameUser: the connector's uid is the listener's.
	SameUser
	// SharedGroup: the listener's effective gid is one of the connector's
	// groups (effective or supplementary).
	SharedGroup
)

func (r Relation) String() string {
	switch r {
	case SameUser:
		return "same-user"
	case SharedGroup:
		return "shared-group"
	}
	return ""
}

// SiteRule is one validated [[rule]] of the site's policy. Within a list
// (From, Sources, To, Ports) any element matches; across fields all must.
// An empty list does not constrain.
type SiteRule struct {
	// Name is what verdicts, explain and events report.
	Name  string
	Allow bool
	// From and FromGroups: the connector is one of these uids or holds one
	// of these gids (effective or supplementary). Both empty: anyone.
	From, FromGroups []uint32
	// Sources: the connection's source address (from_subnets and the
	// addresses of from_nodes). Empty: any trusted source. A rule matches
	// an off-cluster source only when its Sources name that source and it
	// asks nothing of the connector's identity (no From, no Relation):
	// identity from outside the cluster is never trusted.
	Sources []netip.Prefix
	// To and ToGroups: the listener's uid is one of these, or its socket
	// gid is one of ToGroups, or its uid a member of one (Listener.Groups).
	To, ToGroups []uint32
	// Nodes: the listener's node (hostname) is one of these. Empty: any.
	Nodes []string
	// Ports: the destination port is in one of these. Empty: any port
	// above the system ports (system ports are never a site rule's).
	Ports []PortRange
	// Proto: TCP or UDP; 0 means both.
	Proto    Proto
	Relation Relation
	// File and Line say where the rule is written (explain).
	File string
	Line int
}

// IdentityFree reports whether the rule asks nothing of the connector's
// identity: only such a rule, naming sources, can match an off-cluster one.
func (r *SiteRule) IdentityFree() bool {
	return len(r.From) == 0 && len(r.FromGroups) == 0 && r.Relation == NoRelation
}

// Matches reports whether the rule applies to c; trusted is whether c's
// source carries a trusted identity (Policy.InCluster).
func (r *SiteRule) Matches(c Conn, trusted bool) bool {
	if !trusted && (len(r.Sources) == 0 || !r.IdentityFree()) {
		return false
	}
	if len(r.Sources) > 0 && !r.sourceMatches(c.Source) {
		return false
	}
	if r.Proto != 0 && r.Proto != c.Proto {
		return false
	}
	if len(r.Ports) > 0 && !slices.ContainsFunc(r.Ports, func(p PortRange) bool { return p.Contains(c.Port) }) {
		return false
	}
	if len(r.Nodes) > 0 && !slices.Contains(r.Nodes, c.Node) {
		return false
	}
	if (len(r.From) > 0 || len(r.FromGroups) > 0) &&
		!slices.Contains(r.From, c.Connector.UID) && !slices.ContainsFunc(r.FromGroups, c.Connector.HasGroup) {
		return false
	}
	if (len(r.To) > 0 || len(r.ToGroups) > 0) &&
		!slices.Contains(r.To, c.Listener.UID) && !slices.ContainsFunc(r.ToGroups, c.Listener.HasGroup) {
		return false
	}
	switch r.Relation {
	case SameUser:
		return c.Connector.UID == c.Listener.UID
	case SharedGroup:
		return c.Connector.HasGroup(c.Listener.GID)
	}
	return true
}

// sourceMatches: the source address as seen (IPv4-mapped as IPv4). A local
// connection (zero Source) matches no source constraint.
func (r *SiteRule) sourceMatches(src netip.Addr) bool {
	if !src.IsValid() {
		return false
	}
	src = src.Unmap()
	return slices.ContainsFunc(r.Sources, func(p netip.Prefix) bool { return p.Contains(src) })
}

// Where says where the rule is written ("palisade.toml:12"), or "".
func (r *SiteRule) Where() string {
	if r.File == "" {
		return ""
	}
	return fmt.Sprintf("%s:%d", r.File, r.Line)
}

// BuiltinRules are the names of the built-in rules, which a site rule may
// not take.
var BuiltinRules = []Rule{RuleSystemPort, RuleOffClusterPort, RuleOffClusterDenied, RuleSameUser,
	RuleSharedGroup, RuleExemptConnector, RuleExemptListener, RuleUserGrant, RuleDenied}

// SiteRule returns the site rule named name, or nil.
func (p *Policy) SiteRule(name Rule) *SiteRule {
	for i := range p.Rules {
		if Rule(p.Rules[i].Name) == name {
			return &p.Rules[i]
		}
	}
	return nil
}
