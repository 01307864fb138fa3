// Package policy is Palisade's policy core: the user-based firewall rules of
// the MIT LLSC design (reference 001), decided in pure Go so that every data
// plane, the isolation matrix and `palisade explain` agree on one answer.
//
// A connection to a listener is allowed iff the connector's uid equals the
// listener's; or the listener's effective gid is among the connector's
// groups; or the destination port is a system port; or the connector is an
// exempt connector or the listener an exempt listener. Identity is only
// trusted from the cluster's subnets (and from the node itself); an
// off-cluster source reaches only system ports and the ports the site opens
// to it explicitly.
package policy

import (
	"net/netip"
	"slices"
	"strconv"
	"time"
)

// Proto is a transport protocol the policy distinguishes.
type Proto uint8

const (
	TCP Proto = 6
	UDP Proto = 17
)

func (p Proto) String() string {
	if p == UDP {
		return "udp"
	}
	return "tcp"
}

// Identity is what is known of one end of a connection.
type Identity struct {
	UID uint32
	// GID is the effective gid (what newgrp/sg changes).
	GID uint32
	// Groups are the supplementary groups (the connector's; ignored for listeners).
	Groups []uint32
	// GroupsKnown: Groups are every group the directory gives the user now
	// (a remote connector whose groups the deciding node looked up). GID,
	// carried from another node, is then only a claim: a user removed from
	// a group is refused however long his process has run with it.
	GroupsKnown bool
}

// NoGID is the gid of an owner whose group is not known (a socket adopted
// without file credentials): it names no group, not even for an identity
// that carries it.
const NoGID = ^uint32(0)

// HasGroup reports whether gid is the effective gid or a supplementary group
// (only the latter when the groups are known: see GroupsKnown).
func (id Identity) HasGroup(gid uint32) bool {
	if gid == NoGID {
		return false
	}
	if id.GroupsKnown {
		return slices.Contains(id.Groups, gid)
	}
	return id.GID == gid || slices.Contains(id.Groups, gid)
}

// SealedGID is the gid a node carries in the identity of its own user's
// socket (owner gid): the gid itself when the node can vouch for it — it
// has looked the user up (known, groups are every group he has now) and
// gid is one of them — or when it has not looked him up yet (the gid is
// then only a claim, which the receiving node checks as HasGroup does);
// NoGID otherwise: a process that kept a group's gid after its user left
// the group (sg started before the removal) carries no group, so a node
// that has not looked him up does not take the gid on his word.
func SealedGID(gid uint32, known bool, groups []uint32) uint32 {
	if gid == NoGID || !known || slices.Contains(groups, gid) {
		return gid
	}
	return NoGID
}

// Conn is one connection attempt as a data plane sees it.
type Conn struct {
	// Source is the connector's address. A zero Source means a local
	// connection (same node), whose identity is always trusted.
	Source    netip.Addr
	Connector Identity
	Listener  Identity
	Port      uint16
	Proto     Proto
	// Node is the listener's node (its hostname), for site rules limited
	// to some nodes (on_nodes); "" matches none of those rules.
	Node string
	// Grants are the user grants held on the listener's node (`palisade
	// share`); At is the decision's time, against which they expire (zero:
	// every grant given counts).
	Grants []Grant
	At     time.Time
}

// Rule names the rule that decided a verdict.
type Rule string

const (
	RuleSameUser         Rule = "same-user"
	RuleSharedGroup      Rule = "shared-group"
	RuleSystemPort       Rule = "system-port"
	RuleExemptConnector  Rule = "exempt-connector"
	RuleExemptListener   Rule = "exempt-listener"
	RuleOffClusterPort   Rule = "off-cluster-port"
	RuleOffClusterDenied Rule = "off-cluster-denied"
	RuleDenied           Rule = "default-deny"
)

// Verdict is the decision for one Conn.
type Verdict struct {
	Allow bool
	Rule  Rule
}

// PortRange is an inclusive range of ports.
type PortRange struct{ First, Last uint16 }

// Contains reports whether p is in the range.
func (r PortRange) Contains(p uint16) bool { return p >= r.First && p <= r.Last }

// Overlaps reports whether the two ranges share a port.
func (r PortRange) Overlaps(o PortRange) bool { return r.First <= o.Last && o.First <= r.Last }

// String renders "8443" or "9000-9100", the config syntax.
func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return strconv.Itoa(int(r.First)) + "-" + strconv.Itoa(int(r.Last))
}

