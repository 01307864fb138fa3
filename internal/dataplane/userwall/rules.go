package userwall

import "github.com/palisade-hpc/palisade/internal/policy"

// Rule numbers of the C programs (enum uw_rule) and their policy names.
var ruleNames = map[uint8]string{
	1:  string(policy.RuleSameUser),
	2:  string(policy.RuleSharedGroup),
	3:  string(policy.RuleSystemPort),
	4:  string(policy.RuleExemptConnector),
	5:  string(policy.RuleExemptListener),
	6:  string(policy.RuleOffClusterPort),
	7:  string(policy.RuleOffClusterDenied),
	8:  string(policy.RuleDenied),
	9:  "udp-reply",
	10: "no-listener",
	11: "unix-reply",
}

const numRules = 16

// pathNames are the places a decision is taken (enum uw_path).
var pathNames = []string{"local-tcp", "local-udp", "remote-tcp", "remote-udp", "unix"}

func ruleName(r uint8) string {
	if n, ok := ruleNames[r]; ok {
		return n
	}
	return "unknown"
}

func ruleAllows(r uint8) bool { return r != 7 && r != 8 }

func pathName(p uint8) string {
	if int(p) < len(pathNames) {
		return pathNames[p]
	}
	return "unknown"
}

// Counter is one (path, rule) decision count summed over CPUs.
type Counter struct {
	Path    string `json:"path"`
	Rule    string `json:"rule"`
	Allowed bool   `json:"allowed"`
	Count   uint64 `json:"count"`
}

// ReadCounters sums the per-CPU decision counters.
func (d *Dataplane) ReadCounters() ([]Counter, error) {
	return readCounters(d.Map("counters"))
}
