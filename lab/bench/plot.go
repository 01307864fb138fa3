package bench

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// chart is one PNG: a value panel (baseline dashed, mode solid, min–max
// bars) over a ratio panel (mode / baseline with the paired-round range),
// the layout of reference 004's Figures 5–8.
type chart struct {
	file, title, xlabel, ylabel string
	bench, metric               string
	series                      []string // "" = every series of bench/metric
	match                       func(series string) bool
	logX, logY                  bool
	noRatio                     bool
	// sharedBaseline: every series has the same baseline (egress: direct);
	// draw it once, with this label.
	sharedBaseline string
}

func chartsFor(mode string) []chart {
	c := []chart{
		{file: "latency", title: "Request/response round trip", xlabel: "message size (bytes)", ylabel: "median round trip (µs)",
			bench: SuiteLatency, metric: "rtt_us", logX: true, logY: true},
		{file: "conn", title: "Connection setup rate", xlabel: "threads", ylabel: "connections / s",
			bench: SuiteConn, metric: "conn_rate", logX: true},
		{file: "throughput", title: "TCP throughput (iperf3)", xlabel: "parallel streams", ylabel: "Gbit/s",
			bench: SuiteThroughput, metric: "gbit_s", series: []string{"tcp-cross", "tcp-local"}, logX: true},
		{file: "udp", title: "UDP datagram rate of one sender", xlabel: "datagram size (bytes)", ylabel: "kdatagrams/s received",
			bench: SuiteUDP, metric: "dgram_rate", logX: true},
		{file: "mpi", title: "MPI ping-pong one-way latency", xlabel: "message size (bytes)", ylabel: "µs",
			bench: SuiteMPI, metric: "lat_us", logX: true, logY: true},
		{file: "mpi-bw", title: "MPI ping-pong bandwidth", xlabel: "message size (bytes)", ylabel: "MB/s",
			bench: SuiteMPI, metric: "bw_mb_s", logX: true, logY: true},
		{file: "scale", title: "Connection rate vs concurrent users / held connections", xlabel: "users (or held connections)", ylabel: "connections / s",
			bench: SuiteScale, metric: "conn_rate"},
		{file: "setup", title: "Per-user setup time vs users on the node", xlabel: "users", ylabel: "ms",
			bench: SuiteSetup, metric: "setup_ms", logX: true, noRatio: true},
		{file: "egress", title: "Egress throughput, links as they are", xlabel: "parallel transfers", ylabel: "Mbit/s",
			bench: SuiteEgress, metric: "mbit_s", logX: true, sharedBaseline: "direct (baseline)",
			match: func(s string) bool { return !strings.Contains(s, "@") }},
		{file: "egress-1gbit", title: "Egress throughput, gateway link shaped to 1 Gbit/s", xlabel: "parallel transfers", ylabel: "Mbit/s",
			bench: SuiteEgress, metric: "mbit_s", logX: true, sharedBaseline: "direct (baseline)",
			match: func(s string) bool { return strings.HasSuffix(s, "@1gbit") }},
	}
	for i := range c {
		c[i].file = fmt.Sprintf("%s-%s.png", c[i].file, mode)
		c[i].title = fmt.Sprintf("%s — %s", c[i].title, mode)
	}
	return c
}

// WritePlots draws every chart that has data and returns the files per
// "mode/bench" key (relative to dir).
func WritePlots(r *Results, dir string) (map[string][]string, error) {
	out := map[string][]string{}
	var errs []error
	for _, ms := range r.Modes {
		if ms.Status != "ran" {
			continue
		}
		for _, c := range chartsFor(ms.Name) {
			var fs []Figure
			for _, f := range r.Figures {
				if f.Mode == ms.Name && f.Bench == c.bench && f.Metric == c.metric &&
					(len(c.series) == 0 || contains(c.series, f.Series)) && (c.match == nil || c.match(f.Series)) {
					fs = append(fs, f)
				}
			}
			if len(fs) == 0 {
				continue
			}
			if err := drawChart(c, ms.Name, fs, filepath.Join(dir, c.file)); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", c.file, err))
				continue
			}
			k := ms.Name + "/" + c.bench
			out[k] = append(out[k], c.file)
		}
	}
	return out, errors.Join(errs...)
}

func contains(v []string, s string) bool {
	for _, x := range v {
		if x == s {
			return true
		}
	}
	return false
}

type errPts struct {
	plotter.XYs
	plotter.YErrors
}

