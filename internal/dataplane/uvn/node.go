package uvn

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Node-wide settings. tcp/udp_l3mdev_accept = 1 lets the default VRF's
// system services (sshd, slurmd, DNS) serve every user's VRF — the point of
// the design. raw_l3mdev_accept = 0: no system service needs raw sockets
// across VRFs, and it keeps root-owned raw sockets from seeing overlay
// traffic (kernel default is 1). Every user's VXLAN on one underlay shares
// the kernel's single UDP socket for that port, and each joins its own
// multicast group on it: the per-socket IGMP membership limit (default 20)
// would stop the 21st user on a node with ENOBUFS.
var nodeSysctls = [][2]string{
	{"net/ipv4/tcp_l3mdev_accept", "1"},
	{"net/ipv4/udp_l3mdev_accept", "1"},
	{"net/ipv4/raw_l3mdev_accept", "0"},
	{"net/ipv4/igmp_max_memberships", "65536"},
}

const procSys = "/proc/sys/"

func readSysctl(p string) (string, error) {
	b, err := os.ReadFile(procSys + p)
	return strings.TrimSpace(string(b)), err
}

func writeSysctl(p, v string) error { return os.WriteFile(procSys+p, []byte(v), 0o644) }

// ensureNode makes the node-wide objects once (under the node lock).
func (m *Manager) ensureNode() error {
	ns, found, err := m.st.loadNode()
	if err != nil {
		return err
	}
	if found && ns.Complete {
		if ns.SrunRange != "" {
			// Put back a removed tc program (or its map) in place.
			if err := m.ensureSrunTC(ns); err != nil {
				return err
			}
		}
		if err := m.ensureGuardRoot(ns); err != nil {
			return err
		}
		if guardPresent() {
			return nil
		}
		// Someone removed the nftables guard: put it back (VXLAN ports
		// must never be open to users), leave the rest as it is.
		return installGuard(m.guardSpec(ns.ForwardGuard))
	}
	if found {
		if err := m.undoAll(ns.Undo); err != nil {
			return fmt.Errorf("clean up earlier half-done node setup: %w", err)
		}
	}
	ns = &NodeState{}
	err = m.buildNode(ns)
	if err != nil {
		if rerr := m.undoAll(ns.Undo); rerr != nil {
			err = errors.Join(err, fmt.Errorf("rollback: %w", rerr))
		}
		os.Remove(m.st.nodePath())
		return err
	}
	return nil
}

func (m *Manager) recordNode(ns *NodeState, u Undo) error {
	ns.Undo = append(ns.Undo, u)
	return m.st.saveNode(ns)
}

func (m *Manager) buildNode(ns *NodeState) error {
	if err := m.step("node"); err != nil {
		return err
	}
	// The nft guard trusts the privileged source-port range; it is only
	// sound if no unprivileged socket can get such a port.
	if v, err := readSysctl("net/ipv4/ip_unprivileged_port_start"); err == nil {
		if n, _ := strconv.Atoi(v); int64(n) <= m.cfg.SrcPortMax {
			return fmt.Errorf("net.ipv4.ip_unprivileged_port_start is %d: users could send from the VXLAN source ports %d-%d; raise it above %d",
				n, m.cfg.SrcPortMin, m.cfg.SrcPortMax, m.cfg.SrcPortMax)
		}
	}
	if v, err := readSysctl("net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(v); len(f) == 2 {
			if n, _ := strconv.Atoi(f[0]); int64(n) <= m.cfg.SrcPortMax {
				return fmt.Errorf("net.ipv4.ip_local_port_range starts at %d, inside the VXLAN source ports %d-%d", n, m.cfg.SrcPortMin, m.cfg.SrcPortMax)
			}
		}
	}
	for _, kv := range nodeSysctls {
		if err := m.setSysctl(ns, kv[0], kv[1]); err != nil {
			return err
		}
	}
	uplinks, err := m.uplinks()
	if err != nil {
		return err
	}
	// Replies to underlay-port traffic come back on the underlay NICs.
	for _, u := range m.cfg.Underlays {
		if nic, _, _, err := localUnderlay(u); err == nil && nic != nil && !slices.Contains(uplinks, nic.Attrs().Name) {
			uplinks = append(uplinks, nic.Attrs().Name)
		}
	}
	forwardGuard := false
	for _, up := range uplinks {
		for _, f := range []string{"ipv4"} {
			p := "net/" + f + "/conf/" + up + "/forwarding"
			if old, err := readSysctl(p); err == nil && old == "0" {
				forwardGuard = true
			}
			// Forwarding on the uplink's input side carries de-NATed
			// replies into the user's VRF device.
			if err := m.setSysctl(ns, p, "1"); err != nil {
				return err
			}
		}
	}

	if len(m.cfg.UnderlayRanges) > 0 {
		if err := m.natRules(ns); err != nil {
			return err
		}
	}

	// RPDB: the local table must be looked up after the l3mdev rule (1000),
	// or a VRF's addresses that are also local in the default VRF (the
	// mirrored underlay addresses) would be delivered outside the VRF.
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		if err := m.moveLocalRule(ns, fam); err != nil {
			return err
		}
	}

	if m.Srun != (policy.PortRange{}) {
		if err := m.step("srun"); err != nil {
			return err
		}
		if err := m.buildSrun(ns); err != nil {
			return err
		}
	}

	if err := m.step("guard"); err != nil {
		return err
	}
	if err := m.ensureGuardRoot(ns); err != nil {
		return err
	}

	ns.ForwardGuard = forwardGuard
	g := m.guardSpec(forwardGuard)
	if err := m.step("nft"); err != nil {
		return err
	}
	if err := m.recordNode(ns, Undo{Kind: "nft", Name: nftTable}); err != nil {
		return err
	}
	if err := installGuard(g); err != nil {
		return err
	}
	ns.Complete = true
	return m.st.saveNode(ns)
}

