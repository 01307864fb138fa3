package uvn

import (
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/check"
)

// systemUIDMax: uids below uvn.min_uid (default 1000) get no VRF; their
// processes live in the default VRF.
const systemUIDMax = 999

// ExpectUVN is uvn's expectation. Every user process (login, ssh session,
// job step) runs in its user's VRF; system accounts (root) run in the
// default VRF.
//
//   - same user: allowed on every path and node (the user's overlay);
//   - other users, shared groups included: refused (VRFs do not share);
//   - system listeners (default VRF): allowed from every VRF
//     (tcp/udp_l3mdev_accept; IPv4 to other nodes through the underlay
//     ports), also from the outside host — except UDP over IPv6 or
//     loopback from a user's VRF: the service's reply leaves through the
//     default VRF and never reaches the VRF socket;
//   - system connectors (default VRF) → user listeners: refused;
//   - outside host → user listeners: refused;
//   - node → outside host: IPv4 allowed (per-user NAT + SNAT); IPv6 from a
//     user's VRF refused (uvn does not NAT IPv6 out of a VRF).
func ExpectUVN(c *check.Case) check.Verdict {
	connSys := c.Connector.UID <= systemUIDMax
	lisSys := c.Listener.UID <= systemUIDMax
	switch {
	case !c.Managed(): // node → outside host
		if connSys || c.Family == 4 {
			return check.Verdict{Allow: true, Rule: "off-subnet-snat"}
		}
		return check.Verdict{Allow: false, Rule: "no-ipv6-nat"}
	case lisSys && !connSys && c.Connector.Node != check.OutsideHost && c.Proto == policy.UDP && (c.Family == 6 || c.Path == check.Loopback):
		// A UDP service in the default VRF answers through the default
		// VRF; that reaches a VRF socket only via the NAT address (IPv4,
		// not loopback). Documented limit.
		return check.Verdict{Allow: false, Rule: "udp-reply-outside-vrf"}
	case lisSys:
		return check.Verdict{Allow: true, Rule: "default-vrf-service"}
	case c.Connector.Node == check.OutsideHost:
		return check.Verdict{Allow: false, Rule: "off-cluster-to-vrf"}
	case connSys:
		return check.Verdict{Allow: false, Rule: "default-vrf-to-user-vrf"}
	case c.Connector.UID == c.Listener.UID:
		return check.Verdict{Allow: true, Rule: "same-user-vrf"}
	}
	return check.Verdict{Allow: false, Rule: "other-user-vrf"}
}
