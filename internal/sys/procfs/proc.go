// Package procfs is Palisade's one reader of /proc: whether a process still
// runs, its parent, start time, CPU time, memory and command line. It wraps
// github.com/prometheus/procfs (which the metrics endpoint already links) so
// that the kernel's formats are parsed in one place.
package procfs

import (
	"github.com/prometheus/procfs"
)

// Stat is what Palisade uses of /proc/PID/stat and /proc/PID/status.
type Stat struct {
	PID   int
	PPID  int
	State byte   // R, S, D, Z, X, ...
	Comm  string // may hold spaces and ')'
	// Start is the start time in clock ticks since boot: with the pid it
	// names one process across pid reuse.
	Start uint64
	// CPU is user+system time in seconds.
	CPU float64
}

// Zombie reports a process that has exited (zombie or dead): it holds no
// sockets and answers no signals, and PID 1 on these machines may reap it
// only seconds later.
func (s Stat) Zombie() bool { return s.State == 'Z' || s.State == 'X' }

// Read returns the stat of pid (ok false if it is gone).
func Read(pid int) (Stat, bool) {
	if pid <= 0 {
		return Stat{}, false
	}
	p, err := procfs.NewProc(pid)
	if err != nil {
		return Stat{}, false
	}
	return stat(p)
}

func stat(p procfs.Proc) (Stat, bool) {
	s, err := p.Stat()
	if err != nil || len(s.State) != 1 {
		return Stat{}, false
	}
	return Stat{PID: s.PID, PPID: s.PPID, State: s.State[0], Comm: s.Comm, Start: s.Starttime, CPU: s.CPUTime()}, true
}

// Alive reports whether pid exists and has not exited (see Stat.Zombie).
func Alive(pid int) bool {
	s, ok := Read(pid)
	return ok && !s.Zombie()
}

// All returns the stat of every process (those that vanish while /proc is
// read are left out).
func All() []Stat {
	ps, err := procfs.AllProcs()
	if err != nil {
		return nil
	}
	out := make([]Stat, 0, len(ps))
	for _, p := range ps {
		if s, ok := stat(p); ok {
			out = append(out, s)
		}
	}
	return out
}

// Descendants returns pid and every descendant of it still in /proc.
func Descendants(pid int) map[int]bool {
	children := map[int][]int{}
	for _, s := range All() {
		children[s.PPID] = append(children[s.PPID], s.PID)
	}
	out := map[int]bool{pid: true}
	stack := []int{pid}
	for len(stack) > 0 {
		p := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for _, ch := range children[p] {
			if !out[ch] {
				out[ch] = true
				stack = append(stack, ch)
			}
		}
	}
	return out
}

// Memory returns the resident set size and its high-water mark of pid in
// bytes (VmRSS, VmHWM of /proc/PID/status).
func Memory(pid int) (rss, hwm uint64, ok bool) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, 0, false
	}
	st, err := p.NewStatus()
	if err != nil {
		return 0, 0, false
	}
	return st.VmRSS, st.VmHWM, true
}

// Cmdline returns the arguments of pid (nil if it is gone or a kernel
// thread).
func Cmdline(pid int) []string {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return nil
	}
	args, err := p.CmdLine()
	if err != nil || len(args) == 0 {
		return nil
	}
	return args
}

// EffectiveUID returns the effective uid of pid (false if it is gone).
func EffectiveUID(pid int) (uint64, bool) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, false
	}
	st, err := p.NewStatus()
	if err != nil {
		return 0, false
	}
	return st.UIDs[1], true
}
