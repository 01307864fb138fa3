package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Target is one goal stated in an issue and what the run shows for it.
type Target struct {
	Mode     string `json:"mode"`
	Issue    int    `json:"issue"`
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	Verdict  string `json:"verdict"` // met | not met | not measured
	Note     string `json:"note,omitempty"`
}

func (r *Results) figs(mode, bench, series, metric string) []Figure {
	var out []Figure
	for _, f := range r.Figures {
		if f.Mode == mode && f.Bench == bench && (series == "" || f.Series == series) && f.Metric == metric {
			out = append(out, f)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Series != out[j].Series {
			return out[i].Series < out[j].Series
		}
		return out[i].X < out[j].X
	})
	return out
}

func (r *Results) ran(mode string) bool {
	for _, m := range r.Modes {
		if m.Name == mode && m.Status == "ran" {
			return true
		}
	}
	return false
}

// worst returns the figure with the largest (or smallest) ratio.
func worst(fs []Figure, largest bool) (Figure, bool) {
	var w Figure
	found := false
	for _, f := range fs {
		if math.IsNaN(f.Ratio) {
			continue
		}
		if !found || (largest && f.Ratio > w.Ratio) || (!largest && f.Ratio < w.Ratio) {
			w, found = f, true
		}
	}
	return w, found
}

