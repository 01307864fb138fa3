package userwall

import (
	"errors"
	"fmt"
	"net/netip"

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

// syncSet makes the keys of m exactly want (value 1). New keys are added
// before stale ones are removed, so a reload never opens a gap.
func syncSet[K comparable](m *ebpf.Map, want map[K]bool) error {
	one := uint8(1)
	var errs []error
	for k := range want {
		if err := m.Update(k, one, ebpf.UpdateAny); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.String(), err))
		}
	}
	var k K
	var stale []K
	var v uint8
	it := m.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, err)
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// policySets are the keys of the exempt and cluster-subnet maps for p.
func policySets(p *policy.Policy) (conn, lis map[uint32]bool, nets map[uwbpfUwLpmKey]bool) {
	conn, lis, nets = map[uint32]bool{}, map[uint32]bool{}, map[uwbpfUwLpmKey]bool{}
	for _, u := range p.ExemptConnectors {
		conn[u] = true
	}
	for _, u := range p.ExemptListeners {
		lis[u] = true
	}
	for _, s := range p.ClusterSubnets {
		nets[lpmKey(s.Masked())] = true
	}
	return conn, lis, nets
}

// Fits refuses a policy the maps cannot hold, before anything is written:
// the config loader does not know these bounds, and a reload that ran out
// of room half-way would enforce a mix of the old and the new policy.
func (d *Dataplane) Fits(p *policy.Policy) error {
	conn, lis, nets := policySets(p)
	for _, c := range []struct {
		key, m string
		n      int
	}{
		{"policy.exempt_connectors", "exempt_conn", len(conn)},
		{"policy.exempt_listeners", "exempt_lis", len(lis)},
		{"cluster.subnets", "cluster_nets", len(nets)},
	} {
		if max := int(d.Map(c.m).MaxEntries()); c.n > max {
			return fmt.Errorf("%s: %d entries, the data plane holds at most %d", c.key, c.n, max)
		}
	}
	return nil
}

// ApplyPolicy writes the policy into the maps. The settings entry is
// written last: on first install the programs stay idle ("enabled" 0) until
// every other map is filled.
func (d *Dataplane) ApplyPolicy(p *policy.Policy) error {
	if err := d.Fits(p); err != nil {
		return err
	}
	conn, lis, nets := policySets(p)
	var errs []error
	errs = append(errs, syncSet(d.Map("exempt_conn"), conn), syncSet(d.Map("exempt_lis"), lis))
	errs = append(errs, syncSet(d.Map("cluster_nets"), nets))

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
	if err := errors.Join(errs...); err != nil {
		return err
	}
	cfg := uwbpfUwConfig{SystemPortMax: uint32(p.SystemPortMax), Enabled: 1}
	return d.Map("settings").Update(uint32(0), cfg, ebpf.UpdateAny)
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
	return syncSet(d.Map("local_addrs"), want)
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
	return syncSet(d.Map("members"), want)
}

// Disable stops enforcement without detaching (programs answer "allow").
func (d *Dataplane) Disable() error {
	return d.Map("settings").Update(uint32(0), uwbpfUwConfig{}, ebpf.UpdateAny)
}
