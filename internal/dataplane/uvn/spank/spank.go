// Package spank holds Palisade's uvn Slurm SPANK plugin (C, c/pal_uvn_spank.c)
// and builds it. The plugin is configured only through plugstack.conf
// arguments (palisade=PATH config=PATH); see docs/uvn.md.
package spank

import (
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Source is the plugin's C source.
//
//go:embed c/pal_uvn_spank.c
var Source []byte

// PluginName is the file name of the built plugin.
const PluginName = "pal_uvn_spank.so"

// CFlags are the flags the plugin must build cleanly with.
var CFlags = []string{"-Wall", "-Wextra", "-Werror", "-O2", "-fPIC", "-shared"}

// Build compiles the plugin to dst with the C compiler ($CC, default gcc)
// against <slurm/spank.h> (libslurm-dev).
func Build(ctx context.Context, dst string) error {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	dir, err := os.MkdirTemp(filepath.Dir(dst), ".spank-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	src := filepath.Join(dir, "pal_uvn_spank.c")
	if err := os.WriteFile(src, Source, 0o644); err != nil {
		return err
	}
	args := append(append([]string{}, CFlags...), "-o", dst+".tmp", src)
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, cc, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("build SPANK plugin (%s %s): %w: %s", cc, strings.Join(args, " "), err, out.String())
	}
	if err := os.Chmod(dst+".tmp", 0o644); err != nil {
		return err
	}
	return os.Rename(dst+".tmp", dst)
}
