// Package procfs is Palisade's one reader of /proc: whether a process still
// runs, its parent, start time, CPU time, memory, command line, credentials
// and cgroup. It wraps github.com/prometheus/procfs (which the metrics
// endpoint already links) so that the kernel's formats are parsed in one
// place.
package procfs

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

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
	// ChildCPU is the user+system time of its reaped children, in seconds.
	ChildCPU float64
}

// Zombie reports a process that has exited (zombie or dead): it holds no
// sockets and answers no signals, and PID 1 on these machines may reap it
// only seconds later.
func (s Stat) Zombie() bool { return s.State == 'Z' || s.State == 'X' }

// userHZ is the kernel's USER_HZ, the unit of /proc/PID/stat times (as
// procfs's CPUTime assumes).
const userHZ = 100

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
	return Stat{PID: s.PID, PPID: s.PPID, State: s.State[0], Comm: s.Comm, Start: s.Starttime, CPU: s.CPUTime(),
		ChildCPU: float64(s.CUTime+s.CSTime) / userHZ}, true
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

// Cgroup2 returns pid's path in the cgroup v2 hierarchy (the "0::" line of
// /proc/PID/cgroup), as seen from the caller's cgroup namespace.
func Cgroup2(pid int) (string, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return "", err
	}
	cgs, err := p.Cgroups()
	if err != nil {
		return "", err
	}
	for _, c := range cgs {
		if c.HierarchyID == 0 && len(c.Controllers) == 0 {
			return path.Clean("/" + strings.TrimSuffix(c.Path, " (deleted)")), nil
		}
	}
	return "", fmt.Errorf("pid %d: no cgroup2 entry in /proc/%d/cgroup", pid, pid)
}

// Creds is what /proc/PID/status says of a process's credentials
// (prometheus/procfs leaves out the state and the supplementary groups).
type Creds struct {
	Command    string   // Name: the command, at most 15 bytes
	Zombie     bool     // exited (see Stat.Zombie)
	UIDs, GIDs []uint32 // real, effective, saved set, filesystem
	Groups     []uint32 // supplementary groups
}

// EUID is the effective uid: a new socket's owner.
func (c Creds) EUID() uint32 { return c.UIDs[1] }

// EGID is the effective gid: a new socket's group.
func (c Creds) EGID() uint32 { return c.GIDs[1] }

// ReadCreds returns the credentials of pid.
func ReadCreds(pid int) (Creds, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return Creds{}, err
	}
	return parseCreds(b)
}

func parseCreds(b []byte) (Creds, error) {
	var c Creds
	for line := range bytes.Lines(b) {
		key, val, ok := strings.Cut(string(line), ":")
		if !ok {
			continue
		}
		f := strings.Fields(val)
		switch key {
		case "Name":
			c.Command = strings.TrimSpace(val)
		case "State":
			c.Zombie = len(f) > 0 && (f[0] == "Z" || f[0] == "X")
		case "Uid", "Gid", "Groups":
			if key != "Groups" && len(f) < 2 {
				return c, fmt.Errorf("status: malformed %s line %q", key, val)
			}
			ids := make([]uint32, 0, len(f))
			for _, s := range f {
				v, err := strconv.ParseUint(s, 10, 32)
				if err != nil {
					return c, fmt.Errorf("status: %s: %w", key, err)
				}
				ids = append(ids, uint32(v))
			}
			switch key {
			case "Uid":
				c.UIDs = ids
			case "Gid":
				c.GIDs = ids
			default:
				c.Groups = ids
			}
		}
	}
	if c.UIDs == nil || c.GIDs == nil {
		return c, fmt.Errorf("status: no Uid/Gid lines")
	}
	return c, nil
}

// FdinfoIDs lists the distinct non-zero values of key ("map_id", "prog_id")
// in the fdinfo of pid's descriptors: the BPF objects the process holds (a
// link's descriptor carries its program's prog_id too).
func FdinfoIDs(pid int, key string) []uint32 {
	dir := "/proc/" + strconv.Itoa(pid) + "/fdinfo"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var ids []uint32
	for _, e := range ents {
		b, err := os.ReadFile(dir + "/" + e.Name())
		if err != nil {
			continue // closed meanwhile
		}
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, key+":"); ok {
				if id, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32); err == nil && id > 0 {
					ids = append(ids, uint32(id))
				}
			}
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// ThreadsCPU returns the CPU time of every thread of pid in nanoseconds
// (schedstat: exact, unlike stat's clock ticks); 0 if pid is gone, an error
// if a thread's schedstat cannot be read (a kernel without schedstats).
func ThreadsCPU(pid int) (float64, error) {
	threads, err := procfs.AllThreads(pid)
	if err != nil {
		return 0, nil
	}
	t := 0.0
	for _, th := range threads {
		s, err := th.Schedstat()
		if err != nil {
			return 0, err
		}
		t += float64(s.RunningNanoseconds)
	}
	return t, nil
}

// PIDs lists the processes in /proc now.
func PIDs() []int {
	ps, err := procfs.AllProcs()
	if err != nil {
		return nil
	}
	out := make([]int, len(ps))
	for i, p := range ps {
		out[i] = p.PID
	}
	return out
}

// Namespace names pid's namespace of a kind ("net", "uts", ...; pid 0: the
// caller's), as "net:[4026531840]": two processes share a namespace when
// the names are equal.
func Namespace(pid int, kind string) (string, error) {
	p := "/proc/self/ns/" + kind
	if pid != 0 {
		p = "/proc/" + strconv.Itoa(pid) + "/ns/" + kind
	}
	return os.Readlink(p)
}

// SocketInodes returns the inodes of the sockets pid holds open (nil if it
// is gone or its descriptors are not readable).
func SocketInodes(pid int) []uint32 {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return nil
	}
	targets, err := p.FileDescriptorTargets()
	if err != nil {
		return nil
	}
	var out []uint32
	for _, t := range targets {
		s, ok := strings.CutPrefix(t, "socket:[")
		if !ok {
			continue
		}
		if ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 32); err == nil {
			out = append(out, uint32(ino))
		}
	}
	return out
}

// Environ returns the environment of pid (nil if it is gone or not
// readable).
func Environ(pid int) []string {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return nil
	}
	env, err := p.Environ()
	if err != nil {
		return nil
	}
	return env
}

// MountPoints are the mount points of the filesystems of type fstype in
// pid's mount namespace (0: the caller's), in its mount table's order
// (/proc/PID/mountinfo).
func MountPoints(pid int, fstype string) ([]string, error) {
	var ms []*procfs.MountInfo
	var err error
	if pid == 0 {
		ms, err = procfs.GetMounts()
	} else {
		ms, err = procfs.GetProcMounts(pid)
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range ms {
		if m.FSType == fstype {
			out = append(out, m.MountPoint)
		}
	}
	return out, nil
}
