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