// guardSpec is the nftables guard for this node's configuration.
func (m *Manager) guardSpec(forwardGuard bool) guard {
	g := guard{srcMin: uint16(m.cfg.SrcPortMin), srcMax: uint16(m.cfg.SrcPortMax), natPool: m.cfg.NATPrefix, forwardGuard: forwardGuard}
	for _, u := range m.cfg.Underlays {
		gu := guardUnderlay{portLo: uint16(u.Port), portHi: uint16(u.Port + m.cfg.PortSpan() - 1), v6: u.Nets[0].Addr().Is6()}
		if nic, _, _, err := localUnderlay(u); err == nil && nic != nil {
			gu.nic = nic.Attrs().Name
		}
		if len(u.PeerAddrs) > 0 || (!u.GroupNet.IsValid() && len(m.peers(u)) > 0) {
			for _, a := range m.peers(u) {
				gu.peers = append(gu.peers, netip.PrefixFrom(a, a.BitLen()))
			}
		} else {
			gu.peers = []netip.Prefix{u.Nets[0]}
		}
		g.underlays = append(g.underlays, gu)
	}
	return g
}

func (m *Manager) setSysctl(ns *NodeState, p, v string) error {
	old, err := readSysctl(p)
	if err != nil {
		return fmt.Errorf("sysctl %s: %w", p, err)
	}
	if old == v {
		return nil
	}
	if err := m.recordNode(ns, Undo{Kind: "sysctl", Name: p, Value: old}); err != nil {
		return err
	}
	if err := writeSysctl(p, v); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", p, v, err)
	}
	return nil
}

