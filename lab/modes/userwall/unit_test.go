package userwall

import (
	"slices"
	"strings"
	"testing"
)

// TestAgentUnitParses: the lab reads the shipped unit's sandbox (no root
// needed), and refuses a setting it would not emulate, so that the testbed
// never silently runs agents differently from the unit.
func TestAgentUnitParses(t *testing.T) {
	u, err := AgentUnit()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"bpf", "net_admin", "sys_admin", "sys_ptrace", "dac_read_search", "chown"} {
		if !slices.Contains(u.Caps, c) {
			t.Errorf("unit caps %v lack %s", u.Caps, c)
		}
	}
	if !u.NoNewPrivs || !slices.Contains(u.ReadOnly, "/etc") || !slices.Contains(u.ReadOnly, "/home") {
		t.Errorf("sandbox %+v", u)
	}
	p := strings.Join(u.Prefix(), " ")
	if !strings.Contains(p, "--bounding-set=-all,+") || !strings.Contains(p, "--no-new-privs") || !strings.Contains(p, "unshare --mount --propagation slave") {
		t.Errorf("prefix %s", p)
	}
	for _, bad := range []string{"User=palisade", "ProtectSystem=strict", "CapabilityBoundingSet=~CAP_SYS_BOOT", "PrivateTmp=yes"} {
		if _, err := parseUnit("[Service]\nCapabilityBoundingSet=CAP_BPF\n" + bad + "\n"); err == nil {
			t.Errorf("%s: accepted, but the lab does not emulate it", bad)
		}
	}
}
