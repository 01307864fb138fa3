package cli

import (
	"github.com/spf13/cobra"

	egresslab "github.com/palisade-hpc/palisade/lab/modes/egress"
)

// egressOutsideCommand serves the testbed's outside host for the egress
// extension (started by the extension in the outside namespace).
func egressOutsideCommand() *cobra.Command {
	return &cobra.Command{
		Use:                "__egress-outside",
		Hidden:             true,
		Short:              "testbed outside host: HTTP, DNS and UDP echo",
		DisableFlagParsing: true,
		RunE:               func(_ *cobra.Command, args []string) error { return egresslab.ServeOutside(args) },
	}
}
