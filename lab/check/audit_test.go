package check

import (
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// TestAuditEvents: a case the policy refuses passes in audit mode only when
// its listener's node logged an audit event for it during the run.
func TestAuditEvents(t *testing.T) {
	start := time.Now()
	mk := func(conn, lis string, port uint16) *Case {
		c := &Case{Proto: policy.TCP, Connector: Party{Name: conn, User: conn, Node: "node2"},
			Listener: Party{Name: lis, User: lis, Node: "node1"}, Dst: netip.MustParseAddrPort("198.18.0.1:29101"),
			Src: netip.MustParseAddr("198.18.0.2"), Observed: Observation{State: Allowed}}
		c.Dst = netip.AddrPortFrom(c.Dst.Addr(), port)
		c.Expected = Verdict{Allow: true, Rule: "default-deny", Audit: true}
		return c
	}
	logged, missing, old, other := mk("bob", "alice", 29101), mk("carol", "alice", 29101), mk("bob", "alice", 29102), mk("bob", "alice", 29103)
	plain := mk("alice", "alice", 29104)
	plain.Expected = Verdict{Allow: true, Rule: "same-user"}
	ev := func(at time.Time, verdict, conn, dst string) uw.Event {
		return uw.Event{Time: at, Verdict: verdict, Proto: "tcp", Connector: &uw.Party{User: conn},
			Listener: uw.Party{User: "alice"}, Dst: dst, Src: "198.18.0.2:40000"}
	}
	path := filepath.Join(t.TempDir(), "node1.jsonl")
	f, _ := os.Create(path)
	e := json.NewEncoder(f)
	e.Encode(ev(start.Add(time.Second), "audit", "bob", "198.18.0.1:29101"))
	e.Encode(ev(start.Add(-time.Hour), "audit", "bob", "198.18.0.1:29102")) // an earlier run's
	e.Encode(ev(start.Add(time.Second), "deny", "bob", "198.18.0.1:29103")) // not an audit event
	f.Close()
	cases := []*Case{logged, missing, old, other, plain}
	matchAuditEvents(map[string]string{"node1": path}, start, 0, cases)
	if logged.AuditEvent != AuditLogged || !logged.Passed() {
		t.Errorf("logged case: %q pass %v", logged.AuditEvent, logged.Passed())
	}
	for _, c := range []*Case{missing, old, other} {
		if c.AuditEvent != AuditMissing || c.Passed() {
			t.Errorf("case %s→%s port %d: %q pass %v", c.Connector.Name, c.Listener.Name, c.Dst.Port(), c.AuditEvent, c.Passed())
		}
	}
	if plain.AuditEvent != "" || !plain.Passed() {
		t.Errorf("a case the policy allows needs no event: %q", plain.AuditEvent)
	}
}

// TestExpectStaged: traffic from a node that does not enforce yet is
// admitted as unverified; other cluster traffic keeps the policy's verdict.
func TestExpectStaged(t *testing.T) {
	p := &policy.Policy{SystemPortMax: 1023, ClusterSubnets: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")},
		UnenforcedNodes: []netip.Prefix{netip.MustParsePrefix("198.18.0.3/32")}}
	c := &Case{Proto: policy.TCP, Connector: Party{User: "bob", UID: 2002, GID: 2002, Groups: []uint32{2002}, Node: "node3"},
		Listener: Party{User: "alice", UID: 2001, GID: 2001, Node: "node1"}, Dst: netip.MustParseAddrPort("198.18.0.1:29101"),
		Src: netip.MustParseAddr("198.18.0.3"), Policy: p}
	if v := ExpectPolicy(c); !v.Allow || v.Rule != RuleUnverified {
		t.Errorf("from an unenforced node: %+v", v)
	}
	c.Src, c.Connector.Node = netip.MustParseAddr("198.18.0.2"), "node2"
	if v := ExpectPolicy(c); v.Allow {
		t.Errorf("between enforcing nodes: %+v", v)
	}
}
