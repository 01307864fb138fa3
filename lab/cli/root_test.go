package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/cli"
)

// Each binary names itself in --version.
func TestVersionNamesTheBinary(t *testing.T) {
	for name, root := range map[string]func() string{
		"palisade-lab ": func() string { return run(t, New()) },
		"palisade ":     func() string { return run(t, cli.New()) },
	} {
		if out := root(); !strings.HasPrefix(out, name) || strings.Count(out, "\n") != 1 {
			t.Errorf("--version printed %q, want one line starting with %q", out, name)
		}
	}
}

func run(t *testing.T, root *cobra.Command) string {
	t.Helper()
	var b bytes.Buffer
	root.SetOut(&b)
	root.SetArgs([]string{"--version"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	return b.String()
}
