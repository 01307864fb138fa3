package kernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	sysnetns "github.com/palisade-hpc/palisade/internal/sys/netns"
)

// Classic tc attachment, for kernels without tcx links (< 6.6): a clsact
// qdisc and one direct-action cls_bpf filter per direction.
//
//   - Order: the filters sit at preference 1, the first a packet meets
//     (lower runs first; 0 would let the kernel pick). A foreign filter of
//     another kind at preference 1 makes attaching fail with a clear error
//     rather than run after it. A foreign cls_bpf filter at preference 1
//     shares the chain; a new handle is inserted at its head.
//   - Ownership: a filter is ours by its handle (tcHandle) and its name
//     (tcNamePrefix + program). Nothing else is ever replaced or deleted.
//   - Adoption: a restarted agent replaces its filters in place
//     (RTM_NEWTFILTER with NLM_F_REPLACE on the same handle swaps the
//     program atomically): no moment without a filter.
//   - Removal deletes exactly our filters, and the clsact qdisc only when no
//     filter at all is left on it.
//
// Filters cannot be pinned; they live as long as the interface. The program
// ID of lo's egress filter is kept in the pinned map tc_lo, so that the pins
// of a namespace deleted without --uninstall can be recognised (see
// NamespaceGone).
const (
	tcPref       = 1
	tcHandle     = 0x5542
	tcNamePrefix = "palisade:"
	tcLoMap      = "tc_lo"
)

type tcDir struct {
	name   string // "in", "eg"
	parent uint32
}

var (
	tcIngress = tcDir{"in", netlink.HANDLE_MIN_INGRESS}
	tcEgress  = tcDir{"eg", netlink.HANDLE_MIN_EGRESS}
)

func tcFilterName(prog string) string { return tcNamePrefix + prog }

func isOurFilter(f netlink.Filter) (*netlink.BpfFilter, bool) {
	b, ok := f.(*netlink.BpfFilter)
	if !ok || b.Handle != tcHandle || b.Priority != tcPref || !strings.HasPrefix(b.Name, tcNamePrefix) {
		return nil, false
	}
	return b, true
}

// ensureClsact adds the clsact qdisc unless the interface has one.
func ensureClsact(l netlink.Link) error {
	qs, err := netlink.QdiscList(l)
	if err != nil {
		return err
	}
	for _, q := range qs {
		if q.Type() == "clsact" {
			return nil
		}
		// An ingress qdisc holds the same slot: clsact cannot be added.
		if q.Attrs().Parent == netlink.HANDLE_INGRESS {
			return fmt.Errorf("%s has an %s qdisc where clsact goes: remove it or use tcx (kernel >= 6.6)", l.Attrs().Name, q.Type())
		}
	}
	q := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
	if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc to %s: %w", l.Attrs().Name, err)
	}
	return nil
}

// attachTC installs (or replaces in place) our filter in one direction.
func attachTC(ifindex int, dir tcDir, prog *ebpf.Program, progName string) error {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return err
	}
	name := l.Attrs().Name
	if err := ensureClsact(l); err != nil {
		return err
	}
	fs, err := netlink.FilterList(l, dir.parent)
	if err != nil {
		return fmt.Errorf("list tc filters of %s: %w", name, err)
	}
	for _, f := range fs {
		a := f.Attrs()
		if a.Priority != tcPref {
			continue
		}
		if _, ours := isOurFilter(f); ours {
			continue
		}
		if f.Type() != "bpf" || a.Protocol != unix.ETH_P_ALL {
			return fmt.Errorf("tc %s preference %d on %s is taken by another filter (%s): userwall must run first there; move that filter to a later preference",
				dir.name, tcPref, name, f.Type())
		}
		if a.Handle == tcHandle {
			return fmt.Errorf("tc %s filter handle %#x at preference %d on %s belongs to someone else (%s); not replacing it",
				dir.name, tcHandle, tcPref, name, f.(*netlink.BpfFilter).Name)
		}
	}
	filter := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: dir.parent, Handle: tcHandle,
			Priority: tcPref, Protocol: unix.ETH_P_ALL},
		Fd: prog.FD(), Name: tcFilterName(progName), DirectAction: true,
	}
	if err := netlink.FilterReplace(filter); err != nil {
		return fmt.Errorf("tc %s filter on %s: %w", dir.name, name, err)
	}
	return nil
}

// detachTC deletes our filter in one direction (others stay), and the
// clsact qdisc if that left it empty.
func detachTC(ifindex int, dir tcDir) error {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return err
	}
	fs, err := netlink.FilterList(l, dir.parent)
	if err != nil {
		return err
	}
	var errs []error
	deleted := false
	for _, f := range fs {
		if _, ours := isOurFilter(f); ours {
			if err := netlink.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("delete tc %s filter on %s: %w", dir.name, l.Attrs().Name, err))
			}
			deleted = true
		}
	}
	// An empty clsact that was there before us is not ours to remove.
	if deleted {
		removeEmptyClsact(l)
	}
	return errors.Join(errs...)
}

