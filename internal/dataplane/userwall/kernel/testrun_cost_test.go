package kernel

// The exact per-packet cost of the packet programs without traffic: every
// program of the object that judges packets (tc, cgroup skb; found by type)
// is run with BPF_PROG_TEST_RUN on canonical frames, many times per call,
// in test mode with the maps written by the agent's own writers (the
// differential test's harness and first world). An empty program of the
// same type on the same frame is the floor: what the hook and the test run
// cost by themselves. On demand only (it judges no behaviour):
//
//	PALISADE_TESTRUN_COSTS=1 go test -run TestRunCosts -v ./internal/dataplane/userwall/kernel
//
// PALISADE_TESTRUN_SITE_RULES=0,1000 (the default: 0) runs the table once per
// number of site rules: random rules none of the canonical packets match,
// so site_decide scans every mask word (its worst case).
// PALISADE_TESTRUN_SAMPLES=N sets flow_samples (default 0 here: none).
// PALISADE_TESTRUN_GRANTS=N puts N user grants (at most 8) on the
// listener's port, to groups the connector is not in (the worst case of
// grant_decide: every slot checked, a membership lookup each).
//
// `palisade-lab bench` reports the same programs' cost under real traffic
// (run-time statistics); docs/benchmarks puts both side by side.

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// costFrame is one canonical packet.
type costFrame struct {
	name   string
	frame  []byte
	sock   uwbpfUwTestSock
	egress bool // a packet this node sends (else one it receives)
	stamps bool // tc egress stamps it
}

func costFrames(w *world) []costFrame {
	local4, peer4 := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	local6, peer6 := netip.MustParseAddr("2001:2:0:1::1"), netip.MustParseAddr("2001:2:0:1::2")
	now := time.Now().UnixNano()
	alice := uwbpfUwTestSock{Uid: uAlice, Gid: uAlice, NowNs: now}
	lis := alice
	lis.TcpListener = 1
	var out []costFrame
	for _, v6 := range []bool{false, true} {
		l, p, fam := local4, peer4, "v4"
		if v6 {
			l, p, fam = local6, peer6, "v6"
		}
		in := func(name string, proto, flags uint8, kind stampKind, sock uwbpfUwTestSock) {
			cuid := uint32(uAlice)
			if strings.Contains(name, "another user") {
				cuid = uDaemon // shares no group with alice, not exempt: every rule consulted, refused
			}
			c := tcase{v6: v6, proto: proto, tcpFlags: flags, src: p, dst: l, sport: 40000, dport: 29203,
				stamp: kind, cuid: cuid, cgid: cuid, sock: sock}
			out = append(out, costFrame{name: name + " " + fam + ", received", frame: c.frame(w, Key{}), sock: sock})
		}
		outp := func(name string, proto, flags uint8) {
			c := tcase{v6: v6, proto: proto, tcpFlags: flags, src: l, dst: p, sport: 40000, dport: 29203, sock: alice}
			stamps := proto == ipUDP || flags == 0x02
			out = append(out, costFrame{name: name + " " + fam + ", sent", frame: c.frame(w, Key{}), sock: alice, egress: true, stamps: stamps})
		}
		in("established TCP data", ipTCP, 0x18, stNone, alice)
		outp("established TCP data", ipTCP, 0x18)
		in("SYN with stamp", ipTCP, 0x02, stValid, lis)
		in("SYN with stamp, another user's (refused)", ipTCP, 0x02, stValid, lis)
		in("SYN without stamp", ipTCP, 0x02, stNone, lis)
		outp("SYN (to stamp)", ipTCP, 0x02)
		in("UDP with stamp", ipUDP, 0, stValid, alice)
		in("UDP without stamp", ipUDP, 0, stNone, alice)
		outp("UDP (to stamp)", ipUDP, 0)
	}
	return out
}

// perRun is the mean time of one run: the least over batches of a
// Repeat-run test run (the least is the one least disturbed by the rest of
// the machine; the kernel runs the batch back to back).
func perRun(p *ebpf.Program, opts ebpf.RunOptions, repeat, batches int) (time.Duration, uint32, error) {
	opts.Repeat = uint32(repeat)
	best := time.Duration(1 << 62)
	var ret uint32
	for range batches {
		t0 := time.Now()
		r, err := p.Run(&opts)
		d := time.Since(t0)
		if err != nil {
			return 0, 0, err
		}
		ret = r
		best = min(best, d)
	}
	return best / time.Duration(repeat), ret, nil
}

func emptyProg(t ebpf.ProgramType, ret int32) (*ebpf.Program, error) {
	return ebpf.NewProgram(&ebpf.ProgramSpec{Type: t, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()}})
}