// Targets checks the goals of the userwall (3), egress (5) and uvn (6)
// issues against the figures.
func (r *Results) Targets() []Target {
	var ts []Target
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "not met"
	}
	ratioTarget := func(mode string, issue int, goal string, fs []Figure, limit float64, upper bool) Target {
		t := Target{Mode: mode, Issue: issue, Goal: goal}
		if !r.ran(mode) || len(fs) == 0 {
			t.Verdict, t.Measured = "not measured", "—"
			return t
		}
		t.Verdict, t.Measured = ciVerdict(fs, limit, upper)
		return t
	}
	// userwall (issue 3)
	ts = append(ts,
		ratioTarget("userwall", 3, "connection setup ≤ 1.05× on localhost, 1–16 threads", r.figs("userwall", SuiteConn, "conn-local", "seconds"), 1.05, true),
		ratioTarget("userwall", 3, "connection setup ≤ 1.10× across nodes, 1–16 threads", r.figs("userwall", SuiteConn, "conn-cross", "seconds"), 1.10, true),
		ratioTarget("userwall", 3, "bulk TCP throughput ≥ 0.99×", append(r.figs("userwall", SuiteThroughput, "tcp-cross", "gbit_s"), r.figs("userwall", SuiteThroughput, "tcp-local", "gbit_s")...), 0.99, false),
	)
	ts = append(ts, r.rssTarget("userwall", 3, "agent", "agent resident memory ≤ 50 MB", 50))
	// userwall (issue 14): exact in-kernel time, and the wall ratios judged
	// by their confidence intervals.
	ts = append(ts, r.costTargets()...)
	ts = append(ts,
		ratioTarget("userwall", 14, "wall: connection setup ≤ 1.05× (time for all connections, localhost and across nodes)", append(r.figs("userwall", SuiteConn, "conn-local", "seconds"), r.figs("userwall", SuiteConn, "conn-cross", "seconds")...), 1.05, true),
		ratioTarget("userwall", 14, "wall: round trip ≤ 1.02× (median TCP round trip, every size, localhost and across nodes)", r.figs("userwall", SuiteLatency, "", "rtt_us"), 1.02, true),
		ratioTarget("userwall", 14, "wall: bulk TCP throughput ≥ 0.99×", append(r.figs("userwall", SuiteThroughput, "tcp-cross", "gbit_s"), r.figs("userwall", SuiteThroughput, "tcp-local", "gbit_s")...), 0.99, false),
	)
	// userwall (issue 25): real applications side by side with no Palisade.
	var appsUDP, appsRest []Figure
	for _, f := range r.figs("userwall", SuiteApps, "", "gbit_s") {
		if strings.HasPrefix(f.Series, appIperfUDP) {
			appsUDP = append(appsUDP, f)
		} else {
			appsRest = append(appsRest, f)
		}
	}
	for _, m := range []string{"ops_s", "tps", "mbit_s"} {
		appsRest = append(appsRest, r.figs("userwall", SuiteApps, "", m)...)
	}
	ts = append(ts,
		ratioTarget("userwall", 25, "apps: iperf3 UDP, 1,400 and 8,000-byte datagrams, unlimited ≥ 0.97×", appsUDP, 0.97, false),
		ratioTarget("userwall", 25, "apps: iperf3 TCP, redis-benchmark, pgbench, HTTP/3 ≥ 0.98×", appsRest, 0.98, false),
		ratioTarget("userwall", 25, "apps: MPI allreduce time ≤ 1/0.98×", r.figs("userwall", SuiteApps, appMPIAllreduc, "allreduce_us"), 1/0.98, true),
	)
	// egress (issue 5): the verdict is the default client path (tun, root
	// gateway); the other paths and the reference's stack are listed.
	for _, link := range []string{"", "@1gbit"} {
		for _, g := range []struct {
			x     float64
			limit float64
			goal  string
		}{{1, 0.9, "single transfer ≥ 0.9× direct (reference 002: 0.38×)"}, {10, 0.95, "10 transfers ≥ 0.95× direct"}} {
			t := Target{Mode: "egress", Issue: 5, Goal: g.goal}
			if link == "" {
				t.Goal += ", links as they are"
			} else {
				t.Goal += ", gateway link shaped to 1 Gbit/s as in reference 002"
			}
			var parts []string
			var main *Figure
			for _, f := range r.figs("egress", SuiteEgress, "", "mbit_s") {
				path, l, _ := strings.Cut(f.Series, "@")
				if f.X != g.x || (l != "" && "@"+l != link) || (l == "" && link != "") || math.IsNaN(f.Ratio) {
					continue
				}
				name := path
				if path == "openconnect" {
					name = "openconnect+ocserv (reference stack)"
				}
				parts = append(parts, fmt.Sprintf("%s %.2f×", name, f.Ratio))
				if path == "tun" {
					ff := f
					main = &ff
				}
			}
			if !r.ran("egress") || main == nil {
				t.Verdict, t.Measured = "not measured", "—"
			} else {
				t.Measured = strings.Join(parts, "; ")
				t.Verdict = verdict(main.Ratio >= g.limit)
			}
			ts = append(ts, t)
		}
	}
	ts = append(ts, r.rssTarget("egress", 5, "gateway", "gateway resident memory ≤ 100 MB (100 clients)", 100))
	// uvn (issue 6)
	setup := Target{Mode: "uvn", Issue: 6, Goal: "per-user setup ≤ 50 ms, flat up to 1,000 users on a node"}
	if fs := r.figs("uvn", SuiteSetup, "", "setup_ms"); r.ran("uvn") && len(fs) > 0 {
		maxMS, lo, hi := 0.0, math.Inf(1), 0.0
		var parts []string
		for _, f := range fs {
			if f.Series != "setup" {
				continue
			}
			maxMS = math.Max(maxMS, f.With.Median)
			lo, hi = math.Min(lo, f.With.Median), math.Max(hi, f.With.Median)
			parts = append(parts, fmt.Sprintf("%g users: %.1f ms", f.X, f.With.Median))
		}
		setup.Measured = strings.Join(parts, ", ")
		flat := hi <= 1.5*lo
		setup.Verdict = verdict(maxMS <= 50 && flat)
		if !flat {
			setup.Note = fmt.Sprintf("grows %.1f× from the smallest to the largest count", hi/lo)
		}
		for _, f := range r.figs("uvn", SuiteSetup, "reached", "users_reached") {
			if f.With.N > 0 && f.With.Min < f.X {
				setup.Verdict = "not met"
				setup.Note = fmt.Sprintf("only %g of %g users could be set up: %s", f.With.Min, f.X, strings.Trim(f.Notes, "[]"))
			}
		}
	} else {
		setup.Verdict, setup.Measured = "not measured", "—"
	}
	ts = append(ts, setup,
		ratioTarget("uvn", 6, "bulk throughput ≥ 0.95× of the same path without uvn in the same VM", r.figs("uvn", SuiteThroughput, "tcp-cross", "gbit_s"), 0.95, false))
	left := Target{Mode: "uvn", Issue: 6, Goal: "teardown leaves zero objects"}
	if fs := r.figs("uvn", SuiteSetup, "leftover", "leftover"); r.ran("uvn") && len(fs) > 0 {
		n := 0.0
		for _, f := range fs {
			n = math.Max(n, f.With.Max)
		}
		left.Measured = fmt.Sprintf("%g objects left at most", n)
		left.Verdict = verdict(n == 0)
	} else {
		left.Verdict, left.Measured = "not measured", "—"
	}
	ts = append(ts, left)
	return ts
}

