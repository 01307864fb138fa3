package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// Options of a bench run.
type Options struct {
	Quick bool
	Modes []string // default: every mode the bench knows
	Out   string   // output directory (default docs/benchmarks)
	Name  string   // testbed instance on this machine
	// VMName is the VRF-capable VM testbed the uvn mode runs in.
	VMName string
	Rounds int      // override the plan's rounds
	Suites []string // run only these suites (default all of each mode)
	Plan   *Plan    // override the whole plan
	Log    io.Writer
	// Keep leaves testbeds the bench brought up itself running.
	Keep bool
	// Merge keeps the other modes of an existing results.json in Out and
	// replaces only the modes run now (to re-run one mode).
	Merge bool
	// Opener opens (or brings up) the testbed a mode needs; nil = the
	// real testbed (OpenTestbed).
	Opener Opener
}

// Opener returns the Env for a mode's requirements and a function that
// releases it (taking down a testbed the bench brought up).
type Opener func(ctx context.Context, o *Options, req Requirements, log io.Writer) (*Env, func(context.Context) error, error)

// DefaultModes are run when --modes is not given.
var DefaultModes = []string{"none", "userwall", "uvn", "egress"}

// Run measures every mode against its baseline and writes the results.
func Run(ctx context.Context, o Options) (*Results, error) {
	if o.Log == nil {
		o.Log = io.Discard
	}
	if len(o.Modes) == 0 {
		o.Modes = DefaultModes
	}
	for _, m := range o.Modes {
		if _, err := lookupDriver(m); err != nil {
			if _, skip := IsSkip(err); !skip {
				return nil, err
			}
		}
	}
	for _, s := range o.Suites {
		if !slices.Contains(allSuites, s) {
			return nil, fmt.Errorf("unknown suite %q (known: %s)", s, strings.Join(allSuites, ", "))
		}
	}
	plan := FullPlan()
	if o.Quick {
		plan = QuickPlan()
	}
	if o.Plan != nil {
		plan = *o.Plan
	}
	if o.Rounds > 0 {
		plan.Rounds = o.Rounds
	}
	if o.Opener == nil {
		o.Opener = OpenTestbed
	}
	res := &Results{Started: time.Now().UTC(), Quick: o.Quick, Machine: DescribeMachine(), Plan: plan, Extra: map[string]string{}}
	// Run-time statistics of eBPF programs: on only for the accounting
	// passes of the mode rounds (they cost two clock reads per program run,
	// which the measured passes must not pay).
	stats := newBPFStats()
	defer stats.off()
	if stats.Problem != nil {
		res.Extra["bpf_stats"] = "unavailable: " + stats.Problem.Error()
		fmt.Fprintf(o.Log, "bench: eBPF run-time statistics unavailable: %v\n", stats.Problem)
	} else {
		res.Extra["bpf_stats"] = stats.Method
	}
	// Modes on this machine share one testbed, VM modes share the VM
	// testbed; each is brought up (if needed) with what all its modes need.
	type opened struct {
		env     *Env
		release func(context.Context) error
		err     error
	}
	need := map[bool]Requirements{}
	for _, m := range o.Modes {
		if d, err := lookupDriver(m); err == nil {
			r := d.Requires()
			u := need[r.VM]
			u.VM = r.VM
			u.Egress = u.Egress || r.Egress
			if u.TestbedMode == "" {
				u.TestbedMode = r.TestbedMode
			}
			need[r.VM] = u
		}
	}
	envs := map[bool]*opened{}
	defer func() {
		for _, op := range envs {
			if op.release != nil {
				if err := op.release(context.WithoutCancel(ctx)); err != nil {
					fmt.Fprintf(o.Log, "bench: releasing testbed: %v\n", err)
				}
			}
		}
	}()
	mpi := map[*Env]string{}
	for _, mode := range o.Modes {
		if ctx.Err() != nil {
			break
		}
		st := ModeStatus{Name: mode}
		t0 := time.Now()
		d, err := lookupDriver(mode)
		if err == nil {
			st.Baseline = d.BaselineText()
			vm := d.Requires().VM
			op := envs[vm]
			if op == nil {
				op = &opened{}
				op.env, op.release, op.err = o.Opener(ctx, &o, need[vm], o.Log)
				envs[vm] = op
			}
			err = op.err
			if err == nil {
				st.Testbed = op.env.Name
				err = runMode(ctx, &o, plan, d, mode, op.env, res, mpi, stats)
			}
		}
		st.Seconds = time.Since(t0).Seconds()
		var pe *partialError
		if errors.As(err, &pe) {
			st.Status, st.Reason = "ran", pe.Error()
			fmt.Fprintf(o.Log, "bench: mode %s: %v\n", mode, pe)
		} else if reason, ok := IsSkip(err); ok {
			st.Status, st.Reason = "skipped", reason
			fmt.Fprintf(o.Log, "bench: mode %s skipped: %s\n", mode, reason)
		} else if err != nil {
			st.Status, st.Reason = "failed", err.Error()
			fmt.Fprintf(o.Log, "bench: mode %s failed: %v\n", mode, err)
		} else {
			st.Status = "ran"
		}
		res.Modes = append(res.Modes, st)
	}
	res.Finished = time.Now().UTC()
	if o.Merge && o.Out != "" {
		MergeInto(res, filepath.Join(o.Out, "results.json"))
	}
	res.Figures = computeFigures(res.Samples)
	res.Machine.LoadEnd = loadAvg()
	if o.Out != "" {
		if err := WriteOutputs(res, o.Out); err != nil {
			return res, err
		}
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

var allSuites = []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteUDP, SuiteMPI, SuiteScale, SuiteSetup, SuiteEgress, SuiteApps}

// runMode runs the interleaved rounds of one mode.
func runMode(ctx context.Context, o *Options, plan Plan, d Driver, mode string, env *Env, res *Results, mpi map[*Env]string, stats *bpfStats) (err error) {
	if err := d.Prepare(ctx, env); err != nil {
		return err
	}
	defer func() {
		if rerr := d.Restore(context.WithoutCancel(ctx), env); rerr != nil && err == nil {
			err = fmt.Errorf("restore %s: %w", mode, rerr)
		}
	}()
	suites := d.Suites()
	if len(o.Suites) > 0 {
		suites = slices.DeleteFunc(slices.Clone(suites), func(s string) bool { return !slices.Contains(o.Suites, s) })
	}
	if len(suites) == 0 {
		return Skip("none of the selected suites applies to mode %s", mode)
	}
	if slices.Contains(suites, SuiteMPI) || (slices.Contains(suites, SuiteApps) && plan.AppSeconds > 0) {
		if _, ok := mpi[env]; !ok {
			p, err := buildMPI(ctx, env)
			if err != nil {
				fmt.Fprintf(o.Log, "bench: MPI suite unavailable: %v\n", err)
				res.Errors = append(res.Errors, fmt.Sprintf("%s: mpi: %v", mode, err))
			}
			mpi[env] = p
		}
	}
	if pa, ok := d.(PlanAdjuster); ok {
		plan = pa.AdjustPlan(plan, o.Quick)
		if o.Rounds > 0 {
			plan.Rounds = o.Rounds
		}
	}
	fmt.Fprintf(o.Log, "bench: mode %s on testbed %s: %d rounds of %s\n", mode, env.Name, plan.Rounds, strings.Join(suites, ", "))
	failures := 0
	for r := 1; r <= plan.Rounds; r++ {
		for _, v := range []string{Baseline, Enforced} {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := d.Set(ctx, env, v); err != nil {
				err = fmt.Errorf("round %d: switch to %s: %w", r, v, err)
				if r > 1 && hasSamples(res, mode) {
					// Keep the rounds that completed: report them, and why
					// the run stopped.
					res.Errors = append(res.Errors, fmt.Sprintf("%s: %v", mode, err))
					return &partialError{err: err, rounds: r - 1}
				}
				return err
			}
			s := &session{ctx: ctx, env: env, plan: plan, drv: d, mode: mode, variant: v, round: r,
				res: res, log: o.Log, mpiProg: mpi[env]}
			var fp *footprint
			if v == Enforced {
				procs := d.Processes(ctx, env)
				fp = startFootprint(procs)
				switch {
				case !env.VM && stats.Problem == nil:
					// Accounted in a pass of its own before each measured
					// unit, with the statistics on and empty programs on
					// the same hooks: the floor (floor.go, measure).
					if ps := openProgs(procs); len(ps.refs) > 0 {
						ps.procs, ps.stats = procs, stats
						s.progs = ps
					}
				case env.VM && mode == "uvn":
					// The guest's programs, read inside the guest.
					s.progs = newVMProgs(ctx, env)
					noteOnce(res, "bpf_stats", "uvn: kernel.bpf_stats_enabled in the VM's guest, read on each node by `palisade-lab bench progstats`")
				}
			}
			t0 := time.Now()
			errs := s.runSuites(suites)
			if s.progs != nil {
				s.progs.close()
			}
			if fp != nil {
				for _, f := range fp.finish() {
					f.Mode, f.Round = mode, r
					res.Foot = append(res.Foot, f)
				}
			}
			fmt.Fprintf(o.Log, "bench: %s round %d/%d %s: %.1fs\n", mode, r, plan.Rounds, v, time.Since(t0).Seconds())
			for _, e := range errs {
				msg := fmt.Sprintf("%s round %d %s: %v", mode, r, v, e)
				fmt.Fprintln(o.Log, "bench: "+msg)
				res.Errors = append(res.Errors, msg)
				failures++
			}
		}
	}
	if failures > 0 && !hasSamples(res, mode) {
		return errors.New("every measurement failed (see errors)")
	}
	return nil
}

// noteOnce adds a line to res.Extra[key] unless it is there already.
func noteOnce(res *Results, key, line string) {
	lines := strings.Split(res.Extra[key], "; ")
	if res.Extra[key] == "" {
		lines = nil
	}
	if !slices.Contains(lines, line) {
		res.Extra[key] = strings.Join(append(lines, line), "; ")
	}
}

func hasSamples(res *Results, mode string) bool {
	for _, s := range res.Samples {
		if s.Mode == mode {
			return true
		}
	}
	return false
}

// partialError: a mode stopped after some complete rounds.
type partialError struct {
	err    error
	rounds int
}

func (e *partialError) Error() string {
	return fmt.Sprintf("partial: %d complete round(s), then %v", e.rounds, e.err)
}

// PlanAdjuster is implemented by modes whose runs are slower (the VM,
// many paths) and need fewer rounds or points to fit the run's time.
type PlanAdjuster interface {
	AdjustPlan(p Plan, quick bool) Plan
}

// session is one measured set: one mode, one variant, one round.
type session struct {
	ctx       context.Context
	env       *Env
	plan      Plan
	drv       Driver
	mode      string
	variant   string
	round     int
	res       *Results
	log       io.Writer
	mpiProg   string
	servers   []*server
	iperfRuns int // iperf3 clients run: which server is next
	// progs are the data plane's eBPF programs (mode rounds; nil if none
	// or without run-time statistics).
	progs accounting
}

func (s *session) emit(bench, series string, x float64, metric string, v float64, note string) {
	s.res.Samples = append(s.res.Samples, Sample{Mode: s.mode, Variant: s.variant, Round: s.round,
		Bench: bench, Series: series, X: x, Metric: metric, Value: v, Note: note})
}

// wrap applies the driver's per-variant command wrapper.
func (s *session) runAs(node, user string, argv ...string) (string, error) {
	u, a := s.drv.Wrap(s.variant, user, argv)
	return s.env.run(s.ctx, node, u, a...)
}

// startAs starts a server the way runAs runs a client.
func (s *session) startAs(node, user string, argv ...string) (*server, error) {
	u, a := s.drv.Wrap(s.variant, user, argv)
	return s.env.startServer(s.ctx, node, u, a...)
}

// runSuites runs the selected suites, keeping going after a failure so
// that one broken measurement does not hide the others.
func (s *session) runSuites(suites []string) []error {
	var errs []error
	needServers := false
	for _, su := range suites {
		switch su {
		case SuiteThroughput, SuiteLatency, SuiteConn, SuiteScale, SuiteUDP, SuiteApps:
			needServers = true
		}
	}
	if needServers {
		if err := s.startServers(); err != nil {
			return []error{err}
		}
		defer s.stopServers()
		if err := s.verifyEnforcement(); err != nil {
			return []error{err}
		}
	}
	for _, su := range suites {
		var err error
		switch su {
		case SuiteThroughput:
			err = s.throughput()
		case SuiteLatency:
			err = s.latency()
		case SuiteUDP:
			err = s.udp()
		case SuiteConn:
			err = s.conn()
		case SuiteMPI:
			err = s.mpi()
		case SuiteScale:
			err = s.scale()
		case SuiteSetup:
			// Setup times need no baseline and are slow (in the VM): once.
			if s.variant == Enforced && s.round == 1 {
				err = s.setup()
			}
		case SuiteEgress:
			err = s.egress()
		case SuiteApps:
			err = s.apps()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", su, err))
		}
	}
	return errs
}

// CrossUserDenier is implemented by data planes that refuse one user's
// connection to another user's listener (userwall). Before measuring, the
// bench checks that the refusal happens in the mode rounds and not in the
// baseline rounds: numbers from a data plane that is not in force would
// be meaningless.
type CrossUserDenier interface {
	DeniesCrossUser() bool
}

// OtherUser connects to the bench user's listeners in the enforcement check.
const OtherUser = "bob"

func (s *session) verifyEnforcement() error {
	cd, ok := s.drv.(CrossUserDenier)
	if !ok || !cd.DeniesCrossUser() {
		return nil
	}
	client, _, cross, err := s.paths()
	if err != nil {
		return err
	}
	rs, err := s.connRun(client.Name, OtherUser, netip.AddrPortFrom(cross, PortCheck), []int{1}, 3)
	if err != nil {
		return fmt.Errorf("enforcement check: %w", err)
	}
	denied := len(rs) == 1 && rs[0].OK == 0
	switch {
	case s.variant == Enforced && !denied:
		return fmt.Errorf("enforcement check: %s reached %s's listener on %s (%d of %d connections) with %s on: the data plane is not in force", OtherUser, BenchUser, cross, rs[0].OK, rs[0].Conns, s.mode)
	case s.variant == Baseline && denied:
		return fmt.Errorf("enforcement check: %s could not reach %s's listener in the baseline (%s): the data plane is still in force", OtherUser, BenchUser, rs[0].FirstErr)
	}
	return nil
}

// MergeInto adds to res the modes of an earlier results file that res did
// not run, so one mode can be re-measured without re-running the others.
func MergeInto(res *Results, path string) {
	old, err := LoadResults(path)
	if err != nil {
		return
	}
	now := map[string]bool{}
	for _, m := range res.Modes {
		now[m.Name] = true
	}
	// Each kept mode says which run measured it, on what load (the header
	// describes this run only).
	kind := "full"
	if old.Quick {
		kind = "quick"
	}
	from := fmt.Sprintf("measured in the run of %s (%s, %d rounds; load average at start %s, at end %s)",
		old.Started.UTC().Format("2006-01-02 15:04 MST"), kind, old.Plan.Rounds, old.Machine.LoadStart, old.Machine.LoadEnd)
	var modes []ModeStatus
	for _, m := range old.Modes {
		if !now[m.Name] {
			if !mergedFrom(m) {
				m.Reason = strings.TrimSpace(m.Reason + " " + from)
			}
			modes = append(modes, m)
		}
	}
	res.Modes = append(modes, res.Modes...)
	for _, s := range old.Samples {
		if !now[s.Mode] {
			res.Samples = append(res.Samples, s)
		}
	}
	for _, f := range old.Foot {
		if !now[f.Mode] {
			res.Foot = append(res.Foot, f)
		}
	}
	for _, c := range old.Costs {
		if !now[c.Mode] {
			res.Costs = append(res.Costs, c)
		}
	}
	for _, e := range old.Errors {
		keep := true
		for m := range now {
			if strings.HasPrefix(e, m+" ") || strings.HasPrefix(e, m+":") {
				keep = false
			}
		}
		if keep {
			res.Errors = append(res.Errors, e)
		}
	}
	if res.Extra == nil {
		res.Extra = map[string]string{}
	}
	res.Extra["merged"] = fmt.Sprintf("modes %v from this run; the others as noted in the modes table", keys(now))
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// mergedFrom tells whether a mode's status says MergeInto kept it from an
// earlier run.
func mergedFrom(m ModeStatus) bool {
	return strings.Contains(m.Reason, "measured in the run of") || strings.Contains(m.Reason, "from the previous committed run")
}

// Remerge rebuilds res on top of another results file: res keeps only the
// modes its own run measured, and takes every other mode from path (for
// two committed runs of different modes that land one after the other).
func Remerge(res *Results, path string) {
	own := map[string]bool{}
	var modes []ModeStatus
	for _, m := range res.Modes {
		if !mergedFrom(m) {
			own[m.Name] = true
			modes = append(modes, m)
		}
	}
	res.Modes = modes
	res.Samples = slices.DeleteFunc(res.Samples, func(s Sample) bool { return !own[s.Mode] })
	res.Foot = slices.DeleteFunc(res.Foot, func(f Footprint) bool { return !own[f.Mode] })
	res.Costs = slices.DeleteFunc(res.Costs, func(c Cost) bool { return !own[c.Mode] })
	res.Errors = slices.DeleteFunc(res.Errors, func(e string) bool {
		for m := range own {
			if strings.HasPrefix(e, m+" ") || strings.HasPrefix(e, m+":") {
				return false
			}
		}
		return true
	})
	MergeInto(res, path)
	res.Figures = computeFigures(res.Samples)
}
