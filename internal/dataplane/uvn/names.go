// Package uvn is Palisade's second data plane: a VRF per user on every node
// and a VXLAN per user per underlay network (reference 000), set up by PAM and
// the Slurm SPANK plugin, torn down when the user's last session or job on the
// node ends. Every kernel object is made through netlink (vishvananda/netlink),
// nftables (google/nftables) or the bpf syscall (cilium/ebpf): no `ip` exec.
//
// This file holds the pure mappings from a uid to kernel names and numbers.
// They are total over the uids a configuration serves and collision-free.
package uvn

import (
	"fmt"
	"net/netip"
	"strconv"
)

// Kernel limits the mappings respect.
const (
	ifNameMax = 15 // IFNAMSIZ - 1
	vniBits   = 24
	// unreachableMetric is the metric of the catch-all route in every VRF
	// table, so failed lookups never fall through to the main table.
	unreachableMetric = 4278198272
)

// TableID is the routing table of uid's VRF: the uid itself. Table ids are
// 32-bit, uids are 32-bit and (uid_t)-1 is not a uid, so the map is
// injective; the kernel's own tables (0, 253-255) are below min_uid (≥ 256,
// enforced by the configuration). Sites must not use table ids in
// [min_uid, uid_max] for anything else; setup refuses a table that holds
// routes it did not make.
func TableID(uid uint32) uint32 { return uid }

// VNI is uid's VXLAN network identifier: the low 24 bits of the uid. With
// PortOffset (the high 8 bits select the UDP port inside an underlay's port
// block) the pair (port, VNI) is unique for every 32-bit uid, and the kernel
// demultiplexes VXLAN by exactly that pair.
func VNI(uid uint32) uint32 { return uid & (1<<vniBits - 1) }

// PortOffset is added to an underlay's base port for uid: 0 for uid < 2^24.
func PortOffset(uid uint32) uint16 { return uint16(uid >> vniBits) }

// VRFName is the VRF device of uid: "palv<uid>", at most 14 bytes.
func VRFName(uid uint32) string { return "palv" + strconv.FormatUint(uint64(uid), 10) }

// VXLANName is uid's VXLAN device on underlay index i (0-35):
// "pal<i base 36>x<uid>", at most 15 bytes for any uid and independent of the
// NIC's name (prior art used "<nic>u<uid>", which overflows IFNAMSIZ).
func VXLANName(i int, uid uint32) string {
	if i < 0 || i >= 36 {
		panic(fmt.Sprintf("uvn: underlay index %d out of range", i))
	}
	return "pal" + strconv.FormatInt(int64(i), 36) + "x" + strconv.FormatUint(uint64(uid), 10)
}

// GroupFor is uid's multicast group inside the underlay's group prefix:
// base + uid mod size, so users rarely share a group (prior art used one
// group for everyone, so every node received every user's broadcasts).
func GroupFor(group netip.Prefix, uid uint32) netip.Addr {
	return addrInPrefix(group, uint64(uid), false)
}

// addrInPrefix returns the n-th address of p modulo its size; skipBase avoids
// the prefix's first address (n maps into [1, size-1]).
func addrInPrefix(p netip.Prefix, n uint64, skipBase bool) netip.Addr {
	host := p.Addr().BitLen() - p.Bits()
	if host > 63 {
		host = 63
	}
	size := uint64(1) << host
	if skipBase {
		if size <= 1 {
			return p.Addr()
		}
		n = 1 + n%(size-1)
	} else {
		n %= size
	}
	b := p.Masked().Addr().AsSlice()
	for i := len(b) - 1; i >= 0 && n > 0; i-- {
		s := uint64(b[i]) + n&0xff
		b[i] = byte(s)
		n = n>>8 + s>>8
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// poolSize is the number of usable addresses (base excluded) in p, capped.
func poolSize(p netip.Prefix) uint64 {
	host := p.Addr().BitLen() - p.Bits()
	if host > 63 {
		host = 63
	}
	return uint64(1)<<host - 1
}
