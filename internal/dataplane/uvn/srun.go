package uvn

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
)

// Slurm's callbacks into users' VRFs (bpf/srun.c): slurmctld, slurmd and a
// slurmstepd outside the VRF reach srun's and salloc's listeners on
// SrunPortRange ports, and nothing else of the user.
const (
	// srunMark marks the redirected segments; the accepted socket keeps it
	// (tcp_fwmark_accept) and rules 996/997 route its replies by the local
	// and main tables, the way the request came.
	srunMark          = 0x70616c00 // "pal\0"
	srunLocalRulePref = 996
	srunMainRulePref  = 997
	// srunFilterPrio is the tc filter priority of pal_uvn_srun_in on lo and
	// the underlay NICs (ingress).
	srunFilterPrio   = 0x5041
	srunFilterHandle = 1
	srunFilterName   = srunbpfProgPalUvnSrunIn
)

// srunSpec is the embedded collection with the port range and mark set.
func srunSpec(r policy.PortRange) (*ebpf.CollectionSpec, error) {
	spec, err := loadSrunbpf()
	if err != nil {
		return nil, err
	}
	for name, v := range map[string]uint32{srunbpfVarPortMin: uint32(r.First), srunbpfVarPortMax: uint32(r.Last), srunbpfVarSrunMark: srunMark,
		srunbpfVarSrunBudget: SrunBudget(r)} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("srun programs: set %s: %w", name, err)
		}
	}
	return spec, nil
}

// SrunBudget is how many ports of the range one user's VRF may hold claimed
// at once on a node: a quarter of the range (at least 16), so that no
// user can leave the others' sruns without a port.
func SrunBudget(r policy.PortRange) uint32 {
	return max(16, (uint32(r.Last)-uint32(r.First)+1)/4)
}

// checkSrunRange refuses a range that ephemeral ports or underlay ports
// overlap: a default-VRF client's reply traffic to its own ephemeral port
// must never be taken for a callback, and other users' underlay-port
// traffic leaves their VRF from the node's address.
func (m *Manager) checkSrunRange() error {
	r := m.Srun
	if err := CheckSrunRange(r, m.cfg.UnderlayRanges); err != nil {
		return err
	}
	if v, err := readSysctl("net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(v); len(f) == 2 {
			lo, _ := strconv.Atoi(f[0])
			hi, _ := strconv.Atoi(f[1])
			if r.Overlaps(policy.PortRange{First: uint16(lo), Last: uint16(hi)}) {
				return fmt.Errorf("SrunPortRange %s overlaps net.ipv4.ip_local_port_range %d-%d: pick srun ports outside the ephemeral range", r, lo, hi)
			}
		}
	}
	return nil
}

// srunDevices are the devices Slurm's daemons reach this node on: lo (the
// controller or slurmd on this node) and every underlay NIC.
func (m *Manager) srunDevices() ([]netlink.Link, error) {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return nil, err
	}
	devs := []netlink.Link{lo}
	for _, u := range m.cfg.Underlays {
		nic, _, _, err := localUnderlay(u)
		if err != nil {
			return nil, err
		}
		if nic == nil || containsLink(devs, nic) {
			continue
		}
		// The program rewrites an Ethernet destination address; other
		// link types (IPoIB) would need a header pushed first.
		if nic.Attrs().EncapType != "ether" {
			m.logf("uvn: %s is not Ethernet (%s): Slurm's callbacks must come over an Ethernet underlay", nic.Attrs().Name, nic.Attrs().EncapType)
			continue
		}
		devs = append(devs, nic)
	}
	return devs, nil
}

func containsLink(ls []netlink.Link, l netlink.Link) bool {
	for _, o := range ls {
		if o.Attrs().Index == l.Attrs().Index {
			return true
		}
	}
	return false
}

// buildSrun makes the node-wide part: tcp_fwmark_accept, the mark rules,
// and the tc program (with the port map it owns) on every device.
func (m *Manager) buildSrun(ns *NodeState) error {
	if err := m.checkSrunRange(); err != nil {
		return err
	}
	if err := m.setSysctl(ns, "net/ipv4/tcp_fwmark_accept", "1"); err != nil {
		return err
	}
	mask := uint32(0xffffffff)
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		for _, r := range []struct{ pref, table int }{{srunLocalRulePref, unix.RT_TABLE_LOCAL}, {srunMainRulePref, unix.RT_TABLE_MAIN}} {
			if err := m.recordNode(ns, Undo{Kind: "rule", Pref: r.pref, Table: uint32(r.table), Family: fam, Mark: srunMark}); err != nil {
				return err
			}
			rule := netlink.NewRule()
			rule.Family, rule.Priority, rule.Table, rule.Mark, rule.Mask = fam, r.pref, r.table, srunMark, &mask
			if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("add rule fwmark %#x lookup %d: %w", srunMark, r.table, err)
			}
		}
	}
	ns.SrunRange = m.Srun.String()
	return m.ensureSrunTC(ns)
}

