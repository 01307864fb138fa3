package kernel

import (
	"errors"
	"fmt"
	"path/filepath"
	"sort"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// What the pins of a namespace hold, read without the agent: status,
// uninstall, the lab.

// MemberPair is one (uid, gid) entry of the kernel's membership map.
type MemberPair struct{ UID, GID uint32 }

// MissingMembers returns the pairs the members map pinned in pinDir lacks.
func MissingMembers(pinDir string, pairs []MemberPair) ([]MemberPair, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "members"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	var missing []MemberPair
	var v uint8
	for _, p := range pairs {
		err := m.Lookup(uwbpfUwMemberKey{Uid: p.UID, Gid: p.GID}, &v)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			missing = append(missing, p)
		} else if err != nil {
			return nil, err
		}
	}
	return missing, nil
}

// CountMembers returns the number of (uid, gid) entries of the members map
// pinned in pinDir (benchmarks).
func CountMembers(pinDir string) (int, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "members"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, err
	}
	defer m.Close()
	var k uwbpfUwMemberKey
	var v uint8
	n := 0
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	return n, it.Err()
}

// KnowsUser reports whether the known-users map pinned in pinDir holds uid:
// the agent has looked the user up, so membership alone decides for him
// there, and a gid he carries is sealed only if he is a member of it.
func KnowsUser(pinDir string, uid uint32) (bool, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "known_users"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, err
	}
	defer m.Close()
	var v uint8
	err = m.Lookup(uid, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}

// NamespaceGone reports whether the namespace a pin directory belongs to no
// longer exists: every agent attaches to lo, and lo lives exactly as long as
// its namespace, so a tcx link on lo whose device is gone (ifindex 0) means
// the namespace was deleted without `--uninstall`; in tc mode, the program
// of lo's egress filter (recorded in tc_lo) is freed with the filter.
func NamespaceGone(pinDir string) bool {
	l, err := link.LoadPinnedLink(filepath.Join(pinDir, "links", tcxLinkName("eg", "lo")), nil)
	if err != nil {
		gone, _ := tcLoGone(pinDir)
		return gone
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil || info.TCX() == nil {
		return false
	}
	return info.TCX().Ifindex == 0
}

// CollectStale removes the pins of namespaces that no longer exist (their
// programs can never match a socket again but stay loaded while pinned).
// Live namespaces, this one included, are never touched.
func CollectStale(bpffs string) []string {
	var removed []string
	root := filepath.Join(bpffs, "palisade")
	for _, n := range pinnedNames(root) {
		dir := filepath.Join(root, n)
		if NamespaceGone(dir) && RemovePins(dir) == nil {
			removed = append(removed, n)
		}
	}
	return removed
}

func linkTypeName(t link.Type) string {
	switch t {
	case link.CgroupType:
		return "cgroup"
	case link.TCXType:
		return "tcx"
	case link.TracingType:
		return "lsm"
	}
	return fmt.Sprintf("type-%d", t)
}

// PinsView is what the pinned objects in a pin directory say: the
// attachments (pinned links and tc filters), the settings and cluster key
// ids in force, the counters.
type PinsView struct {
	// Attached: some program of ours is attached (a pinned link, even an
	// unreadable one, or a tc filter).
	Attached bool
	Links    []LinkStatus
	// Attach is how the tc programs are attached: "tcx", "tc" or "".
	Attach         string
	UnixLSM        bool
	Enabled, Audit bool
	Keys           []uint8
	Counters       []Counter
	Warnings       []string
}

// LinkStatus is one pinned attachment.
type LinkStatus struct {
	Name    string `json:"name"`
	Type    string `json:"type"`
	Program string `json:"program"`
	ProgID  uint32 `json:"prog_id"`
}

// ReadPins reads the pins in pins (read-only: `palisade status`).
func ReadPins(pins string) PinsView {
	var v PinsView
	linkDir := filepath.Join(pins, "links")
	names := pinnedNames(linkDir)
	sort.Strings(names)
	for _, n := range names {
		l, err := link.LoadPinnedLink(filepath.Join(linkDir, n), nil)
		if err != nil {
			v.Warnings = append(v.Warnings, fmt.Sprintf("pinned link %s unreadable: %v", n, err))
			continue
		}
		ls := LinkStatus{Name: n}
		if info, err := l.Info(); err == nil {
			ls.Type = linkTypeName(info.Type)
			ls.ProgID = uint32(info.Program)
			if p, err := ebpf.NewProgramFromID(info.Program); err == nil {
				if pi, err := p.Info(); err == nil {
					ls.Program = pi.Name
				}
				p.Close()
			}
		}
		l.Close()
		v.Links = append(v.Links, ls)
		if n == lsmHooks[0].link {
			v.UnixLSM = true
		}
	}
	tcs, _ := ourTCFilters()
	for _, f := range tcs {
		v.Links = append(v.Links, LinkStatus{Name: f.linkName(), Type: "tc", Program: f.prog, ProgID: f.progID})
	}
	for _, l := range v.Links {
		switch l.Type {
		case "tc":
			v.Attach = "tc"
		case "tcx":
			if v.Attach == "" {
				v.Attach = "tcx"
			}
		}
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(pins, "settings"), &ebpf.LoadPinOptions{ReadOnly: true}); err == nil {
		var c uwbpfUwConfig
		if m.Lookup(uint32(0), &c) == nil {
			v.Enabled = c.Enabled != 0
			v.Audit = c.Audit != 0
		}
		m.Close()
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(pins, "keys"), &ebpf.LoadPinOptions{ReadOnly: true}); err == nil {
		for i := uint32(0); i < 2; i++ {
			var k uwbpfUwKey
			if m.Lookup(i, &k) == nil && k.Valid != 0 {
				v.Keys = append(v.Keys, uint8(k.Id))
			}
		}
		m.Close()
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(pins, "counters"), &ebpf.LoadPinOptions{ReadOnly: true}); err == nil {
		// audit_counters is absent under programs older than it.
		am, _ := ebpf.LoadPinnedMap(filepath.Join(pins, "audit_counters"), &ebpf.LoadPinOptions{ReadOnly: true})
		v.Counters, _ = readCounters(m, am)
		m.Close()
		if am != nil {
			am.Close()
		}
	}
	v.Attached = len(names) > 0 || len(tcs) > 0
	return v
}
