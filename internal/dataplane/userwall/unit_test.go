package userwall

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

func TestLPMKey(t *testing.T) {
	k := lpmKey(netip.MustParsePrefix("198.18.0.0/24"))
	if k.Prefixlen != 120 || k.Addr[10] != 0xff || k.Addr[11] != 0xff || k.Addr[12] != 198 || k.Addr[13] != 18 {
		t.Errorf("v4 key %+v", k)
	}
	k = lpmKey(netip.MustParsePrefix("2001:2::/64"))
	if k.Prefixlen != 64 || k.Addr[0] != 0x20 || k.Addr[1] != 0x01 || k.Addr[3] != 0x02 {
		t.Errorf("v6 key %+v", k)
	}
}

func TestRuleNamesMatchPolicy(t *testing.T) {
	// The C enum's names are the policy core's rule names.
	for r, want := range map[uint8]policy.Rule{1: policy.RuleSameUser, 2: policy.RuleSharedGroup, 3: policy.RuleSystemPort,
		4: policy.RuleExemptConnector, 5: policy.RuleExemptListener, 6: policy.RuleOffClusterPort,
		7: policy.RuleOffClusterDenied, 8: policy.RuleDenied} {
		if ruleName(r) != string(want) {
			t.Errorf("rule %d: %s, want %s", r, ruleName(r), want)
		}
		if ruleAllows(r) == (want == policy.RuleDenied || want == policy.RuleOffClusterDenied) {
			t.Errorf("rule %d: allows=%v", r, ruleAllows(r))
		}
	}
}

func TestEventRateLimit(t *testing.T) {
	s := &eventSink{limit: newEventLimit(10)}
	now := time.Now()
	n := 0
	for i := 0; i < 100; i++ {
		if s.allow(now) {
			n++
		}
	}
	if n != 50 {
		t.Errorf("burst: %d allowed, want 50 (5 s at 10/s)", n)
	}
	if s.allow(now.Add(50 * time.Millisecond)) {
		t.Error("a token after 0.05 s at 10/s")
	}
	if !s.allow(now.Add(200 * time.Millisecond)) {
		t.Error("no token after 0.2 s at 10/s")
	}
	if (&eventSink{limit: newEventLimit(0)}).allow(now) {
		t.Error("rate 0 must log nothing")
	}
	if (&eventSink{}).allow(now) {
		t.Error("rate 0 must log nothing")
	}
}

func TestDecodeEvent(t *testing.T) {
	tab, err := identity.ParseTables([]byte("alice:x:2001:2001::/home/alice:/bin/sh\nbob:x:2002:2002::/home/bob:/bin/sh\n"),
		[]byte("alice:x:2001:\nbob:x:2002:\nproj1:x:2100:alice,bob\n"))
	if err != nil {
		t.Skip("identity.ParseTables:", err)
	}
	s := &eventSink{node: "node1", names: identity.NewNameCache(tab, time.Minute)}
	r := uwbpfUwEvent{Cuid: 2002, Cgid: 2002, Luid: 2001, Lgid: 2100, Sport: 40000, Dport: 5000,
		Proto: 6, Family: 4, Rule: 8, Path: 2, HasConnector: 1}
	src, dst := netip.MustParseAddr("::ffff:198.18.0.2").As16(), netip.MustParseAddr("::ffff:198.18.0.1").As16()
	r.Saddr, r.Daddr = src, dst
	var buf bytes.Buffer
	binary.Write(&buf, binary.NativeEndian, &r)
	e, err := s.decode(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if e.Rule != "default-deny" || e.Path != "remote-tcp" || e.Proto != "tcp" || e.Src != "198.18.0.2:40000" ||
		e.Dst != "198.18.0.1:5000" || e.Connector == nil || e.Connector.User != "bob" || e.Listener.Group != "proj1" {
		t.Errorf("decoded %+v (connector %+v)", e, e.Connector)
	}
}
