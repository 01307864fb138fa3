package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/lab/testbed"
	// The VM testbed (`testbed up --vm`) and its uvn mode live there.
	_ "github.com/palisade-hpc/palisade/lab/vm"
)

// uvnDriver measures per-user VRF + VXLAN overlays inside the VRF-capable
// VM (the host kernel has no VRF). Baseline and mode run in the same VM on
// the same path (node1 → node2's eth0 address as users know it): baseline
// processes stay in the default VRF; mode processes are logins, which put
// them in the user's VRF, so their traffic crosses the user's VXLAN.
type uvnDriver struct{}

// UVNScaleUIDBase + i are the scale test's users (no passwd entries).
const UVNScaleUIDBase = 60000

// uvnUsers are the testbed users whose networks the bench creates.
var uvnUsers = map[string]string{"alice": "2001", "bob": "2002"}

func (*uvnDriver) Requires() Requirements { return Requirements{VM: true, TestbedMode: "uvn"} }
func (*uvnDriver) BaselineText() string {
	return "the same VM and path with the processes outside the user's VRF"
}

// Suites: no MPI — mpirun's ssh launcher always enters the VRF through
// the PAM line, so MPI has no baseline in the same VM.
func (*uvnDriver) Suites() []string {
	return []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteSetup}
}

// AdjustPlan: everything runs under the VM's software emulation, roughly
// 20 times slower than the host: fewer points and rounds, same method.
func (*uvnDriver) AdjustPlan(p Plan, quick bool) Plan {
	if quick {
		p.Rounds = 1
		p.Streams, p.LocalStreams, p.UDPRate = []int{1}, nil, ""
		p.RRSizes, p.RRIters = []int{1, 65536}, 50
		p.ConnThreads, p.ConnPerThr = []int{1}, 50
		p.SetupUsers = []int{3}
		return p
	}
	p.Rounds = min(p.Rounds, 2)
	p.Streams, p.LocalStreams = []int{1, 4}, []int{1}
	p.RRSizes, p.RRIters = []int{1, 1024, 16384, 65536}, 200
	p.ConnThreads, p.ConnPerThr = []int{1, 4}, 200
	return p
}

// DeniesCrossUser: bob (in his VRF or outside) cannot reach alice's
// listener in her VRF.
func (*uvnDriver) DeniesCrossUser() bool { return true }

func (*uvnDriver) Processes(context.Context, *Env) []Proc { return nil }

func (*uvnDriver) Prepare(ctx context.Context, env *Env) error {
	if !env.VM {
		return Skip("uvn runs in the VRF-capable VM testbed (`palisade-lab testbed up --vm --mode uvn`); this kernel has no VRF")
	}
	if env.Mode != "uvn" {
		return Skip("VM testbed %s runs mode %q, not uvn", env.Name, env.Mode)
	}
	if _, err := env.run(ctx, env.Nodes[0].Name, "", env.Binary, "uvn", "status"); err != nil {
		return Skip("uvn not usable in VM testbed %s: %v", env.Name, err)
	}
	return nil
}

// Set tears the bench users' networks down for the baseline (so nothing
// of uvn is on the path) and sets alice's up on every node for the mode.
func (d *uvnDriver) Set(ctx context.Context, env *Env, variant string) error {
	return testbed.Parallel(env.Nodes, func(n Node) error {
		for _, uid := range []string{uvnUsers["alice"], uvnUsers["bob"]} {
			verb := "teardown"
			if variant == Enforced && uid == uvnUsers[BenchUser] {
				verb = "setup"
			}
			if _, err := env.run(ctx, n.Name, "", env.Binary, "uvn", verb, "--uid", uid); err != nil {
				return err
			}
		}
		if variant == Enforced {
			return nil
		}
		// The baseline's processes are stray (setpriv, no login): with any
		// user's network on the node, the device guard would judge them
		// (a user's stray listener takes no connection from the network)
		// and the baseline would not be the path without uvn.
		out, err := env.run(ctx, n.Name, "", env.Binary, "uvn", "status")
		if err != nil {
			return err
		}
		if !strings.Contains(out, "node: no node-wide objects") {
			return fmt.Errorf("baseline on %s: uvn still has node-wide objects (another user's network: the device guard would judge the baseline's stray processes):\n%s", n.Name, out)
		}
		return nil
	})
}

func (d *uvnDriver) Restore(ctx context.Context, env *Env) error { return d.Set(ctx, env, Baseline) }

// Wrap: in the VM's uvn testbed every command run as a user is a login
// (the VM agent wraps it in `palisade uvn login`, as PAM does for ssh), so
// the mode variant runs as the user unchanged, and the baseline variant
// runs as root and drops to the user with setpriv: same uid, gid and
// groups, but no login, hence no VRF.
func (*uvnDriver) Wrap(variant, user string, argv []string) (string, []string) {
	uid, ok := uvnUsers[user]
	if variant == Enforced || !ok {
		return user, argv
	}
	script := fmt.Sprintf(`exec setpriv --reuid=%[1]s --regid=$(id -g %[2]s) --init-groups -- "$@"`, uid, user)
	return "", append([]string{"sh", "-c", script, "uvn-baseline"}, argv...)
}

// SetupUsers runs the scale test on node.
func (*uvnDriver) SetupUsers(ctx context.Context, env *Env, node string, n int) ([]float64, []float64, int, string, error) {
	out, err := env.run(ctx, node, "", env.LabBinary, "bench", "uvnsetup",
		"--first", strconv.Itoa(UVNScaleUIDBase), "-n", strconv.Itoa(n))
	if err != nil {
		return nil, nil, 0, "", err
	}
	var r UVNScaleResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return nil, nil, 0, "", fmt.Errorf("uvnsetup output: %w", err)
	}
	return r.SetupMS, r.TeardownMS, len(r.Leftovers), r.Failed, nil
}

// UVNDriver measures uvn (per-user VRFs) in the VM testbed.
func UVNDriver() Driver { return &uvnDriver{} }
