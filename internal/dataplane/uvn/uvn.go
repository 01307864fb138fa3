package uvn

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Manager sets up and tears down users' networks on this node (the network
// namespace it runs in). It is safe to run several managers (processes) at
// once: state and locks live in the state directory.
type Manager struct {
	cfg   *Config
	nodes []netip.Addr
	st    store
	// FailAt makes the named step fail (tests: rollback on injected
	// failure). Builds with -tags palisade_fault_injection also read it
	// from $PALISADE_UVN_FAIL_AT (faultinject.go); the shipped binary never.
	FailAt string
	// Logf receives progress messages (nil: silent).
	Logf func(format string, args ...any)
	// Srun is SrunPortRange: Slurm's daemons reach users' listeners on
	// these ports (bpf/srun.c). Zero: no such path.
	Srun policy.PortRange
	// Exempt are the uids of exempt accounts ([uvn] exempt_users, Slurm's
	// accounts): like root and accounts below min_uid, their unbound
	// sockets may serve every user's VRF (bpf/guard.c).
	Exempt []uint32
	// Site is the site's rules for this node (site.go; nil: none are
	// enforced, e.g. a caller that only tears down).
	Site *SiteConfig
}

// New returns a manager for a validated [uvn] section; nodes are the
// cluster's node addresses ([cluster] nodes), the default unicast peers.
func New(cfg *Config, nodes []netip.Addr) *Manager {
	return &Manager{cfg: cfg, nodes: nodes, st: store{cfg.StateDir}, FailAt: failAtEnv()}
}

// failAtEnv is FailAt's value from the environment: none, unless the build
// injects failures (faultinject.go).
var failAtEnv = func() string { return "" }

// faultInjection reports a build with -tags palisade_fault_injection.
var faultInjection = false

func (m *Manager) logf(format string, args ...any) {
	if m.Logf != nil {
		m.Logf(format, args...)
	}
}

// ErrInjected is returned by a step named in FailAt.
var ErrInjected = errors.New("injected failure")

func (m *Manager) step(name string) error {
	if m.FailAt == name {
		return fmt.Errorf("step %s: %w", name, ErrInjected)
	}
	return nil
}

// CheckUID rejects uids the configuration does not serve.
func (m *Manager) CheckUID(uid uint32) error {
	if int64(uid) < m.cfg.MinUID {
		return fmt.Errorf("uid %d is below uvn.min_uid %d (VRF table ids start there)", uid, m.cfg.MinUID)
	}
	if int64(uid) > m.cfg.UIDMax {
		return fmt.Errorf("uid %d is above uvn.uid_max %d (raise uid_max and space the underlay ports by %d)", uid, m.cfg.UIDMax, uint64(uid>>vniBits)+1)
	}
	return nil
}

// Setup makes uid's network on this node (idempotent) and, if pid > 0,
// moves pid's session into it and registers holder (pid if holder is 0) as
// a live user of it. Concurrent setups of one uid serialise on its lock. On
// any failure everything this call made is removed again.
func (m *Manager) Setup(uid uint32, pid, holder int) (*UserState, error) {
	if err := m.CheckUID(uid); err != nil {
		return nil, err
	}
	if pid > 0 {
		if _, ok := procStart(pid); !ok {
			return nil, fmt.Errorf("pid %d does not exist", pid)
		}
	}
	if holder == 0 {
		holder = pid
	}
	unlock, err := m.st.lockUser(uid)
	if err != nil {
		return nil, err
	}
	defer unlock()
	st, found, err := m.st.loadUser(uid)
	if err != nil {
		return nil, err
	}
	fresh := false
	if found && st.Complete && !m.intact(st, true) {
		m.logf("uvn: uid %d: state incomplete on the kernel side; rebuilding", uid)
		st.Complete = false
	}
	if !st.Complete {
		if found {
			// A crash or a failure half-way: remove what the journal lists.
			if err := m.teardownLocked(st); err != nil {
				return nil, fmt.Errorf("clean up earlier half-done setup: %w", err)
			}
		}
		st = &UserState{UID: uid}
		if err := m.build(st); err != nil {
			if rerr := m.teardownLocked(st); rerr != nil {
				err = errors.Join(err, fmt.Errorf("rollback: %w", rerr))
			}
			return nil, err
		}
		fresh = true
	}
	if pid > 0 {
		if err := m.attach(st, pid, holder); err != nil {
			if fresh || len(st.Holders) == 0 {
				if rerr := m.teardownLocked(st); rerr != nil {
					err = errors.Join(err, fmt.Errorf("rollback: %w", rerr))
				}
			}
			return nil, err
		}
	}
	return st, nil
}

