package check

import (
	"context"
	"io"
	"sync"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// VMRelay runs `palisade <args…>` (args start with "check") where a VM
// testbed's native testbed lives — inside the guest — copying its output,
// and returns its exit status. The VM's owner registers it: the matrix
// itself must run next to the nodes, since connectors read their plans and
// write their results in the testbed's directory.
type VMRelay func(ctx context.Context, tb *testbed.Testbed, args []string, stdout, stderr io.Writer) (exit int, err error)

var (
	relayMu sync.Mutex
	relay   VMRelay
)

// RegisterVMRelay installs the relay for VM testbeds.
func RegisterVMRelay(r VMRelay) {
	relayMu.Lock()
	defer relayMu.Unlock()
	relay = r
}

// Relay returns the registered relay, or nil.
func Relay() VMRelay {
	relayMu.Lock()
	defer relayMu.Unlock()
	return relay
}
