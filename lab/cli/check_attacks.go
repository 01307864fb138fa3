package cli

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// runAttacks is `palisade-lab check --attacks [--mode M]`: the attack suite of
// the testbed's mode (userwall, or uvn inside its VM), a line per case and
// "N passed, M failed" last.
func runAttacks(ctx context.Context, tb *testbed.Testbed, mode, only string, actors, kernelDependent, verbose, quiet bool) error {
	if mode == "" {
		mode = tb.Mode
	}
	if tb.Mode != mode {
		return fmt.Errorf("the %s attack suite needs a %s testbed (%s runs mode %q)", mode, mode, tb.Name, tb.Mode)
	}
	if _, err := attack.CasesFor(mode); err != nil {
		return err
	}
	opts := attack.Options{Mode: mode, Actors: actors, KernelDependent: kernelDependent}
	if only != "" {
		opts.Only = strings.Split(only, ",")
	}
	if !quiet {
		opts.Log = func(f string, a ...any) { fmt.Fprintf(os.Stderr, "attacks: "+f+"\n", a...) }
	}
	res, err := attack.RunSuite(ctx, tb, opts)
	if err != nil {
		return err
	}
	_, failed, _ := attack.WriteReport(os.Stdout, res, verbose)
	if ctx.Err() != nil {
		return &cli.ExitError{Code: 130, Msg: "interrupted"}
	}
	if failed > 0 {
		return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("%d attack cases failed", failed)}
	}
	return nil
}