// intact is a cheap check that a complete state's kernel objects exist.
func (m *Manager) intact(st *UserState, repair bool) bool {
	l, err := netlink.LinkByName(st.VRF)
	if err != nil {
		return false
	}
	v, ok := l.(*netlink.Vrf)
	if !ok || v.Table != st.Table {
		return false
	}
	for _, n := range st.Links {
		if _, err := netlink.LinkByName(n); err != nil {
			return false
		}
	}
	if !m.siteIntact() {
		if !repair {
			return false
		}
		// The site rules' table was removed (or never made): put it
		// back for every user of the node.
		if err := m.applySiteLocked(0); err != nil {
			m.logf("uvn: site rules: %v", err)
			return false
		}
	}
	if !guardPresent() || !m.srunIntact() || !m.guardRootIntact() {
		if !repair {
			return false
		}
		// Restore the node-wide guard (and the Slurm-callback program) in
		// place; the user's objects are fine.
		unlock, err := m.st.lockNode()
		if err != nil {
			return false
		}
		defer unlock()
		return m.ensureNode() == nil
	}
	return true
}

// record appends an undo record to the journal on disk before the object
// it undoes is made.
func (m *Manager) record(st *UserState, u Undo) error {
	st.Undo = append(st.Undo, u)
	return m.st.saveUser(st)
}

// build makes uid's objects, journaling each one.
func (m *Manager) build(st *UserState) error {
	uid := st.UID
	st.VRF, st.Table = VRFName(uid), TableID(uid)

	// Node-wide part and the NAT address are decided under the node lock,
	// and the user's state file exists before it is released, so the last
	// user's teardown never removes node-wide objects under a new user.
	unlockNode, err := m.st.lockNode()
	if err != nil {
		return err
	}
	err = m.ensureNode()
	if err == nil {
		err = m.allocNAT(st)
	}
	if err == nil {
		err = m.st.saveUser(st)
	}
	unlockNode()
	if err != nil {
		return err
	}

	if err := m.step("table"); err != nil {
		return err
	}
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := nldump.Retry(func() ([]netlink.Route, error) {
			return netlink.RouteListFiltered(fam, &netlink.Route{Table: int(st.Table)}, netlink.RT_FILTER_TABLE)
		})
		if err != nil {
			return err
		}
		if len(rs) > 0 {
			return fmt.Errorf("routing table %d (uid %d's VRF table) already holds %d routes made by something else; refusing to share it", st.Table, uid, len(rs))
		}
	}

	// The VRF.
	if err := m.step("vrf"); err != nil {
		return err
	}
	if err := m.record(st, Undo{Kind: "link", Name: st.VRF}); err != nil {
		return err
	}
	vrf := &netlink.Vrf{LinkAttrs: netlink.LinkAttrs{Name: st.VRF}, Table: st.Table}
	if err := netlink.LinkAdd(vrf); err != nil {
		return fmt.Errorf("create VRF %s (table %d): %w", st.VRF, st.Table, err)
	}
	vl, err := netlink.LinkByName(st.VRF)
	if err != nil {
		return err
	}
	vidx := vl.Attrs().Index
	// The kernel adds the l3mdev rule (pref 1000) with the first VRF of a
	// network namespace, once; if someone removed it, VRF lookups would
	// silently use the main table. Make sure it is there. It stays after the
	// last user (it matches only flows of an l3mdev).
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		if err := ensureL3mdevRule(fam); err != nil {
			return err
		}
	}

	// Loopback addresses and the NAT addresses live on the VRF device: lo is
	// in the default VRF only, so replies to 127.0.0.1/::1 need these.
	if err := m.step("vrf-addr"); err != nil {
		return err
	}
	addrs := []string{"127.0.0.1/8", "::1/128", st.NAT + "/32"}
	for _, a := range addrs {
		if err := addAddr(vl, netip.MustParsePrefix(a)); err != nil {
			// Never disable IPv6 host-wide (prior art did): fail closed.
			return fmt.Errorf("add %s to %s: %w", a, st.VRF, err)
		}
	}

	// Slurm's callbacks from this node's own default VRF (bpf/srun.c)
	// arrive on the VRF device with a source address that is local in the
	// VRF too (the node's address, mirrored): accept it there. The setting
	// goes with the device.
	if m.Srun != (policy.PortRange{}) {
		if err := writeSysctl("net/ipv4/conf/"+st.VRF+"/accept_local", "1"); err != nil {
			return fmt.Errorf("%s: accept_local: %w", st.VRF, err)
		}
	}

	// Up before routes: a route through a down device is refused.
	if err := netlink.LinkSetUp(vl); err != nil {
		return fmt.Errorf("set %s up: %w", st.VRF, err)
	}

	// Routes: unreachable defaults first, then the off-subnet routes of the
	// main table with the NAT source, then the return route in main.
	if err := m.step("routes"); err != nil {
		return err
	}
	if err := m.vrfRoutes(st, vidx); err != nil {
		return err
	}

	// One VXLAN per underlay this node is on.
	if err := m.step("vxlan"); err != nil {
		return err
	}
	for i := range m.cfg.Underlays {
		if err := m.vxlan(st, i, vidx); err != nil {
			return err
		}
	}

	if err := m.guardAdd(st); err != nil {
		return err
	}
	if err := m.step("site"); err != nil {
		return err
	}
	if err := m.applySiteLocked(uid); err != nil {
		return err
	}
	if err := m.step("complete"); err != nil {
		return err
	}
	st.Complete = true
	if err := m.st.saveUser(st); err != nil {
		return err
	}
	m.logf("uvn: uid %d: VRF %s table %d, VXLANs %v, NAT %s", uid, st.VRF, st.Table, st.Links, st.NAT)
	return nil
}

