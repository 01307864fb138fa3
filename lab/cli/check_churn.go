package cli

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// runChurn is `palisade-lab check --churn DURATION`.
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
		return &cli.ExitError{Code: 130, Msg: "interrupted"}
	}
	if failed > 0 {
		return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("churn: %d failures", failed)}
	}
	return nil
}
