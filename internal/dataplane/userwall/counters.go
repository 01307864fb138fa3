package userwall

import "github.com/cilium/ebpf"

func readCounters(m *ebpf.Map) ([]Counter, error) {
	var out []Counter
	for p := range pathNames {
		for r := 1; r < numRules; r++ {
			if _, ok := ruleNames[uint8(r)]; !ok {
				continue
			}
			var per []uint64
			if err := m.Lookup(uint32(p*numRules+r), &per); err != nil {
				return nil, err
			}
			var sum uint64
			for _, v := range per {
				sum += v
			}
			if sum > 0 {
				out = append(out, Counter{Path: pathNames[p], Rule: ruleName(uint8(r)), Allowed: ruleAllows(uint8(r)), Count: sum})
			}
		}
	}
	return out, nil
}
