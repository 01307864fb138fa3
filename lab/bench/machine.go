package bench

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
)

// Machine describes where a run happened, read from the system itself.
type Machine struct {
	CPU       string  `json:"cpu"`
	Cores     int     `json:"cores"`
	MemoryGiB float64 `json:"memory_gib"`
	Kernel    string  `json:"kernel"`
	OS        string  `json:"os"`
	Virt      string  `json:"virtualization,omitempty"`
	Go        string  `json:"go"`
	Iperf3    string  `json:"iperf3,omitempty"`
	OpenMPI   string  `json:"openmpi,omitempty"`
	LoadStart string  `json:"load_start"`
	LoadEnd   string  `json:"load_end,omitempty"`
	Hostname  string  `json:"hostname,omitempty"`
}

// DescribeMachine reads CPU, cores, memory, kernel and tool versions.
func DescribeMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: runtime.Version(), LoadStart: loadAvg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(l, ":")
			if !ok {
				continue
			}
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			switch {
			case k == "model name" && m.CPU == "":
				m.CPU = v
			case k == "flags" && strings.Contains(" "+v+" ", " hypervisor "):
				m.Virt = "virtual machine (cpuinfo: hypervisor)"
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			f := strings.Fields(l)
			if len(f) >= 2 && f[0] == "MemTotal:" {
				kb, _ := strconv.ParseFloat(f[1], 64)
				m.MemoryGiB = float64(int(kb/1024/1024*10+0.5)) / 10
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "PRETTY_NAME="); ok {
				m.OS = strings.Trim(v, `"`)
			}
		}
	}
	m.Hostname, _ = os.Hostname()
	m.Iperf3 = firstLine("iperf3", "--version")
	m.OpenMPI = firstLine("mpirun", "--version")
	return m
}

func firstLine(name string, args ...string) string {
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		return ""
	}
	l, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return l
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
