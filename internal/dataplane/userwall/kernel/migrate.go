package kernel

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Upgrades across a changed map layout (a newer agent whose maps differ in
// type, key or value size, max_entries or flags from the pinned ones).
//
// A pinned map that matches the new spec is reused as is (state and
// counters kept). A changed one is created anew and pinned under
// <pin>/next; the new programs are loaded against that mix. Until the last
// link is switched, the old programs keep deciding on the old maps, so the
// new ones are complete before they decide anything:
//
//  1. config maps are filled by the agent's usual install (addresses,
//     policy, keys, members, interfaces) before any link changes;
//  2. counters are copied (the pinned ones start where the old ones were);
//  3. if sk_owners changed, the new owner recorders are attached beside the
//     old ones (every socket created from then on is recorded in both maps)
//     and the socket iterators record every TCP and UDP socket that exists;
//  4. each pinned link is switched to its new program (BPF_LINK_UPDATE on
//     cgroup and tcx links, NLM_F_REPLACE on tc filters); an LSM link,
//     which cannot be updated, gets a second link first (pinned under
//     next/links) and the old one goes at commit;
//  5. commit: the pins under next/ replace the old ones (rename on bpffs is
//     atomic), the doubled recorders go, and the old maps and programs are
//     freed with their last reference.
//
// A failure before commit switches every link back to the program it had,
// removes next/ and leaves the old collection as it was. A crash leaves
// next/ behind: the next agent removes it first (nothing in it is attached
// to anything that the pins do not also reach) and starts over.
//
// What a new socket-storage map cannot carry: the owner of a socket the
// iterators do not see (neither TCP nor UDP: raw, ping, UDP-Lite sockets
// created before the upgrade — their owner falls back to the socket's uid,
// no group), an owner's group for sockets handed over to another process
// before the upgrade (the iterator reads the file's credentials), the UDP
// reply state (udp_peers: a reply to a datagram sent before the switch is
// refused until the socket sends again) and the abstract Unix reply state
// (unix_peers, likewise). Events the old programs emit while the links
// switch go to the old ring buffer and are lost.

// layoutVariant, when set (build tag palisade_layout_next), changes the map
// specs before loading: a build with another map layout for the upgrade
// tests.
var layoutVariant func(*ebpf.CollectionSpec)

// migrationFault, when set (test builds: layout_next.go), may fail a
// migration at a named stage ("cgroup:<link>" after that link switched,
// "commit" after every link switched): the rollback test.
var migrationFault func(stage string) error

// Fault fails a migration at stage when a test build asks for it.
func (d *Dataplane) Fault(stage string) error {
	if d.mig == nil || migrationFault == nil {
		return nil
	}
	return migrationFault(stage)
}

// LayoutNextMap is the map only the palisade_layout_next build has.
const LayoutNextMap = "uw_layout_next"

// stagingDir is where a migration pins its new maps and links until commit.
func stagingDir(pinDir string) string { return filepath.Join(pinDir, "next") }

// carriedMaps are state maps whose entries a migration copies from the old
// map (when key and value sizes allow). Config maps are re-derived by the
// agent; socket storage cannot be enumerated from user space.
var carriedMaps = []string{"counters", "audit_counters", "event_stats"}

// ownerRecorders are the cgroup hooks that write sk_owners.
var ownerRecorders = []string{"sock_create", "post_bind4", "post_bind6"}

// migration is the state of a changed-layout upgrade until commit or
// rollback. Only the agent's main goroutine touches it (before the
// Dataplane is shared).
type migration struct {
	next    string
	changed map[string]string    // map name → what changed
	added   []string             // maps this version adds
	old     map[string]*ebpf.Map // the pinned maps being replaced
	reused  map[string]*ebpf.Map // pinned maps the new programs use as they are
	undo    []undoStep           // restores the old attachments
	doubled []link.Link          // new owner recorders beside the old ones
	// replaced are links that cannot be updated: their new link is pinned
	// under next/links and replaces the old pin at commit.
	replaced map[string]link.Link
}

// undoStep switches one attachment back to its old program (restore, on
// rollback) and releases what it holds (release, always).
type undoStep struct {
	restore func() error
	release func()
}

// planMigration compares every pinned map of pinDir with spec. It returns
// nil when nothing is pinned or every pinned map fits (the loader adopts
// them by pinning); otherwise the maps to reuse and the ones to replace.
func planMigration(spec *ebpf.CollectionSpec, pinDir string) (*migration, error) {
	m := &migration{next: stagingDir(pinDir), changed: map[string]string{}, old: map[string]*ebpf.Map{},
		reused: map[string]*ebpf.Map{}, replaced: map[string]link.Link{}}
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		pinned, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			m.added = append(m.added, name) // new in this version: staged too
			continue
		}
		if err != nil {
			m.close()
			return nil, fmt.Errorf("pinned map %s: %w", name, err)
		}
		if err := ms.Compatible(pinned); err != nil {
			if !errors.Is(err, ebpf.ErrMapIncompatible) {
				pinned.Close()
				m.close()
				return nil, err
			}
			m.changed[name] = err.Error()
			m.old[name] = pinned
			continue
		}
		m.reused[name] = pinned
	}
	if len(m.changed) == 0 {
		m.close()
		return nil, nil
	}
	return m, nil
}

