package kernel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// lpmKey is a prefix in the form of the C uw_lpm_key: IPv4 as IPv4-mapped
// IPv6, so one trie holds both families and v4-mapped destinations of v6
// sockets match their IPv4 entries.
func lpmKey(p netip.Prefix) uwbpfUwLpmKey {
	a := p.Addr()
	bits := p.Bits()
	if a.Is4() {
		bits += 96
		a = netip.AddrFrom16(a.As16())
	}
	return uwbpfUwLpmKey{Prefixlen: uint32(bits), Addr: a.As16()}
}

// syncMap makes m hold exactly want: new and changed entries are written
// before stale ones are deleted, so a reload never opens a gap; entries
// already right are not written again. The one writer of the agent's hash
// maps (sets, site masks, grants).
func syncMap[K, V comparable](m *ebpf.Map, want map[K]V) error {
	var errs []error
	var k K
	var v V
	var stale []K
	same := map[K]struct{}{}
	it := m.Iterate()
	for it.Next(&k, &v) {
		if w, ok := want[k]; !ok {
			stale = append(stale, k)
		} else if w == v {
			same[k] = struct{}{}
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
	}
	for k, v := range want {
		if _, ok := same[k]; ok {
			continue
		}
		if err := m.Update(k, v, ebpf.UpdateAny); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
		}
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
		}
	}
	return errors.Join(errs...)
}

// syncSet makes the keys of m exactly want (value 1; syncMap).
func syncSet[K comparable](m *ebpf.Map, want map[K]bool) error {
	vals := make(map[K]uint8, len(want))
	for k := range want {
		vals[k] = 1
	}
	return syncMap(m, vals)
}

// syncIndexed makes the array map m hold want at its indices and zero at
// every other index that is not zero already (interface tables: ifaces,
// if_mtu). Indices out of the array's range are refused by the caller.
func syncIndexed[V uint8 | uint32](m *ebpf.Map, want map[uint32]V) error {
	var errs []error
	var k uint32
	var v V
	var stale []uint32
	it := m.Iterate()
	for it.Next(&k, &v) {
		if _, ok := want[k]; v != 0 && !ok {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
	}
	for k, v := range want {
		if err := m.Update(k, v, ebpf.UpdateAny); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
		}
	}
	var zero V
	for _, k := range stale {
		if err := m.Update(k, zero, ebpf.UpdateAny); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
		}
	}
	return errors.Join(errs...)
}

// policySets are the keys of the exempt, cluster-subnet and unenforced-node
// maps for p.
func policySets(p *policy.Policy) (conn, lis map[uint32]bool, nets, unenf map[uwbpfUwLpmKey]bool) {
	conn, lis, nets, unenf = map[uint32]bool{}, map[uint32]bool{}, map[uwbpfUwLpmKey]bool{}, map[uwbpfUwLpmKey]bool{}
	for _, u := range p.ExemptConnectors {
		conn[u] = true
	}
	for _, u := range p.ExemptListeners {
		lis[u] = true
	}
	for _, s := range p.ClusterSubnets {
		nets[lpmKey(s.Masked())] = true
	}
	for _, s := range p.UnenforcedNodes {
		unenf[lpmKey(s.Masked())] = true
	}
	return conn, lis, nets, unenf
}

// Fits refuses a policy the maps cannot hold, before anything is written:
// the config loader does not know these bounds, and a reload that ran out
// of room half-way would enforce a mix of the old and the new policy.
func (d *Dataplane) Fits(p *policy.Policy) error {
	conn, lis, nets, unenf := policySets(p)
	for _, c := range []struct {
		key, m string
		n      int
	}{
		{"policy.exempt_connectors", "exempt_conn", len(conn)},
		{"policy.exempt_listeners", "exempt_lis", len(lis)},
		{"cluster.subnets", "cluster_nets", len(nets)},
		{"cluster.unenforced_nodes", "unenforced_nets", len(unenf)},
	} {
		if max := int(d.Map(c.m).MaxEntries()); c.n > max {
			return fmt.Errorf("%s: %d entries, the data plane holds at most %d", c.key, c.n, max)
		}
	}
	d.siteMu.Lock()
	defer d.siteMu.Unlock()
	return d.fitsSite(compileSite(p, d.SiteNode()), d.site.members)
}

