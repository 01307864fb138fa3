//go:build palisade_layout_next

package kernel

import (
	"fmt"
	"os"

	"github.com/cilium/ebpf"
)

// A build with another map layout, for the upgrade tests (go build -tags
// palisade_layout_next): the maps it creates differ from the pinned ones of
// a regular build in flags (sk_owners: socket storage, so the owners are
// re-adopted), max_entries (counters: carried over; exempt_conn: refilled
// from the configuration), and it has one map more (LayoutNextMap). The programs are the same object. It can also
// fail a migration on purpose: PALISADE_MIGRATION_FAULT=<stage>.
func init() {
	layoutVariant = func(spec *ebpf.CollectionSpec) {
		const bpfFClone = 1 << 9 // BPF_F_CLONE: accepted sockets inherit the record
		spec.Maps["sk_owners"].Flags |= bpfFClone
		spec.Maps["counters"].MaxEntries += 16
		spec.Maps["exempt_conn"].MaxEntries *= 2
		// A map of this version only: pinned at commit, and its pin
		// removed when a regular build comes back.
		spec.Maps[LayoutNextMap] = &ebpf.MapSpec{Name: LayoutNextMap, Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1}
	}
	// PALISADE_MIGRATION_FAULT=<stage> fails a migration there.
	migrationFault = func(stage string) error {
		if os.Getenv("PALISADE_MIGRATION_FAULT") == stage {
			return fmt.Errorf("injected fault at %s (PALISADE_MIGRATION_FAULT)", stage)
		}
		return nil
	}
}
