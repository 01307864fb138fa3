package cli

import "github.com/spf13/cobra"

// Root returns the command tree, for generated man pages and shell
// completions (package packaging).
func Root() *cobra.Command { return root }
