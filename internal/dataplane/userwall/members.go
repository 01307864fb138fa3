package userwall

import (
	"context"
	"slices"
	"sync/atomic"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/membership"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// newMembers is the agent's membership tracker (package membership): direct
// NSS lookups of the groups local processes hold and of refused connectors,
// plus the local files; never an enumeration of the directory.
func (a *agent) newMembers() *membership.Tracker {
	c := &a.cfg.Agent
	return membership.New(membership.Config{
		Lookup:     &membership.Getent{},
		Files:      func() (*identity.Table, error) { return identity.ReadFiles("/etc/passwd", "/etc/group") },
		LocalGIDs:  membership.LocalGIDs,
		LocalUIDs:  membership.LocalUIDs,
		ApplyKnown: a.dp.SetKnownUsers,
		ExtraGIDs:  a.exempt.groups,
		Apply: func(m identity.Membership) error {
			err := a.dp.SetMembers(m)
			a.exempt.note(m)
			return err
		},
		Refresh: c.GroupRefreshInterval(),
		Rate:    membership.DefaultRate,
		OnError: func(err error) {
			a.log.Warn("group membership lookups failed (those groups have no members until the next round)", "err", err)
		},
	})
}

// groupExempts resolves the "@group" exemptions: the main loop sets the
// groups (setGroups, with each policy it applies), the tracker notes their
// members after every round (note) and signals a change on changed, and the
// main loop then applies the policy with those uids added (withUIDs).
type groupExempts struct {
	gids atomic.Pointer[[2][]uint32] // connector, listener exempt gids
	uids atomic.Pointer[[2][]uint32] // their members' uids
	// ruleGids are the groups site rules name: tracked like exempt groups;
	// their members reach the kernel through SetMembers (sitemaps.go).
	ruleGids atomic.Pointer[[]uint32]
	changed  chan struct{}
}

func (e *groupExempts) setGroups(p *policy.Policy) {
	e.gids.Store(&[2][]uint32{p.ExemptConnectorGroups, p.ExemptListenerGroups})
	var rg []uint32
	for _, r := range p.Rules {
		for _, g := range append(slices.Clone(r.FromGroups), r.ToGroups...) {
			if !slices.Contains(rg, g) {
				rg = append(rg, g)
			}
		}
	}
	e.ruleGids.Store(&rg)
}

// groups lists every exempt gid and every gid a site rule names (for the
// tracker).
func (e *groupExempts) groups() []uint32 {
	var out []uint32
	if g := e.gids.Load(); g != nil {
		out = append(slices.Clone(g[0]), g[1]...)
	}
	if rg := e.ruleGids.Load(); rg != nil {
		out = append(out, *rg...)
	}
	return out
}

func (e *groupExempts) note(m identity.Membership) {
	g := e.gids.Load()
	if g == nil {
		return
	}
	var now [2][]uint32
	for i := range now {
		for uid, gids := range m {
			if slices.ContainsFunc(gids, func(x uint32) bool { return slices.Contains(g[i], x) }) {
				now[i] = append(now[i], uid)
			}
		}
		slices.Sort(now[i])
	}
	if old := e.uids.Load(); old != nil && slices.Equal(old[0], now[0]) && slices.Equal(old[1], now[1]) {
		return
	}
	e.uids.Store(&now)
	select {
	case e.changed <- struct{}{}:
	default:
	}
}

// withUIDs returns p with the exempt groups' current members added to
// its exempt uids (p itself is not changed).
func (e *groupExempts) withUIDs(p *policy.Policy) *policy.Policy {
	u := e.uids.Load()
	if u == nil || (len(p.ExemptConnectorGroups) == 0 && len(p.ExemptListenerGroups) == 0) {
		return p
	}
	q := *p
	add := func(list, more []uint32) []uint32 {
		out := slices.Clone(list)
		for _, x := range more {
			if !slices.Contains(out, x) {
				out = append(out, x)
			}
		}
		return out
	}
	if len(p.ExemptConnectorGroups) > 0 {
		q.ExemptConnectors = add(p.ExemptConnectors, u[0])
	}
	if len(p.ExemptListenerGroups) > 0 {
		q.ExemptListeners = add(p.ExemptListeners, u[1])
	}
	return &q
}

// applyGroupExempts re-applies the running policy after the exempt
// groups' members changed (main loop).
func (a *agent) applyGroupExempts() {
	if err := a.dp.ApplyPolicy(a.exempt.withUIDs(a.cfg.Policy), a.cfg.Agent.Audit); err != nil {
		a.log.Error("exempt groups' members not applied", "err", err)
	}
}

// runMembers runs the tracker; the returned func stops it and waits.
func (a *agent) runMembers(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.members.Run(ctx)
	}()
	return func() { cancel(); <-done }
}
