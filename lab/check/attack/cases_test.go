package attack

import (
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
