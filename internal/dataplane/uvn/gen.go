package uvn

// The Slurm-callback programs (bpf/srun.c) use only UAPI headers (no CO-RE).
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -I/usr/include/x86_64-linux-gnu" -target bpfel -type srun_owner -type srun_key -type srun_lpm4 -type srun_lpm6 srunbpf bpf/srun.c

// The session programs (bpf/vrf.c) are compiled against the committed,
// pinned vmlinux.h both planes share (../include; `make vmlinux`).
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -D__TARGET_ARCH_x86" -target bpfel -type uvn_lpm4 vrfbpf bpf/vrf.c -- -I../include

// The node's device boundary (bpf/guard.c), attached at the cgroup2 root.
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -D__TARGET_ARCH_x86" -target bpfel -type guard_owner -type guard_name -type guard_birth guardbpf bpf/guard.c -- -I../include