func addAddr(l netlink.Link, p netip.Prefix) error {
	a := &netlink.Addr{IPNet: prefixToIPNet(p)}
	if p.Addr().IsLoopback() {
		// Scope host, as on lo: with scope global, source selection for
		// off-subnet traffic could pick 127.0.0.1 (and the kernel refuses
		// a loopback source out of a real device).
		a.Scope = unix.RT_SCOPE_HOST
	}
	if p.Addr().Is6() {
		a.Flags = unix.IFA_F_NODAD
	}
	err := netlink.AddrAdd(l, a)
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

func ipnetToPrefix(n *net.IPNet) (netip.Prefix, bool) {
	if n == nil {
		return netip.Prefix{}, false
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones), true
}

// inUnderlay reports whether p lies inside a configured underlay prefix.
func (m *Manager) inUnderlay(p netip.Prefix) bool {
	for _, u := range m.cfg.Underlays {
		for _, n := range u.Nets {
			if n.Addr().Is4() == p.Addr().Is4() && n.Bits() <= p.Bits() && n.Contains(p.Addr()) {
				return true
			}
		}
	}
	return false
}

func (m *Manager) addRoute(st *UserState, r *netlink.Route) error {
	dst := ""
	if r.Dst != nil {
		dst = r.Dst.String()
	}
	dev := ""
	if r.LinkIndex > 0 {
		if l, err := netlink.LinkByIndex(r.LinkIndex); err == nil {
			dev = l.Attrs().Name
		}
	}
	if err := m.record(st, Undo{Kind: "route", Table: uint32(r.Table), Family: r.Family, Dst: dst, Type: r.Type, Metric: uint32(r.Priority), Dev: dev}); err != nil {
		return err
	}
	if err := netlink.RouteAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add route %s: %w", r, err)
	}
	return nil
}