// uplinks are the configured uplinks, or every device of a main-table
// gateway route (IPv4: off-subnet IPv6 is not NATed, see docs/uvn.md).
func (m *Manager) uplinks() ([]string, error) {
	if len(m.cfg.Uplinks) > 0 {
		return m.cfg.Uplinks, nil
	}
	seen := map[string]bool{}
	var out []string
	for _, fam := range []int{netlink.FAMILY_V4} {
		rs, err := nldump.Retry(func() ([]netlink.Route, error) {
			return netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		})
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			if r.Gw == nil || r.LinkIndex == 0 {
				continue
			}
			l, err := netlink.LinkByIndex(r.LinkIndex)
			if err != nil || isUVNDev(l.Attrs().Name) || seen[l.Attrs().Name] {
				continue
			}
			seen[l.Attrs().Name] = true
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}

const (
	localRulePref  = 32765
	l3mdevRulePref = 1000
)

// ensureL3mdevRule adds "pref 1000 l3mdev" (FRA_L3MDEV, which
// vishvananda/netlink does not model) when the family has no rule at 1000.
func ensureL3mdevRule(fam int) error {
	rules, err := nldump.Retry(func() ([]netlink.Rule, error) { return netlink.RuleList(fam) })
	if err != nil {
		return err
	}
	for _, r := range rules {
		if r.Priority == l3mdevRulePref {
			return nil
		}
	}
	req := nl.NewNetlinkRequest(unix.RTM_NEWRULE, unix.NLM_F_CREATE|unix.NLM_F_EXCL|unix.NLM_F_ACK)
	msg := nl.NewRtMsg()
	msg.Family = uint8(fam)
	msg.Protocol = unix.RTPROT_BOOT
	msg.Scope = unix.RT_SCOPE_UNIVERSE
	msg.Table = unix.RT_TABLE_UNSPEC
	msg.Type = unix.FR_ACT_TO_TBL
	req.AddData(msg)
	req.AddData(nl.NewRtAttr(nl.FRA_PRIORITY, nl.Uint32Attr(l3mdevRulePref)))
	req.AddData(nl.NewRtAttr(unix.FRA_L3MDEV, []byte{1}))
	if _, err := req.Execute(unix.NETLINK_ROUTE, 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add l3mdev rule: %w", err)
	}
	return nil
}

func (m *Manager) moveLocalRule(ns *NodeState, fam int) error {
	rules, err := nldump.Retry(func() ([]netlink.Rule, error) { return netlink.RuleList(fam) })
	if err != nil {
		return err
	}
	var at0, moved bool
	for _, r := range rules {
		if r.Table == unix.RT_TABLE_LOCAL && r.Priority == 0 {
			at0 = true
		}
		if r.Table == unix.RT_TABLE_LOCAL && r.Priority == localRulePref {
			moved = true
		}
	}
	if !at0 {
		return nil // already reordered (by us or the site)
	}
	if err := m.recordNode(ns, Undo{Kind: "rule-local", Family: fam}); err != nil {
		return err
	}
	if !moved {
		r := netlink.NewRule()
		r.Family, r.Table, r.Priority = fam, unix.RT_TABLE_LOCAL, localRulePref
		if err := netlink.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add local rule at %d: %w", localRulePref, err)
		}
	}
	r := netlink.NewRule()
	r.Family, r.Table, r.Priority = fam, unix.RT_TABLE_LOCAL, 0
	if err := netlink.RuleDel(r); err != nil {
		return fmt.Errorf("remove local rule at 0: %w", err)
	}
	return nil
}

// undoAll replays undo records newest first; missing objects are fine.
func (m *Manager) undoAll(us []Undo) error {
	var errs []error
	for i := len(us) - 1; i >= 0; i-- {
		if err := undo(us[i]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func gone(err error) bool {
	var lnf netlink.LinkNotFoundError
	return err == nil || errors.As(err, &lnf) || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) ||
		errors.Is(err, unix.ENODEV) || errors.Is(err, unix.EADDRNOTAVAIL)
}

func undo(u Undo) error {
	switch u.Kind {
	case "link":
		l, err := netlink.LinkByName(u.Name)
		if err != nil {
			if gone(err) {
				return nil
			}
			return err
		}
		if err := netlink.LinkDel(l); !gone(err) {
			return fmt.Errorf("delete link %s: %w", u.Name, err)
		}
	case "route":
		r := &netlink.Route{Table: int(u.Table), Family: u.Family, Type: u.Type, Priority: int(u.Metric)}
		if u.Dst != "" {
			_, n, err := net.ParseCIDR(u.Dst)
			if err != nil {
				return err
			}
			r.Dst = n
		}
		if u.Dev != "" {
			l, err := netlink.LinkByName(u.Dev)
			if err != nil {
				return nil // went with its device
			}
			r.LinkIndex = l.Attrs().Index
		}
		if r.Type == 0 {
			r.Type = unix.RTN_UNICAST
		}
		if err := netlink.RouteDel(r); !gone(err) {
			return fmt.Errorf("delete route %s table %d: %w", u.Dst, u.Table, err)
		}
	case "sysctl":
		if err := writeSysctl(u.Name, u.Value); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("restore sysctl %s: %w", u.Name, err)
		}
	case "rule-local":
		r := netlink.NewRule()
		r.Family, r.Table, r.Priority = u.Family, unix.RT_TABLE_LOCAL, 0
		if err := netlink.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("restore local rule: %w", err)
		}
		r.Priority = localRulePref
		if err := netlink.RuleDel(r); !gone(err) {
			return fmt.Errorf("remove local rule at %d: %w", localRulePref, err)
		}
	case "rule":
		r := netlink.NewRule()
		r.Family, r.Priority, r.Table = u.Family, u.Pref, int(u.Table)
		if u.Mark != 0 {
			mask := uint32(0xffffffff)
			r.Mark, r.Mask = u.Mark, &mask
		}
		if u.Dst != "" {
			_, n, err := net.ParseCIDR(u.Dst)
			if err != nil {
				return err
			}
			r.Src = n
		}
		r.IPProto = u.Proto
		if u.DportHi != 0 {
			r.Dport = netlink.NewRulePortRange(u.DportLo, u.DportHi)
		}
		if err := netlink.RuleDel(r); !gone(err) {
			return fmt.Errorf("remove rule %d: %w", u.Pref, err)
		}
	case "nft":
		if err := removeGuard(); err != nil {
			return fmt.Errorf("remove nftables table: %w", err)
		}
	case "tc":
		return undoSrunFilter(u.Name)
	case "clsact":
		return undoClsact(u.Name)
	case "srun-release":
		return undoSrunRelease(u.Prog)
	case "guard-root":
		return undoGuardRoot(u)
	default:
		return fmt.Errorf("unknown journal record %q", u.Kind)
	}
	return nil
}

