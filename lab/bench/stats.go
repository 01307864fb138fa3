package bench

import (
	"math"
	"sort"
)

// Summary is how every figure is reported: the median of the rounds with
// the smallest and largest round beside it.
type Summary struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	N      int     `json:"n"`
}

// Summarize reduces the per-round values of one figure. NaN and infinite
// values (a failed round) are left out; a figure with no valid round has
// N = 0.
func Summarize(v []float64) Summary {
	var xs []float64
	for _, x := range v {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			xs = append(xs, x)
		}
	}
	if len(xs) == 0 {
		return Summary{Median: math.NaN(), Min: math.NaN(), Max: math.NaN()}
	}
	sort.Float64s(xs)
	return Summary{Median: median(xs), Min: xs[0], Max: xs[len(xs)-1], N: len(xs)}
}

// median of sorted xs.
func median(xs []float64) float64 {
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// medianOf sorts a copy of v and returns its median (NaN when empty).
func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	xs := append([]float64(nil), v...)
	sort.Float64s(xs)
	return median(xs)
}

// percentile of sorted xs (nearest rank), p in [0,100].
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(p/100*float64(len(xs)))) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(xs) {
		i = len(xs) - 1
	}
	return xs[i]
}

// pairedRatios divides each round's mode value by the same round's
// baseline: rounds are interleaved, so a paired ratio cancels slow drift of
// the machine's load that would otherwise leak into the comparison.
func pairedRatios(base, mode []float64) []float64 {
	n := len(base)
	if len(mode) < n {
		n = len(mode)
	}
	out := make([]float64, 0, n)
	for i := 0; i < n; i++ {
		if base[i] > 0 && !math.IsNaN(mode[i]) {
			out = append(out, mode[i]/base[i])
		}
	}
	return out
}

// t95 is the two-sided 95 % quantile of Student's t for df = 1..30.
var t95 = []float64{12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
	2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
	2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042}

// ratioCI is the 95 % confidence interval of the ratio mode/baseline from
// paired per-round ratios: a t interval on their logarithms (ratios are
// multiplicative, so the log makes 0.9× and 1.1× symmetric), transformed
// back. It needs two pairs; NaN otherwise.
func ratioCI(ratios []float64) (lo, hi float64) {
	var ls []float64
	for _, r := range ratios {
		if r > 0 && !math.IsInf(r, 0) && !math.IsNaN(r) {
			ls = append(ls, math.Log(r))
		}
	}
	n := len(ls)
	if n < 2 {
		return math.NaN(), math.NaN()
	}
	mean := 0.0
	for _, x := range ls {
		mean += x
	}
	mean /= float64(n)
	ss := 0.0
	for _, x := range ls {
		ss += (x - mean) * (x - mean)
	}
	sd := math.Sqrt(ss / float64(n-1))
	t := 1.96
	if n-1 <= len(t95) {
		t = t95[n-2]
	}
	h := t * sd / math.Sqrt(float64(n))
	return math.Exp(mean - h), math.Exp(mean + h)
}
