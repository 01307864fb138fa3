// Package vmcheck runs the isolation matrix in a VM testbed for the VM tests
// (lab/kernels, lab/modes/uvn): `palisade-lab check --json` inside the
// guest through the host's relay, judged as a whole. It lives apart from
// lab/vm because lab/vm may not import lab/check (userwall's own VM test
// imports lab/vm, and lab/check imports userwall).
package vmcheck

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

// Matrix runs `check --json args...` in tb's guest and requires a full pass:
// exit 0, no failed case, at least min cases. It returns the report for the
// caller's own requirements (paths, launchers, rules seen).
func Matrix(t *testing.T, ctx context.Context, tb *testbed.Testbed, min int, args ...string) *check.JSONReport {
	t.Helper()
	t0 := time.Now()
	var stdout, stderr bytes.Buffer
	code, err := vm.RelayCheck(ctx, tb, append([]string{"check", "--json"}, args...), &stdout, &stderr)
	if err != nil {
		t.Fatalf("relay: %v\n%s", err, stderr.String())
	}
	rep, err := check.ParseJSON(stdout.Bytes())
	if err != nil {
		t.Fatalf("check exited %d, output is not a report: %v\n%s\n%s", code, err, stdout.String(), stderr.String())
	}
	t.Logf("check %v: %d passed, %d failed in %v (exit %d); warnings %v", args, rep.Passed, rep.Failed,
		time.Since(t0).Round(time.Second), code, rep.Warnings)
	if rep.Failed != 0 || code != 0 || rep.Passed != len(rep.Cases) || rep.Passed < min {
		t.Errorf("want all of ≥%d cases passed and exit 0: %d passed, %d failed of %d, exit %d", min, rep.Passed, rep.Failed, len(rep.Cases), code)
		n := 0
		for _, c := range rep.Cases {
			if !c.Pass && n < 40 {
				n++
				t.Log(c)
			}
		}
		t.Logf("stderr:\n%s", stderr.String())
	}
	return rep
}
