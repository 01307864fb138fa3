// Package procfs reads what the agent, the testbed and check need to know of
// a process from /proc: whether it still runs, its parent, its command line.
package procfs

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Stat returns the state letter and the parent pid from /proc/PID/stat.
// The command name in parentheses may itself hold spaces and ')', so the
// fields are counted from the last ')'.
func Stat(pid int) (state byte, ppid int, ok bool) {
	if pid <= 0 {
		return 0, 0, false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	pp, err := strconv.Atoi(f[1])
	if err != nil {
		return 0, 0, false
	}
	return f[0][0], pp, true
}

// Alive reports whether pid exists and is neither a zombie nor dead: PID 1
// on these machines may reap orphans only seconds later, and a zombie
// neither holds sockets nor answers signals.
func Alive(pid int) bool {
	s, _, ok := Stat(pid)
	return ok && s != 'Z' && s != 'X'
}

// Cmdline returns the arguments of pid (nil if it is gone or a kernel
// thread).
func Cmdline(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || len(b) == 0 {
		return nil
	}
	return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
}
