package uvn

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/bpfiter"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
)

// The node's device boundary (bpf/guard.c): programs at the cgroup2 root
// that keep every socket of the node — in a session or not — off other
// users' devices, with the map of which device is whose.

// guardAttach are the root programs and where they attach.
var guardAttach = []struct {
	prog string
	at   ebpf.AttachType
}{
	{guardbpfProgPalUvnBorn, ebpf.AttachCGroupInetSockCreate},
	{guardbpfProgPalUvnOut, ebpf.AttachCGroupInetEgress},
	{guardbpfProgPalUvnIn, ebpf.AttachCGroupInetIngress},
	{guardbpfProgPalUvnSockopt, ebpf.AttachCGroupSetsockopt},
}

// guardIntact reports whether the root programs (and so their maps) exist.
func guardIntact(ns *NodeState) bool {
	if len(ns.GuardProgs) != len(guardAttach) {
		return false
	}
	for _, id := range ns.GuardProgs {
		if !programAlive(id) {
			return false
		}
	}
	return true
}

// guardRootIntact reports whether the node's root programs are all there.
func (m *Manager) guardRootIntact() bool {
	ns, found, err := m.st.loadNode()
	if err != nil || !found {
		return err == nil
	}
	return guardIntact(ns)
}

// ensureGuardRoot loads and attaches the root programs if any is missing
// (replacing the others), and fills their maps with every user's devices
// (node lock held).
func (m *Manager) ensureGuardRoot(ns *NodeState) error {
	if guardIntact(ns) {
		return nil
	}
	cookie, err := netns.Cookie()
	if err != nil {
		return err
	}
	coll, err := loadGuard(cookie, uint32(m.cfg.MinUID), m.Exempt, m.Srun)
	if err != nil {
		return err
	}
	defer coll.Close()
	// Cluster addresses: where Slurm's callbacks to a stray srun come from.
	if err := fillSources(coll.Maps[guardbpfMapPalUvnSrc4], coll.Maps[guardbpfMapPalUvnSrc6], m.cfg.Underlays); err != nil {
		return err
	}
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	for _, u := range uids {
		if st, ok, err := m.st.loadUser(u); err == nil && ok {
			if err := guardPut(coll.Maps[guardbpfMapPalUvnDevs], coll.Maps[guardbpfMapPalUvnNames], st); err != nil {
				return err
			}
		}
	}
	cg, err := openCgroup2()
	if err != nil {
		return err
	}
	defer cg.Close()
	old := ns.GuardProgs
	ns.GuardProgs = nil
	for _, a := range guardAttach {
		if err := m.recordNode(ns, Undo{Kind: "guard-root", Name: a.prog}); err != nil {
			return err
		}
		id, err := cg.attachProg("/", coll.Programs[a.prog], a.at)
		if err != nil {
			return err
		}
		ns.Undo[len(ns.Undo)-1].Prog = id
		ns.GuardProgs = append(ns.GuardProgs, id)
		if err := m.st.saveNode(ns); err != nil {
			return err
		}
	}
	for i, id := range old {
		if i < len(guardAttach) {
			cg.detachAs("/", id, guardAttach[i].at)
		}
	}
	if err := adoptSockets(coll); err != nil {
		return err
	}
	ids := map[string]*uint32{guardbpfMapPalUvnDevs: &ns.GuardDevs, guardbpfMapPalUvnNames: &ns.GuardNames}
	for name, p := range ids {
		info, err := coll.Maps[name].Info()
		if err != nil {
			return err
		}
		id, _ := info.ID()
		*p = uint32(id)
	}
	return m.st.saveNode(ns)
}

// loadGuard loads bpf/guard.c for the network namespace cookie, with
// min_uid, the exempt accounts and SrunPortRange (zero: none).
func loadGuard(cookie uint64, minUID uint32, exempt []uint32, srun policy.PortRange) (*ebpf.Collection, error) {
	if len(exempt) > int(guardbpfGuardLimitGUARD_MAX_EXEMPT) {
		return nil, fmt.Errorf("%d exempt accounts; at most %d", len(exempt), guardbpfGuardLimitGUARD_MAX_EXEMPT)
	}
	spec, err := loadGuardbpf()
	if err != nil {
		return nil, err
	}
	for name, v := range map[string]any{guardbpfVarNetnsCookie: cookie, guardbpfVarMinUid: minUID,
		guardbpfVarSrunFirst: uint32(srun.First), guardbpfVarSrunLast: uint32(srun.Last)} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("guard programs: set %s: %w", name, err)
		}
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		return nil, fmt.Errorf("load guard programs: %w", err)
	}
	for _, uid := range exempt {
		if err := coll.Maps[guardbpfMapPalUvnExempt].Put(uid, uint8(1)); err != nil {
			coll.Close()
			return nil, err
		}
	}
	return coll, nil
}

