package kernel

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf/link"
)

// TestDataplaneSharedReads: a metrics scrape (Links, LSMErr) while the main
// loop attaches and detaches (the link map) — clean under -race, and every
// read a state the writer made: known names, sorted, once each; at the end
// exactly the links the writer left.
func TestDataplaneSharedReads(t *testing.T) {
	d := &Dataplane{links: map[string]link.Link{}}
	names := map[string]bool{}
	for k := range 7 {
		names[fmt.Sprintf("tcx_eg_if%d", k)] = true
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Value
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				l := d.Links()
				if !slices.IsSorted(l) || len(slices.Compact(slices.Clone(l))) != len(l) || slices.ContainsFunc(l, func(n string) bool { return !names[n] }) {
					bad.Store(fmt.Sprint(l))
				}
				_ = d.LSMErr()
			}
		}
	})
	want := map[string]bool{}
	for i := range 1000 {
		name := fmt.Sprintf("tcx_eg_if%d", i%7)
		d.setLink(name, &link.RawLink{})
		want[name] = true
		if i%3 == 0 {
			d.setLink(name, nil)
			d.setLSMErr(errors.New("no LSM"))
			delete(want, name)
		}
	}
	close(stop)
	wg.Wait()
	if b := bad.Load(); b != nil {
		t.Errorf("a concurrent read saw %s", b)
	}
	if got, w := d.Links(), slices.Sorted(maps.Keys(want)); !slices.Equal(got, w) {
		t.Errorf("links after the writer: %v, want %v", got, w)
	}
	if d.LSMErr() == nil {
		t.Error("LSMErr lost")
	}
}
