package sockowner

import (
	"encoding/json"
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
)

func TestParseTarget(t *testing.T) {
	for _, c := range []struct {
		in    string
		addr  string
		proto policy.Proto
		err   string
	}{
		{"198.18.0.2:5000", "198.18.0.2:5000", policy.TCP, ""},
		{"198.18.0.2:5000/udp", "198.18.0.2:5000", policy.UDP, ""},
		{"198.18.0.2:5000/TCP", "198.18.0.2:5000", policy.TCP, ""},
		{"[2001:2::1]:6000/udp", "[2001:2::1]:6000", policy.UDP, ""},
		{"[::ffff:198.18.0.1]:80", "198.18.0.1:80", policy.TCP, ""},
		{"198.18.0.2:5000/sctp", "", 0, "unknown protocol"},
		{"198.18.0.2", "", 0, "bad address"},
		{"2001:2::1:6000", "", 0, "bad address"},
		{"198.18.0.2:0", "", 0, "port 0"},
		{"node1:22", "", 0, "bad address"},
	} {
		ap, p, err := ParseTarget(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("ParseTarget(%q) err = %v, want %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || ap.String() != c.addr || p != c.proto {
			t.Errorf("ParseTarget(%q) = %v %v %v, want %v %v", c.in, ap, p, err, c.addr, c.proto)
		}
	}
}

func TestQueryRoundTrip(t *testing.T) {
	in := parsedQuery{ID: 42, Proto: policy.UDP, Addr: netip.MustParseAddrPort("[2001:2::1]:6000"),
		Peer: netip.MustParseAddrPort("[2001:2::2]:700"), Node: netip.MustParseAddr("198.18.0.2")}
	out, bad := decodeQuery(encodeQuery(in))
	if bad != nil || !reflect.DeepEqual(out, in) {
		t.Fatalf("round trip: %+v %+v, want %+v", out, bad, in)
	}
}

func TestDecodeQueryRejects(t *testing.T) {
	for _, c := range []struct{ in, status, msg string }{
		{`{`, StatusBadQuery, "malformed"},
		{`{"v":2,"id":7,"proto":"tcp","addr":"198.18.0.1:80"}`, StatusBadVersion, "version 2"},
		{`{"id":7,"proto":"tcp","addr":"198.18.0.1:80"}`, StatusBadVersion, "version 0"},
		{`{"v":1,"id":7,"proto":"icmp","addr":"198.18.0.1:80"}`, StatusBadQuery, "protocol"},
		{`{"v":1,"id":7,"proto":"tcp","addr":"198.18.0.1"}`, StatusBadQuery, "bad addr"},
		{`{"v":1,"id":7,"proto":"tcp","addr":"198.18.0.1:0"}`, StatusBadQuery, "bad addr"},
		{`{"v":1,"id":7,"proto":"tcp","addr":"198.18.0.1:80","peer":"x"}`, StatusBadQuery, "bad peer"},
		{`{"v":1,"id":7,"proto":"tcp","addr":"198.18.0.1:80","node":"node1"}`, StatusBadQuery, "bad node"},
	} {
		_, a := decodeQuery([]byte(c.in))
		if a == nil || a.Status != c.status || !strings.Contains(a.Error, c.msg) {
			t.Errorf("decodeQuery(%s) = %+v, want %s %q", c.in, a, c.status, c.msg)
		}
		if a != nil && c.in != `{` && a.ID != 7 {
			t.Errorf("decodeQuery(%s): answer id %d, want the query's 7", c.in, a.ID)
		}
	}
}

func TestAnswerRoundTrip(t *testing.T) {
	o := Owner{UID: 2001, User: "alice", GID: 2100, Group: "proj1", Groups: []uint32{2001, 2100}, PID: 99, Command: "python3"}
	got, err := decodeAnswer(encodeAnswer(answerFor(5, o, nil)), 5)
	if err != nil || got.UID != o.UID || got.GID != o.GID || !slices.Equal(got.Groups, o.Groups) || got.PID != o.PID || got.Command != o.Command || got.User != "alice" {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if _, err := decodeAnswer(encodeAnswer(answerFor(5, o, nil)), 6); !errors.Is(err, errStaleAnswer) {
		t.Errorf("answer to another id: %v, want stale", err)
	}
	if _, err := decodeAnswer(encodeAnswer(answerFor(5, Owner{}, ErrNoSocket)), 5); !errors.Is(err, ErrNoSocket) {
		t.Errorf("no-socket answer: %v", err)
	}
	if _, err := decodeAnswer(encodeAnswer(answerFor(5, Owner{}, errors.New("boom"))), 5); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("error answer: %v", err)
	}
	if _, err := decodeAnswer([]byte(`{"v":1,"id":5,"status":"ok"}`), 5); err == nil {
		t.Error("ok answer without owner accepted")
	}
	// A huge group list is truncated, and says so, to bound the datagram.
	big := Owner{Groups: make([]uint32, 5000)}
	a := answerFor(1, big, nil)
	if !a.Truncated || len(a.Owner.Groups) != maxGroups || len(encodeAnswer(a)) > maxAnswer {
		t.Errorf("big answer: truncated=%v groups=%d size=%d", a.Truncated, len(a.Owner.Groups), len(encodeAnswer(a)))
	}
}

func TestDiagEncoding(t *testing.T) {
	req := encodeReq(unix.AF_INET6, policy.UDP, allStates,
		netip.MustParseAddrPort("[2001:2::1]:6000"), netip.MustParseAddrPort("[2001:2::2]:99"))
	if len(req) != reqLen || req[0] != unix.AF_INET6 || req[1] != 17 || req[8] != 6000>>8 || req[9] != 6000&0xff || req[11] != 99 || req[12] != 0x20 || req[28+15] != 2 {
		t.Errorf("inet_diag_req_v2 layout: % x", req)
	}
	// An inet_diag_msg for 198.18.0.1:5000 listening, uid 2001, inode 77.
	msg := make([]byte, msgLen)
	msg[0], msg[1] = unix.AF_INET, tcpListen
	msg[4], msg[5] = 5000>>8, 5000&0xff
	copy(msg[8:], []byte{198, 18, 0, 1})
	msg[64], msg[65] = 2001&0xff, 2001>>8
	msg[68] = 77
	s, err := decodeMsg(msg)
	if err != nil || s.Local != netip.MustParseAddrPort("198.18.0.1:5000") || s.UID != 2001 || s.Inode != 77 || !s.listening(policy.TCP) {
		t.Errorf("decodeMsg: %+v %v", s, err)
	}
	if _, err := decodeMsg(msg[:40]); err == nil {
		t.Error("short message accepted")
	}
}

func TestScore(t *testing.T) {
	ap := netip.MustParseAddrPort
	listener := diagSocket{Family: unix.AF_INET6, State: tcpListen, Local: ap("[::]:5000"), Remote: ap("[::]:0"), Inode: 1}
	accepted := diagSocket{Family: unix.AF_INET, State: 1, Local: ap("198.18.0.1:5000"), Remote: ap("198.18.0.2:700"), Inode: 2}
	other := diagSocket{Family: unix.AF_INET, State: tcpListen, Local: ap("198.18.0.9:5000"), Inode: 3}
	timewait := diagSocket{Family: unix.AF_INET, State: 6, Local: ap("198.18.0.1:5000"), Remote: ap("198.18.0.2:701")}
	q := ap("198.18.0.1:5000")
	if !(score(listener, q, netip.AddrPort{}, policy.TCP) > score(accepted, q, netip.AddrPort{}, policy.TCP)) {
		t.Error("a listener must beat an accepted connection on its port")
	}
	if score(accepted, q, ap("198.18.0.2:700"), policy.TCP) < 0 || score(listener, q, ap("198.18.0.2:700"), policy.TCP) >= 0 {
		t.Error("a peer selects the connection, not the listener")
	}
	if score(other, q, netip.AddrPort{}, policy.TCP) >= 0 || score(timewait, q, netip.AddrPort{}, policy.TCP) >= 0 {
		t.Error("other addresses and owner-less sockets must not match")
	}
}

// TestStatusQuery: a status query is recognised by its kind, answered with
// the configured report (or an error without one); an unknown kind is a
// bad query, and a lookup is not taken for a status query.
func TestStatusQuery(t *testing.T) {
	q, _ := json.Marshal(Query{V: Version, ID: 7, Kind: KindStatus})
	s := &Server{cfg: ServerConfig{Report: func() (json.RawMessage, error) { return json.RawMessage(`{"mode":"userwall"}`), nil }}}
	a := s.answerUDP(q)
	if a.Status != StatusOK || a.ID != 7 || string(a.Report) != `{"mode":"userwall"}` || a.Owner != nil {
		t.Errorf("status query: %+v", a)
	}
	if s.Stats().StatusReports != 1 {
		t.Errorf("stats: %+v", s.Stats())
	}
	s.cfg.Report = func() (json.RawMessage, error) { return nil, errors.New("no pins") }
	if a := s.answerUDP(q); a.Status != StatusError || !strings.Contains(a.Error, "no pins") || a.Report != nil {
		t.Errorf("failing report: %+v", a)
	}
	s.cfg.Report = nil
	if a := s.answerUDP(q); a.Status != StatusError || a.Report != nil {
		t.Errorf("no report configured: %+v", a)
	}
	bad, _ := json.Marshal(Query{V: Version, ID: 8, Kind: "reboot"})
	if a := s.answerUDP(bad); a.Status != StatusBadQuery || !strings.Contains(a.Error, "reboot") {
		t.Errorf("unknown kind: %+v", a)
	}
	if pq, a := decodeQuery(encodeQuery(parsedQuery{ID: 9, Addr: netip.MustParseAddrPort("198.18.0.1:5000")})); a != nil || pq.Kind != "" {
		t.Errorf("lookup decoded as %+v, %+v", pq, a)
	}
}
