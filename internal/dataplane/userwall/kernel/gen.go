// Package kernel is userwall's kernel side: the eBPF programs (C in
// ../bpf/userwall.c) and their bpf2go bindings; loading, pinning and
// attaching them (cgroup hooks on the cgroup2 root, tc or tcx on every
// interface, BPF LSM for abstract Unix sockets); the maps the agent
// writes; changed-layout migrations; the nft table that turns refusals
// into resets; the cluster key's stamp (the Go twin of the C MAC); and the
// kernel feature probe. Pins are read here without an agent too (status,
// uninstall, the lab). It knows no agent: package userwall drives it.
package kernel

// The eBPF headers both planes share (vmlinux.h, uapi.h) are in
// internal/dataplane/include. vmlinux.h is committed and pinned: builds
// do not depend on the build host's kernel. CO-RE relocates field offsets
// at load time, so one header serves every BTF kernel; `make vmlinux`
// regenerates it, on purpose only.
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -D__TARGET_ARCH_x86" -target bpfel -type uw_event -type uw_config -type uw_key -type uw_lpm_key -type uw_owner -type uw_member_key -type uw_test_sock -type uw_rule -type uw_path -type uw_stamp -type uw_mark -type uw_estat -type uw_mask -type uw_site -type uw_site_mask -type uw_grant_key -type uw_grants -type uw_node_addrs uwbpf ../bpf/userwall.c -- -I../../include
