package userwall

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/identity"
)

func TestEventRateLimit(t *testing.T) {
	s := sinkLimited(10)
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
	if sinkLimited(0).allow(now) {
		t.Error("rate 0 must log nothing")
	}
	if (&eventSink{}).allow(now) {
		t.Error("rate 0 must log nothing")
	}
}

func sinkLimited(perSec int) *eventSink {
	s := &eventSink{}
	s.out.Store(&sinkOutputs{limit: newEventLimit(perSec)})
	return s
}

func TestDecodeEvent(t *testing.T) {
	tab, err := identity.ParseTables([]byte("alice:x:2001:2001::/home/alice:/bin/sh\nbob:x:2002:2002::/home/bob:/bin/sh\n"),
		[]byte("alice:x:2001:\nbob:x:2002:\nproj1:x:2100:alice,bob\n"))
	if err != nil {
		t.Skip("identity.ParseTables:", err)
	}
	s := &eventSink{node: "node1", names: identity.NewNameCache(tab, time.Minute)}
	r := kernel.RawEvent{Cuid: 2002, Cgid: 2002, Luid: 2001, Lgid: 2100, Sport: 40000, Dport: 5000,
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
