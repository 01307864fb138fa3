package config

import (
	"slices"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// "@group" in the exempt lists: the group's members are exempt.
func TestExemptGroups(t *testing.T) {
	c, err := Parse("g.toml", []byte("[policy]\nexempt_connectors = [\"root\", \"@proj1\"]\nexempt_listeners = [\"@2001\", \"svc\"]\n"), users)
	if err != nil {
		t.Fatal(err)
	}
	p := c.Policy
	if !slices.Equal(p.ExemptConnectors, []uint32{0}) || !slices.Equal(p.ExemptConnectorGroups, []uint32{2100}) ||
		!slices.Equal(p.ExemptListeners, []uint32{2004}) || !slices.Equal(p.ExemptListenerGroups, []uint32{2001}) {
		t.Fatalf("exempt %v %v / %v %v", p.ExemptConnectors, p.ExemptConnectorGroups, p.ExemptListeners, p.ExemptListenerGroups)
	}
	// Round trip through Describe.
	c2, err := Parse("d.toml", []byte(c.Describe(users)), users)
	if err != nil || !slices.Equal(c2.Policy.ExemptConnectorGroups, []uint32{2100}) || !slices.Equal(c2.Policy.ExemptListenerGroups, []uint32{2001}) {
		t.Fatalf("Describe round trip: %v\n%s", err, c.Describe(users))
	}
	carol := policy.Identity{UID: 2003, GID: 2003}
	bob := policy.Identity{UID: 2002, GID: 2002, Groups: []uint32{2100}}
	for _, tc := range []struct {
		conn, lis policy.Identity
		want      policy.Rule
	}{
		{bob, carol, policy.RuleExemptConnector},                                  // bob holds proj1
		{carol, bob, policy.RuleDenied},                                           // carol does not; bob's listener not exempt
		{carol, policy.Identity{UID: 2001, GID: 2001}, policy.RuleExemptListener}, // listener runs as group 2001
	} {
		if v := p.Decide(policy.Conn{Connector: tc.conn, Listener: tc.lis, Port: 5000}); v.Rule != tc.want {
			t.Errorf("%+v → %+v: %s, want %s", tc.conn, tc.lis, v.Rule, tc.want)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{`exempt_connectors = ["@"]`, `policy.exempt_connectors`},
		{`exempt_listeners = ["@proj1", "@2100"]`, `duplicate: "@2100" is gid 2100, already listed as "@proj1"`},
	} {
		if _, err := Parse("b.toml", []byte("[policy]\n"+tc.in+"\n"), users); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want %q", tc.in, err, tc.want)
		}
	}
}
