package bench

// The floor of the accounting. With run-time statistics on, the kernel
// reads the clock before and after every program run and counts the
// difference; on a virtual machine those reads, and the program's entry
// and exit, are a good part of what a short program is charged. To know
// what the data plane's programs really cost, the bench attaches an empty
// program (one instruction: continue / allow) to every hook a data-plane
// link uses — same interfaces, same cgroup, same attach type — for each
// accounting pass, and reads its run time in the same traffic. Its time
// per run is the floor of that hook; the report gives each program's time
// as counted and above the floor.
//
// The probes run first on tcx hooks (they must: a data-plane program that
// passes a packet ends the chain) and in attach order on cgroup hooks
// (every program there runs). They are the bench's own: closed, and so
// detached, when the accounting pass ends (progSet.end), before the
// measured pass.

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/cgroup2"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// floorPrefix names the probes in the accounting (ProgCost.Name).
const floorPrefix = "floor:"

// hookName is the attach type a program runs at, as the report names it.
func hookName(at ebpf.AttachType) string {
	if at == ebpf.AttachCGroupInetIngress {
		return "CGroupInetIngress" // also AttachNone, whose name String gives
	}
	return strings.TrimPrefix(at.String(), "Attach")
}

// floorHook is one place the data plane runs programs at.
type floorHook struct {
	node     string // per-interface hooks: the agent's node; "" = shared
	at       ebpf.AttachType
	typ      ebpf.ProgramType
	netns    string   // /proc/<agent>/ns/net (tcx)
	ifindex  []int    // tcx: the interfaces of the node
	cgroupID uint64   // cgroup hooks
	progs    []uint32 // the data plane's programs there
}

// floorProbes are the empty programs attached for a round, and which
// data-plane program runs at which hook.
type floorProbes struct {
	refs   []*progRef
	links  []link.Link
	hookOf map[uint32]string // data-plane program id → hook name
	// Problems: hooks left without a probe, and why.
	Problems []string
}

// attachFloor finds the hooks of the processes' links and attaches an empty
// program to each. Link types without a floor (LSM, iterators) are listed
// in Problems; their programs are reported as counted only.
func attachFloor(procs []Proc) *floorProbes {
	fp := &floorProbes{hookOf: map[uint32]string{}}
	hooks := map[string]*floorHook{}
	var order []string
	for _, p := range procs {
		for _, id := range procfs.FdinfoIDs(p.PID, "link_id") {
			l, err := link.NewFromID(link.ID(id))
			if err != nil {
				continue
			}
			info, err := l.Info()
			l.Close()
			if err != nil {
				continue
			}
			var key string
			var h floorHook
			switch {
			case info.TCX() != nil:
				t := info.TCX()
				h = floorHook{node: p.Node, at: ebpf.AttachType(t.AttachType), typ: ebpf.SchedCLS,
					netns: fmt.Sprintf("/proc/%d/ns/net", p.PID), ifindex: []int{int(t.Ifindex)}}
				key = p.Node + "/" + hookName(h.at)
			case info.Cgroup() != nil:
				c := info.Cgroup()
				h = floorHook{at: ebpf.AttachType(c.AttachType), cgroupID: c.CgroupId}
				key = fmt.Sprintf("cgroup%d/%s", c.CgroupId, hookName(h.at))
			default:
				fp.Problems = append(fp.Problems, fmt.Sprintf("links of type %d (not tcx or cgroup): no floor probe", info.Type))
				continue
			}
			fp.hookOf[uint32(info.Program)] = hookName(h.at)
			if old := hooks[key]; old != nil {
				old.ifindex = append(old.ifindex, h.ifindex...)
				old.progs = append(old.progs, uint32(info.Program))
				continue
			}
			if h.typ == ebpf.UnspecifiedProgram {
				if prog, err := ebpf.NewProgramFromID(info.Program); err == nil {
					if pi, err := prog.Info(); err == nil {
						h.typ = pi.Type
					}
					prog.Close()
				}
			}
			h.progs = []uint32{uint32(info.Program)}
			hooks[key] = &h
			order = append(order, key)
		}
	}
	for _, key := range order {
		h := hooks[key]
		slices.Sort(h.ifindex)
		h.ifindex = slices.Compact(h.ifindex)
		if err := fp.attach(h); err != nil {
			fp.Problems = append(fp.Problems, fmt.Sprintf("%s: %v", key, err))
		}
	}
	return fp
}

// emptyProgram: one instruction, the hook's "carry on" verdict (tcx: next
// program; cgroup hooks: allow).
func emptyProgram(h *floorHook) (*ebpf.Program, error) {
	ret := int32(1)
	if h.typ == ebpf.SchedCLS {
		ret = -1 // TCX_NEXT
	}
	return ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Name: "pal_floor", Type: h.typ, AttachType: h.at, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()},
	}, ebpf.ProgramOptions{})
}

func (fp *floorProbes) attach(h *floorHook) error {
	prog, err := emptyProgram(h)
	if err != nil {
		return fmt.Errorf("load %s probe: %w", h.typ, err)
	}
	var links []link.Link
	switch {
	case h.typ == ebpf.SchedCLS:
		err = netns.DoPath(h.netns, func() error {
			for _, ifi := range h.ifindex {
				l, err := link.AttachTCX(link.TCXOptions{Interface: ifi, Program: prog, Attach: h.at, Anchor: link.Head()})
				if err != nil {
					return fmt.Errorf("ifindex %d: %w", ifi, err)
				}
				links = append(links, l)
			}
			return nil
		})
	default:
		var path string
		if path, err = cgroupPath(h.cgroupID); err == nil {
			var l link.Link
			if l, err = link.AttachCgroup(link.CgroupOptions{Path: path, Attach: h.at, Program: prog}); err == nil {
				links = append(links, l)
			}
		}
	}
	if err != nil {
		for _, l := range links {
			l.Close()
		}
		prog.Close()
		return err
	}
	fp.links = append(fp.links, links...)
	id := uint32(0)
	if info, err := prog.Info(); err == nil {
		if i, ok := info.ID(); ok {
			id = uint32(i)
		}
	}
	fp.refs = append(fp.refs, &progRef{node: h.node, id: id, name: floorPrefix + hookName(h.at), typ: h.typ.String(), prog: prog})
	return nil
}

// cgroupPath finds the cgroup v2 directory whose id (inode) is id: the
// root of the hierarchy (where the data plane attaches) or one below it.
func cgroupPath(id uint64) (string, error) {
	root, err := cgroup2.MountPoint()
	if err != nil {
		return "", err
	}
	errFound := errors.New("found")
	var found string
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Ino == id {
			found = p
			return errFound
		}
		return nil
	})
	if found == "" {
		return "", fmt.Errorf("no cgroup with id %d under %s", id, root)
	}
	return found, nil
}

func (fp *floorProbes) close() {
	if fp == nil {
		return
	}
	for _, l := range fp.links {
		l.Close()
	}
	for _, r := range fp.refs {
		r.prog.Close()
	}
}
