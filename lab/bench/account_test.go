package bench

import (
	"math"
	"strings"
	"testing"
)

func TestRatioCI(t *testing.T) {
	if lo, hi := ratioCI([]float64{1.1}); !math.IsNaN(lo) || !math.IsNaN(hi) {
		t.Fatalf("one pair must give no interval, got %v–%v", lo, hi)
	}
	lo, hi := ratioCI([]float64{1.04, 1.04, 1.04})
	if math.Abs(lo-1.04) > 1e-9 || math.Abs(hi-1.04) > 1e-9 {
		t.Fatalf("identical pairs: %v–%v", lo, hi)
	}
	// log-ratios ±0.1 around 0, n = 2: mean 0, sd 0.1414, t = 12.706.
	lo, hi = ratioCI([]float64{math.Exp(0.1), math.Exp(-0.1)})
	h := 12.706 * 0.1 * math.Sqrt2 / math.Sqrt2
	if math.Abs(math.Log(hi)-h) > 1e-3 || math.Abs(math.Log(lo)+h) > 1e-3 {
		t.Fatalf("n=2: %v–%v, want ±%v in log", lo, hi, h)
	}
}

func TestCIVerdict(t *testing.T) {
	f := func(r, lo, hi float64) Figure {
		return Figure{Series: "s", Ratio: r, CILo: lo, CIHi: hi}
	}
	for _, c := range []struct {
		fs    []Figure
		upper bool
		want  string
	}{
		{[]Figure{f(1.01, 1.00, 1.03), f(1.02, 1.01, 1.04)}, true, VerdictMet},
		{[]Figure{f(1.01, 1.00, 1.03), f(1.2, 1.1, 1.3)}, true, VerdictNotMet},
		{[]Figure{f(1.01, 0.8, 1.3), f(1.02, 1.01, 1.04)}, true, VerdictUnresolved},
		{[]Figure{f(1.0, math.NaN(), math.NaN())}, true, VerdictUnresolved},
	} {
		if got, m := ciVerdict(c.fs, 1.05, c.upper); got != c.want {
			t.Errorf("%v upper=%v: %s (%s), want %s", c.fs, c.upper, got, m, c.want)
		}
	}
	if v, _ := ciVerdict([]Figure{f(1.0, 0.995, 1.01)}, 0.99, false); v != VerdictMet {
		t.Errorf("lower limit: %s", v)
	}
	if v, _ := ciVerdict([]Figure{f(0.9, 0.85, 0.95)}, 0.99, false); v != VerdictNotMet {
		t.Errorf("lower limit below: %s", v)
	}
}

// TestSingleCopy: on a shared hook every invocation runs every node's
// copy; the work nodes' early exits are removed using an uninvolved node's
// copy, per-interface programs are taken as counted.
func TestSingleCopy(t *testing.T) {
	c := Cost{Ops: 100, Progs: []ProgCost{
		// connect: 100 invocations, each runs all three copies; node1's is
		// the real check (300 ns), node2's and node3's exit (50 ns).
		{Node: "node1", Work: true, Name: "p_connect", Type: "CGroupSockAddr", RunNS: 100 * 300, RunCnt: 100},
		{Node: "node2", Work: true, Name: "p_connect", Type: "CGroupSockAddr", RunNS: 100 * 50, RunCnt: 100},
		{Node: "node3", Work: false, Name: "p_connect", Type: "CGroupSockAddr", RunNS: 100 * 50, RunCnt: 100},
		// tc: per interface, 4 packets per op on each work node.
		{Node: "node1", Work: true, Name: "p_tc", Type: "SchedCLS", RunNS: 400 * 100, RunCnt: 400},
		{Node: "node2", Work: true, Name: "p_tc", Type: "SchedCLS", RunNS: 400 * 120, RunCnt: 400},
		{Node: "node3", Work: false, Name: "p_tc", Type: "SchedCLS", RunNS: 0, RunCnt: 0},
	}}
	got := map[string]progCost{}
	for _, p := range singleCopy(c) {
		got[p.name] = p
	}
	if p := got["p_connect"]; math.Abs(p.nsOp-300) > 1e-9 || p.runsOp != 1 || !p.shared || p.otherNSOp != 50 {
		t.Errorf("shared hook: %+v, want 300 ns/op, 1 run/op, other 50", p)
	}
	if p := got["p_tc"]; math.Abs(p.nsOp-880) > 1e-9 || p.runsOp != 8 || p.shared {
		t.Errorf("tc: %+v, want 880 ns/op over 8 runs", p)
	}
	u := summarizeCosts([]Cost{c})
	if math.Abs(u.single.Median-1180) > 1e-9 || math.Abs(u.measured.Median-1230) > 1e-9 || u.other.Median != 50 {
		t.Errorf("unit: single %v measured %v other %v", u.single.Median, u.measured.Median, u.other.Median)
	}
	if !strings.HasPrefix(u.perPacketBy, "p_") {
		t.Errorf("per-packet hook not found: %+v", u)
	}
}