func TestRunCosts(t *testing.T) {
	if os.Getenv("PALISADE_TESTRUN_COSTS") == "" {
		t.Skip("on demand: PALISADE_TESTRUN_COSTS=1")
	}
	if os.Geteuid() != 0 {
		t.Skip("not root")
	}
	spec, err := loadUwbpf()
	if err != nil {
		t.Fatal(err)
	}
	for name, p := range spec.Programs {
		if p.Type != ebpf.SchedCLS && p.Type != ebpf.CGroupSKB {
			delete(spec.Programs, name)
		}
	}
	if err := spec.Variables["test_mode"].Set(uint32(1)); err != nil {
		t.Fatal(err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			t.Fatalf("load: %+v", verr)
		}
		t.Fatal(err)
	}
	defer coll.Close()
	h := &harness{d: &Dataplane{coll: coll, Node: diffNode}, testSock: coll.Maps["test_sock"]}
	counts := []int{0}
	if v := os.Getenv("PALISADE_TESTRUN_SITE_RULES"); v != "" {
		counts = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 0 || n > policy.MaxSiteRules {
				t.Fatalf("PALISADE_TESTRUN_SITE_RULES: bad count %q", f)
			}
			counts = append(counts, n)
		}
	}
	for _, n := range counts {
		w := worlds()[0]
		w.samples = 0 // no allowed verdict reported
		// PALISADE_TESTRUN_SAMPLES=N: the cost with [agent] flow_samples = N
		// (runs beyond the budget take the over-budget path).
		if n, err := strconv.Atoi(os.Getenv("PALISADE_TESTRUN_SAMPLES")); err == nil {
			w.samples = uint32(n)
		}
		rules := randomSiteRules(rand.New(rand.NewPCG(uint64(n), 7)), n)
		for i := range rules {
			rules[i].From, rules[i].FromGroups = []uint32{uCarol}, nil // alice sends every packet: none matches
		}
		w.pol.Rules = rules
		w.grants = nil
		if g, err := strconv.Atoi(os.Getenv("PALISADE_TESTRUN_GRANTS")); err == nil {
			exp := time.Unix(0, time.Now().UnixNano()+w.offset).Add(time.Hour)
			for i := range min(g, policy.GrantsPerPort) {
				w.grants = append(w.grants, policy.Grant{Owner: uAlice, Port: 29203, Grantee: 3000 + uint32(i), Group: true, Expires: exp})
				if i == g-1 && os.Getenv("PALISADE_TESTRUN_GRANT_HIT") != "" {
					w.grants[i] = policy.Grant{Owner: uAlice, Port: 29203, Grantee: uDaemon, Expires: exp} // the last slot admits the connector
				}
			}
		}
		w.apply(t, h)
		t.Logf("%d site rules, %d user grants:", n, len(w.grants))
		runCosts(t, h, coll, w)
	}
}

func runCosts(t *testing.T, h *harness, coll *ebpf.Collection, w *world) {
	ifindex := remoteIfindex()
	// The tc programs find the IP header through the interface's L2
	// length: the test runs' interface is a managed Ethernet one.
	if ifindex > 1 {
		if err := h.d.SetInterfaces(map[int]int{1: 14, ifindex: 14}); err != nil {
			t.Fatal(err)
		}
	}
	floors := map[ebpf.ProgramType]*ebpf.Program{}
	for _, typ := range []ebpf.ProgramType{ebpf.SchedCLS, ebpf.CGroupSKB} {
		p, err := emptyProg(typ, 1)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		floors[typ] = p
	}
	var names []string
	for n := range coll.Programs {
		names = append(names, n)
	}
	sort.Strings(names)
	const repeat, batches = 2000, 80
	var b strings.Builder
	fmt.Fprintf(&b, "| program | type | packet | ns per run | empty program (floor) | above the floor | returns |\n|---|---|---|---|---|---|---|\n")
	for _, f := range costFrames(w) {
		if err := h.testSock.Update(uint32(0), f.sock, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		opts := ebpf.RunOptions{Data: f.frame}
		if ifindex > 1 {
			opts.Context = skbCtx(ifindex)
		}
		for _, n := range names {
			p := coll.Programs[n]
			info, _ := p.Info()
			// Only the programs of the packet's direction: the ingress
			// hooks judge what arrives, the egress hooks what leaves.
			if strings.Contains(n, "egress") != f.egress {
				continue
			}
			// A test run repeats on the same skb: once stamped, tc egress
			// sees a stamped packet and leaves. Its stamping is timed one
			// run per call (the call's own cost is in the floor, timed
			// the same way).
			rep, bat := repeat, batches
			if n == "uw_tc_egress" && f.stamps {
				rep, bat = 1, repeat
			}
			d, ret, err := perRun(p, opts, rep, bat)
			if err != nil {
				t.Fatalf("%s on %s: %v", n, f.name, err)
			}
			fl, _, err := perRun(floors[info.Type], opts, rep, bat)
			if err != nil {
				t.Fatalf("floor on %s: %v", f.name, err)
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %.0f | %.0f | %.0f | %d |\n", n, info.Type, f.name, float64(d.Nanoseconds()), float64(fl.Nanoseconds()),
				float64(d.Nanoseconds()-fl.Nanoseconds()), ret)
		}
	}
	t.Logf("BPF_PROG_TEST_RUN, %d runs per call, least of %d calls (tc egress stamping: one run per call, least of %d), ifindex %d:\n%s",
		repeat, batches, repeat, ifindex, b.String())
}

// remoteIfindex is an interface index other than lo (the remote paths); 0
// if the host has none. Nothing is sent on it.
func remoteIfindex() int {
	ifs, err := net.Interfaces()
	if err != nil {
		return 0
	}
	for _, i := range ifs {
		if i.Index > 1 {
			return i.Index
		}
	}
	return 0
}
