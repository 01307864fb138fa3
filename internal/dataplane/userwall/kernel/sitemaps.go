package kernel

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// The site rules ([[rule]]) compiled into the maps site_decide reads
// (bpf/userwall.c): one bit per rule, in rule order, per dimension. A
// connection's rules are the AND of its masks; the lowest bit decides. The
// per-packet cost is bounded by the mask width (policy.MaxSiteRules bits),
// not by the rules: at most 9 lookups and 16 words of ANDs.

const siteWords = len(uwbpfUwMask{}.W)

func init() {
	if siteWords*64 != policy.MaxSiteRules {
		panic("uw_mask width is not policy.MaxSiteRules")
	}
}

type siteMask = uwbpfUwMask

func (m *siteMask) set(i int) { m.W[i/64] |= 1 << (i % 64) }

func (m *siteMask) or(o siteMask) {
	for i := range m.W {
		m.W[i] |= o.W[i]
	}
}

// siteTables is the compiled form of a policy's site rules for one node.
type siteTables struct {
	n          int
	fixed      [uwbpfUwSiteMaskSM_MAX]siteMask
	cgid, lgid map[uint32]siteMask
	src        map[uwbpfUwLpmKey]siteMask
	portClass  []uint32 // by port
	classMask  []siteMask
	// ruleUIDs and ruleGroups name the uids and groups (from the rules)
	// whose members' masks the membership adds: connector [0], listener [1].
	ruleUIDs   [2]map[uint32]siteMask
	ruleGroups [2]map[uint32]siteMask
}

// compileSite compiles p's site rules for the node named node.
func compileSite(p *policy.Policy, node string) *siteTables {
	t := &siteTables{n: len(p.Rules), cgid: map[uint32]siteMask{}, lgid: map[uint32]siteMask{},
		src: map[uwbpfUwLpmKey]siteMask{}}
	for i := range t.ruleUIDs {
		t.ruleUIDs[i], t.ruleGroups[i] = map[uint32]siteMask{}, map[uint32]siteMask{}
	}
	add := func(m map[uint32]siteMask, k uint32, i int) {
		v := m[k]
		v.set(i)
		m[k] = v
	}
	fix := func(k uwbpfUwSiteMask, i int) { t.fixed[k].set(i) }
	type pfxRule struct {
		p netip.Prefix
		i int
	}
	var sources []pfxRule
	bounds := []int{0}
	for i := range p.Rules {
		r := &p.Rules[i]
		if len(r.Nodes) == 0 || slices.Contains(r.Nodes, node) {
			fix(uwbpfUwSiteMaskSM_HERE, i)
		}
		if len(r.Nodes) == 0 {
			fix(uwbpfUwSiteMaskSM_ANYNODE, i)
		}
		if r.Allow {
			fix(uwbpfUwSiteMaskSM_ALLOW, i)
		}
		if len(r.From) == 0 && len(r.FromGroups) == 0 {
			fix(uwbpfUwSiteMaskSM_ANY_FROM, i)
		}
		if len(r.To) == 0 && len(r.ToGroups) == 0 {
			fix(uwbpfUwSiteMaskSM_ANY_TO, i)
		}
		if len(r.Sources) == 0 {
			fix(uwbpfUwSiteMaskSM_ANY_SRC, i)
		} else if r.IdentityFree() {
			fix(uwbpfUwSiteMaskSM_UNTRUSTED, i)
		}
		if r.Proto == 0 || r.Proto == policy.TCP {
			fix(uwbpfUwSiteMaskSM_TCP, i)
		}
		if r.Proto == 0 || r.Proto == policy.UDP {
			fix(uwbpfUwSiteMaskSM_UDP, i)
		}
		if r.Proto == 0 {
			fix(uwbpfUwSiteMaskSM_OTHER, i)
		}
		switch r.Relation {
		case policy.NoRelation:
			fix(uwbpfUwSiteMaskSM_NOREL, i)
		case policy.SameUser:
			fix(uwbpfUwSiteMaskSM_SAMEUSER, i)
		case policy.SharedGroup:
			fix(uwbpfUwSiteMaskSM_SHARED, i)
		}
		for _, u := range r.From {
			add(t.ruleUIDs[0], u, i)
		}
		for _, g := range r.FromGroups {
			add(t.cgid, g, i)
			add(t.ruleGroups[0], g, i)
		}
		for _, u := range r.To {
			add(t.ruleUIDs[1], u, i)
		}
		for _, g := range r.ToGroups {
			add(t.lgid, g, i)
			add(t.ruleGroups[1], g, i)
		}
		for _, s := range r.Sources {
			sources = append(sources, pfxRule{s.Masked(), i})
		}
		for _, pr := range r.Ports {
			bounds = append(bounds, int(pr.First), int(pr.Last)+1)
		}
	}
	// A trie entry per prefix, holding every rule whose prefixes contain it
	// (the trie returns the longest match only).
	for _, s := range sources {
		var m siteMask
		for _, o := range sources {
			if o.p.Addr().Is4() == s.p.Addr().Is4() && o.p.Bits() <= s.p.Bits() && o.p.Contains(s.p.Addr()) {
				m.set(o.i)
			}
		}
		t.src[lpmKey(s.p)] = m
	}
	// Port classes: the intervals between the ranges' boundaries.
	slices.Sort(bounds)
	bounds = slices.Compact(bounds)
	if bounds[len(bounds)-1] == 65536 {
		bounds = bounds[:len(bounds)-1]
	}
	t.portClass = make([]uint32, 65536)
	t.classMask = make([]siteMask, len(bounds))
	for c, lo := range bounds {
		hi := 65536
		if c+1 < len(bounds) {
			hi = bounds[c+1]
		}
		for port := lo; port < hi; port++ {
			t.portClass[port] = uint32(c)
		}
		for i := range p.Rules {
			r := &p.Rules[i]
			if len(r.Ports) == 0 || slices.ContainsFunc(r.Ports, func(pr policy.PortRange) bool { return pr.Contains(uint16(lo)) }) {
				t.classMask[c].set(i)
			}
		}
	}
	return t
}