// close releases the handles the migration holds (not the pins).
func (m *migration) close() {
	for _, x := range m.old {
		x.Close()
	}
	for _, x := range m.reused {
		x.Close()
	}
	for _, l := range m.doubled {
		l.Close()
	}
	m.old, m.reused, m.doubled = nil, nil, nil
}

// Migrating lists the maps a changed-layout upgrade replaces, with what
// changed (nil: an ordinary adoption or first install).
func (d *Dataplane) Migrating() map[string]string {
	if d.mig == nil {
		return nil
	}
	return d.mig.changed
}

// removeStaging removes what an interrupted migration left under next/.
func removeStaging(pinDir string) error {
	dir := stagingDir(pinDir)
	if _, err := os.Stat(dir); err != nil {
		return nil
	}
	return removePinTree(dir)
}

// carry copies the entries of the carried maps that were replaced. Per-CPU
// arrays of 64-bit values (the counters) only: keys beyond the new size are
// dropped.
func (m *migration) carry(coll *ebpf.Collection) error {
	var errs []error
	for _, name := range carriedMaps {
		from, to := m.old[name], coll.Maps[name]
		if from == nil || to == nil || from.Type() != ebpf.PerCPUArray || to.Type() != ebpf.PerCPUArray ||
			from.ValueSize() != 8 || to.ValueSize() != 8 {
			continue
		}
		n := min(from.MaxEntries(), to.MaxEntries())
		for k := uint32(0); k < n; k++ {
			var per []uint64
			if err := from.Lookup(k, &per); err != nil {
				errs = append(errs, fmt.Errorf("copy %s[%d]: %w", name, k, err))
				continue
			}
			if err := to.Update(k, per, ebpf.UpdateAny); err != nil {
				errs = append(errs, fmt.Errorf("copy %s[%d]: %w", name, k, err))
			}
		}
	}
	return errors.Join(errs...)
}

// rememberLink records how to switch a pinned link back to the program it
// runs now. Called before the link is updated.
func (d *Dataplane) rememberLink(name string, l link.Link) error {
	if d.mig == nil {
		return nil
	}
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	prog, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return fmt.Errorf("program of link %s: %w", name, err)
	}
	d.mig.undo = append(d.mig.undo, undoStep{
		restore: func() error {
			if err := l.Update(prog); err != nil {
				return fmt.Errorf("restore link %s: %w", name, err)
			}
			return nil
		},
		release: func() { prog.Close() },
	})
	return nil
}

// PrepareMigration runs before the first link switches: if sk_owners is
// replaced, the new owner recorders are attached beside the old ones and
// the socket iterators record the sockets that exist.
func (d *Dataplane) PrepareMigration(cgroupRoot string) error {
	if d.mig == nil {
		return nil
	}
	if _, ok := d.mig.changed["sk_owners"]; !ok {
		return nil
	}
	for _, h := range cgroupHooks {
		if !slices.Contains(ownerRecorders, h.link) {
			continue
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroupRoot, Attach: h.attach, Program: d.coll.Programs[h.prog]})
		if err != nil {
			return fmt.Errorf("attach the new %s beside the old: %w", h.link, err)
		}
		d.mig.doubled = append(d.mig.doubled, l)
	}
	return d.adoptSockets()
}