func (m *Manager) vrfRoutes(st *UserState, vidx int) error {
	table := int(st.Table)
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if fam == netlink.FAMILY_V6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		if err := m.addRoute(st, &netlink.Route{Table: table, Family: fam, Dst: dst, Type: unix.RTN_UNREACHABLE, Priority: unreachableMetric}); err != nil {
			return err
		}
	}
	// Off-subnet IPv4 leaves through the main table's routes with the NAT
	// source. (IPv6 cannot: the kernel refuses a leaked IPv6 route whose
	// preferred source lives in another L3 domain, so off-subnet IPv6 from a
	// VRF hits the unreachable default and fails fast.)
	for _, fam := range []int{netlink.FAMILY_V4} {
		src := net.ParseIP(st.NAT)
		main, err := nldump.Retry(func() ([]netlink.Route, error) {
			return netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		})
		if err != nil {
			return err
		}
		for _, r := range main {
			if r.Type != unix.RTN_UNICAST || r.LinkIndex == 0 || len(r.MultiPath) > 0 {
				continue
			}
			if l, err := netlink.LinkByIndex(r.LinkIndex); err != nil || isUVNDev(l.Attrs().Name) || l.Attrs().Flags&net.FlagLoopback != 0 {
				continue
			}
			if p, ok := ipnetToPrefix(r.Dst); ok && (m.inUnderlay(p) || p.Addr().IsLinkLocalUnicast() || p.Addr().IsMulticast()) {
				continue // reached over the overlay (or link-local)
			}
			c := netlink.Route{Table: table, Family: fam, Dst: r.Dst, Gw: r.Gw, LinkIndex: r.LinkIndex, Src: src, Priority: r.Priority, Scope: r.Scope, Type: unix.RTN_UNICAST}
			if r.Gw != nil {
				c.Flags = int(netlink.FLAG_ONLINK)
			}
			if c.Dst == nil {
				c.Dst = &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
				if fam == netlink.FAMILY_V6 {
					c.Dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
				}
			}
			if err := m.addRoute(st, &c); err != nil {
				return err
			}
		}
		// Return path: de-NATed replies arrive in the default VRF and are
		// forwarded into the VRF device.
		bits := 32
		if fam == netlink.FAMILY_V6 {
			bits = 128
		}
		if err := m.addRoute(st, &netlink.Route{Table: unix.RT_TABLE_MAIN, Family: fam, LinkIndex: vidx,
			Dst: &net.IPNet{IP: src, Mask: net.CIDRMask(bits, bits)}, Scope: netlink.SCOPE_LINK}); err != nil {
			return err
		}
	}
	return nil
}

func isUVNDev(name string) bool {
	if !strings.HasPrefix(name, "pal") || len(name) < 5 {
		return false
	}
	if name[3] == 'v' {
		if _, err := strconv.ParseUint(name[4:], 10, 32); err == nil {
			return true
		}
	}
	if name[4] == 'x' && len(name) > 5 {
		_, err := strconv.ParseUint(name[5:], 10, 32)
		return err == nil
	}
	return false
}

// localUnderlay finds this node's NIC and addresses on underlay u: the NIC
// holding an address in u's first prefix (the tunnel endpoint), and all of
// that NIC's addresses inside any of u's prefixes (mirrored on the VXLAN).
func localUnderlay(u Underlay) (netlink.Link, netip.Addr, []netip.Prefix, error) {
	addrs, err := nldump.Retry(func() ([]netlink.Addr, error) { return netlink.AddrList(nil, netlink.FAMILY_ALL) })
	if err != nil {
		return nil, netip.Addr{}, nil, err
	}
	for _, a := range addrs {
		p, ok := ipnetToPrefix(a.IPNet)
		if !ok || !u.Nets[0].Contains(p.Addr()) {
			continue
		}
		l, err := netlink.LinkByIndex(a.LinkIndex)
		if err != nil || isUVNDev(l.Attrs().Name) {
			continue
		}
		var mirror []netip.Prefix
		for _, b := range addrs {
			q, ok := ipnetToPrefix(b.IPNet)
			if !ok || b.LinkIndex != a.LinkIndex {
				continue
			}
			for _, n := range u.Nets {
				if n.Contains(q.Addr()) {
					mirror = append(mirror, q)
					break
				}
			}
		}
		return l, p.Addr(), mirror, nil
	}
	return nil, netip.Addr{}, nil, nil
}

