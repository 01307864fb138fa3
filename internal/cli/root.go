// Package cli is the cobra command tree of the palisade product binary:
// agent, status, explain, who, config, ident, uvn, gateway, egress. Each file
// builds the commands of one concern and keeps them thin: flags are parsed
// here, the work is done in the concern's own package. The tree is built
// explicitly by New (no init-time registration).
package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"
)

// DefaultConfigPath is where a site keeps Palisade's configuration.
const DefaultConfigPath = "/etc/palisade/palisade.toml"

// configPath is the --config flag shared by every command.
var configPath string

// New builds the palisade command tree.
func New() *cobra.Command {
	root := NewRoot("palisade", "Per-user network isolation for shared HPC clusters", &configPath)
	root.AddCommand(
		agentCommand(),
		statusCommand(),
		doctorCommand(),
		explainCommand(),
		whoCommand(),
		flowsCommand(),
		shareCommand(),
		unshareCommand(),
		auditCommand(),
		configCommand(),
		policyCommand(),
		identCommand(),
		uvnCommand(),
		keyCommand(),
		portalCommand(),
	)
	root.AddCommand(egressCommands()...) // gateway, egress and its namespace helper
	AddVersion(root)
	return root
}

// NewRoot is an empty root command with the shared --config flag bound to
// *config (the lab binary builds its tree on the same root).
func NewRoot(use, short string, config *string) *cobra.Command {
	root := &cobra.Command{
		Use:           use,
		Short:         short,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(config, "config", DefaultConfigPath, "Palisade configuration file (TOML)")
	return root
}

// Execute runs the command line of root and returns the process exit code.
func Execute(root *cobra.Command) int {
	err := root.Execute()
	if err == nil {
		return 0
	}
	code := 1
	var ee *ExitError
	if errors.As(err, &ee) {
		code = ee.Code
	}
	// An ExitError with no message passes on a child's status silently
	// (e.g. testbed exec), the child having said what went wrong.
	if msg := err.Error(); msg != "" {
		fmt.Fprintln(os.Stderr, root.Name()+":", msg)
	}
	return code
}

// writeJSON prints v indented: the --json form of every command.
func writeJSON(w io.Writer, v any) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(v)
}

// ExitError carries a specific exit code (e.g. check mismatches) without
// printing usage.
type ExitError struct {
	Code int
	Msg  string
}

func (e *ExitError) Error() string { return e.Msg }

// ExitCode is the process exit code.
func (e *ExitError) ExitCode() int { return e.Code }
