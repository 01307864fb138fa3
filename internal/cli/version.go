package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/version"
)

// AddVersion adds `version` and --version to root (both binaries carry them).
func AddVersion(root *cobra.Command) {
	info := version.Get()
	// --version prints the one-line form; `palisade version` the long one.
	// The flag is ours, not cobra's Version: cobra prints a custom version
	// line through text/template, and a reachable template executor makes the
	// linker keep every exported method of every type (reflect's
	// MethodByName) — 6.8 MB of the product binary.
	var showVersion bool
	root.Flags().BoolVarP(&showVersion, "version", "v", false, "version for "+root.Name())
	root.RunE = func(cmd *cobra.Command, _ []string) error {
		if !showVersion {
			return cmd.Help() // the bare command, as before: its help
		}
		fmt.Fprintln(cmd.OutOrStdout(), info.Line(root.Name()))
		return nil
	}
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit, build date, Go and cilium/ebpf versions of this binary",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), info)
			}
			fmt.Fprint(cmd.OutOrStdout(), info.Long())
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	root.AddCommand(cmd)
}
