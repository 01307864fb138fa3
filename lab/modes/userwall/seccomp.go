package userwall

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The unit's SystemCallFilter=, emulated: the lab resolves the filter's
// entries as systemd does (groups from `systemd-analyze syscall-filter`,
// names to this architecture's numbers, names it lacks skipped) and the
// agent runs under a seccomp filter that allows those and answers every
// other system call with the unit's SystemCallErrorNumber= (or kills the
// process, systemd's default); a call of another architecture (x32, i386)
// is refused as SystemCallArchitectures=native does.

// unistd is where this architecture's system call numbers are (Debian's
// linux-libc-dev, .ci/deps).
const unistd = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"

// auditArchX8664 is AUDIT_ARCH_X86_64; x32 calls carry this bit in their
// number on the same arch.
const (
	auditArchX8664 = 0xc000003e
	x32SyscallBit  = 0x40000000
)

// syscallTable is systemd's groups (members: names and @groups) and this
// architecture's numbers, read once per process.
type syscallTable struct {
	groups map[string][]string
	nums   map[string]uint32
}

var syscallTables = sync.OnceValues(func() (*syscallTable, error) {
	out, err := exec.Command("systemd-analyze", "syscall-filter").Output()
	if err != nil {
		return nil, fmt.Errorf("systemd-analyze syscall-filter (Debian package systemd, .ci/deps): %w", err)
	}
	groups := map[string][]string{}
	cur := ""
	for l := range strings.Lines(string(out)) {
		f := strings.TrimSpace(l)
		switch {
		case f == "" || strings.HasPrefix(f, "#"):
		case !strings.HasPrefix(l, " ") && strings.HasPrefix(f, "@"):
			cur = f
		case cur != "":
			groups[cur] = append(groups[cur], f)
		}
	}
	f, err := os.Open(unistd)
	if err != nil {
		return nil, fmt.Errorf("system call numbers: %w", err)
	}
	defer f.Close()
	nums := map[string]uint32{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 3 && fs[0] == "#define" && strings.HasPrefix(fs[1], "__NR_") {
			if n, err := strconv.ParseUint(fs[2], 10, 32); err == nil {
				nums[strings.TrimPrefix(fs[1], "__NR_")] = uint32(n)
			}
		}
	}
	if len(groups) == 0 || len(nums) < 300 {
		return nil, fmt.Errorf("system call tables: %d groups, %d numbers", len(groups), len(nums))
	}
	return &syscallTable{groups, nums}, sc.Err()
})

// resolveSyscalls expands a SystemCallFilter= allow list (names and
// @groups, space-separated, over one or more lines) into sorted numbers.
func resolveSyscalls(entries []string) ([]uint32, error) {
	tab, err := syscallTables()
	if err != nil {
		return nil, err
	}
	groups, nums := tab.groups, tab.nums
	set := map[uint32]bool{}
	seen := map[string]bool{}
	var add func(e string) error
	add = func(e string) error {
		if seen[e] {
			return nil
		}
		seen[e] = true
		if strings.HasPrefix(e, "@") {
			members, ok := groups[e]
			if !ok {
				return fmt.Errorf("SystemCallFilter: unknown group %s", e)
			}
			for _, m := range members {
				if err := add(m); err != nil {
					return err
				}
			}
			return nil
		}
		if n, ok := nums[e]; ok {
			set[n] = true
		}
		return nil // another architecture's call: systemd skips it too
	}
	for _, e := range entries {
		if err := add(e); err != nil {
			return nil, err
		}
	}
	var out []uint32
	for n := range set {
		out = append(out, n)
	}
	slices.Sort(out)
	return out, nil
}

// filterProgram is the seccomp program: native architecture only, the
// allowed numbers, else deny (SECCOMP_RET_ERRNO|errno, or KILL_PROCESS
// when errno is 0).
func filterProgram(allow []uint32, errno int) []unix.SockFilter {
	const (
		ldAbsW = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeqK   = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		jgeK   = unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K
		retK   = unix.BPF_RET | unix.BPF_K
	)
	deny := uint32(unix.SECCOMP_RET_KILL_PROCESS)
	if errno != 0 {
		deny = unix.SECCOMP_RET_ERRNO | uint32(errno&unix.SECCOMP_RET_DATA)
	}
	// struct seccomp_data: nr at 0, arch at 4.
	p := []unix.SockFilter{
		{Code: ldAbsW, K: 4},
		{Code: jeqK, Jt: 1, Jf: 0, K: auditArchX8664},
		{Code: retK, K: deny},
		{Code: ldAbsW, K: 0},
		{Code: jgeK, Jt: 0, Jf: 1, K: x32SyscallBit},
		{Code: retK, K: deny},
	}
	for _, n := range allow {
		p = append(p, unix.SockFilter{Code: jeqK, Jt: 0, Jf: 1, K: n}, unix.SockFilter{Code: retK, K: unix.SECCOMP_RET_ALLOW})
	}
	return append(p, unix.SockFilter{Code: retK, K: deny})
}

// UnitExec is `palisade-lab __unit-exec --allow N,N,… --errno E -- argv`:
// the last step of the unit's sandbox (after setpriv): install the
// system call filter on every thread and exec argv under it.
func UnitExec(args []string) error {
	var allow []uint32
	errno := 0
	for len(args) > 0 && args[0] != "--" {
		if len(args) < 2 {
			return fmt.Errorf("__unit-exec: %s needs a value", args[0])
		}
		switch args[0] {
		case "--allow":
			for _, s := range strings.Split(args[1], ",") {
				n, err := strconv.ParseUint(s, 10, 32)
				if err != nil {
					return fmt.Errorf("__unit-exec --allow: %w", err)
				}
				allow = append(allow, uint32(n))
			}
		case "--errno":
			n, err := strconv.Atoi(args[1])
			if err != nil {
				return fmt.Errorf("__unit-exec --errno: %w", err)
			}
			errno = n
		default:
			return fmt.Errorf("__unit-exec: unknown option %s", args[0])
		}
		args = args[2:]
	}
	if len(args) < 2 || len(allow) == 0 {
		return errors.New("usage: __unit-exec --allow N,N,... [--errno E] -- command [args]")
	}
	argv := args[1:]
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return err
	}
	prog := filterProgram(allow, errno)
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	runtime.LockOSThread()
	// Without no_new_privs only CAP_SYS_ADMIN may install a filter; the
	// unit sets it (NoNewPrivileges=yes) and setpriv did before this.
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		return fmt.Errorf("seccomp: %w", e)
	}
	return unix.Exec(path, argv, os.Environ())
}
