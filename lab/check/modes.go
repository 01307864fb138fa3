package check

import (
	"context"
	"fmt"
	"sort"
	"sync"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Expectation states what a mode expects of one case. It is called once
// per case after the matrix is built; the case carries both parties'
// identities (from NSS), the addresses, the path and the listener node's
// policy, so a data plane can state its own semantics (for example what it
// does with traffic to the outside host) without running anything.
type Expectation func(c *Case) Verdict

var (
	modesMu sync.Mutex
	modes   = map[string]Expectation{
		"none":     ExpectOpen,
		"userwall": ExpectPolicy,
		"audit":    ExpectAudit,
	}
)

// RegisterMode makes `palisade-lab check --mode name` use e. Data planes call it
// from an init function; registering a name twice replaces the first.
func RegisterMode(name string, e Expectation) {
	modesMu.Lock()
	defer modesMu.Unlock()
	modes[name] = e
}

// Modes lists the registered modes.
func Modes() []string {
	modesMu.Lock()
	defer modesMu.Unlock()
	out := make([]string, 0, len(modes))
	for n := range modes {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Settler waits, after the listeners are up and before any connector
// runs, until a mode's data plane has taken in what it learns from them
// (the userwall agent: the member lists of the listeners' groups). An
// acknowledgement to wait on, not a sleep; an error is reported as a
// warning and the run goes on (the cases then show what went wrong).
type Settler func(ctx context.Context, tb *testbed.Testbed, cases []*Case) error

var settlers = map[string]Settler{}

// RegisterSettler sets mode's Settler.
func RegisterSettler(mode string, s Settler) {
	modesMu.Lock()
	defer modesMu.Unlock()
	settlers[mode] = s
}

func lookupSettler(mode string) Settler {
	modesMu.Lock()
	defer modesMu.Unlock()
	return settlers[mode]
}

func lookupMode(name string) (Expectation, error) {
	modesMu.Lock()
	defer modesMu.Unlock()
	if e, ok := modes[name]; ok {
		return e, nil
	}
	return nil, fmt.Errorf("unknown check mode %q (known: %v)", name, sortedKeys(modes))
}

func sortedKeys(m map[string]Expectation) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// ExpectOpen is mode none: nothing is isolated — today's shared cluster,
// and the problem Palisade solves.
func ExpectOpen(*Case) Verdict { return Verdict{Allow: true, Rule: "open"} }

// RuleUnmanaged is the verdict rule for listeners off the cluster: no
// Palisade data plane runs on the outside host, so a node reaching it is
// only ordinary routed traffic.
const RuleUnmanaged = "unmanaged-listener"

// ExpectPolicy is mode userwall: the policy core's verdict, with the
// listener node's configured policy. A connection between processes of one
// node is local (identity first hand); one from another node carries the
// source address the listener's node sees, so the off-cluster rule applies
// to the outside host.
func ExpectPolicy(c *Case) Verdict {
	if !c.Managed() {
		return Verdict{Allow: true, Rule: RuleUnmanaged}
	}
	if c.Policy == nil {
		// Run refuses to start a policy mode without every node's policy;
		// reaching here is a bug, and it must not pass silently.
		return Verdict{Allow: false, Rule: "no-policy"}
	}
	pol := c.Policy
	if c.Path == Unix && len(pol.Rules) > 0 {
		// Abstract Unix sockets have no port: the built-in rules decide
		// them (docs/policy.md, Site rules).
		p := *pol
		p.Rules = nil
		pol = &p
	}
	v := pol.Decide(c.Conn())
	if !v.Allow && unverified(c) {
		return Verdict{Allow: true, Rule: RuleUnverified}
	}
	return Verdict{Allow: v.Allow, Rule: string(v.Rule)}
}
