package policy

import "testing"

func TestParsePortRange(t *testing.T) {
	for s, want := range map[string]PortRange{"1": {1, 1}, "65535": {65535, 65535}, " 80 - 90 ": {80, 90}, "5-5": {5, 5}} {
		if got, err := ParsePortRange(s); err != nil || got != want {
			t.Errorf("ParsePortRange(%q) = %v, %v", s, got, err)
		}
	}
	for _, s := range []string{"", "-", "1-", "-5", "0", "65536", "5-4", "1-2-3", "a", "1.5"} {
		if r, err := ParsePortRange(s); err == nil {
			t.Errorf("ParsePortRange(%q) = %v, want error", s, r)
		}
	}
}
