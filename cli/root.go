// Package cli is the cobra command tree of the palisade binary. Each file adds
// the commands of one concern (testbed, check, agent, uvn, egress, bench) and
// keeps them thin: flags are parsed here, the work is done in the concern's
// own package.
package cli

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// DefaultConfigPath is where a site keeps Palisade's configuration.
const DefaultConfigPath = "/etc/palisade/palisade.toml"

var (
	root = &cobra.Command{
		Use:           "palisade",
		Short:         "Per-user network isolation for shared HPC clusters",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	// configPath is the --config flag shared by every command.
	configPath string
)

func init() {
	root.PersistentFlags().StringVar(&configPath, "config", DefaultConfigPath, "Palisade configuration file (TOML)")
}

// register adds a top-level command; each command file calls it from init.
func register(cmds ...*cobra.Command) { root.AddCommand(cmds...) }

// Execute runs the command line and returns the process exit code.
func Execute() int {
	err := root.Execute()
	if err == nil {
		return 0
	}
	code := 1
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	// An exitError with no message passes on a child's status silently
	// (e.g. testbed exec), the child having said what went wrong.
	if msg := err.Error(); msg != "" {
		fmt.Fprintln(os.Stderr, "palisade:", msg)
	}
	return code
}

// exitError carries a specific exit code (e.g. check mismatches) without
// printing usage.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }
func (e *exitError) ExitCode() int { return e.code }
