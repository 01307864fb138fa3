package kernel

import (
	"errors"
	"fmt"
	"strings"
)

// Enforcement is what the programs enforce on this node and how they
// attach: decided once, by Plan, from the kernel feature probe and the
// [agent] settings, before anything is loaded. Load follows it. What the
// kernel then still refuses (LSM programs the verifier rejects, LSM links
// that do not attach) only narrows it, and Dataplane.LSMErr says so.
type Enforcement struct {
	// TC: the tc programs attach as clsact + cls_bpf filters instead of
	// tcx links; TCWhy says why.
	TC    bool
	TCWhy string
	// NoLSM says why abstract Unix sockets are not enforced (the LSM
	// programs are left out); nil: they are.
	NoLSM error
}

// Plan decides the Enforcement for probe p, the tc_attach mode and
// unix_sockets. An error: the configuration asks for what this kernel
// lacks (nothing has been changed).
func Plan(p *Probe, tcAttach string, unixSockets bool) (Enforcement, error) {
	var e Enforcement
	var err error
	if e.TC, e.TCWhy, err = ChooseTC(tcAttach, p); err != nil {
		return Enforcement{}, err
	}
	switch {
	case !unixSockets:
		e.NoLSM = errors.New("disabled by configuration (unix_sockets = false)")
	case !p.Has(FeatLSMActive) && strings.HasPrefix(FeatureDetail(p, FeatLSMActive), "/"):
		e.NoLSM = fmt.Errorf("the bpf LSM is not enabled (%s); boot with lsm=...,bpf", FeatureDetail(p, FeatLSMActive))
	case !p.Has(FeatLSMAttach):
		e.NoLSM = fmt.Errorf("BPF LSM programs cannot attach on this kernel: %s", FeatureDetail(p, FeatLSMAttach))
	}
	return e, nil
}