func removeEmptyClsact(l netlink.Link) {
	for _, p := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		if fs, err := netlink.FilterList(l, p); err != nil || len(fs) > 0 {
			return
		}
	}
	qs, err := netlink.QdiscList(l)
	if err != nil {
		return
	}
	for _, q := range qs {
		if q.Type() == "clsact" {
			_ = netlink.QdiscDel(q)
		}
	}
}

// tcFilter is one of our filters found on an interface.
type tcFilter struct {
	ifname, ifdir, prog string
	ifindex             int
	progID              uint32
}

// linkName is the name the filter has in status (like a pinned link's).
func (f tcFilter) linkName() string { return "tc_" + f.ifdir + "_" + f.ifname }

// ourTCFilters lists our filters on every interface of the namespace.
func ourTCFilters() ([]tcFilter, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	var out []tcFilter
	for _, l := range links {
		for _, dir := range []tcDir{tcIngress, tcEgress} {
			fs, err := netlink.FilterList(l, dir.parent)
			if err != nil {
				continue // no clsact
			}
			for _, f := range fs {
				if b, ours := isOurFilter(f); ours {
					out = append(out, tcFilter{ifname: l.Attrs().Name, ifindex: l.Attrs().Index, ifdir: dir.name,
						prog: strings.TrimPrefix(b.Name, tcNamePrefix), progID: uint32(b.Id)})
				}
			}
		}
	}
	return out, nil
}

// RemoveTCFilters deletes our filters on every interface (uninstall).
func RemoveTCFilters() error {
	fs, err := ourTCFilters()
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range fs {
		dir := tcIngress
		if f.ifdir == tcEgress.name {
			dir = tcEgress
		}
		errs = append(errs, detachTC(f.ifindex, dir))
	}
	return errors.Join(errs...)
}

// tcLoSpec is the pinned one-entry map holding the program ID of lo's
// egress filter.
var tcLoSpec = &ebpf.MapSpec{Name: tcLoMap, Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1}

func recordTCLo(pinDir string, progID uint32) error {
	path := filepath.Join(pinDir, tcLoMap)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		if m, err = ebpf.NewMap(tcLoSpec); err != nil {
			return err
		}
		if err := m.Pin(path); err != nil {
			m.Close()
			return err
		}
	}
	defer m.Close()
	return m.Update(uint32(0), progID, ebpf.UpdateAny)
}

func readTCLo(pinDir string) uint32 {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, tcLoMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0
	}
	defer m.Close()
	var id uint32
	_ = m.Lookup(uint32(0), &id)
	return id
}

// tcLoGone reports whether the lo egress program recorded in pinDir no
// longer exists: the filter holding it went with the namespace's lo.
// ok is false when nothing was recorded (not a tc-mode namespace).
func tcLoGone(pinDir string) (gone, ok bool) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, tcLoMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, false
	}
	defer m.Close()
	var id uint32
	if err := m.Lookup(uint32(0), &id); err != nil || id == 0 {
		return false, false
	}
	p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
	if err != nil {
		return errors.Is(err, unix.ENOENT) || errors.Is(err, os.ErrNotExist), true
	}
	defer p.Close()
	// IDs are allocated cyclically; a reused ID names another program.
	if info, err := p.Info(); err == nil && !strings.HasPrefix(progEgress, info.Name) {
		return true, true
	}
	return false, true
}

// probeClsact adds a clsact qdisc and a cls_bpf direct-action filter to lo
// in a throw-away network namespace (so nothing on the node changes).
func probeClsact() error {
	prog, err := noopProgram(ebpf.SchedCLS, ebpf.AttachNone, "")
	if err != nil {
		return err
	}
	defer prog.Close()
	return inScratchNetns(func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		q := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: lo.Attrs().Index,
			Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
		if err := h.QdiscAdd(q); err != nil {
			return fmt.Errorf("clsact qdisc: %w", err)
		}
		f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: lo.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
			Handle: tcHandle, Priority: tcPref, Protocol: unix.ETH_P_ALL}, Fd: prog.FD(), Name: "probe", DirectAction: true}
		if err := h.FilterAdd(f); err != nil {
			return fmt.Errorf("cls_bpf filter: %w", err)
		}
		return nil
	})
}

// inScratchNetns runs f with a netlink handle opened in a new, empty network
// namespace that disappears afterwards. Only the calling OS thread enters
// it, and only while the handle's socket is opened.
func inScratchNetns(f func(*netlink.Handle) error) error {
	var h *netlink.Handle
	err := sysnetns.DoNew(func() (err error) {
		h, err = netlink.NewHandle()
		return err
	})
	if err != nil {
		if h != nil {
			h.Close()
		}
		return fmt.Errorf("scratch network namespace: %w", err)
	}
	defer h.Close()
	return f(h)
}
