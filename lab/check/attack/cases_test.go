package attack

import (
	"slices"
	"strings"
	"testing"
)

// Each mode's case set has unique names (--only and the report key on
// them); uvn's has at least 33 cases, each named uvn-…; a mode without a
// set is refused, not run as another mode's.
func TestCaseSets(t *testing.T) {
	for _, mode := range []string{"userwall", "uvn"} {
		cs, err := CasesFor(mode)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, c := range cs {
			if seen[c.Name] {
				t.Errorf("%s: case %s twice", mode, c.Name)
			}
			seen[c.Name] = true
			if c.Why == "" || c.Class == "" || c.Run == nil {
				t.Errorf("%s: case %s lacks its class, rationale or body", mode, c.Name)
			}
			if mode == "uvn" && !strings.HasPrefix(c.Name, "uvn-") {
				t.Errorf("uvn case %s not named uvn-…", c.Name)
			}
		}
		if mode == "uvn" && len(cs) < 33 {
			t.Errorf("uvn: %d cases, want at least 33", len(cs))
		}
	}
	if _, err := CasesFor("egress"); err == nil {
		t.Error("CasesFor(egress): no error")
	}
}

// TestKernelCases: every entry of the kernel-dependent selection names a
// userwall case (a renamed case must not drop out of the kernels' run
// unnoticed); the selection is a strict subset and holds the cases only a
// VM can run (abstract Unix sockets: the bpf LSM; DCCP: gone from 6.16).
func TestKernelCases(t *testing.T) {
	cs := Cases()
	n := 0
	for _, c := range cs {
		if KernelDependent(c.Name) {
			n++
		}
	}
	for _, e := range kernelDependent {
		if !slices.ContainsFunc(cs, func(c *Case) bool { return selects(e, c.Name) }) {
			t.Errorf("kernel-dependent entry %q names no userwall case", e)
		}
	}
	for _, name := range []string{"abstract-unix-stream", "abstract-unix-dgram", "proto-dccp-cross-v4", "agent-sigkill-restart"} {
		if !KernelDependent(name) {
			t.Errorf("%s is not in the kernel-dependent selection", name)
		}
	}
	if KernelDependent("portal-cross-user-cross") || KernelDependent("udp-size-1472") || n == 0 || n >= len(cs) {
		t.Errorf("selection of %d of %d cases", n, len(cs))
	}
	t.Logf("%d of %d cases depend on the kernel", n, len(cs))
}
