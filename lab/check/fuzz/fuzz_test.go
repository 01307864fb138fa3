package fuzz

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/check"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// instance is this package's own testbed (other packages test in parallel).
var instance = testbed.RunName("fz")

var tb *testbed.Testbed

// fuzzBudget is the short run in `make test`; PALISADE_FUZZ_BUDGET (a
// duration) and PALISADE_FUZZ_SEED change it for a longer or other run.
var (
	fuzzBudget = 75 * time.Second
	fuzzSeed   = uint64(20)
)

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		fmt.Println("fuzz: integration tests need root (and no -short)")
		os.Exit(m.Run())
	}
	if d, err := time.ParseDuration(os.Getenv("PALISADE_FUZZ_BUDGET")); err == nil {
		fuzzBudget = d
	}
	if s := os.Getenv("PALISADE_FUZZ_SEED"); s != "" {
		fmt.Sscan(s, &fuzzSeed)
	}
	testbed.RegisterMode(uwlab.ModeName, uwlab.TestbedMode{}) // as cmd/palisade-lab wires it
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	testbed.DownOrphans(ctx)
	var err error
	tb, err = testbed.Up(ctx, testbed.Options{Name: instance, Nodes: 2, Mode: "userwall"})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testbed up:", err)
		_ = testbed.Down(context.Background(), instance)
		os.Exit(1)
	}
	code := m.Run()
	if err := testbed.Down(context.Background(), instance); err != nil {
		fmt.Fprintln(os.Stderr, "testbed down:", err)
		code = 1
	}
	os.Exit(code)
}

func needTestbed(t *testing.T) {
	t.Helper()
	if tb == nil {
		t.Skip("needs root and the " + instance + " testbed")
	}
}

// TestFuzz runs the fuzzer for its short budget with a fixed seed: no
// attacker's byte may reach a sentinel the policy refuses him, and the same
// programs as alice must reach hers.
func TestFuzz(t *testing.T) {
	needTestbed(t)
	ctx, cancel := context.WithTimeout(context.Background(), fuzzBudget+5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, tb, Options{Duration: fuzzBudget, Seed: fuzzSeed, Mode: "userwall", Log: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	rep.Write(&out)
	t.Logf("\n%s", out.String())
	if rep.Failed() {
		t.Errorf("the fuzzer failed (seed %d): see the report", rep.Seed)
	}
	if rep.Rounds < 10 || rep.SendsOK < 10 {
		t.Errorf("only %d programs, %d accepted sends", rep.Rounds, rep.SendsOK)
	}
	if rep.ControlDelivered == 0 || rep.Probes == 0 {
		t.Errorf("the positive control delivered %d, %d probes", rep.ControlDelivered, rep.Probes)
	}
}

// setAudit switches node's agent to audit mode (decide and log, refuse
// nothing) or back, by reload: one node with every check removed.
func setAudit(t *testing.T, node string, on bool) {
	t.Helper()
	n, _ := tb.Node(node)
	p := tb.ConfigPath(node)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	const mark = "audit = true # fuzz test\n"
	s := strings.Replace(string(b), mark, "", 1)
	if on {
		s = strings.Replace(s, "[agent]\n", "[agent]\n"+mark, 1)
	}
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := uwlab.NodeCommand(context.Background(), tb, n, "agent", "--reload").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "configuration reloaded") {
		t.Fatalf("%s: reload (audit %v): %v %s", node, on, err, out)
	}
}

// TestFuzzCatchesAuditNode proves the fuzzer can fail: with node2's agent
// in audit mode (every check there removed), the same fuzzer must find a
// leak into node2's sentinels, and reduce it to a minimal program that
// still leaks on its own.
func TestFuzzCatchesAuditNode(t *testing.T) {
	needTestbed(t)
	setAudit(t, "node2", true)
	defer setAudit(t, "node2", false)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, tb, Options{Duration: 60 * time.Second, Seed: fuzzSeed, Mode: "userwall", Log: t.Logf,
		Minimize: 1, StopAfter: 1})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	rep.Write(&out)
	t.Logf("\n%s", out.String())
	if len(rep.Findings) == 0 {
		t.Fatalf("audit mode on node2: the fuzzer found no leak in %d programs (seed %d)", rep.Rounds, rep.Seed)
	}
	fd := rep.Findings[0]
	for _, l := range fd.Leaks {
		if !strings.HasPrefix(l.Sentinel, "node2/") {
			t.Errorf("leak into %s: only node2 is in audit mode", l.Sentinel)
		}
	}
	if fd.Minimal == nil || !fd.Reproduced {
		t.Fatalf("the finding was not reduced to a program that leaks alone")
	}
	if len(fd.Minimal.Steps) > len(fd.Program.Steps) || len(fd.Minimal.Steps) > 4 {
		t.Errorf("minimal program has %d steps (of %d):\n%s", len(fd.Minimal.Steps), len(fd.Program.Steps), fd.Minimal)
	}
	if !rep.Failed() || !strings.Contains(out.String(), fmt.Sprintf("seed %d", rep.Seed)) {
		t.Errorf("a run with a finding must fail and print its seed")
	}
}

// TestFuzzSeesSharedGroup: the data plane lets bob, a proj1 member, reach
// alice's sockets under sg proj1 (rule shared-group). Judged by an
// expectation without that rule, the same fuzzer must report his deliveries
// there — and only there: the judge tells the rules apart, and the
// attackers' programs really reach what the rule opens.
func TestFuzzSeesSharedGroup(t *testing.T) {
	needTestbed(t)
	base, err := check.Expect("userwall")
	if err != nil {
		t.Fatal(err)
	}
	noShared := func(c *check.Case) check.Verdict {
		d := *c
		d.Connector.Groups = nil
		d.Connector.GID = d.Connector.UID // private group = uid in the testbed
		return base(&d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, tb, Options{Duration: 90 * time.Second, Seed: fuzzSeed, Mode: "userwall", Log: t.Logf,
		Expect: noShared, Minimize: -1, StopAfter: 1})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	rep.Write(&out)
	t.Logf("\n%s", out.String())
	var shared int
	for _, fd := range rep.Findings {
		if fd.Known != "" {
			continue
		}
		for _, l := range fd.Leaks {
			if fd.Program.User != "bob" || !strings.Contains(l.Sentinel, "/alice+proj1/") {
				t.Errorf("round %d: %s's leak into %s: only bob's into proj1 sentinels are expected", fd.Round, fd.Program.User, l.Sentinel)
			}
			shared++
		}
	}
	if shared == 0 {
		t.Errorf("judged without shared-group, no delivery of bob into proj1 sentinels in %d programs", rep.Rounds)
	}
}

// TestRegressions replays the minimal programs of fixed findings: none may
// leak, and each, run as alice, must reach her sockets (the path is there).
func TestRegressions(t *testing.T) {
	needTestbed(t)
	for _, r := range Regressions {
		t.Run(r.Name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			p := r.Program
			rep, err := Run(ctx, tb, Options{Seed: fuzzSeed, Mode: "userwall", Replay: &p, Minimize: -1})
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			rep.Write(&out)
			if rep.Failed() || len(rep.Findings) > 0 {
				t.Errorf("replay of\n%s\n%s", p.String(), out.String())
			}
			if rep.ControlDelivered == 0 {
				t.Errorf("the same program as alice reached nothing:\n%s", out.String())
			}
		})
	}
}
