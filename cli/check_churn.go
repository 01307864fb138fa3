package cli

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/palisade-hpc/palisade/check/attack"
	"github.com/palisade-hpc/palisade/testbed"
)

// runChurn is `palisade check --churn DURATION`.
func runChurn(ctx context.Context, tb *testbed.Testbed, d time.Duration, quiet bool) error {
	if tb.Mode != "userwall" {
		return fmt.Errorf("the churn test needs a userwall testbed (%s runs mode %q)", tb.Name, tb.Mode)
	}
	opts := attack.ChurnOptions{Duration: d}
	if !quiet {
		opts.Log = func(f string, a ...any) { fmt.Fprintf(os.Stderr, f+"\n", a...) }
	}
	rep, err := attack.Churn(ctx, tb, opts)
	if err != nil {
		return err
	}
	failed := rep.Write(os.Stdout)
	if ctx.Err() != nil {
		return &exitError{130, "interrupted"}
	}
	if failed > 0 {
		return &exitError{1, fmt.Sprintf("churn: %d failures", failed)}
	}
	return nil
}
