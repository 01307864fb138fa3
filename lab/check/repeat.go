package check

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// RunRepeat runs the matrix n times with the same options (a fresh set of
// listeners and connectors each time) and calls each after every run. A
// flaky case shows up as a mismatch in some runs only: never retried away.
func RunRepeat(ctx context.Context, tb *testbed.Testbed, opts Options, n int, each func(i int, r *Report)) ([]*Report, error) {
	if n < 1 {
		return nil, fmt.Errorf("repeat %d: want at least 1", n)
	}
	var reps []*Report
	for i := 1; i <= n && ctx.Err() == nil; i++ {
		r, err := Run(ctx, tb, opts)
		if err != nil {
			return reps, fmt.Errorf("run %d of %d: %w", i, n, err)
		}
		reps = append(reps, r)
		if each != nil {
			each(i, r)
		}
	}
	return reps, nil
}

// WriteRepeatRun prints one run of a repeat: its counts and its mismatches
// (at most max, 0 = all).
func WriteRepeatRun(w io.Writer, i, n int, r *Report, max int) {
	passed, failed := r.Counts()
	fmt.Fprintf(w, "run %d/%d: %d passed, %d failed (%v)\n", i, n, passed, failed, r.Elapsed.Round(10*time.Millisecond))
	for j, c := range r.Failures() {
		if max > 0 && j == max {
			fmt.Fprintf(w, "  … and %d more\n", failed-j)
			break
		}
		fmt.Fprintf(w, "  %s\n", describeFailure(c))
	}
}

// WriteRepeatSummary prints the totals; its last line is "N passed, M
// failed" over every case of every run.
func WriteRepeatSummary(w io.Writer, reps []*Report) (passed, failed int) {
	var bad []int
	for i, r := range reps {
		p, f := r.Counts()
		passed += p
		failed += f
		if f > 0 {
			bad = append(bad, i+1)
		}
	}
	fmt.Fprintf(w, "repeat: %d runs, %d runs with mismatches %v, %d mismatches in total\n", len(reps), len(bad), bad, failed)
	fmt.Fprintf(w, "%d passed, %d failed\n", passed, failed)
	return passed, failed
}
