package uvnconfig

import (
	"slices"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// SiteNote is something uvn does differently from policy.Decide with one
// site rule (config check reports each as a WARNING on a uvn node).
type SiteNote struct {
	Rule int
	Msg  string
}

// SiteNotes lists the site rules uvn cannot enforce as written, and why
// (docs/policy.md, "Enforcement"). srun is SrunPortRange (zero: unknown);
// callers are the accounts that may call back into it besides root and
// those below minUID: Slurm's (SlurmUser, SlurmdUser) and [uvn]
// exempt_users, whose uids may be above min_uid (Debian's slurm: 64030).
func SiteNotes(p *policy.Policy, minUID int64, srun policy.PortRange, callers []uint32) []SiteNote {
	var out []SiteNote
	for i := range p.Rules {
		r := &p.Rules[i]
		if r.Allow && r.Relation != policy.SameUser {
			out = append(out, SiteNote{i, "uvn: an allow rule opens nothing beyond a user's own listeners (other users' and off-cluster " +
				"connections never reach a user's VRF): in uvn it only decides, before later deny rules, connections within one user's VRF"})
		}
		if len(r.ToGroups) > 0 {
			out = append(out, SiteNote{i, "uvn: to = \"@group\" matches the listener's user's membership of the group, not the socket's gid " +
				"(nftables' input hook does not see the receiving socket)"})
		}
		system := len(r.FromGroups) > 0 || slices.ContainsFunc(r.From, func(u uint32) bool { return int64(u) < minUID || slices.Contains(callers, u) })
		overlaps := len(r.Ports) == 0 || srun == (policy.PortRange{}) || slices.ContainsFunc(r.Ports, srun.Overlaps)
		if !r.Allow && system && overlaps {
			out = append(out, SiteNote{i, "uvn: Slurm's callbacks into SrunPortRange carry no identity uvn can see: this rule's from " +
				"does not match them (only rules without from and relation apply to them)"})
		}
	}
	return out
}
