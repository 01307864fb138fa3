package uvn

import "testing"

// TestFailAtEnvNotShipped: a regular build ignores $PALISADE_UVN_FAIL_AT
// (only -tags palisade_fault_injection reads it).
func TestFailAtEnvNotShipped(t *testing.T) {
	t.Setenv("PALISADE_UVN_FAIL_AT", "vxlan")
	want := ""
	if faultInjection {
		want = "vxlan"
	}
	if got := New(&Config{}, nil).FailAt; got != want {
		t.Errorf("FailAt = %q, want %q (fault injection built in: %v)", got, want, faultInjection)
	}
}