// ApplyPolicy writes the policy into the maps. The settings entry is
// written last: on first install the programs stay idle ("enabled" 0) until
// every other map is filled. audit makes the programs report refusals
// without refusing.
func (d *Dataplane) ApplyPolicy(p *policy.Policy, audit bool) error {
	if err := d.Fits(p); err != nil {
		return err
	}
	conn, lis, nets, unenf := policySets(p)
	var errs []error
	errs = append(errs, syncSized(d, "exempt_conn", conn), syncSized(d, "exempt_lis", lis))
	errs = append(errs, syncSized(d, "cluster_nets", nets), syncSized(d, "unenforced_nets", unenf))

	var words [1024]uint64
	for _, r := range p.OffClusterPorts {
		for port := uint32(r.First); port <= uint32(r.Last); port++ {
			words[port/64] |= 1 << (port % 64)
		}
	}
	ports := d.Map("offc_ports")
	for i, w := range words {
		var cur uint64
		if err := ports.Lookup(uint32(i), &cur); err == nil && cur == w {
			continue
		}
		if err := ports.Update(uint32(i), w, ebpf.UpdateAny); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, d.applySite(p))
	if err := errors.Join(errs...); err != nil {
		return err
	}
	cfg := uwbpfUwConfig{SystemPortMax: uint32(p.SystemPortMax), Enabled: 1, ClockOffsetNs: ClockOffset(), AllowSamples: d.AllowSamples}
	if audit {
		cfg.Audit = 1
	}
	return d.Map("settings").Update(uint32(0), cfg, ebpf.UpdateAny)
}

// ClockOffset is the wall clock minus CLOCK_MONOTONIC: what the programs add
// to their clock (bpf_ktime_get_coarse_ns, CLOCK_MONOTONIC at tick
// resolution) to get the time a stamp is sealed for.
func ClockOffset() int64 {
	var mono, wall unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono)
	unix.ClockGettime(unix.CLOCK_REALTIME, &wall)
	return wall.Nano() - mono.Nano()
}

// RefreshClock keeps the clock offset current (NTP steps the wall clock).
func (d *Dataplane) RefreshClock() error {
	m := d.Map("settings")
	var cfg uwbpfUwConfig
	if err := m.Lookup(uint32(0), &cfg); err != nil {
		return err
	}
	cfg.ClockOffsetNs = ClockOffset()
	return m.Update(uint32(0), cfg, ebpf.UpdateAny)
}

// SetKeys loads the cluster keys: keys[0] seals stamps, every key verifies.
// The new sealing key is written last, so a stamp sealed during the change
// is always verifiable by this node.
func (d *Dataplane) SetKeys(keys []Key) error {
	m := d.Map("keys")
	slot := func(k Key) uwbpfUwKey {
		k0, k1 := k.halves()
		return uwbpfUwKey{K0: k0, K1: k1, Id: uint32(k.ID()), Valid: 1}
	}
	second := uwbpfUwKey{}
	if len(keys) > 1 {
		second = slot(keys[1])
	}
	if err := m.Update(uint32(1), second, ebpf.UpdateAny); err != nil {
		return err
	}
	first := uwbpfUwKey{}
	if len(keys) > 0 {
		first = slot(keys[0])
	}
	return m.Update(uint32(0), first, ebpf.UpdateAny)
}

// SetInterfaces records the L2 header length of each managed interface (the
// tc programs find the IP header with it); others are zeroed.
func (d *Dataplane) SetInterfaces(l2 map[int]int) error {
	m := d.Map("ifaces")
	var errs []error
	want := map[uint32]uint8{}
	for idx, n := range l2 {
		if idx <= 0 || idx >= int(m.MaxEntries()) || n < 0 || n > 64 {
			errs = append(errs, fmt.Errorf("interface index %d (L2 header %d) cannot be managed", idx, n))
			continue
		}
		want[uint32(idx)] = uint8(n + 1)
	}
	return errors.Join(append(errs, syncIndexed(m, want))...)
}

// SetLocalAddrs makes the local-address trie exactly addrs plus the
// addresses every node answers on (loopback, unspecified).
func (d *Dataplane) SetLocalAddrs(addrs []netip.Addr) error {
	want := map[uwbpfUwLpmKey]bool{}
	for _, p := range []string{"127.0.0.0/8", "::1/128", "0.0.0.0/32", "::/128"} {
		want[lpmKey(netip.MustParsePrefix(p))] = true
	}
	for _, a := range addrs {
		a = a.Unmap().WithZone("")
		want[lpmKey(netip.PrefixFrom(a, a.BitLen()))] = true
	}
	return syncSized(d, "local_addrs", want)
}