// Rollback undoes a migration that failed before commit: every link runs
// its old program again, the staged pins go. The old maps were never
// touched except the config maps that both versions share (refilled from
// the same configuration).
func (d *Dataplane) Rollback() error {
	m := d.mig
	if m == nil {
		return nil
	}
	var errs []error
	for _, u := range slices.Backward(m.undo) {
		errs = append(errs, u.restore())
		u.release()
	}
	m.undo = nil
	d.mu.Lock()
	for name, old := range m.replaced {
		// The old LSM link is still pinned and attached; the new one goes
		// with its staged pin.
		if nl := d.links[name]; nl != nil {
			_ = nl.Unpin()
			nl.Close()
		}
		d.links[name] = old
	}
	d.mu.Unlock()
	m.replaced = nil
	m.close()
	errs = append(errs, removeStaging(d.PinDir))
	d.mig = nil
	return errors.Join(errs...)
}

// Commit ends a migration whose links all run the new programs: the staged
// pins replace the old ones, the doubled recorders go, the handles on the
// old objects are released (the kernel frees them with their last pin).
func (d *Dataplane) Commit() error {
	m := d.mig
	if m == nil {
		return nil
	}
	var errs []error
	for _, name := range slices.Concat(slices.Collect(maps.Keys(m.changed)), m.added) {
		if err := os.Rename(filepath.Join(m.next, name), filepath.Join(d.PinDir, name)); err != nil {
			errs = append(errs, fmt.Errorf("move pin %s: %w", name, err))
		}
	}
	for name, old := range m.replaced {
		if err := os.Rename(filepath.Join(m.next, "links", name), filepath.Join(d.linkDir(), name)); err != nil {
			errs = append(errs, fmt.Errorf("move link pin %s: %w", name, err))
			continue
		}
		old.Close() // its pin was replaced: this detaches it
	}
	m.replaced = nil
	for _, u := range m.undo {
		u.release()
	}
	m.undo = nil
	m.close()
	if len(errs) == 0 {
		errs = append(errs, removePinTree(m.next))
	}
	d.mig = nil
	return errors.Join(errs...)
}

// removePinTree removes a pin directory: links (detached) first, then maps.
func removePinTree(dir string) error {
	var errs []error
	linkDir := filepath.Join(dir, "links")
	for _, n := range pinnedNames(linkDir) {
		p := filepath.Join(linkDir, n)
		if l, err := link.LoadPinnedLink(p, nil); err == nil {
			if err := l.Unpin(); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
			l.Close()
		} else if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
	}
	_ = os.Remove(linkDir)
	for _, n := range pinnedNames(dir) {
		p := filepath.Join(dir, n)
		if n == "next" {
			errs = append(errs, removePinTree(p))
			continue
		}
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(dir); err != nil && !os.IsNotExist(err) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// forgetLast drops the undo step just recorded (its update did not happen).
func (d *Dataplane) forgetLast() {
	if d.mig == nil || len(d.mig.undo) == 0 {
		return
	}
	d.mig.undo[len(d.mig.undo)-1].release()
	d.mig.undo = d.mig.undo[:len(d.mig.undo)-1]
}

// rememberTC records how to put our tc filter of one direction back on its
// current program (none there: how to remove the new one). Called before
// the filter is replaced.
func (d *Dataplane) rememberTC(ifindex int, dir tcDir, progName string) error {
	if d.mig == nil {
		return nil
	}
	fs, err := ourTCFilters()
	if err != nil {
		return err
	}
	for _, f := range fs {
		if f.ifindex != ifindex || f.ifdir != dir.name {
			continue
		}
		prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(f.progID))
		if err != nil {
			return fmt.Errorf("program of tc filter %s: %w", f.linkName(), err)
		}
		name := f.prog
		d.mig.undo = append(d.mig.undo, undoStep{
			restore: func() error { return attachTC(ifindex, dir, prog, name) },
			release: func() { prog.Close() },
		})
		return nil
	}
	d.mig.undo = append(d.mig.undo, undoStep{
		restore: func() error { return detachTC(ifindex, dir) }, release: func() {}})
	return nil
}

// PruneMaps removes the pins of maps this version no longer has (an
// upgrade dropped them): once every link runs this version's programs
// nothing uses them, and the pin alone would keep them allocated. Called
// after a successful install or commit; other pins (tc_lo, links, next)
// are not maps of the collection and stay.
func (d *Dataplane) PruneMaps() []string {
	var gone []string
	ents, err := os.ReadDir(d.PinDir)
	if err != nil {
		return nil
	}
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || n == tcLoMap || d.coll.Maps[n] != nil {
			continue
		}
		if err := os.Remove(filepath.Join(d.PinDir, n)); err == nil {
			gone = append(gone, n)
		}
	}
	return gone
}
