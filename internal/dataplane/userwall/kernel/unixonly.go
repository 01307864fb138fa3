package kernel

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// LoadUnixOnly loads the two abstract-Unix LSM programs alone for the
// namespace cookie, unpinned, applies p and attaches them (Close detaches):
// the guest side of the LSM test runs the hooks with the agent's own
// loader, policy and event code and nothing else.
func LoadUnixOnly(cookie uint64, p *policy.Policy) (*Dataplane, error) {
	spec, err := loadUwbpf()
	if err != nil {
		return nil, err
	}
	for name := range spec.Programs {
		if name != progUnixStream && name != progUnixDgram {
			delete(spec.Programs, name)
		}
	}
	if err := spec.Variables["netns_cookie"].Set(cookie); err != nil {
		return nil, err
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load: %+v", verr)
		}
		return nil, fmt.Errorf("load: %w", err)
	}
	d := &Dataplane{coll: coll, links: map[string]link.Link{}}
	if err := d.ApplyPolicy(p, false); err != nil {
		d.Close()
		return nil, err
	}
	for _, h := range lsmHooks {
		l, err := link.AttachLSM(link.LSMOptions{Program: coll.Programs[h.prog]})
		if err != nil {
			d.Close()
			return nil, fmt.Errorf("attach %s: %w", h.prog, err)
		}
		d.links[h.link] = l
	}
	return d, nil
}
