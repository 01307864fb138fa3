package bench

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
)

// Suites a mode can run.
const (
	SuiteThroughput = "throughput" // iperf3 TCP 1..8 streams, UDP fixed load
	SuiteLatency    = "latency"    // request/response 1 B .. 64 KiB
	SuiteConn       = "conn"       // N threads × new connections
	SuiteMPI        = "mpi"        // ping-pong and allreduce, 2 and 3 nodes
	SuiteScale      = "scale"      // userwall: verdict cost vs users/held connections
	SuiteSetup      = "setup"      // uvn: per-user setup time vs users
	SuiteEgress     = "egress"     // gateway vs direct, 1..20 transfers
	SuiteUDP        = "udp"        // small-datagram rate and UDP round trips
	SuiteApps       = "apps"       // real applications: iperf3, redis, pgbench, MPI, HTTP/3
)

// Proc is a data-plane process whose footprint is recorded.
type Proc struct {
	Node string
	Name string // e.g. "agent", "gateway"
	PID  int
}

// Driver plugs a data plane into the bench. A driver switches its data
// plane off (Baseline) and on (Enforced) between rounds on one testbed, so
// both are measured on the same machine state, interleaved.
type Driver interface {
	// Requires says what testbed the mode needs.
	Requires() Requirements
	// Prepare checks that the mode can run on env. Return Skip(reason)
	// when its data plane is not available; any other error fails the mode.
	Prepare(ctx context.Context, env *Env) error
	// Set switches the data plane to variant (Baseline or Enforced).
	Set(ctx context.Context, env *Env, variant string) error
	// Restore leaves the testbed as Prepare found it.
	Restore(ctx context.Context, env *Env) error
	// Processes lists the data plane's processes (for the footprint).
	Processes(ctx context.Context, env *Env) []Proc
	// Wrap returns the user and argv that run argv as user in the given
	// variant (e.g. inside the user's VRF); most drivers change nothing.
	Wrap(variant, user string, argv []string) (string, []string)
	// Suites lists what is measured for this mode.
	Suites() []string
	// BaselineText describes what the mode is compared against.
	BaselineText() string
}

// Requirements of a mode's testbed.
type Requirements struct {
	TestbedMode string // the testbed's --mode ("" = any)
	VM          bool   // runs in the VRF-capable VM testbed
	Egress      bool   // needs the --egress extension
}

// SkipError marks a mode that cannot run here, with the reason.
type SkipError struct{ Reason string }

func (e *SkipError) Error() string { return "skipped: " + e.Reason }

// Skip returns a SkipError.
func Skip(format string, a ...any) error { return &SkipError{Reason: fmt.Sprintf(format, a...)} }

// IsSkip reports whether err is a SkipError and returns its reason.
func IsSkip(err error) (string, bool) {
	var s *SkipError
	if errors.As(err, &s) {
		return s.Reason, true
	}
	return "", false
}

var (
	drvMu   sync.Mutex
	drivers = map[string]Driver{"none": &noneDriver{}}
)

// RegisterDriver makes a mode available to `palisade-lab bench --modes`.
func RegisterDriver(name string, d Driver) {
	drvMu.Lock()
	defer drvMu.Unlock()
	drivers[name] = d
}

// Known modes: registered or not, these names are accepted so that a mode
// whose data plane has not landed is reported as skipped, not as a typo.
var knownModes = []string{"none", "userwall", "uvn", "egress"}

// lookupDriver returns the driver of a mode, or a skip/unknown error.
func lookupDriver(name string) (Driver, error) {
	drvMu.Lock()
	d, ok := drivers[name]
	drvMu.Unlock()
	if ok {
		return d, nil
	}
	for _, k := range knownModes {
		if k == name {
			return nil, Skip("the %s data plane is not built into this binary yet", name)
		}
	}
	return nil, fmt.Errorf("unknown mode %q (known: %v)", name, ModeNames())
}

// ModeNames lists every mode name the bench accepts.
func ModeNames() []string {
	drvMu.Lock()
	defer drvMu.Unlock()
	set := map[string]bool{}
	for _, k := range knownModes {
		set[k] = true
	}
	for k := range drivers {
		set[k] = true
	}
	var out []string
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// AvailableModes lists the modes whose driver is built in.
func AvailableModes() []string {
	drvMu.Lock()
	defer drvMu.Unlock()
	var out []string
	for k := range drivers {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// noneDriver is the A/A run: both variants are the plain testbed, so its
// ratios show the noise floor of this machine for every figure. On a
// testbed brought up with a data plane, that plane is switched off for the
// run (through its own driver) and back on afterwards.
type noneDriver struct{ other Driver }

func (*noneDriver) Requires() Requirements { return Requirements{} }

func (n *noneDriver) Prepare(ctx context.Context, env *Env) error {
	n.other = nil
	if env.Mode == "" || env.Mode == "none" {
		return nil
	}
	d, err := lookupDriver(env.Mode)
	if err != nil {
		return Skip("testbed %s runs mode %s, which the bench cannot switch off: %v", env.Name, env.Mode, err)
	}
	if err := d.Prepare(ctx, env); err != nil {
		return err
	}
	if err := d.Set(ctx, env, Baseline); err != nil {
		_ = d.Restore(ctx, env)
		return fmt.Errorf("switch %s off for the A/A run: %w", env.Mode, err)
	}
	n.other = d
	return nil
}

func (*noneDriver) Set(context.Context, *Env, string) error { return nil }

func (n *noneDriver) Restore(ctx context.Context, env *Env) error {
	if n.other == nil {
		return nil
	}
	err := n.other.Restore(ctx, env)
	n.other = nil
	return err
}

func (*noneDriver) Processes(context.Context, *Env) []Proc { return nil }
func (*noneDriver) Wrap(_, user string, argv []string) (string, []string) {
	return user, argv
}
func (*noneDriver) BaselineText() string { return "the same testbed (A/A run: the noise floor)" }

// AdjustPlan: the A/A run only shows the noise floor; two rounds do.
func (*noneDriver) AdjustPlan(p Plan, quick bool) Plan {
	p.Rounds = min(p.Rounds, 2)
	return p
}

func (*noneDriver) Suites() []string {
	return []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteUDP, SuiteMPI}
}
