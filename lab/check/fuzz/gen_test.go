package fuzz

import (
	"encoding/json"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func testWorld() *World {
	a := netip.MustParseAddr
	nodes := []NodeAddrs{
		NewNodeAddrs("node1", a("198.18.0.1"), a("2001:2::1"), a("198.19.0.1"), a("2001:2:0:1::1"), a("fe80::1").WithZone("eth0")),
		NewNodeAddrs("node2", a("198.18.0.2"), a("2001:2::2"), a("198.19.0.2"), a("2001:2:0:1::2"), a("fe80::2").WithZone("eth0")),
	}
	return &World{Nodes: nodes, Sentinels: BuildSentinels(nodes, 47000), Attackers: []string{"bob", "carol"},
		Owner: "alice", Slurm: true, Protos: []string{"mptcp", "tcp", "udp", "udplite"}, VictimUID: 2001, VictimGID: 2001}
}

// TestGenerateDeterministic: a seed and round always draw the same program,
// and different rounds draw different ones.
func TestGenerateDeterministic(t *testing.T) {
	w := testWorld()
	seen := map[string]bool{}
	for round := range 50 {
		a, _ := json.Marshal(Generate(w, 42, round))
		b, _ := json.Marshal(Generate(w, 42, round))
		if string(a) != string(b) {
			t.Fatalf("round %d: two draws differ:\n%s\n%s", round, a, b)
		}
		seen[string(a)] = true
	}
	if len(seen) < 45 {
		t.Errorf("50 rounds drew only %d distinct programs", len(seen))
	}
	a, _ := json.Marshal(Generate(w, 42, 0))
	b, _ := json.Marshal(Generate(w, 43, 0))
	if string(a) == string(b) {
		t.Errorf("seeds 42 and 43 drew the same first program")
	}
}

// TestGeneratedCallsExist: every option, flag and control message the
// generator draws is one the executor knows and can encode, every program
// sends something, and over many rounds every wrap, fd passing and every
// option appear.
func TestGeneratedCallsExist(t *testing.T) {
	w := testWorld()
	wraps := map[string]bool{}
	opts := map[string]bool{}
	peers := 0
	for round := range 3000 {
		p := Generate(w, 7, round)
		wraps[p.Wrap] = true
		if p.Peer != "" {
			peers++
			if p.Peer == p.User || !slices.ContainsFunc(p.Steps, func(s Step) bool { return s.Op == "passfd" }) {
				t.Fatalf("round %d: peer %s of %s without a passfd", round, p.Peer, p.User)
			}
		}
		if p.Wrap == "ssh" && (p.Via == "" || p.Via == p.Node) {
			t.Fatalf("round %d: ssh from %s to %q", round, p.Node, p.Via)
		}
		sends := 0
		for _, s := range append(slices.Clone(p.Steps), p.PeerSteps...) {
			if s.sends() {
				sends++
			}
			if s.Op == "setsockopt" {
				if _, ok := options[s.Opt]; !ok {
					t.Fatalf("round %d: unknown option %s", round, s.Opt)
				}
				opts[s.Opt] = true
			}
			for _, fl := range s.Flags {
				if _, ok := msgFlags[fl]; !ok {
					t.Fatalf("round %d: unknown flag %s", round, fl)
				}
			}
			for _, c := range s.Cmsgs {
				if _, err := cmsg(c); err != nil && !strings.Contains(err.Error(), "no such device") {
					t.Fatalf("round %d: %s=%s: %v", round, c.Type, c.Val, err)
				}
			}
			if s.String() == "" {
				t.Fatalf("round %d: step %+v renders empty", round, s)
			}
		}
		if sends == 0 {
			t.Fatalf("round %d sends nothing:\n%s", round, p)
		}
	}
	for _, wr := range []string{"", "sg", "unshare-r", "unshare-rn", "ssh", "srun", "su"} {
		if !wraps[wr] {
			t.Errorf("no program with wrap %q", wr)
		}
	}
	if peers == 0 {
		t.Errorf("no program passes a socket")
	}
	for o := range options {
		if !opts[o] {
			t.Errorf("option %s never drawn", o)
		}
	}
}

// TestDDMin: delta debugging finds the two steps a failure needs.
func TestDDMin(t *testing.T) {
	var steps []Step
	for i := range 13 {
		steps = append(steps, Step{Op: "setsockopt", S: i})
	}
	tests := 0
	got := ddmin(steps, func(ss []Step) bool {
		tests++
		has := func(i int) bool { return slices.ContainsFunc(ss, func(s Step) bool { return s.S == i }) }
		return has(3) && has(9)
	})
	if len(got) != 2 || got[0].S != 3 || got[1].S != 9 {
		t.Fatalf("ddmin kept %+v", got)
	}
	if tests > 60 {
		t.Errorf("ddmin needed %d tests for 13 steps", tests)
	}
}

// TestProgramString renders a program as readable calls.
func TestProgramString(t *testing.T) {
	p := &Program{Node: "node1", User: "bob", Wrap: "sg", Steps: []Step{
		{Op: "socket", Fam: 6, Proto: "udp"},
		{Op: "setsockopt", Opt: "SO_REUSEADDR", Val: "1"},
		{Op: "bind", Addr: "[::]:47010"},
		{Op: "sendmsg", Addr: "[2001:2::2]:47008", Size: 1472, Cmsgs: []Cmsg{{"IPV6_PKTINFO", "2001:2::1%eth0"}}, Flags: []string{"MSG_ZEROCOPY"}},
	}}
	want := `as bob on node1, under ` + "`sg proj1`" + `:
   0  s0 = socket(AF_INET6, SOCK_DGRAM, IPPROTO_UDP)
   1  setsockopt(s0, SOL_SOCKET, SO_REUSEADDR, 1)
   2  bind(s0, [::]:47010)
   3  sendmsg(s0, "PALATK <nonce>…" 1472 B, to [2001:2::2]:47008, cmsg{IPV6_PKTINFO=2001:2::1%eth0}, MSG_ZEROCOPY)
`
	if got := p.String(); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

// uvn's run leaves out exactly the link-local sentinels (a session cannot
// bind them), every other mode keeps them.
func TestSentinelsByDesign(t *testing.T) {
	ll := netip.MustParseAddr("fe80::1").WithZone("eth0")
	nodes := []NodeAddrs{NewNodeAddrs("node1", netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("2001:2::1"),
		netip.MustParseAddr("198.19.0.1"), netip.MustParseAddr("2001:2:0:1::1"), ll)}
	all := BuildSentinels(nodes, 47000)
	lls := 0
	for _, s := range all {
		if s.Form == "ll" {
			lls++
		}
	}
	if lls == 0 {
		t.Fatal("no link-local sentinels built")
	}
	kept, left := ForMode(all, "uvn")
	if len(kept) != len(all)-lls || left["ll"] == "" || len(left) != 1 {
		t.Errorf("uvn: kept %d of %d (%d link-local), left %v", len(kept), len(all), lls, left)
	}
	for _, s := range kept {
		if s.Form == "ll" {
			t.Errorf("uvn kept %s", s.Tag)
		}
	}
	for _, m := range []string{"userwall", "none"} {
		if kept, left := ForMode(all, m); len(kept) != len(all) || len(left) != 0 {
			t.Errorf("%s: kept %d of %d, left %v", m, len(kept), len(all), left)
		}
	}
}
