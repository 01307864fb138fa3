package version

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func TestGetUnstamped(t *testing.T) {
	i := Get()
	if i.Version != "devel" || i.GoVersion != runtime.Version() {
		t.Fatalf("unstamped build: %+v", i)
	}
	if !strings.HasPrefix(i.String(), "palisade devel (commit ") {
		t.Fatalf("String() = %q", i.String())
	}
}

// TestStamped builds a tiny program with the Makefile's -X flags and checks
// that every field arrives, cilium/ebpf's version included (it is read from
// the embedded module list, so the program must link the module).
func TestStamped(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a binary")
	}
	dir := t.TempDir()
	src := `package main

import (
	"fmt"

	_ "github.com/cilium/ebpf"
	"github.com/palisade-hpc/palisade/internal/version"
)

func main() { fmt.Print(version.Get().Long()) }
`
	// The program must live inside the module to import an internal
	// package; a leading "_" keeps it out of ./... patterns meanwhile.
	pkg, err := os.MkdirTemp(".", "_stamptest")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(pkg)
	if err := os.WriteFile(filepath.Join(pkg, "main.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "v")
	const p = "github.com/palisade-hpc/palisade/internal/version."
	ld := "-X " + p + "version=1.2.3 -X " + p + "commit=0123456789abcdef -X " + p + "date=2026-01-02T03:04:05Z"
	if out, err := exec.Command("go", "build", "-ldflags", ld, "-o", bin, "./"+pkg).CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"version:     1.2.3\n", "commit:      0123456789abcdef\n",
		"build date:  2026-01-02T03:04:05Z\n", "go:          " + runtime.Version(), "cilium/ebpf: v0."} {
		if !strings.Contains(string(out), want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}
