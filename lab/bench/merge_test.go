package bench

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestRemerge: re-merging keeps only what the run measured itself and takes
// every other mode — including a newer run of a mode the run had merged
// from an older file — from the other file.
func TestRemerge(t *testing.T) {
	sample := func(mode string, v float64) Sample {
		return Sample{Mode: mode, Variant: Enforced, Round: 1, Bench: "conn", Series: "s", X: 1, Metric: "m", Value: v}
	}
	mine := &Results{
		Modes: []ModeStatus{
			{Name: "egress", Status: "ran", Reason: "measured in the run of 2026-11-22 07:39 UTC (full, 3 rounds)"},
			{Name: "userwall", Status: "ran"},
		},
		Samples: []Sample{sample("egress", 1), sample("userwall", 2)},
		Costs:   []Cost{{Mode: "egress", Ops: 1}, {Mode: "userwall", Ops: 2, AcctOps: 3}},
		Errors:  []string{"egress round 1 mode: old", "userwall round 2 mode: mine"},
	}
	other := Results{
		Modes:   []ModeStatus{{Name: "egress", Status: "ran"}, {Name: "userwall", Status: "ran"}},
		Samples: []Sample{sample("egress", 10), sample("userwall", 20)},
		Costs:   []Cost{{Mode: "egress", Ops: 10}, {Mode: "userwall", Ops: 20}},
		Errors:  []string{"egress round 1 mode: new", "userwall round 1 mode: theirs"},
	}
	b, err := json.Marshal(other)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "results.json")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	Remerge(mine, path)
	got := map[string]float64{}
	for _, s := range mine.Samples {
		got[s.Mode] = s.Value
	}
	if len(mine.Samples) != 2 || got["userwall"] != 2 || got["egress"] != 10 {
		t.Errorf("samples %+v: want userwall 2 (this run) and egress 10 (the other file)", mine.Samples)
	}
	ops := map[string]float64{}
	for _, c := range mine.Costs {
		ops[c.Mode] = c.ProgOps()
	}
	if len(mine.Costs) != 2 || ops["userwall"] != 3 || ops["egress"] != 10 {
		t.Errorf("costs %+v", mine.Costs)
	}
	if !slices.Equal(mine.Errors, []string{"userwall round 2 mode: mine", "egress round 1 mode: new"}) {
		t.Errorf("errors %q: want this run's userwall error and the other file's egress error", mine.Errors)
	}
	for _, m := range mine.Modes {
		if m.Name == "userwall" && mergedFrom(m) || m.Name == "egress" && !mergedFrom(m) {
			t.Errorf("mode %+v: userwall is this run's, egress the other file's", m)
		}
	}
	if len(mine.Figures) == 0 {
		t.Error("figures not recomputed")
	}
}
