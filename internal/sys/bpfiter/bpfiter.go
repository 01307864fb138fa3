// Package bpfiter runs BPF iterator programs once, for their side effects:
// both data planes walk the sockets that existed before their programs
// attached (socket iterators), so that an older socket gets the record a
// new one gets at creation.
package bpfiter

import (
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Run attaches each named iterator program of coll, reads it to the end (the
// program runs once per object it visits) and detaches it, in order.
func Run(coll *ebpf.Collection, names ...string) error {
	for _, name := range names {
		it, err := link.AttachIter(link.IterOptions{Program: coll.Programs[name]})
		if err != nil {
			return fmt.Errorf("socket iterator %s: %w", name, err)
		}
		rd, err := it.Open()
		if err == nil {
			_, err = io.Copy(io.Discard, rd)
			rd.Close()
		}
		it.Close()
		if err != nil {
			return fmt.Errorf("socket iterator %s: %w", name, err)
		}
	}
	return nil
}
