package userwall

import (
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// grantFixture is a store over fake listeners and a fake kernel map: the
// agent's rules for grants, without a data plane.
type grantFixture struct {
	s         *grantStore
	pol       *policy.Policy
	listeners map[uint16][]uint32
	kernel    []policy.Grant
	writes    int
	now       time.Time
	lines     []string
}

func newGrantFixture() *grantFixture {
	f := &grantFixture{pol: policy.Default(), listeners: map[uint16][]uint32{}, now: time.Unix(1_800_000_000, 0)}
	res := &identity.Table{
		Users:  []identity.User{{Name: "alice", UID: 2001, GID: 2001}, {Name: "bob", UID: 2002, GID: 2002}, {Name: "carol", UID: 2003, GID: 2003}},
		Groups: []identity.Group{{Name: "proj2", GID: 2200, Members: []string{"bob"}}},
	}
	f.s = &grantStore{
		pol: func() *policy.Policy { return f.pol }, res: res, node: "node1",
		log:       slog.New(slog.NewTextHandler(io.Discard, nil)),
		logLine:   func(b []byte) { f.lines = append(f.lines, string(b)) },
		listeners: func(p uint16) ([]uint32, error) { return f.listeners[p], nil },
		write: func(gs []policy.Grant) error {
			f.writes++
			f.kernel = gs
			return nil
		},
		now: func() time.Time { return f.now },
	}
	return f
}

func TestGrantForgeryRefused(t *testing.T) {
	f := newGrantFixture()
	f.listeners[8888] = []uint32{2001} // alice's Jupyter
	// bob grants himself (or carol) alice's port: refused, nothing written.
	for _, with := range []string{"bob", "carol", "@proj2"} {
		_, err := f.s.handle(2002, GrantRequest{Op: "share", Port: 8888, With: []string{with}})
		if err == nil || !strings.Contains(err.Error(), "you hold no TCP listener on port 8888") {
			t.Fatalf("bob sharing alice's 8888 with %s: %v", with, err)
		}
	}
	if f.writes != 0 || len(f.s.active()) != 0 {
		t.Fatalf("a refused grant changed the kernel: %d writes, %v", f.writes, f.kernel)
	}
	// Positive control: alice shares her own port.
	a, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 8888, With: []string{"bob"}, For: "2h"})
	if err != nil || len(a.Grants) != 1 || len(f.kernel) != 1 {
		t.Fatalf("alice's share: %v %v %v", a, err, f.kernel)
	}
	g := f.kernel[0]
	if g.Owner != 2001 || g.Port != 8888 || g.Grantee != 2002 || g.Group || !g.Expires.Equal(f.now.Add(2*time.Hour)) {
		t.Fatalf("kernel grant %+v", g)
	}
	// bob cannot revoke alice's grant either.
	if _, err := f.s.handle(2002, GrantRequest{Op: "unshare", Port: 8888}); err == nil || len(f.kernel) != 1 {
		t.Fatalf("bob unsharing alice's grant: %v, kernel %v", err, f.kernel)
	}
	if len(f.lines) != 1 || !strings.Contains(f.lines[0], `"grant":"created"`) {
		t.Fatalf("event log: %q", f.lines)
	}
}

func TestGrantBounds(t *testing.T) {
	f := newGrantFixture()
	f.listeners[8888] = []uint32{2001}
	f.listeners[9999] = []uint32{2001}
	f.pol.Grants.MaxPerUser = 2
	f.pol.Grants.Max, f.pol.Grants.Default = 4*time.Hour, time.Hour
	for _, c := range []struct {
		req  GrantRequest
		want string
	}{
		{GrantRequest{Op: "share", Port: 8888, With: []string{"bob"}, For: "5h"}, "exceeds this cluster's maximum of 4h0m0s"},
		{GrantRequest{Op: "share", Port: 8888, With: []string{"bob"}, For: "-1h"}, "want a positive duration"},
		{GrantRequest{Op: "share", Port: 22, With: []string{"bob"}}, "is a system port"},
		{GrantRequest{Op: "share", Port: 8888, With: []string{"mallory"}}, "mallory"},
		{GrantRequest{Op: "share", Port: 8888, With: []string{"alice"}}, "your own listeners"},
		{GrantRequest{Op: "share", Port: 8888, With: []string{"bob", "carol", "@proj2"}}, "exceed this cluster's limit of 2 per user"},
	} {
		if _, err := f.s.handle(2001, c.req); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.req, err, c.want)
		}
	}
	if f.writes != 0 {
		t.Fatalf("refused requests wrote the kernel map %d times", f.writes)
	}
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 8888, With: []string{"bob", "@proj2"}}); err != nil {
		t.Fatal(err)
	}
	// Sharing again renews, and does not count twice.
	f.now = f.now.Add(time.Hour)
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 8888, With: []string{"bob"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 9999, With: []string{"carol"}}); err == nil {
		t.Fatal("a third grant passed the limit of 2")
	}
	if len(f.kernel) != 2 || !f.kernel[1].Expires.Equal(f.now.Add(-time.Hour).Add(time.Hour)) {
		t.Fatalf("kernel: %v", f.kernel)
	}
	// The site switch: no new grants, and the sweep removes the old ones.
	f.pol.Grants.Disabled = true
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 9999, With: []string{"carol"}}); err == nil || !strings.Contains(err.Error(), "disabled") {
		t.Fatalf("share with grants disabled: %v", err)
	}
	f.s.sweep()
	if len(f.kernel) != 0 || len(f.s.active()) != 0 {
		t.Fatalf("grants left after the site disabled them: %v", f.kernel)
	}
}

