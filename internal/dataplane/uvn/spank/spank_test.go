package spank

import (
	"context"
	"debug/elf"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestBuildPlugin compiles the plugin with -Werror against the real
// <slurm/spank.h> and checks the symbols slurmstepd looks up.
func TestBuildPlugin(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc not installed")
	}
	so := filepath.Join(t.TempDir(), PluginName)
	if err := Build(context.Background(), so); err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(so)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, s := range syms {
		if s.Section != elf.SHN_UNDEF {
			have[s.Name] = true
		}
	}
	for _, want := range []string{"plugin_name", "plugin_type", "plugin_version", "spank_plugin_version",
		"slurm_spank_init", "slurm_spank_exit"} {
		if !have[want] {
			t.Errorf("plugin lacks symbol %s", want)
		}
	}
}