// adoptSockets runs the guard's TCP and UDP socket iterators once in this
// network namespace, after sock_create is attached: every socket older
// than the guard gets its birth record (its VRF now, its owner), so that
// none is judged as another namespace's (a socket made since has one).
func adoptSockets(coll *ebpf.Collection) error {
	return bpfiter.Run(coll, guardbpfProgPalUvnAdoptTcp, guardbpfProgPalUvnAdoptUdp)
}

// undoGuardRoot detaches one root program (Name says which).
func undoGuardRoot(u Undo) error {
	for _, a := range guardAttach {
		if a.prog == u.Name {
			cg, err := openCgroup2()
			if err != nil {
				return err
			}
			defer cg.Close()
			return cg.detachAs("/", u.Prog, a.at)
		}
	}
	return fmt.Errorf("unknown guard program %q", u.Name)
}

// guardPut enters st's devices (VRF and VXLANs) into the maps.
func guardPut(devs, names *ebpf.Map, st *UserState) error {
	vl, err := netlink.LinkByName(st.VRF)
	if err != nil {
		return nil // not built (yet): nothing to guard
	}
	o := guardbpfGuardOwner{Vrf: uint32(vl.Attrs().Index), Uid: st.UID}
	for _, n := range append([]string{st.VRF}, st.Links...) {
		l, err := netlink.LinkByName(n)
		if err != nil {
			continue
		}
		if err := devs.Put(uint32(l.Attrs().Index), o); err != nil {
			return fmt.Errorf("guard map: %s: %w", n, err)
		}
		var k guardbpfGuardName
		for i := 0; i < len(n) && i < len(k.Name)-1; i++ {
			k.Name[i] = int8(n[i])
		}
		if err := names.Put(k, o); err != nil {
			return fmt.Errorf("guard map: %s: %w", n, err)
		}
	}
	return nil
}

// guardMaps opens the node's guard maps (nil, nil if there are none).
func (m *Manager) guardMaps() (devs, names *ebpf.Map, err error) {
	ns, found, err := m.st.loadNode()
	if err != nil || !found || ns.GuardDevs == 0 {
		return nil, nil, err
	}
	devs, err = ebpf.NewMapFromID(ebpf.MapID(ns.GuardDevs))
	if err != nil {
		return nil, nil, fmt.Errorf("guard device map (id %d): %w", ns.GuardDevs, err)
	}
	names, err = ebpf.NewMapFromID(ebpf.MapID(ns.GuardNames))
	if err != nil {
		devs.Close()
		return nil, nil, fmt.Errorf("guard name map (id %d): %w", ns.GuardNames, err)
	}
	return devs, names, nil
}

// guardAdd enters a freshly built user's devices.
func (m *Manager) guardAdd(st *UserState) error {
	devs, names, err := m.guardMaps()
	if err != nil || devs == nil {
		return err
	}
	defer devs.Close()
	defer names.Close()
	return guardPut(devs, names, st)
}

// guardDrop removes every entry owned by the VRF device vrf.
func (m *Manager) guardDrop(vrf int) error {
	devs, names, err := m.guardMaps()
	if err != nil || devs == nil {
		return err
	}
	defer devs.Close()
	defer names.Close()
	var errs []error
	var (
		idx  uint32
		name guardbpfGuardName
		o    guardbpfGuardOwner
		di   []uint32
		dn   []guardbpfGuardName
	)
	it := devs.Iterate()
	for it.Next(&idx, &o) {
		if o.Vrf == uint32(vrf) {
			di = append(di, idx)
		}
	}
	errs = append(errs, it.Err())
	it = names.Iterate()
	for it.Next(&name, &o) {
		if o.Vrf == uint32(vrf) {
			dn = append(dn, name)
		}
	}
	errs = append(errs, it.Err())
	for _, k := range di {
		if err := devs.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	for _, k := range dn {
		if err := names.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
