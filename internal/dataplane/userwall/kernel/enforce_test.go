package kernel

import (
	"strings"
	"testing"
)

func probeWith(fs ...Feature) *Probe { return &Probe{Kernel: "6.1.0", Features: fs} }

// TestPlan: what enforces is decided from the probe and the settings alone.
func TestPlan(t *testing.T) {
	tcx := Feature{Name: FeatTCX, Present: true}
	cls := Feature{Name: FeatClsact, Present: true}
	lsmOn := Feature{Name: FeatLSMActive, Present: true, Detail: "/sys/kernel/security/lsm"}
	lsmOff := Feature{Name: FeatLSMActive, Detail: "/sys/kernel/security/lsm"}
	attach := Feature{Name: FeatLSMAttach, Present: true}
	noAttach := Feature{Name: FeatLSMAttach, Detail: "EPERM"}
	for _, c := range []struct {
		name     string
		p        *Probe
		tc       string
		unix     bool
		wantTC   bool
		wantLSM  string // "" enforced, else a substring of NoLSM
		wantFail bool
	}{
		{"all there", probeWith(tcx, cls, lsmOn, attach), "auto", true, false, "", false},
		{"no tcx: tc", probeWith(cls, lsmOn, attach), "auto", true, true, "", false},
		{"tc asked", probeWith(tcx, cls, lsmOn, attach), "tc", true, true, "", false},
		{"tcx asked, missing", probeWith(cls, lsmOn, attach), "tcx", true, false, "", true},
		{"unix off", probeWith(tcx, lsmOn, attach), "auto", false, false, "unix_sockets = false", false},
		{"LSM not in the list", probeWith(tcx, lsmOff, noAttach), "auto", true, false, "not enabled", false},
		{"LSM cannot attach", probeWith(tcx, lsmOn, noAttach), "auto", true, false, "cannot attach", false},
	} {
		e, err := Plan(c.p, c.tc, c.unix)
		if (err != nil) != c.wantFail {
			t.Errorf("%s: err %v, want failure %v", c.name, err, c.wantFail)
			continue
		}
		if err != nil {
			continue
		}
		if e.TC != c.wantTC || e.TCWhy == "" {
			t.Errorf("%s: TC %v (%q), want %v", c.name, e.TC, e.TCWhy, c.wantTC)
		}
		switch {
		case c.wantLSM == "" && e.NoLSM != nil:
			t.Errorf("%s: NoLSM %v, want enforced", c.name, e.NoLSM)
		case c.wantLSM != "" && (e.NoLSM == nil || !strings.Contains(e.NoLSM.Error(), c.wantLSM)):
			t.Errorf("%s: NoLSM %v, want %q", c.name, e.NoLSM, c.wantLSM)
		}
	}
}