// uidMasks are the per-uid masks: the rules naming the uid, and the rules
// naming a group the membership says it is in. dir 0: connector, 1: listener.
func (t *siteTables) uidMasks(dir int, members identity.Membership) map[uint32]siteMask {
	out := map[uint32]siteMask{}
	for u, m := range t.ruleUIDs[dir] {
		out[u] = m
	}
	if len(t.ruleGroups[dir]) == 0 {
		return out
	}
	for uid, gids := range members {
		for _, g := range gids {
			if m, ok := t.ruleGroups[dir][g]; ok {
				v := out[uid]
				v.or(m)
				out[uid] = v
			}
		}
	}
	return out
}

// layout identifies what the rule bits mean: when it changes, the maps are
// rewritten while site_decide fails closed.
func (t *siteTables) layout() [32]byte {
	h := sha256.New()
	binary.Write(h, binary.NativeEndian, uint64(t.n))
	binary.Write(h, binary.NativeEndian, t.fixed)
	binary.Write(h, binary.NativeEndian, t.portClass)
	binary.Write(h, binary.NativeEndian, t.classMask)
	for _, m := range []map[uint32]siteMask{t.cgid, t.lgid, t.ruleUIDs[0], t.ruleUIDs[1], t.ruleGroups[0], t.ruleGroups[1]} {
		keys := slices.Sorted(func(yield func(uint32) bool) {
			for k := range m {
				if !yield(k) {
					return
				}
			}
		})
		binary.Write(h, binary.NativeEndian, uint64(len(keys)))
		for _, k := range keys {
			binary.Write(h, binary.NativeEndian, k)
			binary.Write(h, binary.NativeEndian, m[k])
		}
	}
	keys := make([]uwbpfUwLpmKey, 0, len(t.src))
	for k := range t.src {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b uwbpfUwLpmKey) int {
		if c := slices.Compare(a.Addr[:], b.Addr[:]); c != 0 {
			return c
		}
		return int(a.Prefixlen) - int(b.Prefixlen)
	})
	for _, k := range keys {
		binary.Write(h, binary.NativeEndian, k)
		binary.Write(h, binary.NativeEndian, t.src[k])
	}
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

// siteState is what the dataplane remembers of the site rules it applied.
type siteState struct {
	tables  *siteTables
	layout  [32]byte
	applied bool
	members identity.Membership
}

// SiteNode is the node name site rules' on_nodes are matched against: the
// dataplane's Node, or the host name.
func (d *Dataplane) SiteNode() string {
	if d.Node != "" {
		return d.Node
	}
	h, _ := os.Hostname()
	return h
}

