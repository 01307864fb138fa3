package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

func configCommand() *cobra.Command {
	configCmd := &cobra.Command{
		Use:   "config",
		Short: "Inspect Palisade's configuration",
	}
	check := &cobra.Command{
		Use:   "check",
		Short: "Validate the configuration file and print the effective policy",
		Long: "Validate --config (unknown keys, subnets, users, ports, ranges, duplicates) and print\n" +
			"the effective policy with every default filled in. Exits 1 with file:line: key: message\n" +
			"for each problem. Nothing is applied.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := policy.Load(configPath)
			if err != nil {
				return &ExitError{1, "invalid configuration:\n" + err.Error()}
			}
			fmt.Fprint(cmd.OutOrStdout(), cfg.Describe(identity.System()))
			fmt.Fprintf(cmd.OutOrStdout(), "# %s: OK\n", configPath)
			return nil
		},
	}
	configCmd.AddCommand(check)
	return configCmd
}
