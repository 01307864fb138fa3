// Package userwall is Palisade's identity firewall in eBPF: per-user
// network isolation enforced in the kernel (package kernel) on the socket a
// packet is delivered to. Socket hooks on the cgroup2 root record each
// socket's owner; tc egress seals the sender's uid and gid into an IP-layer
// stamp (SipHash MAC under the cluster key) on SYNs and datagrams;
// cgroup_skb ingress decides with the delivering socket; BPF LSM hooks
// decide abstract Unix sockets.
//
// This package is the agent that keeps the kernel side in step with the
// configuration and the node (RunAgent: the main loop and reload; the
// services beside it: events, flows, metrics, membership, grants, portal
// delegation, ident), and the flows socket with its client (AskFlows).
// What the CLI reads or asks of a node without being its agent — status,
// uninstall, reload signals, the cluster view, the state file — is package
// control, which this package writes for. See docs/userwall.md and
// docs/architecture.md.
package userwall