func (m *Manager) peers(u Underlay) []netip.Addr {
	if len(u.PeerAddrs) > 0 {
		return u.PeerAddrs
	}
	var out []netip.Addr
	for _, a := range m.nodes {
		if u.Nets[0].Contains(a) {
			out = append(out, a)
		}
	}
	return out
}

func (m *Manager) vxlan(st *UserState, i, vidx int) error {
	u := m.cfg.Underlays[i]
	nic, local, mirror, err := localUnderlay(u)
	if err != nil {
		return err
	}
	if nic == nil {
		m.logf("uvn: underlay %d (%s): this node has no address in it; skipped", i, u.Nets[0])
		return nil
	}
	name := VXLANName(i, st.UID)
	if err := m.record(st, Undo{Kind: "link", Name: name}); err != nil {
		return err
	}
	st.Links = append(st.Links, name)
	vx := &netlink.Vxlan{
		LinkAttrs:    netlink.LinkAttrs{Name: name, MasterIndex: vidx},
		VxlanId:      int(VNI(st.UID)),
		VtepDevIndex: nic.Attrs().Index,
		SrcAddr:      net.IP(local.AsSlice()),
		TTL:          int(m.cfg.VXLANTTL),
		Learning:     true,
		Port:         int(u.Port) + int(PortOffset(st.UID)),
		PortLow:      int(m.cfg.SrcPortMin),
		PortHigh:     int(m.cfg.SrcPortMax) + 1, // the kernel's range is [low, high)
	}
	if u.GroupNet.IsValid() {
		vx.Group = net.IP(GroupFor(u.GroupNet, st.UID).AsSlice())
	}
	if local.Is6() {
		vx.UDP6ZeroCSumRx = false
	}
	if err := netlink.LinkAdd(vx); err != nil {
		return fmt.Errorf("create VXLAN %s (VNI %d, port %d, dev %s): %w", name, vx.VxlanId, vx.Port, nic.Attrs().Name, err)
	}
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetMaster(l, &netlink.Vrf{LinkAttrs: netlink.LinkAttrs{Index: vidx}}); err != nil {
		return fmt.Errorf("enslave %s: %w", name, err)
	}
	for _, p := range mirror {
		if err := addAddr(l, p); err != nil {
			return fmt.Errorf("add %s to %s: %w", p, name, err)
		}
	}
	if !u.GroupNet.IsValid() {
		zero := net.HardwareAddr{0, 0, 0, 0, 0, 0}
		for _, peer := range m.peers(u) {
			if peer == local || slices.ContainsFunc(mirror, func(p netip.Prefix) bool { return p.Addr() == peer }) {
				continue
			}
			if err := netlink.NeighAppend(&netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_BRIDGE,
				Flags: netlink.NTF_SELF, State: netlink.NUD_PERMANENT | netlink.NUD_NOARP,
				HardwareAddr: zero, IP: net.IP(peer.AsSlice())}); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s: FDB entry for peer %s: %w", name, peer, err)
			}
		}
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// allocNAT picks uid's NAT addresses: base + uid (mod pool), probing past
// addresses other users of this node hold. Called under the node lock.
func (m *Manager) allocNAT(st *UserState) error {
	used := map[string]bool{}
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	for _, u := range uids {
		if u == st.UID {
			continue
		}
		o, ok, err := m.st.loadUser(u)
		if err != nil || !ok {
			continue
		}
		used[o.NAT] = true
	}
	pick := func(p netip.Prefix) (string, error) {
		size := poolSize(p)
		for k := uint64(0); k < size && k < 1<<20; k++ {
			a := addrInPrefix(p, uint64(st.UID)+k, true).String()
			if !used[a] {
				return a, nil
			}
		}
		return "", fmt.Errorf("NAT pool %s is exhausted", p)
	}
	if st.NAT, err = pick(m.cfg.NATPrefix); err != nil {
		return err
	}
	return nil
}
