// Command palisade-lab is Palisade's lab: the simulated cluster (testbed),
// the isolation matrix (check), the benchmarks (bench), the VM testbed (vm)
// and the traffic probes (probe). It runs the product binary (palisade,
// expected next to it) on the testbed's nodes.
//
// The data planes' lab adapters are wired here, explicitly: what a testbed
// mode brings up, what check expects of it and how bench switches it.
package main

import (
	"os"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/bench"
	"github.com/palisade-hpc/palisade/lab/check"
	labcli "github.com/palisade-hpc/palisade/lab/cli"
	egresslab "github.com/palisade-hpc/palisade/lab/modes/egress"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	uvnlab "github.com/palisade-hpc/palisade/lab/modes/uvn"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

func main() {
	// userwall: the agent on every node; check expects the policy core's
	// verdict (check's built-in "userwall" expectation).
	testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{})
	check.RegisterSettler(userwalllab.ModeName, userwalllab.SettleCheck)
	bench.RegisterDriver(userwalllab.ModeName, bench.UserwallDriver())

	// uvn: per-user VRFs, inside the VM testbed.
	testbed.RegisterMode(uvnlab.ModeName, uvnlab.UVNMode{})
	check.RegisterMode(uvnlab.ModeName, uvnlab.ExpectUVN)
	bench.RegisterDriver(uvnlab.ModeName, bench.UVNDriver())

	// egress: an extension next to any mode (testbed up --egress).
	testbed.RegisterExtension(egresslab.Name, egresslab.Ext{})
	bench.RegisterDriver(egresslab.Name, bench.EgressGatewayDriver())

	// The VM testbed (testbed up --vm) and check's relay into it.
	testbed.RegisterVM(vm.Handler{})
	check.RegisterVMRelay(vm.RelayCheck)

	os.Exit(cli.Execute(labcli.New()))
}
