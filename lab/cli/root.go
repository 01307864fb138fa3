// Package cli is the cobra command tree of the palisade-lab binary: testbed,
// check, bench, vm and probe, plus the egress extension's outside host. It
// builds on the product's root command (internal/cli) and is built
// explicitly by New; the data planes' lab adapters are wired by the caller
// (cmd/palisade-lab) before it runs.
package cli

import (
	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/cli"
)

// configPath is the --config flag (used by `bench uvnsetup` on a node).
var configPath string

// New builds the palisade-lab command tree.
func New() *cobra.Command {
	root := cli.NewRoot("palisade-lab", "Palisade's lab: a simulated cluster, the isolation matrix, benchmarks", &configPath)
	root.AddCommand(
		testbedCommand(),
		checkCommand(),
		benchCommand(),
		vmCommand(),
		probeCommand(),
		egressOutsideCommand(),
		unitExecCommand(),
	)
	cli.AddVersion(root)
	return root
}
