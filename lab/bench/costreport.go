package bench

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Verdicts of a ratio judged by its confidence interval.
const (
	VerdictMet        = "met"
	VerdictNotMet     = "not met"
	VerdictUnresolved = "not resolvable on this machine"
)

// ciVerdict judges ratio figures against a limit (upper: ratio ≤ limit,
// else ratio ≥ limit) by their 95 % confidence intervals: met when every
// interval is on the right side, not met when one lies wholly on the wrong
// side, otherwise not resolvable (the machine's noise is wider than the
// margin).
func ciVerdict(fs []Figure, limit float64, upper bool) (verdict, measured string) {
	state, n, resolved := 0, 0, 0
	var bad *Figure
	for i, f := range fs {
		if math.IsNaN(f.Ratio) {
			continue
		}
		n++
		s := 1
		switch {
		case math.IsNaN(f.CILo):
		case upper && f.CIHi <= limit, !upper && f.CILo >= limit:
			s = 0
		case upper && f.CILo > limit, !upper && f.CIHi < limit:
			s = 2
		}
		if s != 1 {
			resolved++
		}
		if s > state || (s == state && bad == nil) {
			state, bad = s, &fs[i]
		}
	}
	if n == 0 {
		return "not measured", "—"
	}
	w, _ := worst(fs, upper)
	measured = fmt.Sprintf("worst %.3f× (%s, x=%g; 95 %% CI %s); %d of %d figures resolved", w.Ratio, w.Series, w.X, fmtCI(w), resolved, n)
	switch state {
	case 0:
		return VerdictMet, measured
	case 2:
		return VerdictNotMet, measured + fmt.Sprintf("; %s x=%g: CI %s", bad.Series, bad.X, fmtCI(*bad))
	}
	return VerdictUnresolved, measured
}

// sharedHook reports whether programs of this type are attached to a hook
// every node of the testbed shares (the cgroup2 root, LSM): there each
// operation runs every node's copy, and all but one leave at their
// namespace check. Per-interface programs (tc, XDP) run only in their node.
func sharedHook(typ string) bool {
	return strings.HasPrefix(typ, "CGroup") || typ == "SockOps" || typ == "LSM" || typ == "Tracing"
}

// progCost is one program's cost per operation in one unit, the copies of
// all nodes doing the work together.
type progCost struct {
	name, typ string
	hook      string
	runsOp    float64 // runs per operation on the work nodes (real ones)
	nsRun     float64 // ns per real run
	nsOp      float64 // ns per operation
	otherNSOp float64 // the other nodes' copies, per operation
	shared    bool
	// floorRun is the empty program's ns per run at the same hook in the
	// same unit (NaN: no probe there); aboveOp is nsOp less runsOp floors
	// (nsOp when there is no floor).
	floorRun float64
	aboveOp  float64
}

// floors is the ns per run of the floor probes of a unit, by hook (the
// work nodes' probes and the shared hooks' ones).
func floors(c Cost) map[string]float64 {
	ns, cnt := map[string]float64{}, map[string]float64{}
	for _, p := range c.Progs {
		if p.Floor && p.Work {
			ns[p.Hook] += float64(p.RunNS)
			cnt[p.Hook] += float64(p.RunCnt)
		}
	}
	out := map[string]float64{}
	for h, n := range cnt {
		if n > 0 {
			out[h] = ns[h] / n
		}
	}
	return out
}

