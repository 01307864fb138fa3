package vm

import (
	"context"
	"io"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// RelayCheck runs `palisade-lab check …` inside the guest against its native
// testbed (same instance name and paths there) and relays its output.
func RelayCheck(ctx context.Context, tb *testbed.Testbed, args []string, stdout, stderr io.Writer) (int, error) {
	return Exec(ctx, Dir(tb), Request{Op: "sh", Argv: append([]string{tb.LabBinary}, args...)}, nil, stdout, stderr)
}
