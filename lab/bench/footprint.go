package bench

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// clkTck is USER_HZ, which is 100 on every Linux architecture Go supports
// for /proc/<pid>/stat accounting.
const clkTck = 100

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

// procCPU is utime+stime of pid in seconds, or -1.
func procCPU(pid int) float64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return -1
	}
	s := string(b)
	// comm may contain spaces and parentheses: fields start after the last ')'.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return -1
	}
	fs := strings.Fields(s[i+1:])
	// fs[0] is state (field 3); utime and stime are fields 14 and 15.
	if len(fs) < 13 || fs[0] == "Z" {
		return -1
	}
	ut, _ := strconv.ParseFloat(fs[11], 64)
	st, _ := strconv.ParseFloat(fs[12], 64)
	return (ut + st) / clkTck
}

// procMem returns VmRSS and VmHWM of pid in MB.
func procMem(pid int) (rss, hwm float64) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb / 1024
		case "VmHWM:":
			hwm = kb / 1024
		}
	}
	return
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