func (r *Results) rssTarget(mode string, issue int, proc, goal string, limitMB float64) Target {
	t := Target{Mode: mode, Issue: issue, Goal: goal}
	peak := 0.0
	node := ""
	for _, f := range r.Foot {
		if f.Mode == mode && f.Process == proc && f.HWMMB > peak {
			peak, node = f.HWMMB, f.Node
		}
	}
	if peak == 0 {
		t.Verdict, t.Measured = "not measured", "—"
		return t
	}
	t.Measured = fmt.Sprintf("peak %.1f MB (%s on %s)", peak, proc, node)
	if peak <= limitMB {
		t.Verdict = "met"
	} else {
		t.Verdict = "not met"
	}
	return t
}

// WriteOutputs writes results.json, results.md and the plots into dir,
// and refreshes the results section of dir/README.md if it has one.
func WriteOutputs(r *Results, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("results.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	plots, perr := WritePlots(r, dir)
	md := Markdown(r, plots)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if err := updateReadme(filepath.Join(dir, "README.md"), md); err != nil {
		return err
	}
	return perr
}

// Markers delimiting the generated part of docs/benchmarks/README.md.
const (
	readmeBegin = "<!-- bench:results:begin (generated by palisade-lab bench; do not edit) -->"
	readmeEnd   = "<!-- bench:results:end -->"
)

func updateReadme(path, md string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil // no README here: nothing to refresh
	}
	s := string(b)
	i, j := strings.Index(s, readmeBegin), strings.Index(s, readmeEnd)
	if i < 0 || j < i {
		return nil
	}
	// Demote the generated headings by one level to nest under the README's.
	body := strings.ReplaceAll("\n"+md, "\n#", "\n##")
	s = s[:i+len(readmeBegin)] + "\n" + strings.TrimSpace(body) + "\n" + s[j:]
	return os.WriteFile(path, []byte(s), 0o644)
}

func fmtNum(x float64) string {
	switch {
	case math.IsNaN(x):
		return "—"
	case x == 0:
		return "0"
	case math.Abs(x) >= 1000:
		return fmt.Sprintf("%.0f", x)
	case math.Abs(x) >= 100:
		return fmt.Sprintf("%.1f", x)
	case math.Abs(x) >= 10:
		return fmt.Sprintf("%.2f", x)
	default:
		return fmt.Sprintf("%.3g", x)
	}
}

func fmtSummary(s Summary) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 {
		return fmtNum(s.Median)
	}
	return fmt.Sprintf("%s [%s–%s]", fmtNum(s.Median), fmtNum(s.Min), fmtNum(s.Max))
}

// fmtCI is a figure's 95 % confidence interval.
func fmtCI(f Figure) string {
	if math.IsNaN(f.CILo) {
		return "—"
	}
	return fmt.Sprintf("%.3f–%.3f", f.CILo, f.CIHi)
}

func fmtRatio(f Figure) string {
	if math.IsNaN(f.Ratio) {
		return "—"
	}
	s := fmt.Sprintf("**%.3f**", f.Ratio)
	if !math.IsNaN(f.RatioMin) && f.RatioMin != f.RatioMax {
		s += fmt.Sprintf(" [%.3f–%.3f]", f.RatioMin, f.RatioMax)
	}
	return s
}

// xLabel names the x column of a bench.
func xLabel(bench string) string {
	switch bench {
	case SuiteThroughput:
		return "streams"
	case SuiteLatency, SuiteUDP:
		return "bytes"
	case SuiteConn:
		return "threads"
	case SuiteMPI:
		return "bytes"
	case SuiteScale:
		return "users / held conns"
	case SuiteSetup:
		return "users"
	case SuiteEgress:
		return "transfers"
	case SuiteApps:
		return "clients / bytes"
	}
	return "x"
}

var benchTitles = map[string]string{
	SuiteThroughput: "Bulk throughput (iperf3)",
	SuiteLatency:    "Request/response latency",
	SuiteConn:       "Connection setup (N threads × new connections, one byte each)",
	SuiteUDP:        "UDP datagrams: rate of one sender, and round trips",
	SuiteMPI:        "MPI (OpenMPI, TCP BTL, one rank per node)",
	SuiteScale:      "Verdict cost vs concurrent users and live connections",
	SuiteSetup:      "Per-user setup time vs users on a node",
	SuiteEgress:     "Egress: through the gateway vs direct",
	SuiteApps:       "Real applications across nodes (iperf3, redis-benchmark, pgbench, MPI allreduce, HTTP/3)",
}