// teardownLocked removes everything of st (user lock held): programs and
// cgroups first (no socket may be bound to a vanishing ifindex), then the
// journal newest first; then, if no user is left, the node-wide objects.
func (m *Manager) teardownLocked(st *UserState) error {
	var errs []error
	if len(st.Attach) > 0 {
		cg, err := openCgroup2()
		if err != nil {
			errs = append(errs, err)
		} else {
			for _, a := range st.Attach {
				if err := cg.detachAll(a); err != nil {
					errs = append(errs, err)
				}
				if a.Created {
					if err := cg.removeCgroup(a.Cgroup); err != nil {
						errs = append(errs, fmt.Errorf("remove cgroup %s: %w", a.Cgroup, err))
					}
				}
			}
			cg.Close()
		}
	}
	if vl, err := netlink.LinkByName(st.VRF); err == nil {
		if err := m.dropSrunClaims(vl.Attrs().Index); err != nil {
			errs = append(errs, fmt.Errorf("srun port claims: %w", err))
		}
		if err := m.guardDrop(vl.Attrs().Index); err != nil {
			errs = append(errs, fmt.Errorf("guard maps: %w", err))
		}
	}
	if err := m.undoAll(st.Undo); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		// Keep the journal so a later teardown can finish the job.
		st.Complete = false
		m.st.saveUser(st)
		return errors.Join(errs...)
	}
	if err := m.st.removeUser(st.UID); err != nil {
		return err
	}
	*st = UserState{UID: st.UID}
	return m.maybeTeardownNode()
}

func (m *Manager) maybeTeardownNode() error {
	// The users left keep their rules: what the rebuild needs is looked up
	// before the node lock.
	var pr *sitePrep
	if uids, err := m.st.users(); err == nil && len(uids) > 0 && m.Site != nil {
		if pr, err = m.prepareSite(0, false); err != nil {
			return err
		}
	}
	unlock, err := m.st.lockNode()
	if err != nil {
		return err
	}
	defer unlock()
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	if len(uids) > 0 {
		if pr == nil {
			// Users came meanwhile; their own setup rebuilds too.
			if m.Site == nil {
				return nil
			}
			pr = &sitePrep{known: map[uint32]groupsEntry{}}
			if pr.p, err = m.st.readAccepted(); err != nil || pr.p == nil {
				return err
			}
		}
		return m.applySite(pr)
	}
	if err := removeSite(); err != nil {
		return fmt.Errorf("remove nftables table %s: %w", siteTable, err)
	}
	ns, found, err := m.st.loadNode()
	if err != nil || !found {
		return err
	}
	if err := m.undoAll(ns.Undo); err != nil {
		ns.Complete = false
		m.st.saveNode(ns)
		return err
	}
	return os.Remove(m.st.nodePath())
}

