package bench

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"time"
)

// Variants of a round: the same testbed without and with the data plane.
const (
	Baseline = "baseline"
	Enforced = "mode"
)

// Sample is one measured value of one round.
type Sample struct {
	Mode    string  `json:"mode"`
	Variant string  `json:"variant"` // baseline | mode
	Round   int     `json:"round"`
	Bench   string  `json:"bench"`  // throughput, latency, conn, mpi, scale, egress, setup
	Series  string  `json:"series"` // e.g. tcp-cross, rr-local
	X       float64 `json:"x"`      // streams, message size, threads, users
	Metric  string  `json:"metric"`
	Value   float64 `json:"value"`
	// Note records anything odd about the sample (errors, loss).
	Note string `json:"note,omitempty"`
}

// metricInfo says how to print and compare a metric.
type metricInfo struct {
	Unit   string
	Higher bool // higher is better
	Label  string
}

var metrics = map[string]metricInfo{
	"gbit_s":          {"Gbit/s", true, "throughput"},
	"mbit_s":          {"Mbit/s", true, "throughput"},
	"loss_pct":        {"%", false, "loss"},
	"rtt_us":          {"µs", false, "round trip (median)"},
	"seconds":         {"s", false, "time for all connections"},
	"conn_rate":       {"conn/s", true, "connection rate"},
	"connect_us":      {"µs", false, "connect() (median)"},
	"lat_us":          {"µs", false, "one-way latency"},
	"bw_mb_s":         {"MB/s", true, "bandwidth"},
	"allreduce_us":    {"µs", false, "allreduce time"},
	"setup_ms":        {"ms", false, "per-user setup"},
	"teardown_ms":     {"ms", false, "per-user teardown"},
	"leftover":        {"objects", false, "objects left after teardown"},
	"users_reached":   {"users", true, "users set up before a failure"},
	"client_cpu_s_gb": {"CPU s/GB", false, "CPU per GB carried, client process tree (transfer program + client data path)"},
	"gw_cpu_s_gb":     {"CPU s/GB", false, "CPU per GB carried, gateway processes"},
	"map_mb":          {"MiB", false, "kernel memory of the membership map (per node)"},
	"dgram_rate":      {"kdgram/s", true, "datagrams received per second"},
	"ops_s":           {"op/s", true, "requests per second"},
	"tps":             {"tx/s", true, "transactions per second"},
	"cpu_us_op":       {"µs/op", false, "CPU time per operation (load generator + server)"},
	"bpf_ns_op":       {"ns/op", false, "eBPF run time per operation (the nodes doing the work)"},
	"bpf_other_ns_op": {"ns/op", false, "eBPF run time per operation (the testbed's other nodes' copies)"},
}

func metricOf(m string) metricInfo {
	if mi, ok := metrics[m]; ok {
		return mi
	}
	return metricInfo{Unit: "", Higher: false, Label: m}
}

// Figure is one reported number: the baseline and the mode side by side,
// each as median with min–max over the rounds, and their ratio.
type Figure struct {
	Mode     string  `json:"mode"`
	Bench    string  `json:"bench"`
	Series   string  `json:"series"`
	X        float64 `json:"x"`
	Metric   string  `json:"metric"`
	Unit     string  `json:"unit"`
	Higher   bool    `json:"higher_is_better"`
	Baseline Summary `json:"baseline"`
	With     Summary `json:"with_mode"`
	// Ratio is median(mode) / median(baseline); RatioMin/Max span the
	// per-round paired ratios.
	Ratio    float64 `json:"ratio"`
	RatioMin float64 `json:"ratio_min"`
	RatioMax float64 `json:"ratio_max"`
	// CILo–CIHi is the 95 % confidence interval of the ratio from the
	// paired rounds (NaN with fewer than two pairs).
	CILo  float64 `json:"ci95_lo"`
	CIHi  float64 `json:"ci95_hi"`
	Notes string  `json:"notes,omitempty"`
}

// Key identifies a figure.
func (f Figure) Key() string {
	return fmt.Sprintf("%s/%s/%s/%g/%s", f.Mode, f.Bench, f.Series, f.X, f.Metric)
}

// ModeStatus records whether a mode ran and, if not, why.
type ModeStatus struct {
	Name    string `json:"name"`
	Status  string `json:"status"` // ran | skipped | failed
	Reason  string `json:"reason,omitempty"`
	Testbed string `json:"testbed,omitempty"`
	// Baseline says what the mode is compared against.
	Baseline string  `json:"baseline"`
	Seconds  float64 `json:"seconds"`
}