// Policy is a validated policy. Build it with Load or Parse, or by hand in tests.
type Policy struct {
	// SystemPortMax is the highest system port: ports <= it are always reachable.
	SystemPortMax uint16
	// ExemptConnectors and ExemptListeners are uids.
	ExemptConnectors []uint32
	ExemptListeners  []uint32
	// ExemptConnectorGroups and ExemptListenerGroups are gids ("@group" in
	// the configuration): their members are exempt, resolved like the
	// shared-group membership (the agent looks up each group's member list
	// and keeps it fresh; internal/membership).
	ExemptConnectorGroups []uint32
	ExemptListenerGroups  []uint32
	// ClusterSubnets are the networks identity is trusted from.
	ClusterSubnets []netip.Prefix
	// OffClusterPorts are the non-system ports off-cluster sources may reach.
	OffClusterPorts []PortRange
	// UnenforcedNodes are cluster nodes without the agent yet (staged
	// rollout): identity-less traffic from them is admitted, and reported.
	UnenforcedNodes []netip.Prefix
	// Rules are the site's [[rule]] entries, in order: consulted after the
	// system ports and before the built-in rules (docs/policy.md).
	Rules []SiteRule
	// Grants is the site's switch and bounds for user grants.
	Grants GrantPolicy
}

// Default returns the policy used when the configuration says nothing:
// system ports below 1024, root exempt both ways, no cluster subnets.
func Default() *Policy {
	return &Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{0}, ExemptListeners: []uint32{0}, Grants: DefaultGrantPolicy()}
}

// InCluster reports whether identity from addr is trusted. Loopback and the
// zero address (a local connection) are always trusted.
func (p *Policy) InCluster(addr netip.Addr) bool {
	if !addr.IsValid() || addr.IsLoopback() {
		return true
	}
	addr = addr.Unmap()
	for _, s := range p.ClusterSubnets {
		if s.Contains(addr) {
			return true
		}
	}
	return false
}

// Decide applies the rules in a fixed order and reports the first that
// decides:
//
//  1. system-port: Port <= SystemPortMax, for everyone from anywhere (in the
//     original, ports below 1024 never reach the daemon at all);
//     then the site's rules (Rules) in order: the first that matches decides
//     with its own name (SiteRule.Matches);
//  2. off-cluster-port / off-cluster-denied: a source outside ClusterSubnets
//     (and not link-local: Trusted) carries no trusted identity, so only OffClusterPorts decide for it;
//  3. same-user: connector uid == listener uid;
//  4. shared-group: the listener's effective gid is one of the connector's
//     groups (effective or supplementary) — how newgrp/sg shares a listener;
//  5. exempt-connector, 6. exempt-listener;
//  7. user-grant: a grant of the listener's owner on this TCP port admits
//     the connector (Conn.Grants, unless the site disabled grants);
//  8. default-deny.
//
// Among 3-7 the order only changes which allowing rule is reported.
func (p *Policy) Decide(c Conn) Verdict { return p.DecideTrusted(c, p.Trusted(c.Source)) }

// Trusted reports whether the data plane trusts the identity a source
// carries: InCluster, or a link-local unicast address (fe80::/10,
// 169.254/16). Only a neighbour on a cluster link can send from one, and
// userwall verifies its stamp like any other (an unstamped datagram from it
// is refused as unstamped-from-cluster, never let in as an off-cluster
// reply); counting it off-cluster here made explain and the differential
// test disagree with the kernel (docs/fuzz.md, finding 2).
func (p *Policy) Trusted(addr netip.Addr) bool {
	return p.InCluster(addr) || addr.Unmap().IsLinkLocalUnicast()
}

// DecideTrusted is Decide for a data plane that knows whether the
// connector's identity is proven (userwall: a valid stamp from the cluster,
// this node or a link-local address) rather than inferring it from the
// source address; Source still decides the site rules' sources.
func (p *Policy) DecideTrusted(c Conn, trusted bool) Verdict {
	if c.Port <= p.SystemPortMax {
		return Verdict{true, RuleSystemPort}
	}
	for i := range p.Rules {
		if r := &p.Rules[i]; r.Matches(c, trusted) {
			return Verdict{r.Allow, Rule(r.Name)}
		}
	}
	if !trusted {
		for _, r := range p.OffClusterPorts {
			if r.Contains(c.Port) {
				return Verdict{true, RuleOffClusterPort}
			}
		}
		return Verdict{false, RuleOffClusterDenied}
	}
	switch {
	case c.Connector.UID == c.Listener.UID:
		return Verdict{true, RuleSameUser}
	case c.Connector.HasGroup(c.Listener.GID):
		return Verdict{true, RuleSharedGroup}
	case slices.Contains(p.ExemptConnectors, c.Connector.UID) || slices.ContainsFunc(p.ExemptConnectorGroups, c.Connector.HasGroup):
		return Verdict{true, RuleExemptConnector}
	case slices.Contains(p.ExemptListeners, c.Listener.UID) || slices.ContainsFunc(p.ExemptListenerGroups, c.Listener.HasGroup):
		return Verdict{true, RuleExemptListener}
	case p.GrantFor(c) != nil:
		return Verdict{true, RuleUserGrant}
	}
	return Verdict{false, RuleDenied}
}