// attach moves pid's session into the VRF and registers holder.
func (m *Manager) attach(st *UserState, pid, holder int) error {
	if err := m.step("attach"); err != nil {
		return err
	}
	vl, err := netlink.LinkByName(st.VRF)
	if err != nil {
		return err
	}
	cg, err := openCgroup2()
	if err != nil {
		return err
	}
	defer cg.Close()
	var h Holder
	if holder > 0 {
		start, ok := procStart(holder)
		if !ok {
			return fmt.Errorf("holder pid %d does not exist", holder)
		}
		h = Holder{PID: holder, Start: start}
	}
	if err := m.checkNotNested(st.UID, pid); err != nil {
		return err
	}
	path, created, err := cg.sessionCgroup(pid, st.UID)
	if err != nil {
		return err
	}
	have := false
	for _, a := range st.Attach {
		if a.Cgroup == path && programAlive(a.ProgID) && cg.exists(path) {
			have = true
		}
	}
	if !have {
		// Record the cgroup first (so a failure below still removes it).
		a := Attachment{Cgroup: path, Created: created, Holder: h}
		st.Attach = append(st.Attach, a)
		if err := m.st.saveUser(st); err != nil {
			return err
		}
		a0 := &st.Attach[len(st.Attach)-1]
		id, err := cg.attach(path, vl.Attrs().Index)
		if err != nil {
			return err
		}
		a0.ProgID = id
		if err := m.attachLinkLocal(cg, a0); err != nil {
			return err
		}
		if err := m.attachUnderlay(cg, a0, st); err != nil {
			return err
		}
		if err := m.attachSrun(cg, a0, vl.Attrs().Index, vl.Attrs().HardwareAddr); err != nil {
			return err
		}
	}
	if holder > 0 {
		st.pruneHolders(0)
		if !slices.Contains(st.Holders, h) {
			st.Holders = append(st.Holders, h)
		}
	}
	m.pruneAttachments(st, cg, nil)
	return m.st.saveUser(st)
}

// checkNotNested refuses a session of uid whose process is inside another
// user's attachment (su or sudo to uid from that user's session, with
// pam_exec in their stack): programs attached above run after the session's
// own, so its sockets would be bound to the other user's VRF.
func (m *Manager) checkNotNested(uid uint32, pid int) error {
	here, err := procfs.Cgroup2(pid)
	if err != nil {
		return err
	}
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	for _, u := range uids {
		if u == uid {
			continue
		}
		// Read without the other user's lock: a stale answer only
		// refuses or admits this one session, never changes a network.
		other, found, err := m.st.loadUser(u)
		if err != nil || !found {
			continue
		}
		for _, a := range other.Attach {
			if here == a.Cgroup || strings.HasPrefix(here, strings.TrimSuffix(a.Cgroup, "/")+"/") {
				return fmt.Errorf("pid %d is in uid %d's network (cgroup %s): a session of uid %d cannot start inside another user's session; start it from a fresh login", pid, u, a.Cgroup, uid)
			}
		}
	}
	return nil
}

// pruneAttachments removes the attachments whose holder is no longer a live
// holder of st and in whose cgroup no process is left but those of leaving
// (the holder being released, this process): their programs are detached,
// leaving processes move back to the parent of a cgroup Palisade made, and
// that cgroup goes. An attachment that still holds other processes stays
// (they keep their VRF: a user process never leaves it), and so does the
// network (see Release).
func (m *Manager) pruneAttachments(st *UserState, cg *cgroup2, leaving []int) {
	kept := st.Attach[:0]
	for _, a := range st.Attach {
		if !cg.exists(a.Cgroup) {
			continue
		}
		if a.Holder.PID != 0 && slices.Contains(st.Holders, a.Holder) {
			kept = append(kept, a)
			continue
		}
		pids, err := cg.procs(a.Cgroup, true)
		if err != nil {
			kept = append(kept, a)
			continue
		}
		var others []int
		for _, p := range pids {
			if slices.Contains(leaving, p) {
				if a.Created {
					cg.writeFile(path.Dir(a.Cgroup), "cgroup.procs", strconv.Itoa(p))
				}
				continue
			}
			if _, alive := procStart(p); alive {
				others = append(others, p)
			}
		}
		if len(others) > 0 {
			m.logf("uvn: uid %d: cgroup %s keeps its VRF: %d process(es) still in it (%v)", st.UID, a.Cgroup, len(others), others)
			kept = append(kept, a)
			continue
		}
		if err := cg.detachAll(a); err != nil {
			m.logf("uvn: uid %d: %v", st.UID, err)
			kept = append(kept, a)
			continue
		}
		if a.Created {
			if err := cg.removeCgroup(a.Cgroup); err != nil {
				m.logf("uvn: uid %d: remove cgroup %s: %v", st.UID, a.Cgroup, err)
				a.ProgID, a.ConnectID, a.SendmsgID, a.Bind4ID, a.Bind6ID, a.ReleaseID = 0, 0, 0, 0, 0, 0
				a.EgressID, a.IngressID, a.LinkLocalID = 0, 0, 0
				kept = append(kept, a)
				continue
			}
		}
	}
	st.Attach = kept
}

