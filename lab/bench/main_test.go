package bench

import (
	"os"
	"testing"

	"github.com/palisade-hpc/palisade/lab/check"
	egresslab "github.com/palisade-hpc/palisade/lab/modes/egress"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	uvnlab "github.com/palisade-hpc/palisade/lab/modes/uvn"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

// TestMain wires the data planes as cmd/palisade-lab does.
func TestMain(m *testing.M) {
	testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{})
	RegisterDriver(userwalllab.ModeName, UserwallDriver())
	testbed.RegisterMode(uvnlab.ModeName, uvnlab.UVNMode{})
	check.RegisterMode(uvnlab.ModeName, uvnlab.ExpectUVN)
	RegisterDriver(uvnlab.ModeName, UVNDriver())
	testbed.RegisterExtension(egresslab.Name, egresslab.Ext{})
	RegisterDriver(egresslab.Name, EgressGatewayDriver())
	testbed.RegisterVM(vm.Handler{})
	check.RegisterVMRelay(vm.RelayCheck)
	os.Exit(m.Run())
}
