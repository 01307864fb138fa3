package bench

// In-kernel accounting: the run time and run count the kernel keeps for
// every eBPF program while BPF_ENABLE_STATS is in force, read around each
// measured unit. Programs are found through the data plane's own processes
// (every program or link descriptor an agent holds), never by name, so the
// accounting follows whatever the data plane loads; each program is
// attributed to the node of the agent that loaded it.

import (
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// ProgCost is one program's run time and run count during one unit.
type ProgCost struct {
	Node string `json:"node"` // node of the agent that loaded it
	// Work: the program belongs to a node the operation ran on (client or
	// server); the testbed's other nodes' copies are reported apart.
	Work bool   `json:"work"`
	ID   uint32 `json:"id"`
	Name string `json:"name"`
	Type string `json:"type"`
	// Hook is the attach type the program runs at ("" = not known); a
	// floor probe (Floor) is the empty program the bench attached there.
	Hook   string `json:"hook,omitempty"`
	Floor  bool   `json:"floor,omitempty"`
	RunNS  uint64 `json:"run_ns"`
	RunCnt uint64 `json:"run_cnt"`
}

// ProcCPU is the CPU time (user + system) of one process involved in a unit.
type ProcCPU struct {
	Node    string  `json:"node"`
	Process string  `json:"process"` // "client", "server"
	CPUNS   float64 `json:"cpu_ns"`
}

// Cost is the exact accounting of one measured unit (one series and x of
// one round and variant): the operations it performed, the eBPF run time of
// the data plane's programs and the CPU time of the processes involved.
type Cost struct {
	Mode    string     `json:"mode"`
	Variant string     `json:"variant"`
	Round   int        `json:"round"`
	Bench   string     `json:"bench"`
	Series  string     `json:"series"`
	X       float64    `json:"x"`
	Ops     float64    `json:"ops"`
	OpUnit  string     `json:"op_unit"` // connection, round trip, datagram, MiB
	WallSec float64    `json:"wall_seconds"`
	Progs   []ProgCost `json:"programs,omitempty"`
	// AcctOps are the operations of the accounting pass that Progs were
	// read around, when that pass was not the measured one (0: Progs
	// belong to the Ops of the measured pass, as in runs before 2026-11-24).
	AcctOps float64   `json:"acct_ops,omitempty"`
	CPU     []ProcCPU `json:"cpu,omitempty"`
}

// ProgOps is the number of operations Progs were counted over.
func (c Cost) ProgOps() float64 {
	if c.AcctOps > 0 {
		return c.AcctOps
	}
	return c.Ops
}

// WorkNS is the eBPF run time of the data plane on the nodes that did the
// work (other=false) or on the other nodes (other=true); floor probes are
// not counted.
func (c Cost) WorkNS(other bool) float64 {
	t := 0.0
	for _, p := range c.Progs {
		if p.Work != other && !p.Floor {
			t += float64(p.RunNS)
		}
	}
	return t
}

// CPUNS is the CPU time of the processes involved.
func (c Cost) CPUNS() float64 {
	t := 0.0
	for _, p := range c.CPU {
		t += p.CPUNS
	}
	return t
}

// bpfStats switches the kernel's run-time statistics on for the accounting
// passes and off again for the measured ones: with them on, the kernel
// reads the clock twice around every program run, which on this kind of
// virtual machine costs about as much as a short program (the floor).
// BPF_ENABLE_STATS is preferred (the statistics stop when our descriptor
// closes, even if we crash); the sysctl is the fallback and is restored.
type bpfStats struct {
	fd      io.Closer
	sysctl  string // previous sysctl value to restore ("" = not touched)
	Method  string
	Problem error
}

const statsSysctl = "/proc/sys/kernel/bpf_stats_enabled"

// newBPFStats finds out how the statistics can be switched on (Method) or
// why not (Problem), and leaves them off.
func newBPFStats() *bpfStats {
	s := &bpfStats{}
	s.Problem = s.on()
	s.off()
	return s
}

func (s *bpfStats) on() error {
	if s.fd != nil || s.sysctl != "" {
		return nil
	}
	fd, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err == nil {
		s.fd, s.Method = fd, "BPF_ENABLE_STATS"
		return nil
	}
	prev, rerr := os.ReadFile(statsSysctl)
	if rerr != nil {
		return fmt.Errorf("BPF_ENABLE_STATS: %v; sysctl: %v", err, rerr)
	}
	if werr := os.WriteFile(statsSysctl, []byte("1\n"), 0o644); werr != nil {
		return fmt.Errorf("BPF_ENABLE_STATS: %v; sysctl: %v", err, werr)
	}
	s.sysctl, s.Method = strings.TrimSpace(string(prev)), "kernel.bpf_stats_enabled"
	return nil
}

func (s *bpfStats) off() {
	if s.fd != nil {
		s.fd.Close()
		s.fd = nil
	}
	if s.sysctl != "" {
		_ = os.WriteFile(statsSysctl, []byte(s.sysctl+"\n"), 0o644)
		s.sysctl = ""
	}
}

// statsOn tells whether the kernel's statistics are on (ours or another
// process's: the switch is machine-wide).
func statsOn() bool {
	b, err := os.ReadFile(statsSysctl)
	return err == nil && strings.TrimSpace(string(b)) == "1"
}

// progRef is one program of a data-plane process, held open for a set.
type progRef struct {
	node      string // "" = a floor probe of a shared hook
	id        uint32
	name, typ string
	prog      *ebpf.Program
}

// fullName is the program's function name from its BTF (the kernel keeps
// only 15 characters of the object name).
func fullName(info *ebpf.ProgramInfo) string {
	if fis, err := info.FuncInfos(); err == nil {
		for _, fi := range fis {
			if fi.Offset == 0 && fi.Func != nil && fi.Func.Name != "" {
				return fi.Func.Name
			}
		}
	}
	return info.Name
}

// progSet is the programs of a mode's processes during one measured set,
// and, during an accounting pass, the floor probes attached beside them.
type progSet struct {
	refs  []*progRef
	floor *floorProbes
	procs []Proc    // the processes (their links give the floor's hooks)
	stats *bpfStats // switched on for the accounting passes
}

// progCounters is a snapshot of every program's run time and count.
type progCounters map[uint32][2]uint64

// openProgs opens the programs the processes hold.
func openProgs(procs []Proc) *progSet {
	ps := &progSet{}
	seen := map[uint32]bool{}
	for _, p := range procs {
		for _, id := range procfs.FdinfoIDs(p.PID, "prog_id") {
			if seen[id] {
				continue
			}
			seen[id] = true
			prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
			if err != nil {
				continue // unloaded meanwhile
			}
			r := &progRef{node: p.Node, id: id, prog: prog}
			if info, err := prog.Info(); err == nil {
				r.name, r.typ = fullName(info), info.Type.String()
			}
			ps.refs = append(ps.refs, r)
		}
	}
	return ps
}

// snap reads every program's counters.
func (ps *progSet) snap() progCounters {
	c := progCounters{}
	if ps == nil {
		return c
	}
	for _, r := range ps.refs {
		if st, err := r.prog.Stats(); err == nil {
			c[r.id] = [2]uint64{uint64(st.Runtime), st.RunCount}
		}
	}
	return c
}

// delta returns what each program did between two snapshots; work names
// the nodes the operation ran on.
func (ps *progSet) delta(a, b progCounters, work []string) []ProgCost {
	if ps == nil {
		return nil
	}
	var out []ProgCost
	for _, r := range ps.refs {
		x, okA := a[r.id]
		y, okB := b[r.id]
		if !okA || !okB {
			continue
		}
		pc := ProgCost{Node: r.node, Work: slices.Contains(work, r.node), ID: r.id,
			Name: r.name, Type: r.typ, RunNS: y[0] - x[0], RunCnt: y[1] - x[1]}
		if hook, ok := strings.CutPrefix(r.name, floorPrefix); ok {
			pc.Hook, pc.Floor = hook, true
			pc.Work = pc.Work || r.node == ""
		} else if ps.floor != nil {
			pc.Hook = ps.floor.hookOf[r.id]
		}
		out = append(out, pc)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Node != out[j].Node {
			return out[i].Node < out[j].Node
		}
		return out[i].Name < out[j].Name
	})
	return out
}

func (ps *progSet) close() {
	if ps == nil {
		return
	}
	for _, r := range ps.refs {
		if !strings.HasPrefix(r.name, floorPrefix) {
			r.prog.Close()
		}
	}
	ps.floor.close()
}

// begin starts an accounting pass: statistics on, floor probes attached.
// It returns the hooks left without a probe, and why.
func (ps *progSet) begin() ([]string, error) {
	if err := ps.stats.on(); err != nil {
		return nil, err
	}
	fp := attachFloor(ps.procs)
	ps.floor = fp
	ps.refs = append(ps.refs, fp.refs...)
	return fp.Problems, nil
}

// end ends an accounting pass: probes detached, statistics off.
func (ps *progSet) end() {
	ps.refs = slices.DeleteFunc(ps.refs, func(r *progRef) bool { return strings.HasPrefix(r.name, floorPrefix) })
	ps.floor.close()
	ps.floor = nil
	ps.stats.off()
}
