package attack

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// instance is this package's own testbed (other packages test in parallel).
var instance = testbed.RunName("at")

var tb *testbed.Testbed

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		fmt.Println("attack: integration tests need root (and no -short)")
		os.Exit(m.Run())
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

// TestSuite runs every attack case with its control.
func TestSuite(t *testing.T) {
	needTestbed(t)
	// A guard against a hang only: speed is the bench's (ci1: 4m13s on a
	// machine at load 25 failed a "< 3 min" target that was here).
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	t0 := time.Now()
	res, err := RunSuite(ctx, tb, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	passed, failed, na := WriteReport(&out, res, false)
	t.Logf("attack suite in %v:\n%s", time.Since(t0).Round(time.Second), out.String())
	if len(res) < 30 || passed+failed+na != len(Cases()) {
		t.Errorf("%d cases ran (%d passed, %d failed, %d n/a) of %d", len(res), passed, failed, na, len(Cases()))
	}
	for _, r := range res {
		if r.Status() == "FAIL" {
			t.Errorf("%s", r.Line())
		}
	}
}

// TestChurn runs a short churn: zero attacks may succeed.
func TestChurn(t *testing.T) {
	needTestbed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	opts := ChurnOptions{Duration: 30 * time.Second, Every: 2 * time.Second}
	rep, err := Churn(ctx, tb, opts)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	failed := rep.Write(&out)
	t.Logf("%s", out.String())
	if failed > 0 {
		t.Errorf("churn: %d failures", failed)
	}
	ls, lok, as, _ := rep.Totals()
	if ls < 500 || as < 500 {
		t.Errorf("only %d legitimate and %d attack attempts", ls, as)
	}
	if float64(lok) < 0.95*float64(ls) {
		t.Errorf("legitimate success %d/%d below 95 %%", lok, ls)
	}
	if !strings.Contains(out.String(), "sigkill") {
		t.Errorf("no SIGKILL disruption ran")
	}
}