func TestGrantSweep(t *testing.T) {
	f := newGrantFixture()
	f.listeners[8888] = []uint32{2001}
	f.listeners[9000] = []uint32{2001}
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 8888, With: []string{"bob"}, For: "10m"}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.s.handle(2001, GrantRequest{Op: "share", Port: 9000, With: []string{"carol"}, For: "1h"}); err != nil {
		t.Fatal(err)
	}
	f.s.sweep()
	if len(f.kernel) != 2 {
		t.Fatalf("sweep removed live grants: %v", f.kernel)
	}
	// alice's listener on 9000 closes and bob binds the port: the grant
	// (keyed on alice) goes, and never names bob's socket.
	f.listeners[9000] = []uint32{2002}
	f.now = f.now.Add(11 * time.Minute) // and 8888's expires
	f.s.sweep()
	if len(f.kernel) != 0 {
		t.Fatalf("grants left: %v", f.kernel)
	}
	var whys []string
	for _, l := range f.lines[2:] {
		whys = append(whys, l[strings.Index(l, `"grant":`):][:20])
	}
	if got := strings.Join(whys, " "); !strings.Contains(got, `"grant":"expired"`) || !strings.Contains(got, `"grant":"closed"`) {
		t.Fatalf("events %q", f.lines)
	}
}

func TestGrantAdmits(t *testing.T) {
	exp := time.Unix(1_800_000_000, 0)
	p := policy.Default()
	p.ClusterSubnets = nil
	gs := []policy.Grant{{Owner: 2001, Port: 8888, Grantee: 2002, Expires: exp}, {Owner: 2001, Port: 8888, Grantee: 2200, Group: true, Expires: exp}}
	conn := func(cuid uint32, groups []uint32, luid uint32, port uint16, proto policy.Proto, at time.Time) policy.Conn {
		return policy.Conn{Connector: policy.Identity{UID: cuid, GID: cuid, Groups: groups}, Listener: policy.Identity{UID: luid, GID: luid},
			Port: port, Proto: proto, Grants: gs, At: at}
	}
	before := exp.Add(-time.Second)
	for _, c := range []struct {
		name string
		c    policy.Conn
		want policy.Rule
	}{
		{"grantee", conn(2002, nil, 2001, 8888, policy.TCP, before), policy.RuleUserGrant},
		{"group member", conn(2003, []uint32{2200}, 2001, 8888, policy.TCP, before), policy.RuleUserGrant},
		{"someone else", conn(2003, nil, 2001, 8888, policy.TCP, before), policy.RuleDenied},
		{"another owner's socket on the port", conn(2002, nil, 2003, 8888, policy.TCP, before), policy.RuleDenied},
		{"another port", conn(2002, nil, 2001, 8889, policy.TCP, before), policy.RuleDenied},
		{"udp", conn(2002, nil, 2001, 8888, policy.UDP, before), policy.RuleDenied},
		{"expired", conn(2002, nil, 2001, 8888, policy.TCP, exp), policy.RuleDenied},
	} {
		if v := p.Decide(c.c); v.Rule != c.want {
			t.Errorf("%s: %v, want %s", c.name, v, c.want)
		}
	}
	c := conn(2002, nil, 2001, 8888, policy.TCP, before)
	if e := p.Explain(c); !strings.Contains(e, "2001's grant on 8888/tcp to 2002, expires 2027-01-15 08:00:00 UTC") {
		t.Errorf("explain: %s", e)
	}
	p.Grants.Disabled = true
	if v := p.Decide(c); v.Rule != policy.RuleDenied {
		t.Errorf("grants disabled: %v", v)
	}
}