// Markdown renders the results as tables.
func Markdown(r *Results, plots map[string][]string) string {
	var b bytes.Buffer
	w := func(f string, a ...any) { fmt.Fprintf(&b, f, a...) }
	kind := "full"
	if r.Quick {
		kind = "quick (--quick: fewer points, shorter runs)"
	}
	w("# Results\n\n")
	w("Run %s → %s (%s), %s run, %d interleaved rounds (baseline, mode, baseline, mode, …). ",
		r.Started.Format("2006-01-02 15:04 MST"), r.Finished.Format("15:04 MST"),
		r.Finished.Sub(r.Started).Round(time.Second), kind, r.Plan.Rounds)
	if mg := r.Extra["merged"]; mg != "" {
		w("Merged results: %s. ", mg)
	}
	w("Every figure is the median over rounds with [min–max]; the ratio is median(mode) / median(baseline), with the range of the per-round paired ratios and the 95 %% confidence interval of the ratio (t interval on the paired rounds' log-ratios). A target on a ratio is *met* when its whole interval is inside the target, *not met* when it lies wholly outside, and *not resolvable on this machine* otherwise.\n\n")
	m := r.Machine
	w("**Machine:** %s, %d cores, %.1f GiB, kernel %s, %s", m.CPU, m.Cores, m.MemoryGiB, m.Kernel, m.OS)
	if m.Virt != "" {
		w(", %s", m.Virt)
	}
	w("; %s; %s; %s. Load average at start %s, at end %s.\n\n", m.Go, m.Iperf3, m.OpenMPI, m.LoadStart, m.LoadEnd)

	w("## Modes\n\n| mode | status | testbed | compared with | time | note |\n|---|---|---|---|---|---|\n")
	for _, ms := range r.Modes {
		w("| %s | %s | %s | %s | %.0f s | %s |\n", ms.Name, ms.Status, orDash(ms.Testbed), orDash(ms.Baseline), ms.Seconds, mdEscape(ms.Reason))
	}
	w("\n## Targets\n\n| issue | mode | target | measured | verdict |\n|---|---|---|---|---|\n")
	for _, t := range r.Targets() {
		v := t.Verdict
		if t.Note != "" {
			v += " (" + t.Note + ")"
		}
		w("| #%d | %s | %s | %s | %s |\n", t.Issue, t.Mode, t.Goal, t.Measured, v)
	}
	w("\n## Published figures beside this run's\n\n%s\n", ReferenceComparison(r))
	for _, ms := range r.Modes {
		if ms.Status != "ran" {
			continue
		}
		w("## Mode `%s` (vs %s)\n\n", ms.Name, ms.Baseline)
		b.WriteString(costTables(r, ms.Name))
		for _, bench := range allSuites {
			var fs []Figure
			for _, f := range r.Figures {
				// The accounting's figures are in the cost table above.
				if f.Mode == ms.Name && f.Bench == bench && !accountingMetric(f.Metric) {
					fs = append(fs, f)
				}
			}
			if len(fs) == 0 {
				continue
			}
			sort.SliceStable(fs, func(i, j int) bool {
				if fs[i].Metric != fs[j].Metric {
					return fs[i].Metric < fs[j].Metric
				}
				if fs[i].Series != fs[j].Series {
					return fs[i].Series < fs[j].Series
				}
				return fs[i].X < fs[j].X
			})
			w("### %s\n\n", benchTitles[bench])
			for _, p := range plots[ms.Name+"/"+bench] {
				w("![%s](%s)\n\n", bench, p)
			}
			w("| metric | series | %s | baseline | %s | ratio | 95 %% CI |\n|---|---|---|---|---|---|---|\n", xLabel(bench), ms.Name)
			for _, f := range fs {
				mi := metricOf(f.Metric)
				better := "lower is better"
				if mi.Higher {
					better = "higher is better"
				}
				w("| %s (%s; %s) | %s | %s | %s | %s | %s | %s |\n", mi.Label, f.Unit, better, f.Series, strconv.FormatFloat(f.X, 'f', -1, 64),
					fmtSummary(f.Baseline), fmtSummary(f.With), fmtRatio(f), fmtCI(f))
			}
			w("\n")
		}
		b.WriteString(footprintTable(r, ms.Name))
	}
	if len(r.Errors) > 0 {
		w("## Errors during the run\n\n")
		for _, e := range r.Errors {
			w("- %s\n", mdEscape(e))
		}
		w("\n")
	}
	return b.String()
}

