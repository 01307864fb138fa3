package attack

import (
	"slices"
	"strings"
)

// The userwall cases whose outcome can depend on the kernel version: what
// lab/kernels runs in the VM on the other kernels (Debian's 6.1 in make
// test). The rule: a case is here when what decides it changes with the
// kernel rather than with the programs' own logic —
//
//   - a path the agent picks from its kernel probe: tc (clsact) or tcx
//     attachment, installed, adopted and replaced across restarts; the bpf
//     LSM (abstract Unix sockets: only the VM can attach LSM programs);
//   - kernel objects read through BTF beyond a socket's common fields
//     (MPTCP subflows, TIME_WAIT sockets at delivery, the namespace of a
//     socket without a record) or found by the kernel's socket lookup
//     helpers, whose matching changed between versions;
//   - packets the kernel builds around a stamp: GSO, fragments, a datagram
//     near the MTU, SYN data and a full TCP option space, options a user
//     may set (bpf_skb_adjust_room, checksums and segmentation changed);
//   - protocols a kernel may lack (SCTP, DCCP: gone in 6.16, so only an
//     older guest runs those cases; UDP-Lite);
//   - deliveries without a sending socket: looped multicast and broadcast
//     copies (which hooks see the clone, and in what order, is the kernel's).
//
// A case decided only by the programs' logic, their maps and the agent in
// user space (reply state, device-bound and link-local delivery, port
// co-binding refused at bind, identity of deputies, user namespaces,
// spoofing from outside, ssh, Slurm, grants, portals, real applications)
// gives the same answer on every kernel that loads the programs, which
// the kernel suite proves first (status: attach mode, LSM, probe) and the
// isolation matrix exercises on every path. Every case still runs on the
// host's kernel (lab/check/attack). An entry is a case name or a prefix
// ending in "-"; TestKernelCases keeps each one matching.
var kernelDependent = []string{
	// attachment and the agent's start, restart and adoption
	"agent-sigkill-restart", "agent-sigterm-restart", "nft-flush-", "new-address-agent-stopped",
	"udp-socket-predates-agent-",
	// the bpf LSM
	"abstract-unix-",
	// kernel objects through BTF, the kernel's lookups
	"mptcp-listen-nobind-", "proto-mptcp-", "tcp-timewait-cross", "reuseaddr-cobind-dualstack-wild-cross",
	"reuseaddr-wild-over-specific-", "reuseaddr-wild-over-connected-", "reuseaddr-ephemeral-cobind-",
	// packets built around the stamp
	"udp-gso-", "udp-size-1472-", "udp-size-8000-", "udp-reply-unstamped-fragment-", "group-near-mtu-",
	"tcp-fastopen-", "tcp-option-md5-", "forge-stamp-",
	// protocols
	"proto-sctp-", "proto-dccp-", "proto-udplite-", "reuseaddr-cobind-udplite-",
	// looped multicast and broadcast
	"mcast-loop-", "mcast-allhosts-local-", "mcast-allnodes-local-", "mcast-joined-group-local-",
	"bcast-subnet-local-", "bcast-limited-local-", "bcast-reuseaddr-cobound-local-",
}

// KernelDependent reports whether a userwall case's outcome can depend on
// the kernel version (the rule above).
func KernelDependent(name string) bool {
	return slices.ContainsFunc(kernelDependent, func(e string) bool { return selects(e, name) })
}

// selects reports whether entry e of kernelDependent names case name.
func selects(e, name string) bool {
	if strings.HasSuffix(e, "-") {
		return strings.HasPrefix(name, e)
	}
	return name == e
}
