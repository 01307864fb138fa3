package vm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// RelayCheck runs `palisade-lab check …` inside the guest against its native
// testbed (same instance name and paths there) and relays its output.
func RelayCheck(ctx context.Context, tb *testbed.Testbed, args []string, stdout, stderr io.Writer) (int, error) {
	return Exec(ctx, Dir(tb), Request{Op: "sh", Argv: append([]string{tb.LabBinary}, args...)}, nil, stdout, stderr)
}

// RelayCheckReport runs `palisade-lab check --json args…` in the guest and
// decodes its report: code is check's exit status, stderr its log.
func RelayCheckReport(ctx context.Context, tb *testbed.Testbed, args []string) (rep *check.JSONReport, code int, stderr string, err error) {
	var out, log bytes.Buffer
	code, err = RelayCheck(ctx, tb, append([]string{"check", "--json"}, args...), &out, &log)
	if err != nil {
		return nil, code, log.String(), fmt.Errorf("relay: %w", err)
	}
	rep = &check.JSONReport{}
	if err := json.Unmarshal(out.Bytes(), rep); err != nil {
		return nil, code, log.String(), fmt.Errorf("check exited %d, output is not a report: %w\n%s", code, err, out.String())
	}
	return rep, code, log.String(), nil
}
