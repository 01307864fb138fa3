package kernel

import (
	"sort"

	"github.com/cilium/ebpf"
)

// readCounters reads the decision counters and, if audit is not nil, the
// audit counters (refusals audit mode let through).
func readCounters(m, audit *ebpf.Map) ([]Counter, error) {
	out, err := readCounterMap(m, false)
	if err != nil || audit == nil {
		return out, err
	}
	more, err := readCounterMap(audit, true)
	out = append(out, more...)
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Path != out[j].Path {
			return out[i].Path < out[j].Path
		}
		return out[i].Rule < out[j].Rule
	})
	return out, err
}

func readCounterMap(m *ebpf.Map, audit bool) ([]Counter, error) {
	var out []Counter
	for p, pname := range pathNames {
		for r := 1; r < numRules; r++ {
			if _, ok := ruleNames[uwbpfUwRule(r)]; !ok {
				continue
			}
			var per []uint64
			if err := m.Lookup(uint32(int(p)*numRules+r), &per); err != nil {
				return nil, err
			}
			var sum uint64
			for _, v := range per {
				sum += v
			}
			if sum > 0 {
				out = append(out, Counter{Path: pname, Rule: RuleName(uint8(r)), Allowed: RuleAllows(uint8(r)) && !audit, Audit: audit, Count: sum})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Path != out[j].Path {
			return out[i].Path < out[j].Path
		}
		return out[i].Rule < out[j].Rule
	})
	return out, nil
}