// fitsSite refuses site rules the maps cannot hold.
func (d *Dataplane) fitsSite(t *siteTables, members identity.Membership) error {
	for _, c := range []struct {
		what, m string
		n       int
	}{
		{"connector users (with the members of their groups)", "site_cuid", len(t.uidMasks(0, members))},
		{"connector groups", "site_cgid", len(t.cgid)},
		{"listener users (with the members of their groups)", "site_luid", len(t.uidMasks(1, members))},
		{"listener groups", "site_lgid", len(t.lgid)},
		{"source prefixes", "site_src", len(t.src)},
		{"port classes", "site_port_mask", len(t.classMask)},
	} {
		if max := int(d.Map(c.m).MaxEntries()); c.n > max {
			return fmt.Errorf("[[rule]]: %d %s, the data plane holds at most %d", c.n, c.what, max)
		}
	}
	return nil
}

// applySite writes the site rules' maps. A change of the rules' layout
// (what the bits mean) is written while site_decide refuses every
// connection it would decide (fail closed, milliseconds); a membership
// change only rewrites per-uid masks, each entry atomically.
func (d *Dataplane) applySite(p *policy.Policy) error {
	d.siteMu.Lock()
	defer d.siteMu.Unlock()
	t := compileSite(p, d.SiteNode())
	if err := d.fitsSite(t, d.site.members); err != nil {
		return err
	}
	lay := t.layout()
	cfgMap := d.Map("site_cfg")
	if d.site.applied && lay == d.site.layout {
		d.site.tables = t
		return d.syncSiteUIDs()
	}
	var errs []error
	if t.n > 0 || d.site.applied {
		// Fail closed while the bits change meaning.
		errs = append(errs, cfgMap.Update(uint32(0), uwbpfUwSite{N: uint32(max(t.n, 1)), Updating: 1}, ebpf.UpdateAny))
	}
	for k := uwbpfUwSiteMask(0); k < uwbpfUwSiteMaskSM_MAX; k++ {
		errs = append(errs, d.Map("site_masks").Update(uint32(k), t.fixed[k], ebpf.UpdateAny))
	}
	errs = append(errs, syncMap(d.Map("site_cgid"), t.cgid), syncMap(d.Map("site_lgid"), t.lgid),
		syncMap(d.Map("site_src"), t.src))
	cm := d.Map("site_port_mask")
	for c, m := range t.classMask {
		errs = append(errs, cm.Update(uint32(c), m, ebpf.UpdateAny))
	}
	errs = append(errs, writePortClasses(d.Map("site_port_class"), t.portClass))
	d.site.tables = t
	errs = append(errs, d.syncSiteUIDs())
	if err := errors.Join(errs...); err != nil {
		// Stays failing closed (updating): the agent reports the error and
		// puts the running policy back.
		d.site.applied = false
		return fmt.Errorf("site rules: %w", err)
	}
	if err := cfgMap.Update(uint32(0), uwbpfUwSite{N: uint32(t.n)}, ebpf.UpdateAny); err != nil {
		d.site.applied = false
		return err
	}
	d.site.layout, d.site.applied = lay, true
	return nil
}

// setSiteMembers re-derives the per-uid masks after a membership change.
func (d *Dataplane) setSiteMembers(m identity.Membership) error {
	d.siteMu.Lock()
	defer d.siteMu.Unlock()
	d.site.members = m
	if d.site.tables == nil {
		return nil
	}
	return d.syncSiteUIDs()
}

// syncSiteUIDs writes the per-uid masks (siteMu held).
func (d *Dataplane) syncSiteUIDs() error {
	t := d.site.tables
	return errors.Join(syncMap(d.Map("site_cuid"), t.uidMasks(0, d.site.members)),
		syncMap(d.Map("site_luid"), t.uidMasks(1, d.site.members)))
}

// writePortClasses writes the port → class array, in one batch when the
// kernel can.
func writePortClasses(m *ebpf.Map, classes []uint32) error {
	keys := make([]uint32, len(classes))
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := m.BatchUpdate(keys, classes, nil); err == nil {
		return nil
	}
	for i, c := range classes {
		if err := m.Update(uint32(i), c, ebpf.UpdateAny); err != nil {
			return err
		}
	}
	return nil
}

// SiteMembers returns the groups uid is a member of, as the site rules'
// compiled masks know them.
func (d *Dataplane) SiteMembers(uid uint32) []uint32 {
	d.siteMu.Lock()
	defer d.siteMu.Unlock()
	return slices.Clone(d.site.members[uid])
}
