package bench

import (
	"context"

	"github.com/palisade-hpc/palisade/lab/modes/userwall"
)

// userwallDriver switches the eBPF identity firewall on (an agent per
// node, started the way the testbed's userwall mode starts it) and off
// (userwall.StopAgents = `palisade agent --uninstall` on every node: agent
// stopped and every program, pin and nft table removed, so the baseline
// round really has no data plane) between rounds.
type userwallDriver struct{ wasOn bool }

func (*userwallDriver) Requires() Requirements { return Requirements{} }
func (*userwallDriver) BaselineText() string {
	return "the same testbed with the agent uninstalled (no programs, pins or nft table)"
}
func (*userwallDriver) Suites() []string {
	return []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteUDP, SuiteMPI, SuiteScale, SuiteApps}
}

// AdjustPlan: the full run takes more interleaved rounds, so that the
// wall-clock ratios get usable confidence intervals.
func (*userwallDriver) AdjustPlan(p Plan, quick bool) Plan {
	if !quick {
		p.Rounds = max(p.Rounds, 5)
	}
	return p
}

// DeniesCrossUser: bob → alice across nodes is refused with the agent on.
func (*userwallDriver) DeniesCrossUser() bool { return true }

func (*userwallDriver) Wrap(_, user string, argv []string) (string, []string) {
	return user, argv
}

func (d *userwallDriver) Prepare(ctx context.Context, env *Env) error {
	if env.VM || env.TB == nil {
		return Skip("userwall is measured on the host testbed, not in the VM")
	}
	d.wasOn = len(d.Processes(ctx, env)) > 0
	// Start from a clean, known state.
	return d.Set(ctx, env, Baseline)
}

func (d *userwallDriver) Set(ctx context.Context, env *Env, variant string) error {
	if variant == Baseline {
		return userwall.StopAgents(ctx, env.TB)
	}
	return userwall.StartAgents(ctx, env.TB)
}

// Restore leaves the agents running if they were before the bench.
func (d *userwallDriver) Restore(ctx context.Context, env *Env) error {
	if d.wasOn || env.Mode == "userwall" {
		return d.Set(ctx, env, Enforced)
	}
	return d.Set(ctx, env, Baseline)
}

func (d *userwallDriver) Processes(_ context.Context, env *Env) []Proc {
	var out []Proc
	for _, n := range env.Nodes {
		if pid := pidFromFile(userwall.AgentPidFile(env.TB, n.Name)); pid > 0 {
			out = append(out, Proc{Node: n.Name, Name: "agent", PID: pid})
		}
	}
	return out
}

// UserwallDriver switches the userwall agents off and on between rounds.
func UserwallDriver() Driver { return &userwallDriver{} }