// Footprint is a data-plane process's cost during one measured set.
type Footprint struct {
	Mode    string  `json:"mode"`
	Round   int     `json:"round"`
	Node    string  `json:"node"`
	Process string  `json:"process"`
	PID     int     `json:"pid"`
	CPUSec  float64 `json:"cpu_seconds"`
	WallSec float64 `json:"wall_seconds"`
	RSSMB   float64 `json:"rss_mb"`
	HWMMB   float64 `json:"peak_rss_mb"`
}

// Results is everything a run produced (results.json).
type Results struct {
	Started  time.Time    `json:"started"`
	Finished time.Time    `json:"finished"`
	Quick    bool         `json:"quick"`
	Machine  Machine      `json:"machine"`
	Plan     Plan         `json:"plan"`
	Modes    []ModeStatus `json:"modes"`
	Samples  []Sample     `json:"samples"`
	Figures  []Figure     `json:"figures"`
	Foot     []Footprint  `json:"footprint"`
	// Costs is the exact accounting of every measured unit.
	Costs  []Cost            `json:"costs,omitempty"`
	Errors []string          `json:"errors,omitempty"`
	Extra  map[string]string `json:"extra,omitempty"`
}

// computeFigures groups samples into figures. Samples of a figure are
// paired by round for the ratio range.
func computeFigures(samples []Sample) []Figure {
	type key struct {
		mode, bench, series, metric string
		x                           float64
	}
	type acc struct {
		base, mode map[int]float64
		notes      []string
	}
	groups := map[key]*acc{}
	var order []key
	for _, s := range samples {
		k := key{s.Mode, s.Bench, s.Series, s.Metric, s.X}
		a := groups[k]
		if a == nil {
			a = &acc{base: map[int]float64{}, mode: map[int]float64{}}
			groups[k] = a
			order = append(order, k)
		}
		if s.Variant == Baseline {
			a.base[s.Round] = s.Value
		} else {
			a.mode[s.Round] = s.Value
		}
		if s.Note != "" && len(a.notes) < 3 {
			a.notes = append(a.notes, fmt.Sprintf("r%d %s: %s", s.Round, s.Variant, s.Note))
		}
	}
	var figs []Figure
	for _, k := range order {
		a := groups[k]
		var rounds []int
		seen := map[int]bool{}
		for r := range a.base {
			seen[r] = true
		}
		for r := range a.mode {
			seen[r] = true
		}
		for r := range seen {
			rounds = append(rounds, r)
		}
		sort.Ints(rounds)
		var bv, mv, pb, pm []float64
		for _, r := range rounds {
			b, okb := a.base[r]
			m, okm := a.mode[r]
			if okb {
				bv = append(bv, b)
			}
			if okm {
				mv = append(mv, m)
			}
			if okb && okm {
				pb, pm = append(pb, b), append(pm, m)
			}
		}
		mi := metricOf(k.metric)
		f := Figure{Mode: k.mode, Bench: k.bench, Series: k.series, X: k.x, Metric: k.metric,
			Unit: mi.Unit, Higher: mi.Higher, Baseline: Summarize(bv), With: Summarize(mv),
			Ratio: math.NaN(), RatioMin: math.NaN(), RatioMax: math.NaN(), CILo: math.NaN(), CIHi: math.NaN()}
		if f.Baseline.N > 0 && f.With.N > 0 && f.Baseline.Median > 0 {
			f.Ratio = f.With.Median / f.Baseline.Median
			prs := pairedRatios(pb, pm)
			pr := Summarize(prs)
			f.RatioMin, f.RatioMax = pr.Min, pr.Max
			f.CILo, f.CIHi = ratioCI(prs)
		}
		if len(a.notes) > 0 {
			f.Notes = fmt.Sprint(a.notes)
		}
		figs = append(figs, f)
	}
	return figs
}

// fp maps NaN and ±Inf to null: JSON has no NaN, and a missing value must
// not masquerade as zero.
func fp(x float64) *float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return nil
	}
	return &x
}

// MarshalJSON writes undefined values as null.
func (s Summary) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Median *float64 `json:"median"`
		Min    *float64 `json:"min"`
		Max    *float64 `json:"max"`
		N      int      `json:"n"`
	}{fp(s.Median), fp(s.Min), fp(s.Max), s.N})
}

// MarshalJSON writes undefined ratios as null.
func (f Figure) MarshalJSON() ([]byte, error) {
	type plain Figure
	return json.Marshal(struct {
		plain
		Ratio    *float64 `json:"ratio"`
		RatioMin *float64 `json:"ratio_min"`
		RatioMax *float64 `json:"ratio_max"`
		CILo     *float64 `json:"ci95_lo"`
		CIHi     *float64 `json:"ci95_hi"`
	}{plain(f), fp(f.Ratio), fp(f.RatioMin), fp(f.RatioMax), fp(f.CILo), fp(f.CIHi)})
}
