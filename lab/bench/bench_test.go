package bench

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// testbedName is this package's own testbed instance (go test runs
// packages in parallel; every package that needs a testbed has its own).
var testbedName = testbed.RunName("bn")

func TestSummarizeAndRatios(t *testing.T) {
	s := Summarize([]float64{3, 1, 2, math.NaN(), 5})
	if s.Median != 2.5 || s.Min != 1 || s.Max != 5 || s.N != 4 {
		t.Fatalf("Summarize = %+v", s)
	}
	if s := Summarize(nil); s.N != 0 || !math.IsNaN(s.Median) {
		t.Fatalf("empty Summarize = %+v", s)
	}
	samples := []Sample{
		{Mode: "m", Variant: Baseline, Round: 1, Bench: SuiteConn, Series: "a", X: 1, Metric: "seconds", Value: 1.0},
		{Mode: "m", Variant: Enforced, Round: 1, Bench: SuiteConn, Series: "a", X: 1, Metric: "seconds", Value: 1.1},
		{Mode: "m", Variant: Baseline, Round: 2, Bench: SuiteConn, Series: "a", X: 1, Metric: "seconds", Value: 2.0},
		{Mode: "m", Variant: Enforced, Round: 2, Bench: SuiteConn, Series: "a", X: 1, Metric: "seconds", Value: 2.4},
	}
	fs := computeFigures(samples)
	if len(fs) != 1 {
		t.Fatalf("want 1 figure, got %d", len(fs))
	}
	f := fs[0]
	if math.Abs(f.Ratio-1.75/1.5) > 1e-9 || math.Abs(f.RatioMin-1.1) > 1e-9 || math.Abs(f.RatioMax-1.2) > 1e-9 {
		t.Fatalf("ratio %v [%v–%v]", f.Ratio, f.RatioMin, f.RatioMax)
	}
	// NaN must not break JSON.
	b, err := json.Marshal(Figure{Ratio: math.NaN(), RatioMin: math.NaN(), RatioMax: math.NaN(), Baseline: Summarize(nil)})
	if err != nil || !strings.Contains(string(b), `"ratio":null`) {
		t.Fatalf("marshal: %s %v", b, err)
	}
}

// TestReportOffline renders tables and plots from synthetic samples: the
// report and plot code must work without a testbed.
func TestReportOffline(t *testing.T) {
	r := &Results{Started: time.Now(), Finished: time.Now(), Plan: QuickPlan(),
		Modes: []ModeStatus{{Name: "userwall", Status: "ran", Baseline: "agent off"}, {Name: "uvn", Status: "skipped", Reason: "no VM"}}}
	for round := 1; round <= 2; round++ {
		for _, v := range []string{Baseline, Enforced} {
			k := 1.0
			if v == Enforced {
				k = 1.04
			}
			for _, size := range []float64{1, 1024, 65536} {
				r.Samples = append(r.Samples, Sample{Mode: "userwall", Variant: v, Round: round, Bench: SuiteLatency, Series: "rr-local", X: size, Metric: "rtt_us", Value: k * (20 + size/1000)})
			}
			for _, th := range []float64{1, 2, 4} {
				r.Samples = append(r.Samples, Sample{Mode: "userwall", Variant: v, Round: round, Bench: SuiteConn, Series: "conn-local", X: th, Metric: "seconds", Value: k * th},
					Sample{Mode: "userwall", Variant: v, Round: round, Bench: SuiteConn, Series: "conn-local", X: th, Metric: "conn_rate", Value: 1000 / k})
			}
		}
	}
	r.Foot = []Footprint{{Mode: "userwall", Round: 1, Node: "node1", Process: "agent", PID: 1, CPUSec: 0.2, WallSec: 10, RSSMB: 20, HWMMB: 22}}
	r.Figures = computeFigures(r.Samples)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte("# x\n"+readmeBegin+"\nold\n"+readmeEnd+"\ntail\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteOutputs(r, dir); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"results.json", "results.md", "latency-userwall.png", "conn-userwall.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing or empty: %v", f, err)
		}
	}
	readme, _ := os.ReadFile(filepath.Join(dir, "README.md"))
	if strings.Contains(string(readme), "old") || !strings.Contains(string(readme), "tail") || !strings.Contains(string(readme), "conn-userwall.png") {
		t.Errorf("README section not refreshed:\n%s", readme)
	}
	var verdict string
	for _, tg := range r.Targets() {
		if tg.Issue == 3 && strings.Contains(tg.Goal, "localhost") {
			verdict = tg.Verdict
		}
	}
	if verdict != "met" { // 1.04 ≤ 1.05
		t.Errorf("localhost connection-setup target: %q, want met", verdict)
	}
	back, err := LoadResults(filepath.Join(dir, "results.json"))
	if err != nil || len(back.Figures) != len(r.Figures) {
		t.Fatalf("LoadResults: %v (%d figures)", err, len(back.Figures))
	}
}

func TestUnknownModeRejected(t *testing.T) {
	_, err := Run(context.Background(), Options{Modes: []string{"bogus"}, Opener: func(context.Context, *Options, Requirements, io.Writer) (*Env, func(context.Context) error, error) {
		t.Fatal("opener must not be called for a bad mode")
		return nil, nil, nil
	}})
	if err == nil || !strings.Contains(err.Error(), "unknown mode") {
		t.Fatalf("want unknown mode error, got %v", err)
	}
}