func drawChart(c chart, mode string, fs []Figure, path string) (err error) {
	// gonum/plot panics on degenerate axes (e.g. a log axis with no
	// positive value): one bad chart must not lose the run's other outputs.
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("plot: %v", r)
		}
	}()
	bySeries := map[string][]Figure{}
	var names []string
	for _, f := range fs {
		if _, ok := bySeries[f.Series]; !ok {
			names = append(names, f.Series)
		}
		bySeries[f.Series] = append(bySeries[f.Series], f)
	}
	sort.Strings(names)
	xs := map[float64]bool{}
	for _, f := range fs {
		xs[f.X] = true
	}
	if len(xs) < 2 {
		c.logX = false // a single x: a log axis would have no range
	}
	// Few x values (threads, streams, sizes): label exactly those.
	var xticks plot.Ticker
	if len(xs) <= 12 {
		var ts []plot.Tick
		for x := range xs {
			ts = append(ts, plot.Tick{Value: x, Label: humanNum(x)})
		}
		sort.Slice(ts, func(i, j int) bool { return ts[i].Value < ts[j].Value })
		xticks = plot.ConstantTicks(ts)
	}
	top, bot := plot.New(), plot.New()
	top.Title.Text = c.title
	top.Y.Label.Text = c.ylabel
	top.Legend.Top = true
	top.Legend.Left = true
	bot.X.Label.Text = c.xlabel
	bot.Y.Label.Text = fmt.Sprintf("%s / baseline", mode)
	for _, p := range []*plot.Plot{top, bot} {
		if c.logX {
			p.X.Scale = plot.LogScale{}
			p.X.Tick.Marker = logTicks{}
		}
	}
	if xticks != nil {
		top.X.Tick.Marker, bot.X.Tick.Marker = xticks, xticks
	}
	if c.logY {
		top.Y.Scale = plot.LogScale{}
		top.Y.Tick.Marker = logTicks{}
	}
	if c.noRatio {
		top.X.Label.Text = c.xlabel
		if c.logX {
			top.X.Scale = plot.LogScale{}
			top.X.Tick.Marker = logTicks{}
		}
		if xticks != nil {
			top.X.Tick.Marker = xticks
		}
	}
	ratioLo, ratioHi := 1.0, 1.0
	ratioPts := false
	for i, name := range names {
		ff := bySeries[name]
		sort.Slice(ff, func(a, b int) bool { return ff[a].X < ff[b].X })
		col := plotutil.Color(i)
		for _, v := range []string{Baseline, Enforced} {
			if v == Baseline && c.sharedBaseline != "" && i > 0 {
				continue
			}
			var pts errPts
			for _, f := range ff {
				s := f.With
				if v == Baseline {
					s = f.Baseline
				}
				if s.N == 0 || (c.logY && s.Median <= 0) || (c.logX && f.X <= 0) {
					continue
				}
				pts.XYs = append(pts.XYs, plotter.XY{X: f.X, Y: s.Median})
				pts.YErrors = append(pts.YErrors, struct{ Low, High float64 }{s.Median - s.Min, s.Max - s.Median})
			}
			if len(pts.XYs) == 0 {
				continue
			}
			l, sc, err := plotter.NewLinePoints(pts.XYs)
			if err != nil {
				return err
			}
			l.Color, sc.Color = col, col
			label := name + " " + mode
			if v == Baseline {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
				sc.Shape = draw.CircleGlyph{}
				label = name + " baseline"
				if c.sharedBaseline != "" {
					label = c.sharedBaseline
					l.Color, sc.Color = color.Black, color.Black
				}
			} else {
				sc.Shape = draw.TriangleGlyph{}
			}
			top.Add(l, sc)
			if len(pts.XYs) > 0 && !c.logY {
				if eb, err := plotter.NewYErrorBars(pts); err == nil {
					eb.Color = col
					top.Add(eb)
				}
			} else if eb, err := plotter.NewYErrorBars(logSafe(pts)); err == nil {
				eb.Color = col
				top.Add(eb)
			}
			top.Legend.Add(label, l, sc)
		}
		if c.noRatio {
			continue
		}
		var rp errPts
		for _, f := range ff {
			if math.IsNaN(f.Ratio) || (c.logX && f.X <= 0) {
				continue
			}
			lo, hi := f.RatioMin, f.RatioMax
			if math.IsNaN(lo) {
				lo, hi = f.Ratio, f.Ratio
			}
			rp.XYs = append(rp.XYs, plotter.XY{X: f.X, Y: f.Ratio})
			rp.YErrors = append(rp.YErrors, struct{ Low, High float64 }{f.Ratio - lo, hi - f.Ratio})
			ratioLo, ratioHi = math.Min(ratioLo, lo), math.Max(ratioHi, hi)
		}
		if len(rp.XYs) > 0 {
			ratioPts = true
			l, sc, err := plotter.NewLinePoints(rp.XYs)
			if err != nil {
				return err
			}
			l.Color, sc.Color = col, col
			bot.Add(l, sc)
			if eb, err := plotter.NewYErrorBars(rp); err == nil {
				eb.Color = col
				bot.Add(eb)
			}
		}
	}
	if c.noRatio {
		return saveSingle(top, path)
	}
	if !ratioPts {
		// No ratio to show (no baseline): a value panel alone.
		if c.logX {
			top.X.Label.Text = c.xlabel
		}
		return saveSingle(top, path)
	}
	// The parity line: 1.0 means no overhead.
	bot.Y.Min, bot.Y.Max = math.Min(0.9, ratioLo-0.02), math.Max(1.1, ratioHi+0.02)
	one := plotter.NewFunction(func(float64) float64 { return 1 })
	one.Color = plotutil.Color(7)
	one.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
	bot.Add(one)
	bot.Add(plotter.NewGrid())
	top.Add(plotter.NewGrid())

	const w, h = 7 * vg.Inch, 7 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter,
		PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 4 * vg.Millimeter}
	plots := [][]*plot.Plot{{top}, {bot}}
	cs := plot.Align(plots, tiles, dc)
	// Give the value panel two thirds of the height.
	cs[0][0].Min.Y = h * 0.36
	cs[1][0].Max.Y = h * 0.33
	top.Draw(cs[0][0])
	bot.Draw(cs[1][0])
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		return err
	}
	return f.Close()
}

