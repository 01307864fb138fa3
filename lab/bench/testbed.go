package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// DefaultVMName is the VM testbed the uvn mode uses unless --vm-name says
// otherwise.
const DefaultVMName = "palvm"

// EnvFromTestbed adapts a running testbed.
func EnvFromTestbed(tb *testbed.Testbed) *Env {
	e := &Env{Name: tb.Name, Dir: tb.Dir, Binary: tb.Binary, LabBinary: tb.LabBinary, VM: tb.VM, Mode: tb.Mode, Command: tb.Command, TB: tb}
	for _, n := range tb.Nodes {
		e.Nodes = append(e.Nodes, Node{Name: n.Name, Eth0: n.Eth0V4, Eth0V6: n.Eth0V6, IB: n.IBV4})
	}
	out := Node{Name: tb.Outside.Name, Eth0: tb.Outside.Eth0V4}
	e.Outside = &out
	return e
}

// OpenTestbed is the default Opener: it uses the running instance, or
// brings one up with what the modes need (and takes it down afterwards
// unless Keep is set). An instance that is up but lacks something a mode
// needs is used as it is; that mode's Prepare reports it as skipped.
func OpenTestbed(ctx context.Context, o *Options, req Requirements, log io.Writer) (*Env, func(context.Context) error, error) {
	name := o.Name
	if req.VM {
		name = o.VMName
		if name == "" {
			name = DefaultVMName
		}
	}
	name = testbed.ResolveName(name)
	tb, err := testbed.Open(name)
	if err == nil {
		return EnvFromTestbed(tb), nil, nil
	}
	if !errors.Is(err, testbed.ErrNotUp) {
		return nil, nil, err
	}
	opts := testbed.Options{Name: name, VM: req.VM, Egress: req.Egress}
	if req.TestbedMode != "" && slices.Contains(testbed.Modes(), req.TestbedMode) {
		opts.Mode = req.TestbedMode
	}
	fmt.Fprintf(log, "bench: bringing up testbed %s (vm=%v egress=%v mode=%q)\n", name, req.VM, req.Egress, opts.Mode)
	tb, err = testbed.Up(ctx, opts)
	if err != nil && req.Egress {
		// The egress extension may not be built in yet: the other modes
		// can still run; the egress mode will report itself skipped.
		fmt.Fprintf(log, "bench: testbed %s with --egress failed (%v); retrying without\n", name, err)
		opts.Egress = false
		tb, err = testbed.Up(ctx, opts)
	}
	if err != nil {
		if req.VM {
			return nil, nil, Skip("cannot bring up the VM testbed %s: %v", name, err)
		}
		return nil, nil, fmt.Errorf("bring up testbed %s: %w", name, err)
	}
	release := func(ctx context.Context) error {
		if o.Keep {
			fmt.Fprintf(log, "bench: leaving testbed %s up (--keep)\n", name)
			return nil
		}
		fmt.Fprintf(log, "bench: taking down testbed %s\n", name)
		return testbed.Down(ctx, name)
	}
	return EnvFromTestbed(tb), release, nil
}