// TestQuickOnTestbed runs `palisade-lab bench --quick` on a real testbed and
// checks that the figures are produced and sane: positive values, finite
// ratios, files present. It does not judge speed. By default it measures
// none and userwall only: uvn (a second VM boot) and egress are proven by
// ./vm and ./egress/..., and their bench drivers would double CI's time;
// PALISADE_BENCH_TEST_MODES=all (or a comma list) runs them too.
func TestQuickOnTestbed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (brings up a testbed)")
	}
	if testing.Short() {
		t.Skip("-short")
	}
	want := []string{"none", "userwall"}
	switch env := os.Getenv("PALISADE_BENCH_TEST_MODES"); env {
	case "":
	case "all":
		want = DefaultModes
	default:
		want = strings.Split(env, ",")
	}
	modes := slices.DeleteFunc(slices.Clone(want), func(m string) bool { return !slices.Contains(AvailableModes(), m) })
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var log strings.Builder
	res, err := Run(ctx, Options{Quick: true, Modes: modes, Out: out, Name: testbedName, VMName: testbed.RunName("bv"), Log: &log})
	t.Log(log.String())
	if err != nil {
		t.Fatalf("bench: %v", err)
	}
	for _, m := range res.Modes {
		switch m.Status {
		case "ran":
		case "skipped":
			if m.Reason == "" {
				t.Errorf("mode %s skipped without a reason", m.Name)
			}
			if m.Name == "none" {
				t.Errorf("mode none must always run: %s", m.Reason)
			}
		default:
			t.Errorf("mode %s %s: %s", m.Name, m.Status, m.Reason)
		}
	}
	for _, f := range []string{"results.json", "results.md"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing or empty", f)
		}
	}
	byMode := map[string]int{}
	for _, f := range res.Figures {
		byMode[f.Mode]++
		// Zero is a valid measurement for these (no loss, no other node's
		// copy running).
		if f.Metric == "loss_pct" || f.Metric == "leftover" || f.Metric == "bpf_other_ns_op" {
			continue
		}
		for _, s := range []Summary{f.Baseline, f.With} {
			if s.N > 0 && !(s.Median > 0 && s.Min > 0 && s.Max >= s.Min) {
				t.Errorf("%s: implausible %+v", f.Key(), s)
			}
		}
		if f.Baseline.N > 0 && f.With.N > 0 && (math.IsNaN(f.Ratio) || math.IsInf(f.Ratio, 0) || f.Ratio <= 0) {
			t.Errorf("%s: ratio %v", f.Key(), f.Ratio)
		}
	}
	for _, m := range res.Modes {
		if m.Status != "ran" {
			continue
		}
		if byMode[m.Name] == 0 {
			t.Errorf("mode %s ran but produced no figures", m.Name)
		}
		for _, s := range []string{"latency", "conn", "throughput"} {
			p := filepath.Join(out, s+"-"+m.Name+".png")
			if m.Name == "egress" || m.Name == "uvn" {
				continue // measured differently; their own charts are checked by figures
			}
			if st, err := os.Stat(p); err != nil || st.Size() == 0 {
				t.Errorf("plot %s missing", p)
			}
		}
	}
	// The exact accounting: userwall's units carry its programs' run time,
	// attributed to nodes, and every unit the processes' CPU time.
	if slices.ContainsFunc(res.Modes, func(m ModeStatus) bool { return m.Name == "userwall" && m.Status == "ran" }) {
		progs, cpu, floorRuns := 0, 0, 0
		for _, c := range res.Costs {
			if c.Mode != "userwall" || c.Variant != Enforced {
				continue
			}
			if c.WorkNS(false) > 0 {
				progs++
			}
			if c.CPUNS() > 0 {
				cpu++
			}
			for _, p := range c.Progs {
				if (p.Node == "" && !p.Floor) || p.Name == "" || p.Type == "" {
					t.Errorf("program without node, name or type: %+v", p)
				}
				if p.Floor && p.RunCnt > 0 {
					floorRuns++
				}
				if strings.HasPrefix(p.Type, "SchedCLS") || strings.HasPrefix(p.Type, "CGroupSKB") {
					if p.Hook == "" {
						t.Errorf("packet program without its hook: %+v", p)
					}
				}
			}
		}
		// The floor: an empty program ran on the data plane's hooks.
		if floorRuns == 0 {
			t.Errorf("userwall: no floor probe ran (extra %v)", res.Extra)
		}
		if progs == 0 || cpu == 0 {
			t.Errorf("userwall: %d units with eBPF run time, %d with CPU time (extra %v)", progs, cpu, res.Extra)
		}
		md, _ := os.ReadFile(filepath.Join(out, "results.md"))
		for _, want := range []string{"In-kernel cost per operation", "Per program: conn conn-cross", "95 % CI", "in-kernel time ≤ 1.5 µs per TCP connection", "above the floor"} {
			if !strings.Contains(string(md), want) {
				t.Errorf("results.md lacks %q", want)
			}
		}
		for _, f := range res.Figures {
			if f.Mode == "userwall" && f.Metric == "seconds" && f.Baseline.N >= 2 && f.With.N >= 2 && math.IsNaN(f.CILo) {
				t.Errorf("%s: no confidence interval from %d rounds", f.Key(), f.With.N)
			}
		}
	}
	// Every suite of "none" must have produced its figures.
	for _, b := range []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteUDP, SuiteMPI} {
		n := 0
		for _, f := range res.Figures {
			if f.Mode == "none" && f.Bench == b {
				n++
			}
		}
		if n == 0 {
			t.Errorf("mode none: no %s figures (errors: %v)", b, res.Errors)
		}
	}
}
