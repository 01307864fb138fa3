package cli

import (
	"github.com/spf13/cobra"

	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
)

// unitExecCommand applies the agent unit's system call filter and execs the
// agent (the last step of the testbed's emulation of palisade-agent.service).
func unitExecCommand() *cobra.Command {
	return &cobra.Command{
		Use:                userwalllab.UnitExecCommand + " --allow N,N,... [--errno E] -- command [args]",
		Hidden:             true,
		Short:              "run a command under the agent unit's system call filter",
		DisableFlagParsing: true,
		RunE:               func(_ *cobra.Command, args []string) error { return userwalllab.UnitExec(args) },
	}
}
