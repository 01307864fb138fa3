package bench

import (
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// footprint samples data-plane processes around one measured set.
type footprint struct {
	procs []Proc
	cpu0  []float64
	t0    time.Time
}

func startFootprint(procs []Proc) *footprint {
	f := &footprint{procs: procs, t0: time.Now()}
	for _, p := range procs {
		f.cpu0 = append(f.cpu0, procCPU(p.PID))
	}
	return f
}

// finish returns each process's CPU time during the set and its resident
// memory at the end (current and peak).
func (f *footprint) finish() []Footprint {
	wall := time.Since(f.t0).Seconds()
	var out []Footprint
	for i, p := range f.procs {
		c := procCPU(p.PID)
		if c < 0 || f.cpu0[i] < 0 {
			continue // gone
		}
		rss, hwm := procMem(p.PID)
		out = append(out, Footprint{Node: p.Node, Process: p.Name, PID: p.PID,
			CPUSec: c - f.cpu0[i], WallSec: wall, RSSMB: rss, HWMMB: hwm})
	}
	return out
}

// procCPU is utime+stime of pid in seconds, or -1 if it has exited.
func procCPU(pid int) float64 {
	s, ok := procfs.Read(pid)
	if !ok || s.Zombie() {
		return -1
	}
	return s.CPU
}

// procMem returns VmRSS and VmHWM of pid in MB.
func procMem(pid int) (rss, hwm float64) {
	r, h, _ := procfs.Memory(pid)
	return float64(r) / (1 << 20), float64(h) / (1 << 20)
}

// pidFromFile reads a pid file; 0 if absent, unreadable or not running.
func pidFromFile(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 || procCPU(pid) < 0 {
		return 0
	}
	return pid
}
