package bench

// In-kernel accounting of uvn inside the VM. The host cannot see the
// guest's programs, and uvn has no agent process whose descriptors name
// them: its programs are attached by short-lived `palisade uvn` runs and
// recorded in each node's state directory. So a reader runs inside the
// guest, on each node (in the node's network namespace, with the node's
// palisade.toml): `palisade-lab bench progstats` lists the programs the
// node's uvn state names (the device guard at the cgroup2 root, the
// release program, every session attachment) and the tc programs on the
// node's own interfaces (Slurm's hand-over), each with the run time and
// run count the kernel keeps while kernel.bpf_stats_enabled is 1. The
// bench's host side (vmProgs) switches the guest's statistics on for the
// accounting passes and reads every node around each unit, as progSet
// does on the host.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
)

// GuestProg is one program of a node, as the guest reader reports it.
type GuestProg struct {
	ID     uint32 `json:"id"`
	Name   string `json:"name"`
	Type   string `json:"type"`
	RunNS  uint64 `json:"run_ns"`
	RunCnt uint64 `json:"run_cnt"`
}

// GuestProgs is what `palisade-lab bench progstats` prints.
type GuestProgs struct {
	// Stats is kernel.bpf_stats_enabled as the reader found it (before
	// any change it was asked to make).
	Stats    string      `json:"stats"`
	Programs []GuestProg `json:"programs"`
}

// ReadGuestProgs lists the uvn programs of this node (configPath's
// state_dir, and the tc programs of this network namespace's interfaces).
// setStats, if not "", is first written to kernel.bpf_stats_enabled.
func ReadGuestProgs(configPath, setStats string) (*GuestProgs, error) {
	prev, err := os.ReadFile(statsSysctl)
	if err != nil {
		return nil, err
	}
	res := &GuestProgs{Stats: strings.TrimSpace(string(prev))}
	if setStats != "" {
		if err := os.WriteFile(statsSysctl, []byte(setStats+"\n"), 0o644); err != nil {
			return nil, err
		}
	}
	cfg, err := config.Load(configPath)
	if err != nil {
		return nil, err
	}
	ids, err := uvnStateProgs(cfg.UVN.StateDir)
	if err != nil {
		return nil, err
	}
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	for _, l := range links {
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(l, parent)
			if err != nil {
				continue // no clsact on this interface
			}
			for _, f := range fs {
				if b, ok := f.(*netlink.BpfFilter); ok && b.Id > 0 {
					ids = append(ids, uint32(b.Id))
				}
			}
		}
	}
	slices.Sort(ids)
	for _, id := range slices.Compact(ids) {
		if id == 0 {
			continue
		}
		prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
		if err != nil {
			continue // detached and unloaded meanwhile
		}
		gp := GuestProg{ID: id}
		if info, err := prog.Info(); err == nil {
			gp.Name, gp.Type = fullName(info), info.Type.String()
		}
		if st, err := prog.Stats(); err == nil {
			gp.RunNS, gp.RunCnt = uint64(st.Runtime), st.RunCount
		}
		prog.Close()
		res.Programs = append(res.Programs, gp)
	}
	return res, nil
}

// uvnStateProgs are the program ids a node's uvn state records.
func uvnStateProgs(dir string) ([]uint32, error) {
	var ids []uint32
	var ns uvn.NodeState
	if err := readJSON(filepath.Join(dir, "node.json"), &ns); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	ids = append(ids, ns.GuardProgs...)
	ids = append(ids, ns.SrunRelease)
	for _, u := range ns.Undo {
		ids = append(ids, u.Prog)
	}
	users, err := filepath.Glob(filepath.Join(dir, "user-*.json"))
	if err != nil {
		return nil, err
	}
	for _, p := range users {
		var us uvn.UserState
		if err := readJSON(p, &us); err != nil {
			continue // removed meanwhile
		}
		for _, a := range us.Attach {
			ids = append(ids, a.ProgID, a.ConnectID, a.SendmsgID, a.Bind4ID, a.Bind6ID, a.ReleaseID,
				a.EgressID, a.IngressID, a.LinkLocalID)
		}
	}
	return ids, nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
