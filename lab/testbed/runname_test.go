package testbed

import (
	"os"
	"testing"
)

// TestRunName: a run's names are valid instance names, differ by kind, and
// carry this process as their owner.
func TestRunName(t *testing.T) {
	a, b := RunName("xa"), RunName("xb")
	for _, n := range []string{a, b} {
		if err := validateName(n); err != nil || len(n) != 10 {
			t.Errorf("RunName: %q (%v), want a valid 10-character name", n, err)
		}
	}
	if a == b || a != RunName("xa") {
		t.Errorf("RunName: %q and %q", a, b)
	}
	if pid, start := owner(); pid != os.Getpid() || start == 0 {
		t.Errorf("owner() = %d, %d: want this test process", pid, start)
	}
	t.Setenv(OwnerEnv, "1")
	if pid, _ := owner(); pid != 1 {
		t.Errorf("owner() with %s=1: %d", OwnerEnv, pid)
	}
}