// TestFloor: each program's time above the floor is its time less, for
// every run, the empty program's time per run at the same hook (the work
// nodes' probes, and the shared hooks' one); a hook without a probe keeps
// its time as counted, and the unit is then not "floored".
func TestFloor(t *testing.T) {
	c := Cost{Ops: 100, Progs: []ProgCost{
		// shared hook: node1 checks (300 ns), node2 and node3 exit (50 ns);
		// the probe runs once per invocation at 40 ns.
		{Node: "node1", Work: true, Name: "p_connect", Type: "CGroupSockAddr", Hook: "CGroupInet4Connect", RunNS: 100 * 300, RunCnt: 100},
		{Node: "node2", Work: true, Name: "p_connect", Type: "CGroupSockAddr", Hook: "CGroupInet4Connect", RunNS: 100 * 50, RunCnt: 100},
		{Node: "node3", Work: false, Name: "p_connect", Type: "CGroupSockAddr", Hook: "CGroupInet4Connect", RunNS: 100 * 50, RunCnt: 100},
		{Work: true, Name: floorPrefix + "CGroupInet4Connect", Type: "CGroupSockAddr", Hook: "CGroupInet4Connect", Floor: true, RunNS: 100 * 40, RunCnt: 100},
		// tc: 4 packets per op on each work node at 100 ns; the work
		// nodes' probes 60 and 80 ns per run, an idle node's probe ignored.
		{Node: "node1", Work: true, Name: "p_tc", Type: "SchedCLS", Hook: "TCXEgress", RunNS: 400 * 100, RunCnt: 400},
		{Node: "node2", Work: true, Name: "p_tc", Type: "SchedCLS", Hook: "TCXEgress", RunNS: 400 * 100, RunCnt: 400},
		{Node: "node1", Work: true, Name: floorPrefix + "TCXEgress", Type: "SchedCLS", Hook: "TCXEgress", Floor: true, RunNS: 400 * 60, RunCnt: 400},
		{Node: "node2", Work: true, Name: floorPrefix + "TCXEgress", Type: "SchedCLS", Hook: "TCXEgress", Floor: true, RunNS: 400 * 80, RunCnt: 400},
		{Node: "node3", Work: false, Name: floorPrefix + "TCXEgress", Type: "SchedCLS", Hook: "TCXEgress", Floor: true, RunNS: 1000, RunCnt: 1},
	}}
	got := map[string]progCost{}
	for _, p := range singleCopy(c) {
		got[p.name] = p
	}
	if len(got) != 2 {
		t.Fatalf("floor probes taken for data-plane programs: %+v", got)
	}
	if p := got["p_connect"]; math.Abs(p.floorRun-40) > 1e-9 || math.Abs(p.aboveOp-260) > 1e-9 {
		t.Errorf("shared hook: %+v, want floor 40, 260 ns/op above", p)
	}
	if p := got["p_tc"]; math.Abs(p.floorRun-70) > 1e-9 || math.Abs(p.aboveOp-8*30) > 1e-9 {
		t.Errorf("tc: %+v, want floor 70, 240 ns/op above", p)
	}
	u := summarizeCosts([]Cost{c})
	if !u.floored || math.Abs(u.above.Median-500) > 1e-9 || math.Abs(u.perPacketAbove-260) > 1e-9 || u.perPacketAboveBy != "p_connect" {
		t.Errorf("unit: %+v, want 500 ns/op above the floor, 260 ns per run above (p_connect)", u)
	}
	// The probes are not the data plane's time.
	if math.Abs(u.measured.Median-1150) > 1e-9 || math.Abs(u.other.Median-50) > 1e-9 {
		t.Errorf("as counted %v, other nodes %v: want 1150 and 50 (probes excluded)", u.measured.Median, u.other.Median)
	}
	// Without probes: as counted, not floored.
	var bare Cost
	bare.Ops = c.Ops
	for _, p := range c.Progs {
		if !p.Floor {
			bare.Progs = append(bare.Progs, p)
		}
	}
	if u := summarizeCosts([]Cost{bare}); u.floored || math.Abs(u.above.Median-u.single.Median) > 1e-9 {
		t.Errorf("no probes: floored=%v above %v single %v", u.floored, u.above.Median, u.single.Median)
	}
}

// TestAccountingPass: when the programs were counted in an accounting pass
// of their own (AcctOps), every per-operation eBPF figure is divided by that
// pass's operations, not by the measured pass's.
func TestAccountingPass(t *testing.T) {
	progs := []ProgCost{
		{Node: "node1", Work: true, Name: "p_tc", Type: "SchedCLS", Hook: "TCXEgress", RunNS: 400 * 100, RunCnt: 400},
		{Node: "node1", Work: true, Name: floorPrefix + "TCXEgress", Type: "SchedCLS", Hook: "TCXEgress", Floor: true, RunNS: 400 * 60, RunCnt: 400},
	}
	same := summarizeCosts([]Cost{{Ops: 100, Progs: progs}})
	apart := summarizeCosts([]Cost{{Ops: 250, AcctOps: 100, Progs: progs}})
	for _, u := range []unitCost{same, apart} {
		if math.Abs(u.measured.Median-400) > 1e-9 || math.Abs(u.above.Median-160) > 1e-9 {
			t.Errorf("as counted %v, above the floor %v: want 400 and 160 ns per operation", u.measured.Median, u.above.Median)
		}
	}
	if (Cost{Ops: 250}).ProgOps() != 250 || (Cost{Ops: 250, AcctOps: 100}).ProgOps() != 100 {
		t.Error("ProgOps: want AcctOps when set, else Ops")
	}
}