// Release drops holder (0: none, just prune dead holders) from uid's
// holders and removes exactly the attachments made for it (and for holders
// that died), moving holder and this process out of cgroups Palisade made.
// When no live holder and no attachment is left, the user's network is torn
// down. It reports whether it tore down.
func (m *Manager) Release(uid uint32, holder int) (bool, error) {
	unlock, err := m.st.lockUser(uid)
	if err != nil {
		return false, err
	}
	defer unlock()
	st, found, err := m.st.loadUser(uid)
	if err != nil || !found {
		return false, err
	}
	st.pruneHolders(holder)
	leaving := []int{os.Getpid()}
	if holder > 0 {
		leaving = append(leaving, holder)
	}
	cg, err := openCgroup2()
	if err != nil {
		return false, err
	}
	m.pruneAttachments(st, cg, leaving)
	cg.Close()
	if len(st.Holders) > 0 || len(st.Attach) > 0 {
		return false, m.st.saveUser(st)
	}
	return true, m.teardownLocked(st)
}

// Teardown removes uid's network on this node whatever its holders.
func (m *Manager) Teardown(uid uint32) error {
	unlock, err := m.st.lockUser(uid)
	if err != nil {
		return err
	}
	defer unlock()
	st, found, err := m.st.loadUser(uid)
	if err != nil {
		return err
	}
	if !found {
		return m.maybeTeardownNode()
	}
	return m.teardownLocked(st)
}

