// Package userwall is Palisade's identity firewall in eBPF: per-user network
// isolation enforced in the kernel at connect time (local TCP/UDP), on the
// SYN (cross-node TCP, identity carried in a TCP option), per datagram
// (cross-node UDP, identity in an IP option) and on abstract Unix sockets
// (BPF LSM). The agent loads and pins the programs of one network namespace,
// keeps their maps in step with the policy and the node's addresses, and
// reports verdicts as events and metrics. See docs/userwall.md.
package userwall

// bpf/vmlinux.h is committed and pinned: builds do not depend on the build
// host's kernel. CO-RE relocates field offsets at load time, so one header
// serves every BTF kernel; `make vmlinux` regenerates it, on purpose only.
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -D__TARGET_ARCH_x86" -target bpfel -type uw_event -type uw_config -type uw_key -type uw_lpm_key -type uw_owner -type uw_member_key -type uw_test_sock -type uw_rule -type uw_path -type uw_stamp -type uw_mark -type uw_estat -type uw_mask -type uw_site -type uw_site_mask -type uw_grant_key -type uw_grants -type uw_node_addrs uwbpf bpf/userwall.c -- -I./bpf
