package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// accounting reads the data plane's programs around a unit: progSet for
// programs this machine's kernel runs, vmProgs for the VM's.
type accounting interface {
	// begin switches the statistics on (and attaches floor probes where
	// there are any); it returns the hooks left without a probe.
	begin() ([]string, error)
	snap() progCounters
	delta(a, b progCounters, work []string) []ProgCost
	end()
	close()
}

// vmProgs reads the uvn programs of every node of the VM testbed through
// `palisade-lab bench progstats` inside the guest (guestprogs.go). The
// guest is one kernel: its statistics switch is one, set through the first
// node. There are no floor probes in the guest (the report then gives each
// program as counted, which under the VM's emulation includes the two
// clock reads per run the statistics cost).
type vmProgs struct {
	ctx  context.Context
	env  *Env
	mu   sync.Mutex
	info map[uint32]progRef // id → node, name, type (prog unset)
	prev string             // the guest's statistics switch before begin
	on   bool
}

func newVMProgs(ctx context.Context, env *Env) *vmProgs {
	return &vmProgs{ctx: ctx, env: env, info: map[uint32]progRef{}}
}

func (v *vmProgs) read(node, set string) (*GuestProgs, error) {
	argv := []string{v.env.LabBinary, "bench", "progstats"}
	if set != "" {
		argv = append(argv, "--set-stats", set)
	}
	out, err := v.env.run(v.ctx, node, "", argv...)
	if err != nil {
		return nil, err
	}
	var g GuestProgs
	if err := json.Unmarshal([]byte(out), &g); err != nil {
		return nil, fmt.Errorf("progstats on %s: %w: %s", node, err, tail(out, 200))
	}
	return &g, nil
}

func (v *vmProgs) begin() ([]string, error) {
	if len(v.env.Nodes) == 0 {
		return nil, fmt.Errorf("no nodes")
	}
	g, err := v.read(v.env.Nodes[0].Name, "1")
	if err != nil {
		return nil, err
	}
	if !v.on {
		v.prev, v.on = g.Stats, true
	}
	return []string{"uvn in the VM: no floor probes in the guest (programs as counted, statistics' clock reads included)"}, nil
}

func (v *vmProgs) end() {
	if !v.on {
		return
	}
	prev := v.prev
	if prev == "" {
		prev = "0"
	}
	if _, err := v.read(v.env.Nodes[0].Name, prev); err == nil {
		v.on = false
	}
}

func (v *vmProgs) close() { v.end() }

// snap reads every node's programs (in parallel: each read is a relayed
// command, about a second under emulation).
func (v *vmProgs) snap() progCounters {
	c := progCounters{}
	_ = testbed.Parallel(v.env.Nodes, func(n Node) error {
		g, err := v.read(n.Name, "")
		if err != nil {
			return err
		}
		v.mu.Lock()
		defer v.mu.Unlock()
		for _, p := range g.Programs {
			c[p.ID] = [2]uint64{p.RunNS, p.RunCnt}
			v.info[p.ID] = progRef{node: n.Name, id: p.ID, name: p.Name, typ: p.Type}
		}
		return nil
	})
	return c
}

func (v *vmProgs) delta(a, b progCounters, work []string) []ProgCost {
	var out []ProgCost
	for id, y := range b {
		x, ok := a[id]
		r, known := v.info[id]
		if !ok || !known {
			continue
		}
		out = append(out, ProgCost{Node: r.node, Work: slices.Contains(work, r.node), ID: id,
			Name: r.name, Type: r.typ, RunNS: y[0] - x[0], RunCnt: y[1] - x[1]})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Node != out[j].Node {
			return out[i].Node < out[j].Node
		}
		return out[i].Name < out[j].Name
	})
	return out
}