// TeardownAll removes every user's network and the node-wide objects.
func (m *Manager) TeardownAll() error {
	uids, err := m.st.users()
	if err != nil {
		return err
	}
	var errs []error
	for _, u := range uids {
		if err := m.Teardown(u); err != nil {
			errs = append(errs, fmt.Errorf("uid %d: %w", u, err))
		}
	}
	if err := m.maybeTeardownNode(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// UserStatus is one user's line of `palisade uvn status`.
type UserStatus struct {
	UserState
	Intact      bool `json:"intact"`
	LiveHolders int  `json:"live_holders"`
	// SrunClaims of SrunBudget SrunPortRange ports the user's VRF holds
	// claimed (bpf/srun.c); at the budget, the user's next srun on this
	// node finds no port ("all ports in range exhausted").
	SrunClaims uint32 `json:"srun_claims"`
	SrunBudget uint32 `json:"srun_budget,omitempty"`
	SrunRange  string `json:"srun_range,omitempty"`
}

// SrunExhausted says, naming the user (name: identity.UserName's
// "alice(2001)") and the budget, that the user's VRF holds every SrunPortRange
// claim it may on this node; "" while it does not. srun itself can only
// say Slurm's "all ports in range exhausted" (the refused bind is EPERM to
// it), so the node says why where it can: `palisade uvn status`, the
// PAM and SPANK entry points' output and logs.
func (u *UserStatus) SrunExhausted(name string) string {
	if u.SrunBudget == 0 || u.SrunClaims < u.SrunBudget {
		return ""
	}
	return fmt.Sprintf("user %s holds %d SrunPortRange claims (%s) on this node, the budget of %d per user: "+
		"an srun from the user's VRF here fails with \"all ports in range exhausted\" until some of the user's sockets on those ports close",
		name, u.SrunClaims, u.SrunRange, u.SrunBudget)
}

// SrunStatus is uid's claims against its budget on this node (zero
// budget: no Slurm-callback path here, or the user has no network).
func (m *Manager) SrunStatus(uid uint32) UserStatus {
	us := UserStatus{UserState: UserState{UID: uid, VRF: VRFName(uid)}}
	counts, budget, rng := m.srunCounts()
	if counts == nil {
		return us
	}
	defer counts.Close()
	us.SrunBudget, us.SrunRange = budget, rng
	if vl, err := netlink.LinkByName(us.VRF); err == nil {
		counts.Lookup(uint32(vl.Attrs().Index), &us.SrunClaims) // none: 0
	}
	return us
}

// srunCounts opens the map of live claims per VRF, with the budget and the
// range it counts for (nil: no Slurm-callback path on this node).
func (m *Manager) srunCounts() (*ebpf.Map, uint32, string) {
	ns, found, err := m.st.loadNode()
	if err != nil || !found || ns.SrunCount == 0 {
		return nil, 0, ""
	}
	r, err := policy.ParsePortRange(ns.SrunRange)
	if err != nil {
		return nil, 0, ""
	}
	counts, err := ebpf.NewMapFromID(ebpf.MapID(ns.SrunCount))
	if err != nil {
		return nil, 0, ""
	}
	return counts, SrunBudget(r), ns.SrunRange
}

// Status lists the users with a network on this node.
func (m *Manager) Status() ([]UserStatus, *NodeState, error) {
	uids, err := m.st.users()
	if err != nil {
		return nil, nil, err
	}
	var out []UserStatus
	counts, budget, rng := m.srunCounts()
	if counts != nil {
		defer counts.Close()
	}
	for _, u := range uids {
		st, ok, err := m.st.loadUser(u)
		if err != nil || !ok {
			continue
		}
		us := UserStatus{UserState: *st, SrunBudget: budget, SrunRange: rng}
		if vl, err := netlink.LinkByName(st.VRF); err == nil && counts != nil {
			counts.Lookup(uint32(vl.Attrs().Index), &us.SrunClaims) // none: 0
		}
		us.Intact = st.Complete && m.intact(st, false)
		for _, h := range st.Holders {
			if h.alive() {
				us.LiveHolders++
			}
		}
		out = append(out, us)
	}
	ns, found, err := m.st.loadNode()
	if !found {
		ns = nil
	}
	return out, ns, err
}

// Leftovers lists uvn kernel objects in this network namespace (links
// named like ours, the nft table, non-empty VRF tables of known users):
// after the last teardown it must be empty.
func Leftovers() ([]string, error) {
	var out []string
	links, err := nldump.Retry(func() ([]netlink.Link, error) { return netlink.LinkList() })
	if err != nil {
		return nil, err
	}
	for _, l := range links {
		if isUVNDev(l.Attrs().Name) {
			out = append(out, "link "+l.Attrs().Name)
		}
	}
	if guardPresent() {
		out = append(out, "nft table inet "+nftTable)
	}
	if sitePresent() {
		out = append(out, "nft table inet "+siteTable)
	}
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := nldump.Retry(func() ([]netlink.Route, error) {
			return netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
		})
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			if r.Table != unix.RT_TABLE_MAIN && r.Table != unix.RT_TABLE_LOCAL && r.Table != unix.RT_TABLE_DEFAULT {
				out = append(out, fmt.Sprintf("route table %d %s", r.Table, r))
			}
		}
	}
	return out, nil
}

// StateDir is where the manager keeps journals.
func (m *Manager) StateDir() string { return filepath.Clean(m.st.dir) }

// detachAll removes every program of a.
func (c *cgroup2) detachAll(a Attachment) error {
	return errors.Join(
		c.detachAs(a.Cgroup, a.Bind4ID, ebpf.AttachCGroupInet4PostBind),
		c.detachAs(a.Cgroup, a.Bind6ID, ebpf.AttachCGroupInet6PostBind),
		c.detachAs(a.Cgroup, a.ReleaseID, ebpf.AttachCgroupInetSockRelease),
		c.detachAs(a.Cgroup, a.ConnectID, ebpf.AttachCGroupInet4Connect),
		c.detachAs(a.Cgroup, a.SendmsgID, ebpf.AttachCGroupUDP4Sendmsg),
		c.detachAs(a.Cgroup, a.EgressID, ebpf.AttachCGroupInetEgress),
		c.detachAs(a.Cgroup, a.IngressID, ebpf.AttachCGroupInetIngress),
		c.detachAs(a.Cgroup, a.LinkLocalID, ebpf.AttachCGroupInet6Bind),
		c.detach(a.Cgroup, a.ProgID))
}

