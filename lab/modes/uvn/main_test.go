package uvn

import (
	"os"
	"testing"

	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

// TestMain wires what cmd/palisade-lab wires for uvn: the mode, its
// expectation and the VM testbed.
func TestMain(m *testing.M) {
	testbed.RegisterMode(ModeName, UVNMode{})
	testbed.RegisterVM(vm.Handler{})
	check.RegisterMode(ModeName, ExpectUVN)
	check.RegisterVMRelay(vm.RelayCheck)
	os.Exit(m.Run())
}