// ensureSrunTC attaches the tc program wherever it is missing, with the
// node's port map (made here if it does not exist any more).
func (m *Manager) ensureSrunTC(ns *NodeState) error {
	devs, err := m.srunDevices()
	if err != nil {
		return err
	}
	var missing []netlink.Link
	for _, d := range devs {
		if !srunFilterPresent(d) {
			missing = append(missing, d)
		}
	}
	if len(missing) == 0 && srunMapAlive(ns.SrunMap) {
		return nil
	}
	r, err := policy.ParsePortRange(ns.SrunRange)
	if err != nil {
		return fmt.Errorf("node state: srun range %q: %w", ns.SrunRange, err)
	}
	spec, err := srunSpec(r)
	if err != nil {
		return err
	}
	delete(spec.Programs, srunbpfProgPalUvnPbind4)
	delete(spec.Programs, srunbpfProgPalUvnPbind6)
	opts := ebpf.CollectionOptions{}
	if srunMapAlive(ns.SrunMap) && srunMapAlive(ns.SrunCount) {
		repl, err := srunSharedMaps(ns)
		if err != nil {
			return err
		}
		defer closeMaps(repl)
		opts.MapReplacements = repl
	} else {
		missing = devs // a new map: every device gets the program that uses it
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, opts)
	if err != nil {
		return fmt.Errorf("load srun tc program: %w", err)
	}
	defer coll.Close()
	if err := fillSrunSources(coll, m.cfg.Underlays); err != nil {
		return err
	}
	info, err := coll.Maps[srunbpfMapPalSrunPorts].Info()
	if err != nil {
		return err
	}
	id, _ := info.ID()
	newMap := ns.SrunMap != uint32(id)
	ns.SrunMap = uint32(id)
	if info, err = coll.Maps[srunbpfMapPalSrunCount].Info(); err != nil {
		return err
	}
	cid, _ := info.ID()
	newMap = newMap || ns.SrunCount != uint32(cid)
	ns.SrunCount = uint32(cid)
	if err := m.st.saveNode(ns); err != nil {
		return err
	}
	if newMap || !programAlive(ns.SrunRelease) {
		if err := m.attachSrunRelease(ns, coll.Programs[srunbpfProgPalUvnRelease]); err != nil {
			return err
		}
	}
	for _, d := range missing {
		created, err := ensureClsact(d)
		if err != nil {
			return err
		}
		if created {
			if err := m.recordNode(ns, Undo{Kind: "clsact", Name: d.Attrs().Name}); err != nil {
				return err
			}
		}
		if err := m.recordNode(ns, Undo{Kind: "tc", Name: d.Attrs().Name}); err != nil {
			return err
		}
		f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: d.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
			Handle: srunFilterHandle, Protocol: unix.ETH_P_ALL, Priority: srunFilterPrio},
			Fd: coll.Programs[srunbpfProgPalUvnSrunIn].FD(), Name: srunFilterName, DirectAction: true}
		if err := netlink.FilterReplace(f); err != nil {
			return fmt.Errorf("attach %s to %s ingress: %w", srunFilterName, d.Attrs().Name, err)
		}
	}
	return nil
}

// attachSrunRelease attaches the claims' release program to the cgroup2
// root (replacing one that uses an older map): there it runs for every
// socket, whatever became of the programs of the cgroup the socket was made
// in.
func (m *Manager) attachSrunRelease(ns *NodeState, prog *ebpf.Program) error {
	cg, err := openCgroup2()
	if err != nil {
		return err
	}
	defer cg.Close()
	if err := m.recordNode(ns, Undo{Kind: "srun-release", Name: "/"}); err != nil {
		return err
	}
	old := ns.SrunRelease
	id, err := cg.attachProg("/", prog, ebpf.AttachCgroupInetSockRelease)
	if err != nil {
		return err
	}
	// The id is known only now: the record made before the attach gets it.
	ns.Undo[len(ns.Undo)-1].Prog = id
	ns.SrunRelease = id
	if err := m.st.saveNode(ns); err != nil {
		return err
	}
	if old != 0 && old != id {
		return cg.detachAs("/", old, ebpf.AttachCgroupInetSockRelease)
	}
	return nil
}