// SetNodeAddrs writes the node's unicast addresses as the list a user's
// wildcard bind is checked against (node_addrs: another user's socket on
// any of them refuses it). More than the list holds is written as an
// overflow, which the bind check treats as unknown: such binds are refused
// (fail closed) and the error says so.
func (d *Dataplane) SetNodeAddrs(addrs []netip.Addr) error {
	var l uwbpfUwNodeAddrs
	seen := map[netip.Addr]bool{}
	var over error
	for _, a := range addrs {
		a = a.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() || a.IsMulticast() || seen[a] {
			continue
		}
		seen[a] = true
		if int(l.N) == len(l.Addr) {
			l.N = uint32(len(l.Addr)) + 1
			over = fmt.Errorf("the node has more than %d addresses: users' wildcard binds with SO_REUSEADDR are refused", len(l.Addr))
			break
		}
		l.Addr[l.N] = a.As16()
		l.N++
	}
	if err := d.Map("node_addrs").Update(uint32(0), l, ebpf.UpdateAny); err != nil {
		return err
	}
	return over
}

// SetInterfaceMTUs records the device MTU of each managed interface
// (if_mtu; others are cleared): a datagram to a broadcast, multicast or
// link-local destination, whose route keeps that MTU, must leave the
// stamp's room in it or is refused at send (rule unstampable).
func (d *Dataplane) SetInterfaceMTUs(mtu map[int]int) error {
	m := d.Map("if_mtu")
	var errs []error
	want := map[uint32]uint32{}
	for idx, n := range mtu {
		if idx <= 0 || idx >= int(m.MaxEntries()) || n < 0 {
			errs = append(errs, fmt.Errorf("interface index %d (MTU %d) cannot be managed", idx, n))
			continue
		}
		want[uint32(idx)] = uint32(n)
	}
	return errors.Join(append(errs, syncIndexed(m, want))...)
}

// SetBroadcasts makes the IPv4 broadcast addresses of the node's
// interfaces exactly addrs (bcast_addrs; see SetInterfaceMTUs).
func (d *Dataplane) SetBroadcasts(addrs []netip.Addr) error {
	want := map[uint32]bool{}
	for _, a := range addrs {
		if a = a.Unmap(); a.Is4() {
			b := a.As4()
			want[binary.NativeEndian.Uint32(b[:])] = true
		}
	}
	return syncSet(d.Map("bcast_addrs"), want)
}

// SetKnownUsers makes the known-users set exactly uids: the users whose every
// group is in the members map, for whom a carried gid is no longer trusted.
func (d *Dataplane) SetKnownUsers(uids []uint32) error {
	want := map[uint32]bool{}
	for _, u := range uids {
		want[u] = true
	}
	return syncSet(d.Map("known_users"), want)
}

// SetMembers loads NSS group membership (uid in gid) for the cross-node
// group rule: the SYN carries only the connector's uid and effective gid.
func (d *Dataplane) SetMembers(m identity.Membership) error {
	want := map[uwbpfUwMemberKey]bool{}
	for uid, gids := range m {
		for _, g := range gids {
			want[uwbpfUwMemberKey{Uid: uid, Gid: g}] = true
		}
	}
	return errors.Join(syncSized(d, "members", want), d.setSiteMembers(m))
}

// syncSized is syncSet on the named map, remembering its size.
func syncSized[K comparable](d *Dataplane, name string, want map[K]bool) error {
	err := syncSet(d.Map(name), want)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sizes == nil {
		d.sizes = map[string]int{}
	}
	if err != nil {
		delete(d.sizes, name) // unknown: partly written
	} else {
		d.sizes[name] = len(want)
	}
	return err
}

// MapSize is the number of entries in a set map (exempt_conn, exempt_lis,
// cluster_nets, unenforced_nets, local_addrs, members) as last written;
// false if unknown (never written, or the last write failed part-way).
func (d *Dataplane) MapSize(name string) (int, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	n, ok := d.sizes[name]
	return n, ok
}

// Disable stops enforcement without detaching (programs answer "allow").
func (d *Dataplane) Disable() error {
	return d.Map("settings").Update(uint32(0), uwbpfUwConfig{}, ebpf.UpdateAny)
}

// ListsLocalAddr reports whether the local-address trie pinned under pinDir
// holds a: the agent's acknowledgement that it knows a new address (IPv6
// sources it does not list are refused, see uw_skb_egress).
func ListsLocalAddr(pinDir string, a netip.Addr) (bool, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "local_addrs"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, err
	}
	defer m.Close()
	a = a.Unmap().WithZone("")
	var v uint8
	err = m.Lookup(lpmKey(netip.PrefixFrom(a, a.BitLen())), &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}