// logSafe trims error bars that would reach zero or below on a log axis.
func logSafe(p errPts) errPts {
	q := errPts{XYs: p.XYs, YErrors: make(plotter.YErrors, len(p.YErrors))}
	for i, e := range p.YErrors {
		lo := e.Low
		if p.XYs[i].Y-lo <= 0 {
			lo = p.XYs[i].Y * 0.5
		}
		q.YErrors[i] = struct{ Low, High float64 }{lo, e.High}
	}
	return q
}

func saveSingle(p *plot.Plot, path string) error {
	p.Add(plotter.NewGrid())
	if _, isLog := p.Y.Scale.(plot.LogScale); !isLog {
		p.Y.Min = 0 // absolute values (setup times): zero-based, or flat looks steep
	}
	return p.Save(7*vg.Inch, 4.5*vg.Inch, path)
}

// logTicks labels 1, 2 and 5 × 10^k (plot.LogTicks labels only powers of
// ten, which leaves a narrow range such as 20–80 µs without any label).
type logTicks struct{}

func (logTicks) Ticks(min, max float64) []plot.Tick {
	if min <= 0 || max <= min {
		return plot.DefaultTicks{}.Ticks(min, max)
	}
	var ts []plot.Tick
	decades := math.Log10(max / min)
	for e := math.Floor(math.Log10(min)); math.Pow(10, e) <= max; e++ {
		base := math.Pow(10, e)
		for m := 1; m <= 9; m++ {
			v := float64(m) * base
			if v < min || v > max {
				continue
			}
			label := ""
			if m == 1 || (decades < 3 && (m == 2 || m == 5)) {
				label = humanNum(v)
			}
			ts = append(ts, plot.Tick{Value: v, Label: label})
		}
	}
	return ts
}

// humanNum prints 1024 as 1Ki, 65536 as 64Ki, 10000 as 10k: axis labels
// stay short.
func humanNum(v float64) string {
	switch {
	case v >= 1<<20 && math.Mod(v, 1<<20) == 0:
		return fmt.Sprintf("%gMi", v/(1<<20))
	case v >= 1<<10 && math.Mod(v, 1<<10) == 0:
		return fmt.Sprintf("%gKi", v/(1<<10))
	case v >= 1e6 && math.Mod(v, 1e6) == 0:
		return fmt.Sprintf("%gM", v/1e6)
	case v >= 1e3 && math.Mod(v, 1e3) == 0:
		return fmt.Sprintf("%gk", v/1e3)
	}
	return fmt.Sprintf("%g", v)
}