// undoSrunRelease detaches the release program from the cgroup2 root.
func undoSrunRelease(id uint32) error {
	cg, err := openCgroup2()
	if err != nil {
		return err
	}
	defer cg.Close()
	return cg.detachAs("/", id, ebpf.AttachCgroupInetSockRelease)
}

// fillSrunSources puts the underlay prefixes (where Slurm's daemons live)
// into the source tries.
func fillSrunSources(coll *ebpf.Collection, us []Underlay) error {
	return fillSources(coll.Maps[srunbpfMapPalSrunSrc4], coll.Maps[srunbpfMapPalSrunSrc6], us)
}

// fillSources puts the underlay prefixes into an IPv4 and an IPv6 LPM trie
// keyed {prefixlen, address in network order} (srun.c's and guard.c's).
func fillSources(m4, m6 *ebpf.Map, us []Underlay) error {
	for _, u := range us {
		for _, n := range u.Nets {
			var err error
			if n.Addr().Is4() {
				k := srunbpfSrunLpm4{Prefixlen: uint32(n.Bits()), Addr: nativeAddr4(n.Addr())}
				err = m4.Put(k, uint8(1))
			} else {
				k := srunbpfSrunLpm6{Prefixlen: uint32(n.Bits())}
				b := n.Addr().As16()
				for i := range k.Addr {
					k.Addr[i] = uint32(b[4*i]) | uint32(b[4*i+1])<<8 | uint32(b[4*i+2])<<16 | uint32(b[4*i+3])<<24
				}
				err = m6.Put(k, uint8(1))
			}
			if err != nil {
				return fmt.Errorf("cluster prefix %s: %w", n, err)
			}
		}
	}
	return nil
}

// nativeAddr4 is an IPv4 address as the little-endian u32 that holds its
// network-order bytes (as the program reads ip.saddr).
func nativeAddr4(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func srunMapAlive(id uint32) bool {
	if id == 0 {
		return false
	}
	mp, err := ebpf.NewMapFromID(ebpf.MapID(id))
	if err != nil {
		return false
	}
	mp.Close()
	return true
}

func srunFilters(l netlink.Link) ([]netlink.Filter, error) {
	return nldump.Retry(func() ([]netlink.Filter, error) { return netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS) })
}

func srunFilterPresent(l netlink.Link) bool {
	fs, err := srunFilters(l)
	if err != nil {
		return false
	}
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok && b.Priority == srunFilterPrio && strings.HasPrefix(b.Name, srunFilterName) {
			return true
		}
	}
	return false
}

// ensureClsact adds the clsact qdisc to l; created is false if it was there.
func ensureClsact(l netlink.Link) (created bool, err error) {
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscAdd(q); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return false, nil
		}
		return false, fmt.Errorf("add clsact to %s: %w", l.Attrs().Name, err)
	}
	return true, nil
}

// undoSrunFilter removes the tc filter from dev (missing is fine).
func undoSrunFilter(dev string) error {
	l, err := netlink.LinkByName(dev)
	if err != nil {
		return nil
	}
	f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
		Handle: srunFilterHandle, Protocol: unix.ETH_P_ALL, Priority: srunFilterPrio}}
	if err := netlink.FilterDel(f); err != nil && !gone(err) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("remove %s from %s: %w", srunFilterName, dev, err)
	}
	return nil
}

// undoClsact removes the clsact qdisc uvn added to dev, unless someone else
// has filters on it now.
func undoClsact(dev string) error {
	l, err := netlink.LinkByName(dev)
	if err != nil {
		return nil
	}
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		fs, err := nldump.Retry(func() ([]netlink.Filter, error) { return netlink.FilterList(l, parent) })
		if err != nil || len(fs) > 0 {
			return err
		}
	}
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscDel(q); err != nil && !gone(err) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("remove clsact from %s: %w", dev, err)
	}
	return nil
}

