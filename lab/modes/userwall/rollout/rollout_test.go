// Package rollout_test proves the rollout settings of the userwall data
// plane on real testbeds of their own: audit mode (testbed up --audit,
// check --mode audit, then enforcement switched on by a reload) and a
// staged rollout (testbed up --agents node1,node2).
package rollout_test

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/check"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

func TestMain(m *testing.M) {
	testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{})
	os.Exit(m.Run())
}

func up(t *testing.T, opts testbed.Options) *testbed.Testbed {
	t.Helper()
	if os.Geteuid() != 0 || testing.Short() {
		t.Skip("needs root (and no -short): a testbed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	testbed.DownOrphans(ctx)
	tb, err := testbed.Up(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := testbed.Down(context.Background(), opts.Name); err != nil {
			t.Errorf("testbed down: %v", err)
		}
	})
	return tb
}

// matrix runs the isolation matrix in mode and fails the test on any
// mismatch; it returns the report.
func matrix(t *testing.T, tb *testbed.Testbed, mode string) *check.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	rep, err := check.Run(ctx, tb, check.Options{Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	if _, failed := rep.Counts(); failed > 0 {
		var b bytes.Buffer
		rep.MaxMismatches = 30
		rep.WriteTable(&b)
		t.Fatalf("check --mode %s: %d mismatches\n%s", mode, failed, b.String())
	}
	return rep
}

func rules(rep *check.Report) map[string]int {
	n := map[string]int{}
	for _, c := range rep.Cases {
		n[c.Expected.Rule]++
	}
	return n
}

// TestAuditMode: in audit mode every case of the matrix goes through and
// every case the policy refuses is in its listener node's event log as an
// audit event; a reload with audit = false then enforces, without a restart.
func TestAuditMode(t *testing.T) {
	tb := up(t, testbed.Options{Name: testbed.RunName("ra"), Nodes: 3, Mode: userwalllab.ModeName, Audit: true})
	rep := matrix(t, tb, "audit")
	audited := 0
	for _, c := range rep.Cases {
		if c.Expected.Audit {
			audited++
		}
	}
	if audited < 100 {
		t.Errorf("only %d cases refused by the policy: the matrix does not exercise audit mode", audited)
	}
	t.Logf("audit: %d cases, %d would-be refusals each found as an audit event", len(rep.Cases), audited)

	// Enforce: audit = false on every node, by reload.
	for _, n := range tb.Nodes {
		p := tb.ConfigPath(n.Name)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(p, bytes.Replace(b, []byte("audit = true"), []byte("audit = false"), 1), 0o644)
		out, err := userwalllab.NodeCommand(context.Background(), tb, n, "agent", "--reload").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "configuration reloaded") {
			t.Fatalf("%s: reload: %v %s", n.Name, err, out)
		}
	}
	rep = matrix(t, tb, "userwall")
	if r := rules(rep); r["default-deny"] == 0 {
		t.Errorf("no refusal after audit mode was switched off: %v", r)
	}
}

// TestStagedRollout: with the agent on node1 and node2 only, Slurm, MPI, ssh
// and each user's own traffic work across enforcing and non-enforcing
// nodes (the matrix expects the policy between enforcing nodes, open
// listeners on node3, and node3's identity-less traffic admitted as
// unverified), and between enforcing nodes other users stay refused.
func TestStagedRollout(t *testing.T) {
	tb := up(t, testbed.Options{Name: testbed.RunName("rs"), Nodes: 3, Mode: userwalllab.ModeName, Agents: []string{"node1", "node2"}})
	rep := matrix(t, tb, "userwall")
	r := rules(rep)
	if r[check.RuleUnverified] == 0 || r[check.RuleUnenforcedNode] == 0 || r["default-deny"] == 0 {
		t.Errorf("the matrix lacks unverified, unenforced-node or refused cases: %v", r)
	}
	// Refusals between the enforcing nodes, per launcher: Slurm and MPI
	// steps of other users stay refused there too.
	refused := map[check.Launcher]int{}
	for _, c := range rep.Cases {
		if !c.Expected.Allow && c.Connector.Node != "node3" && c.Listener.Node != "node3" && c.Observed.State == check.Refused {
			refused[c.Launcher]++
		}
	}
	for _, l := range check.Launchers {
		if refused[l] == 0 {
			t.Errorf("no refused case between enforcing nodes with launcher %s: %v", l, refused)
		}
	}
	t.Logf("staged: %d cases, rules %v", len(rep.Cases), r)
}