// attachUnderlay attaches the underlay-port programs (see underlayPrograms)
// for the IPv4 underlay prefixes.
func (m *Manager) attachUnderlay(cg *cgroup2, a *Attachment, st *UserState) error {
	nets := m.cfg.Nets4()
	if len(nets) == 0 || len(m.cfg.UnderlayRanges) == 0 {
		return nil
	}
	nat, err := netip.ParseAddr(st.NAT)
	if err != nil {
		return err
	}
	// The node's own addresses are included: a UDP service in the default
	// VRF answers from the default VRF, which reaches the VRF socket only
	// through the NAT address (rule 998 delivers locally).
	conn, send, err := underlayPrograms(m.cfg.UnderlayRanges, nets, nat)
	if err != nil {
		return fmt.Errorf("load underlay-port programs: %w", err)
	}
	defer conn.Close()
	defer send.Close()
	if a.ConnectID, err = cg.attachProg(a.Cgroup, conn, ebpf.AttachCGroupInet4Connect); err != nil {
		return err
	}
	a.SendmsgID, err = cg.attachProg(a.Cgroup, send, ebpf.AttachCGroupUDP4Sendmsg)
	return err
}

// Node rules for the underlay ports: a socket the underlay-port program
// gave the user's NAT address as source and marked natMark (connections,
// connected UDP), and unconnected UDP from a NAT address to an underlay
// port, are routed by the local and main tables, before the l3mdev rule
// sends them to the VRF table. Not the source alone: a user may bind his
// own NAT address, and masquerade would then give any connection of his
// the node's address (Slurm's hand-over trusts cluster addresses).
const (
	natLocalRulePref = 998
	natMainRulePref  = 999
	natMark          = 0x70616c01 // "pal\x01"
)

func (m *Manager) natRules(ns *NodeState) error {
	type sel struct {
		mark   uint32
		proto  int
		lo, hi uint16
	}
	sels := []sel{{mark: natMark}}
	for _, r := range m.cfg.UnderlayRanges {
		sels = append(sels, sel{proto: unix.IPPROTO_UDP, lo: r.First, hi: r.Last})
	}
	mask := uint32(0xffffffff)
	for _, r := range []struct{ pref, table int }{{natLocalRulePref, unix.RT_TABLE_LOCAL}, {natMainRulePref, unix.RT_TABLE_MAIN}} {
		for _, s := range sels {
			if err := m.recordNode(ns, Undo{Kind: "rule", Pref: r.pref, Table: uint32(r.table), Family: netlink.FAMILY_V4,
				Dst: m.cfg.NATPrefix.String(), Mark: s.mark, Proto: s.proto, DportLo: s.lo, DportHi: s.hi}); err != nil {
				return err
			}
			rule := netlink.NewRule()
			rule.Family, rule.Priority, rule.Table = netlink.FAMILY_V4, r.pref, r.table
			rule.Src = prefixToIPNet(m.cfg.NATPrefix)
			if s.mark != 0 {
				rule.Mark, rule.Mask = s.mark, &mask
			}
			if s.proto != 0 {
				rule.IPProto = s.proto
				rule.Dport = netlink.NewRulePortRange(s.lo, s.hi)
			}
			if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("add rule from %s lookup %d: %w", m.cfg.NATPrefix, r.table, err)
			}
		}
	}
	return nil
}

// attachLinkLocal attaches the session's refusal of link-local binds
// (bpf/vrf.c); the packets themselves are the node's device guard's
// (bpf/guard.c, at the cgroup2 root).
func (m *Manager) attachLinkLocal(cg *cgroup2, a *Attachment) error {
	p, err := linkLocalProgram()
	if err != nil {
		return fmt.Errorf("load link-local bind program: %w", err)
	}
	defer p.Close()
	a.LinkLocalID, err = cg.attachProg(a.Cgroup, p, ebpf.AttachCGroupInet6Bind)
	return err
}
