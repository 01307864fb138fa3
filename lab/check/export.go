package check

import (
	"fmt"
	"os"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// What other judges of the testbed's traffic (the attack fuzzer) share
// with the matrix: the modes' expectations, the nodes' policies and the
// parties' identities, so that every tool decides "allowed" one way.

// Expect returns mode's registered expectation.
func Expect(mode string) (Expectation, error) { return lookupMode(mode) }

// SettlerFor returns mode's Settler, or nil.
func SettlerFor(mode string) Settler { return lookupSettler(mode) }

// ConnectorParty is user as a connector: uid, primary gid and every group
// from res (as setpriv --init-groups, sshd and slurmstepd give them).
func ConnectorParty(res identity.Resolver, user string) (Party, error) {
	return connectorParty(res, user)
}

// ListenerParty is user (under `sg group` if group is not "") as a
// listener named name.
func ListenerParty(res identity.Resolver, name, user, group string) (Party, error) {
	return party(res, name, user, group)
}

// NodePolicies reads every node's policy as the data plane there reads it.
// With strict, a node whose configuration does not load is an error;
// otherwise it is left out.
func NodePolicies(tb *testbed.Testbed, res identity.Resolver, strict bool) (map[string]*policy.Policy, error) {
	pols := map[string]*policy.Policy{}
	for _, n := range tb.Nodes {
		data, err := os.ReadFile(tb.ConfigPath(n.Name))
		var cfg *config.Config
		if err == nil {
			cfg, err = config.Parse(tb.ConfigPath(n.Name), data, res)
		}
		if err != nil {
			if strict {
				return nil, fmt.Errorf("policy of %s: %w", n.Name, err)
			}
			continue
		}
		pols[n.Name] = cfg.Policy
	}
	return pols, nil
}