// singleCopy splits a unit's program costs by program: for per-interface
// programs, the work nodes' copies; for programs on shared hooks, the work
// nodes' copies minus their early exits (every invocation runs every
// node's copy; an uninvolved node's copy counts the invocations and gives
// the cost of an early exit). The result is what the operation costs with
// one copy per host, as on a real cluster. Floor probes are not programs
// of the data plane: they give each program's floor.
func singleCopy(c Cost) []progCost {
	type acc struct {
		workNS, workCnt, otherNS, otherCnt, otherMaxCnt float64
		typ, hook                                       string
	}
	by := map[string]*acc{}
	for _, p := range c.Progs {
		if p.Floor {
			continue
		}
		a := by[p.Name]
		if a == nil {
			a = &acc{typ: p.Type, hook: p.Hook}
			by[p.Name] = a
		}
		if p.Work {
			a.workNS += float64(p.RunNS)
			a.workCnt += float64(p.RunCnt)
		} else {
			a.otherNS += float64(p.RunNS)
			a.otherCnt += float64(p.RunCnt)
			a.otherMaxCnt = math.Max(a.otherMaxCnt, float64(p.RunCnt))
		}
	}
	fl := floors(c)
	var out []progCost
	for name, a := range by {
		pc := progCost{name: name, typ: a.typ, hook: a.hook, shared: sharedHook(a.typ), otherNSOp: a.otherNS / c.ProgOps()}
		ns, cnt := a.workNS, a.workCnt
		if pc.shared && a.otherMaxCnt > 0 && a.otherCnt > 0 {
			exits := math.Max(0, cnt-a.otherMaxCnt)
			ns = math.Max(0, ns-exits*a.otherNS/a.otherCnt)
			cnt = a.otherMaxCnt
		}
		pc.nsOp, pc.runsOp = ns/c.ProgOps(), cnt/c.ProgOps()
		if cnt > 0 {
			pc.nsRun = ns / cnt
		}
		pc.floorRun, pc.aboveOp = math.NaN(), pc.nsOp
		if f, ok := fl[a.hook]; ok && a.hook != "" {
			pc.floorRun = f
			pc.aboveOp = math.Max(0, ns-cnt*f) / c.ProgOps()
		}
		if cnt > 0 || a.otherCnt > 0 {
			out = append(out, pc)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// medianFinite is the median of the values that are not NaN (NaN if none).
func medianFinite(v []float64) float64 {
	return medianOf(slices.DeleteFunc(slices.Clone(v), math.IsNaN))
}

// costKey identifies a unit across rounds.
type costKey struct {
	mode, bench, series string
	x                   float64
}

// costsOf groups a mode's costs (mode variant) by unit, in run order.
func (r *Results) costsOf(mode, variant string) (map[costKey][]Cost, []costKey) {
	by := map[costKey][]Cost{}
	var order []costKey
	for _, c := range r.Costs {
		if c.Mode != mode || c.Variant != variant || c.Ops <= 0 {
			continue
		}
		k := costKey{c.Mode, c.Bench, c.Series, c.X}
		if _, ok := by[k]; !ok {
			order = append(order, k)
		}
		by[k] = append(by[k], c)
	}
	return by, order
}

// unitCost is a unit's in-kernel cost per operation, median over rounds.
type unitCost struct {
	key          costKey
	opUnit       string
	single       Summary // eBPF ns/op on the work nodes, one copy per host
	above        Summary // the same above the floor probes' time
	floored      bool    // floor probes ran in every round
	measured     Summary // eBPF ns/op of the work nodes' copies as counted
	other        Summary // eBPF ns/op of the other nodes' copies
	progs        []progCost
	rounds       int
	perPacketMax float64 // worst ns per run among hooks running ≥ 0.5× per op
	perPacketBy  string
	// perPacketAbove: the worst ns per run above the floor (same hooks).
	perPacketAbove   float64
	perPacketAboveBy string
}

func summarizeCosts(cs []Cost) unitCost {
	u := unitCost{rounds: len(cs)}
	if len(cs) == 0 {
		return u
	}
	c0 := cs[0]
	u.key, u.opUnit = costKey{c0.Mode, c0.Bench, c0.Series, c0.X}, c0.OpUnit
	var single, above, measured, other []float64
	type pacc struct {
		runs, nsRun, nsOp, other, floor, above []float64
		typ, hook                              string
		shared                                 bool
	}
	pa := map[string]*pacc{}
	u.floored = true
	for _, c := range cs {
		s, ab := 0.0, 0.0
		floored := false
		for _, p := range singleCopy(c) {
			s += p.nsOp
			ab += p.aboveOp
			floored = floored || !math.IsNaN(p.floorRun)
			a := pa[p.name]
			if a == nil {
				a = &pacc{typ: p.typ, hook: p.hook, shared: p.shared}
				pa[p.name] = a
			}
			a.runs = append(a.runs, p.runsOp)
			a.nsRun = append(a.nsRun, p.nsRun)
			a.nsOp = append(a.nsOp, p.nsOp)
			a.other = append(a.other, p.otherNSOp)
			a.floor = append(a.floor, p.floorRun)
			a.above = append(a.above, p.aboveOp)
		}
		u.floored = u.floored && floored
		single = append(single, s)
		above = append(above, ab)
		measured = append(measured, c.WorkNS(false)/c.ProgOps())
		other = append(other, c.WorkNS(true)/c.ProgOps())
	}
	u.single, u.above, u.measured, u.other = Summarize(single), Summarize(above), Summarize(measured), Summarize(other)
	for name, a := range pa {
		p := progCost{name: name, typ: a.typ, hook: a.hook, shared: a.shared, runsOp: medianOf(a.runs), nsRun: medianOf(a.nsRun),
			nsOp: medianOf(a.nsOp), otherNSOp: medianOf(a.other), floorRun: medianFinite(a.floor), aboveOp: medianOf(a.above)}
		u.progs = append(u.progs, p)
		if p.runsOp >= 0.5 && p.nsRun > u.perPacketMax {
			u.perPacketMax, u.perPacketBy = p.nsRun, name
		}
		if p.runsOp >= 0.5 && !math.IsNaN(p.floorRun) && p.nsRun-p.floorRun > u.perPacketAbove {
			u.perPacketAbove, u.perPacketAboveBy = p.nsRun-p.floorRun, name
		}
	}
	sort.Slice(u.progs, func(i, j int) bool { return u.progs[i].nsOp > u.progs[j].nsOp })
	return u
}

// cpuPerOp is the CPU time per operation of the processes involved (load
// generator + server), baseline and mode, as a figure.
func (r *Results) cpuFigure(k costKey) (Figure, bool) {
	for _, f := range r.Figures {
		if f.Mode == k.mode && f.Bench == k.bench && f.Series == k.series && f.X == k.x && f.Metric == "cpu_us_op" {
			return f, true
		}
	}
	return Figure{}, false
}

// headlineUnits are the units whose per-program breakdown is printed: the
// smallest point of each cross-node series (and the single stream).
func headline(order []costKey) []costKey {
	first := map[string]costKey{}
	var series []string
	for _, k := range order {
		f, ok := first[k.series]
		if !ok {
			series = append(series, k.series)
		}
		if !ok || k.x < f.x {
			first[k.series] = k
		}
	}
	var out []costKey
	for _, s := range series {
		if strings.Contains(s, "cross") {
			out = append(out, first[s])
		}
	}
	return out
}

// costTables renders the in-kernel accounting of one mode.
func costTables(r *Results, mode string) string {
	by, order := r.costsOf(mode, Enforced)
	if len(order) == 0 {
		return ""
	}
	progs, apart := false, false
	for _, cs := range by {
		for _, c := range cs {
			progs = progs || len(c.Progs) > 0
			apart = apart || c.AcctOps > 0
		}
	}
	// Where the probes' and the statistics' own time went.
	probesIn := "(the probes run in the mode's rounds only, so their own time is also in the mode's wall-clock figures); "
	if apart {
		probesIn = "(statistics and probes are on only in an accounting pass that runs each unit once more just before its measured pass; " +
			"the measured pass — wall-clock figures, CPU time — runs without them); "
	}
	var b strings.Builder
	w := func(f string, a ...any) { fmt.Fprintf(&b, f, a...) }
	if !progs {
		// No data-plane programs (the A/A run): CPU per operation only,
		// whose ratios show the noise of that measurement.
		w("### CPU time per operation\n\nUser + system time of the load generator and the server per operation, median over rounds [min–max], ratio with its 95 %% CI (no data-plane programs in this mode).\n\n")
		w("| suite | series | x | per | CPU baseline (µs) | CPU mode (µs) | CPU ratio [95 %% CI] |\n|---|---|---|---|---|---|---|\n")
		for _, k := range order {
			u := summarizeCosts(by[k])
			if f, ok := r.cpuFigure(k); ok && !math.IsNaN(f.Ratio) {
				w("| %s | %s | %s | %s | %s | %s | %.3f [%s] |\n", k.bench, k.series, strconv.FormatFloat(k.x, 'f', -1, 64), u.opUnit,
					fmtSummary(f.Baseline), fmtSummary(f.With), f.Ratio, fmtCI(f))
			}
		}
		w("\n")
		return b.String()
	}
	w("### In-kernel cost per operation (exact accounting)\n\n")
	w("eBPF run time per operation from the kernel's run-time statistics (run_time_ns, run_cnt of every program the data plane's agents hold, read around each unit; %s), "+
		"median over rounds [min–max]. *one copy per host*: the nodes doing the work (client, and server across nodes), with the early exits of the other nodes' copies on shared hooks removed "+
		"(cgroup and LSM programs are attached once per host, and the testbed's nodes share one host: every operation runs every node's copy, all but one leave at the namespace check) — an upper bound, since the host's other network namespaces (other testbeds) run every copy too; "+
		"*above the floor*: the same less, for every run, the run time of an empty program the bench attached to the same hook (same interfaces, same cgroup, same attach type) in the same traffic — "+
		"what the statistics themselves (two clock reads per run) and a program's entry and exit cost; that part is not the data plane's work and vanishes with the statistics off "+
		probesIn+
		"*as counted*: the work nodes' copies including those exits; *other nodes*: the testbed's other nodes' copies. "+
		"CPU: user + system time of the load generator and the server per operation (baseline → mode, ratio with 95 %% CI).\n\n", orDash(r.Extra["bpf_stats"]))
	if fl := r.Extra["bpf_floor"]; fl != "" {
		w("Floor probes: %s.\n\n", fl)
	}
	if on := r.Extra["bpf_stats_measured"]; on != "" {
		w("Statistics: %s.\n\n", on)
	}
	w("| suite | series | x | per | eBPF above the floor (ns) | eBPF, one copy per host (ns) | eBPF as counted (ns) | other nodes (ns) | CPU baseline (µs) | CPU mode (µs) | CPU ratio [95 %% CI] |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, k := range order {
		u := summarizeCosts(by[k])
		cpuB, cpuM, cpuR := "—", "—", "—"
		if f, ok := r.cpuFigure(k); ok {
			cpuB, cpuM = fmtSummary(f.Baseline), fmtSummary(f.With)
			if !math.IsNaN(f.Ratio) {
				cpuR = fmt.Sprintf("%.3f [%s]", f.Ratio, fmtCI(f))
			}
		}
		ab := "—"
		if u.floored {
			ab = "**" + fmtSummary(u.above) + "**"
		}
		w("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", k.bench, k.series, strconv.FormatFloat(k.x, 'f', -1, 64), u.opUnit,
			ab, fmtSummary(u.single), fmtSummary(u.measured), fmtSummary(u.other), cpuB, cpuM, cpuR)
	}
	w("\n")
	for _, k := range headline(order) {
		u := summarizeCosts(by[k])
		w("#### Per program: %s %s, x = %s (per %s, %d rounds)\n\n", k.bench, k.series, strconv.FormatFloat(k.x, 'f', -1, 64), u.opUnit, u.rounds)
		w("| program | type | hook | runs per %s | ns per run | floor (ns per run) | ns per %s | above the floor (ns per %s) | other nodes' copies (ns per %s) |\n|---|---|---|---|---|---|---|---|---|\n", u.opUnit, u.opUnit, u.opUnit, u.opUnit)
		for _, p := range u.progs {
			if p.runsOp == 0 && p.otherNSOp == 0 {
				continue
			}
			name := p.name
			if p.shared {
				name += " ¹"
			}
			floor := "—"
			if !math.IsNaN(p.floorRun) {
				floor = fmt.Sprintf("%.0f", p.floorRun)
			}
			w("| %s | %s | %s | %.2f | %.0f | %s | %.0f | %.0f | %.0f |\n", name, p.typ, orDash(p.hook), p.runsOp, p.nsRun, floor, p.nsOp, p.aboveOp, p.otherNSOp)
		}
		w("| **total** | | | | | | **%.0f** | **%.0f** | %.0f |\n\n", u.single.Median, u.above.Median, u.other.Median)
	}
	w("¹ shared hook: early exits of the other nodes' copies removed (see above).\n\n")
	return b.String()
}

// costTargets are issue 14's in-kernel targets for userwall.
func (r *Results) costTargets() []Target {
	const mode = "userwall"
	by, order := r.costsOf(mode, Enforced)
	find := func(bench string, series ...string) []unitCost {
		var out []unitCost
		for _, k := range order {
			if k.bench == bench && slices.Contains(series, k.series) {
				out = append(out, summarizeCosts(by[k]))
			}
		}
		return out
	}
	verdict := func(ok bool) string {
		if ok {
			return VerdictMet
		}
		return VerdictNotMet
	}
	var ts []Target
	// Each target is judged above the floor when the floor probes ran (the
	// statistics' own clock reads are not the data plane's cost), else as
	// measured; the text gives both.
	cost := func(u unitCost) float64 {
		if u.floored {
			return u.above.Median
		}
		return u.single.Median
	}
	basis := func(u unitCost) string {
		if u.floored {
			return "above the floor"
		}
		return "as measured, no floor probes"
	}
	// Per TCP connection, cross-node, both nodes.
	t := Target{Mode: mode, Issue: 14, Goal: "in-kernel time ≤ 1.5 µs per TCP connection (cross-node, both nodes, eBPF run time)"}
	if us := find(SuiteConn, "conn-cross"); len(us) > 0 {
		w := us[0]
		for _, u := range us {
			if cost(u) > cost(w) {
				w = u
			}
		}
		t.Measured = fmt.Sprintf("worst %.2f µs %s (x=%g threads; as measured %.2f µs, as counted %.2f µs; top: %s)", cost(w)/1e3, basis(w), w.key.x,
			w.single.Median/1e3, w.measured.Median/1e3, topProgs(w, 3))
		t.Verdict = verdict(cost(w) <= 1500)
	} else {
		t.Verdict, t.Measured = "not measured", "—"
	}
	ts = append(ts, t)
	// Per established-TCP packet per hook: the smallest round trips.
	t = Target{Mode: mode, Issue: 14, Goal: "≤ 40 ns per established-TCP packet per hook (1-byte round trips across nodes)"}
	if us := find(SuiteLatency, "rr-cross"); len(us) > 0 {
		u := us[0]
		for _, x := range us {
			if x.key.x < u.key.x {
				u = x
			}
		}
		var parts []string
		for _, p := range u.progs {
			if p.runsOp >= 0.5 {
				fl := ""
				if !math.IsNaN(p.floorRun) {
					fl = fmt.Sprintf(" (floor %.0f)", p.floorRun)
				}
				parts = append(parts, fmt.Sprintf("%s %.0f ns%s × %.2f", p.name, p.nsRun, fl, p.runsOp))
			}
		}
		worst, by := u.perPacketMax, u.perPacketBy
		if u.floored {
			worst, by = u.perPacketAbove, u.perPacketAboveBy
			t.Measured = fmt.Sprintf("worst %.0f ns per run above the floor (%s); as measured worst %.0f ns (%s); per round trip: %s",
				u.perPacketAbove, orDash(u.perPacketAboveBy), u.perPacketMax, u.perPacketBy, strings.Join(parts, ", "))
		} else {
			t.Measured = fmt.Sprintf("worst %.0f ns per run (%s, no floor probes); per round trip: %s", u.perPacketMax, u.perPacketBy, strings.Join(parts, ", "))
		}
		t.Verdict = verdict(worst <= 40 && (by != "" || u.floored))
	} else {
		t.Verdict, t.Measured = "not measured", "—"
	}
	ts = append(ts, t)
	// Per UDP datagram, both ends.
	t = Target{Mode: mode, Issue: 14, Goal: "≤ 300 ns per UDP datagram including the MAC, both ends together (UDP round trips across nodes, smallest datagram)"}
	if us := find(SuiteUDP, "udprr4-cross", "udprr6-cross"); len(us) > 0 {
		min := math.Inf(1)
		for _, u := range us {
			min = math.Min(min, u.key.x)
		}
		var parts []string
		worst := 0.0
		for _, u := range us {
			if u.key.x != min {
				continue
			}
			worst = math.Max(worst, cost(u))
			parts = append(parts, fmt.Sprintf("%s %.0f ns %s (as measured %.0f ns; %s)", u.key.series, cost(u), basis(u), u.single.Median, topProgs(u, 3)))
		}
		t.Measured = fmt.Sprintf("%g B: %s", min, strings.Join(parts, "; "))
		t.Verdict = verdict(worst <= 300)
	} else {
		t.Verdict, t.Measured = "not measured", "—"
	}
	ts = append(ts, t)
	return ts
}

// topProgs names the n costliest programs of a unit (above the floor when
// the floor probes ran).
func topProgs(u unitCost, n int) string {
	ps := slices.Clone(u.progs)
	op := func(p progCost) float64 {
		if u.floored {
			return p.aboveOp
		}
		return p.nsOp
	}
	sort.SliceStable(ps, func(i, j int) bool { return op(ps[i]) > op(ps[j]) })
	var parts []string
	for i, p := range ps {
		if i >= n || op(p) <= 0 {
			break
		}
		parts = append(parts, fmt.Sprintf("%s %.0f ns", p.name, op(p)))
	}
	return strings.Join(parts, ", ")
}