// accountingMetric: per-operation figures of the exact accounting.
func accountingMetric(m string) bool {
	return m == "cpu_us_op" || m == "bpf_ns_op" || m == "bpf_other_ns_op"
}

func footprintTable(r *Results, mode string) string {
	type agg struct {
		cpu, wall []float64
		rss, hwm  float64
	}
	by := map[string]*agg{}
	var keys []string
	for _, f := range r.Foot {
		if f.Mode != mode {
			continue
		}
		k := f.Process + " on " + f.Node
		a := by[k]
		if a == nil {
			a = &agg{}
			by[k] = a
			keys = append(keys, k)
		}
		a.cpu = append(a.cpu, f.CPUSec)
		a.wall = append(a.wall, f.WallSec)
		a.rss = math.Max(a.rss, f.RSSMB)
		a.hwm = math.Max(a.hwm, f.HWMMB)
	}
	if len(keys) == 0 {
		return ""
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString("### Footprint of the data plane's processes\n\n| process | CPU per measured set (s) | CPU share of the set | RSS max (MB) | peak RSS (MB) |\n|---|---|---|---|---|\n")
	for _, k := range keys {
		a := by[k]
		share := make([]float64, len(a.cpu))
		for i := range a.cpu {
			if a.wall[i] > 0 {
				share[i] = 100 * a.cpu[i] / a.wall[i]
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s %% | %.1f | %.1f |\n", k, fmtSummary(Summarize(a.cpu)), fmtSummary(Summarize(share)), a.rss, a.hwm)
	}
	b.WriteString("\n")
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

func mdEscape(s string) string {
	s = strings.ReplaceAll(s, "|", "\\|")
	return strings.ReplaceAll(s, "\n", " ")
}

// LoadResults reads a results.json (to re-render tables and plots) and
// recomputes the figures from its samples.
func LoadResults(path string) (*Results, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Results
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	r.Figures = computeFigures(r.Samples)
	return &r, nil
}

// ratioRange summarises the ratios of figures as "a–b×" (median ratios).
func ratioRange(fs []Figure, keep func(Figure) bool) (lo, hi float64, ok bool) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, f := range fs {
		if math.IsNaN(f.Ratio) || (keep != nil && !keep(f)) {
			continue
		}
		lo, hi, ok = math.Min(lo, f.Ratio), math.Max(hi, f.Ratio), true
	}
	return
}

func pct(r float64) string {
	d := (r - 1) * 100
	if math.Abs(d) < 0.05 {
		return "±0%"
	}
	return fmt.Sprintf("%+.1f%%", d)
}

func pctRange(lo, hi float64) string {
	if lo == hi {
		return pct(lo)
	}
	return pct(lo) + " … " + pct(hi)
}

// ReferenceComparison puts the references' published overheads beside the
// same quantity measured in this run (generated, so it always matches
// results.json).
func ReferenceComparison(r *Results) string {
	var b strings.Builder
	row := func(ref, what, theirs, ours string) {
		if ours == "" {
			ours = "not measured in this run"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", ref, what, theirs, ours)
	}
	b.WriteString("| reference | quantity | published | this run |\n|---|---|---|---|\n")
	threads := func(f Figure) bool { return f.X <= 16 }
	ours := ""
	if lo, hi, ok := ratioRange(r.figs("userwall", SuiteConn, "conn-local", "seconds"), threads); ok {
		ours = "userwall, localhost: " + pctRange(lo, hi)
	}
	if lo, hi, ok := ratioRange(r.figs("userwall", SuiteConn, "conn-cross", "seconds"), threads); ok {
		ours += "; across nodes: " + pctRange(lo, hi)
	}
	row("001 (MIT user-based firewall: NFQUEUE + ident2), Figure 2", "time for N threads × 1,000 new connections, 1 byte each",
		"+90% at 1–7 threads, worse at ≥ 8; +35% with the LD_PRELOAD pre-cache (1–5 threads)", ours)
	ours = ""
	if lo, hi, ok := ratioRange(r.figs("userwall", SuiteConn, "", "connect_us"), threads); ok {
		ours = "userwall: " + pctRange(lo, hi) + " (median connect(), all thread counts and paths)"
	}
	row("shared/notes/ebpf-userwall.md (probes on this machine kind)", "connect() latency", "connect-time check +7%; SYN option +5–11%; NFQUEUE +63–154%", ours)
	ours = ""
	if lo, hi, ok := ratioRange(append(r.figs("userwall", SuiteThroughput, "tcp-cross", "gbit_s"), r.figs("userwall", SuiteThroughput, "tcp-local", "gbit_s")...), nil); ok {
		ours = "userwall, iperf3 TCP 1–8 streams: " + pctRange(lo, hi)
	}
	row("001, Figure 1", "bulk throughput", "unchanged (netcat, single stream)", ours)
	ours = ""
	if lo, hi, ok := ratioRange(r.figs("uvn", SuiteThroughput, "tcp-cross", "gbit_s"), nil); ok {
		ours = "uvn, iperf3 TCP across nodes in the VM (software-emulated CPU): " + pctRange(lo, hi)
	}
	row("000 (UVN: VRF + VXLAN), §6.2.1", "iperf3 throughput", "−1–2% (25 GbE, 1–8 instances)", ours)
	ours = ""
	for _, f := range r.figs("uvn", SuiteLatency, "rr-cross", "rtt_us") {
		if f.X == 1 && f.Baseline.N > 0 && f.With.N > 0 {
			ours = fmt.Sprintf("uvn, 1-byte round trip across nodes in the VM: %+.0f µs (%s)", f.With.Median-f.Baseline.Median, pct(f.Ratio))
		}
	}
	row("000, IMB-P2P", "small-message latency", "+3–10 µs", ours)
	ours = ""
	var parts []string
	for _, f := range r.figs("egress", SuiteEgress, "", "mbit_s") {
		if f.X == 1 && strings.HasSuffix(f.Series, "@1gbit") && !math.IsNaN(f.Ratio) {
			parts = append(parts, fmt.Sprintf("%s %.0f of %.0f Mbit/s (%.2f×)", strings.TrimSuffix(f.Series, "@1gbit"), f.With.Median, f.Baseline.Median, f.Ratio))
		}
	}
	if len(parts) > 0 {
		ours = "1 Gbit/s link: " + strings.Join(parts, "; ")
	}
	row("002 (user-level VPN: openconnect + ocserv), Table 1", "single transfer through the VPN vs direct", "334 of 872 Mbit/s (0.38×; TCP over TCP, 1 GbE)", ours)
	ours = ""
	parts = nil
	for _, f := range r.figs("egress", SuiteEgress, "", "mbit_s") {
		if f.X == 10 && strings.HasSuffix(f.Series, "@1gbit") && !math.IsNaN(f.Ratio) {
			parts = append(parts, fmt.Sprintf("%s %.2f×", strings.TrimSuffix(f.Series, "@1gbit"), f.Ratio))
		}
	}
	if len(parts) > 0 {
		ours = "1 Gbit/s link: " + strings.Join(parts, "; ")
	}
	row("002, Table 1", "10 transfers through the VPN vs direct", "namespace client 885 vs 846 Mbit/s (≈1.0×)", ours)
	ours = ""
	if lo, hi, ok := ratioRange(r.figs("userwall", SuiteLatency, "", "rtt_us"), nil); ok {
		ours = "userwall round trips 1 B–64 KiB: " + pctRange(lo, hi)
	}
	row("004 (NSX-T distributed firewall), Figures 5–9", "latency vs message size; bandwidth", "small latency overhead; bandwidth −5% (VLAN), −8% (GENEVE overlay)", ours)
	ours = ""
	if lo, hi, ok := ratioRange(append(r.figs("userwall", SuiteMPI, "", "lat_us"), r.figs("userwall", SuiteMPI, "", "allreduce_us")...), nil); ok {
		ours = "userwall, MPI ping-pong latency and allreduce time: " + pctRange(lo, hi)
	}
	row("pcocc (CEA, ISC 2024 workshops)", "application overhead", "< 1% on HPL and HPCG (50 nodes, RDMA not namespaced)", ours)
	var noise []string
	for _, bench := range []string{SuiteThroughput, SuiteLatency, SuiteConn, SuiteMPI} {
		var aa []Figure
		for _, f := range r.Figures {
			if f.Mode == "none" && f.Bench == bench && f.Metric != "loss_pct" {
				aa = append(aa, f)
			}
		}
		if lo, hi, ok := ratioRange(aa, nil); ok {
			noise = append(noise, fmt.Sprintf("%s %s", bench, pctRange(lo, hi)))
		}
	}
	if len(noise) > 0 {
		fmt.Fprintf(&b, "\nNoise floor of this run (mode `none`: the testbed against itself; ratio range over each suite's figures): %s.\n", strings.Join(noise, "; "))
	}
	return b.String()
}