// attachSrun attaches the claiming programs (post_bind4/6) to a user's
// cgroup, sharing the node's port map (the release program is the node's).
func (m *Manager) attachSrun(cg *cgroup2, a *Attachment, vrfIndex int, vrfMAC net.HardwareAddr) error {
	if m.Srun == (policy.PortRange{}) {
		return nil
	}
	ns, found, err := m.st.loadNode()
	if err != nil {
		return err
	}
	if !found || !srunMapAlive(ns.SrunMap) || !srunMapAlive(ns.SrunCount) {
		return errors.New("the node's srun port map is missing (node state damaged); run `palisade uvn setup` to repair")
	}
	r, err := policy.ParsePortRange(ns.SrunRange)
	if err != nil {
		return err
	}
	spec, err := srunSpec(r)
	if err != nil {
		return err
	}
	if err := spec.Variables[srunbpfVarVrfIfindex].Set(uint32(vrfIndex)); err != nil {
		return err
	}
	var mac [6]byte
	copy(mac[:], vrfMAC)
	if err := spec.Variables[srunbpfVarVrfMac].Set(mac); err != nil {
		return err
	}
	delete(spec.Programs, srunbpfProgPalUvnSrunIn)
	delete(spec.Programs, srunbpfProgPalUvnRelease)
	delete(spec.Maps, srunbpfMapPalSrunSrc4)
	delete(spec.Maps, srunbpfMapPalSrunSrc6)
	repl, err := srunSharedMaps(ns)
	if err != nil {
		return err
	}
	defer closeMaps(repl)
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return fmt.Errorf("load srun claim programs: %w", err)
	}
	defer coll.Close()
	for _, p := range []struct {
		name string
		at   ebpf.AttachType
		id   *uint32
	}{
		{srunbpfProgPalUvnPbind4, ebpf.AttachCGroupInet4PostBind, &a.Bind4ID},
		{srunbpfProgPalUvnPbind6, ebpf.AttachCGroupInet6PostBind, &a.Bind6ID},
	} {
		id, err := cg.attachProg(a.Cgroup, coll.Programs[p.name], p.at)
		if err != nil {
			return err
		}
		*p.id = id
	}
	return nil
}

// dropSrunClaims forgets every port claimed for the VRF device ifindex (its
// sockets are about to lose their VRF).
func (m *Manager) dropSrunClaims(ifindex int) error {
	ns, found, err := m.st.loadNode()
	if err != nil || !found || !srunMapAlive(ns.SrunMap) {
		return err
	}
	pm, err := ebpf.NewMapFromID(ebpf.MapID(ns.SrunMap))
	if err != nil {
		return nil
	}
	defer pm.Close()
	var (
		key   uint64
		owner srunbpfSrunOwner
		drop  []uint64
	)
	it := pm.Iterate()
	for it.Next(&key, &owner) {
		if owner.Ifindex == uint32(ifindex) {
			drop = append(drop, key) // its port and its claiming sockets
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	for _, p := range drop {
		if err := pm.Delete(p); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	if cm, err := ebpf.NewMapFromID(ebpf.MapID(ns.SrunCount)); err == nil {
		defer cm.Close()
		if err := cm.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// srunIntact reports whether the node's Slurm-callback path (if built) is
// whole: its port map and the tc program on every device.
func (m *Manager) srunIntact() bool {
	ns, found, err := m.st.loadNode()
	if err != nil || !found || ns.SrunRange == "" {
		return err == nil
	}
	if !srunMapAlive(ns.SrunMap) || !srunMapAlive(ns.SrunCount) || !programAlive(ns.SrunRelease) {
		return false
	}
	devs, err := m.srunDevices()
	if err != nil {
		return false
	}
	for _, d := range devs {
		if !srunFilterPresent(d) {
			return false
		}
	}
	return true
}

// srunSharedMaps opens the node's port and claim maps (by id) for loading
// programs that share them.
func srunSharedMaps(ns *NodeState) (map[string]*ebpf.Map, error) {
	out := map[string]*ebpf.Map{}
	for name, id := range map[string]uint32{srunbpfMapPalSrunPorts: ns.SrunMap, srunbpfMapPalSrunCount: ns.SrunCount} {
		mp, err := ebpf.NewMapFromID(ebpf.MapID(id))
		if err != nil {
			closeMaps(out)
			return nil, fmt.Errorf("srun map %s (id %d): %w", name, id, err)
		}
		out[name] = mp
	}
	return out, nil
}

func closeMaps(ms map[string]*ebpf.Map) {
	for _, mp := range ms {
		mp.Close()
	}
}
