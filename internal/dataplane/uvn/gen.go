package uvn

// The Slurm-callback programs (bpf/srun.c) are compiled with clang and
// embedded by bpf2go; they use only UAPI headers (no CO-RE).
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -cflags "-O2 -g -Wall -I/usr/include/x86_64-linux-gnu" -target bpfel -type srun_owner -type srun_lpm4 -type srun_lpm6 srunbpf bpf/srun.c
