package uvn

import (
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

var extremeUIDs = []uint32{256, 1000, 2001, 65535, 65536, 1<<22 - 1, 1 << 22, 1<<24 - 1, 1 << 24, 1<<31 + 7, 1<<32 - 2}

func TestTableIDInjectiveAndClearOfKernelTables(t *testing.T) {
	seen := map[uint32]uint32{}
	for _, u := range extremeUIDs {
		id := TableID(u)
		if id == 0 || (id >= 253 && id <= 255) {
			t.Errorf("uid %d -> table %d is a kernel table", u, id)
		}
		if o, dup := seen[id]; dup {
			t.Errorf("uid %d and %d share table %d", u, o, id)
		}
		seen[id] = u
	}
	// prior art's uid<<16 collides from uid 65536 on: ours must not
	if TableID(1) == TableID(65537) {
		t.Fatal("collision")
	}
}

func TestVNIAndPortPairUnique(t *testing.T) {
	type key struct {
		vni  uint32
		port uint16
	}
	seen := map[key]uint32{}
	for _, u := range extremeUIDs {
		k := key{VNI(u), PortOffset(u)}
		if k.vni >= 1<<24 {
			t.Errorf("uid %d: VNI %d exceeds 24 bits", u, k.vni)
		}
		if o, dup := seen[k]; dup {
			t.Errorf("uid %d and %d share (VNI, port offset) %v", u, o, k)
		}
		seen[k] = u
	}
	if VNI(2001) != 2001 || PortOffset(2001) != 0 {
		t.Error("uids below 2^24 must map to VNI = uid on the base port")
	}
	if VNI(1<<24+5) != 5 || PortOffset(1<<24+5) != 1 {
		t.Error("uid 2^24+5 must be VNI 5 on base port + 1")
	}
}

func TestNamesFitIFNAMSIZ(t *testing.T) {
	seen := map[string]bool{}
	for _, u := range extremeUIDs {
		names := []string{VRFName(u)}
		for i := 0; i < MaxUnderlays; i++ {
			names = append(names, VXLANName(i, u))
		}
		for _, n := range names {
			if len(n) > ifNameMax {
				t.Errorf("%q is %d bytes > 15", n, len(n))
			}
			if !strings.HasPrefix(n, "pal") || !isUVNDev(n) {
				t.Errorf("%q is not recognised as a uvn device", n)
			}
			if seen[n] {
				t.Errorf("duplicate name %q", n)
			}
			seen[n] = true
		}
	}
	if VXLANName(35, 1<<32-2) != "palzx4294967294" {
		t.Errorf("got %q", VXLANName(35, 1<<32-2))
	}
	// A long NIC name does not enter the name at all.
	for _, nic := range []string{"enp175s0f0", "ib0", "enx0123456789ab"} {
		if strings.Contains(VXLANName(0, 12345), nic) {
			t.Error("NIC name leaked into the VXLAN name")
		}
	}
	for _, n := range []string{"pal-br0", "pal-n1", "palisade0", "palv", "pal0y12", "eth0"} {
		if isUVNDev(n) {
			t.Errorf("%q wrongly taken for a uvn device", n)
		}
	}
}

func TestNATAddressesInPool(t *testing.T) {
	pool := netip.MustParsePrefix("100.64.0.0/10")
	seen := map[netip.Addr]uint32{}
	for _, u := range []uint32{1000, 2001, 2002, 1<<22 - 2, 65536} {
		a := addrInPrefix(pool, uint64(u), true)
		if !pool.Contains(a) || a == pool.Addr() {
			t.Errorf("uid %d -> %s outside pool or the base", u, a)
		}
		if o, dup := seen[a]; dup {
			t.Errorf("uid %d and %d share %s", u, o, a)
		}
		seen[a] = u
	}
	// Above the pool size the address wraps (setup then probes for a free one).
	if a := addrInPrefix(pool, 1<<32-2, true); !pool.Contains(a) {
		t.Errorf("wrapped address %s outside the pool", a)
	}
	if a := addrInPrefix(netip.MustParsePrefix("100.64.0.0/10"), 2001, true); a.String() != "100.64.7.210" {
		t.Errorf("uid 2001 -> %s", a)
	}
	v6 := netip.MustParsePrefix("2001:2:0:ff::/64")
	if a := addrInPrefix(v6, 2001, true); a.String() != "2001:2:0:ff::7d2" {
		t.Errorf("v6 -> %s", a)
	}
	g := netip.MustParsePrefix("239.192.0.0/16")
	if a := GroupFor(g, 2001); a.String() != "239.192.7.209" {
		t.Errorf("group -> %s", a)
	}
	if a := GroupFor(netip.MustParsePrefix("239.1.1.1/32"), 2001); a.String() != "239.1.1.1" {
		t.Errorf("single group -> %s", a)
	}
}

func TestJournalRollbackOrderAndIdempotentUndo(t *testing.T) {
	dir := t.TempDir()
	s := store{dir}
	st := &UserState{UID: 2001}
	m := &Manager{st: s, cfg: &Config{StateDir: dir}}
	for _, n := range []string{"palv2001", "pal0x2001", "pal1x2001"} {
		if err := m.record(st, Undo{Kind: "link", Name: n}); err != nil {
			t.Fatal(err)
		}
	}
	got, ok, err := s.loadUser(2001)
	if err != nil || !ok || len(got.Undo) != 3 || got.Undo[2].Name != "pal1x2001" {
		t.Fatalf("journal not persisted step by step: %+v %v %v", got, ok, err)
	}
	// Undoing links that were never created is a no-op, not an error:
	// that is what makes a half-way failure roll back cleanly.
	if err := m.undoAll(got.Undo); err != nil {
		t.Fatalf("undo of absent objects: %v", err)
	}
	if err := undo(Undo{Kind: "bogus"}); err == nil {
		t.Fatal("unknown journal record accepted")
	}
	uids, _ := s.users()
	if len(uids) != 1 || uids[0] != 2001 {
		t.Fatalf("users() = %v", uids)
	}
	if err := s.removeUser(2001); err != nil {
		t.Fatal(err)
	}
	if _, err := filepath.Glob(filepath.Join(dir, "*.json")); err != nil {
		t.Fatal(err)
	}
}

func TestInjectedFailureStep(t *testing.T) {
	m := &Manager{FailAt: "vxlan"}
	if err := m.step("vrf"); err != nil {
		t.Fatal(err)
	}
	if err := m.step("vxlan"); err == nil {
		t.Fatal("no injected failure")
	}
}

func TestCheckUID(t *testing.T) {
	cfg := &Config{}
	cfg.SetDefaults()
	m := &Manager{cfg: cfg}
	for _, c := range []struct {
		uid uint32
		ok  bool
	}{{0, false}, {999, false}, {1000, true}, {1<<24 - 1, true}, {1 << 24, false}} {
		if err := m.CheckUID(c.uid); (err == nil) != c.ok {
			t.Errorf("uid %d: err %v", c.uid, err)
		}
	}
}

func TestHolders(t *testing.T) {
	st := &UserState{Holders: []Holder{{PID: 1 << 30, Start: 1}}}
	st.pruneHolders(0)
	if len(st.Holders) != 0 {
		t.Fatal("dead holder kept")
	}
}

// TestCheckNotNested: a session may not start inside another user's
// attachment (its sockets would be bound to that user's VRF), may start
// inside its own, and a sibling cgroup whose name extends the attachment's
// is not inside it.
func TestCheckNotNested(t *testing.T) {
	here, err := procfs.Cgroup2(os.Getpid())
	if err != nil {
		t.Skipf("no cgroup2 for this process: %v", err)
	}
	dir := t.TempDir()
	s := store{dir}
	m := &Manager{st: s, cfg: &Config{StateDir: dir}}
	for _, c := range []struct {
		name   string
		cgroup string // uid 3001's attachment
		uid    uint32 // the session's uid
		refuse bool
	}{
		{"inside another user's attachment", here, 2001, true},
		{"below another user's attachment", path.Dir(here), 2001, true},
		{"inside one's own attachment", here, 3001, false},
		{"a sibling whose name extends it", here + "x", 2001, false},
		{"elsewhere", "/pal-uvntest-elsewhere", 2001, false},
	} {
		if err := s.saveUser(&UserState{UID: 3001, Attach: []Attachment{{Cgroup: c.cgroup}}}); err != nil {
			t.Fatal(err)
		}
		err := m.checkNotNested(c.uid, os.Getpid())
		if (err != nil) != c.refuse {
			t.Errorf("%s (%s in %s): err %v, want refused=%v", c.name, here, c.cgroup, err, c.refuse)
		}
	}
}

// The widest srun range config accepts must fit the claim map: three entries
// per port (its claim, the claiming socket's, a lingering claim).
func TestSrunPortsMap(t *testing.T) {
	spec, err := loadSrunbpf()
	if err != nil {
		t.Fatal(err)
	}
	if got := spec.Maps[srunbpfMapPalSrunPorts].MaxEntries; got != 3*maxSrunPorts {
		t.Fatalf("pal_srun_ports holds %d entries; maxSrunPorts = %d needs %d", got, maxSrunPorts, 3*maxSrunPorts)
	}
}

// A used-up srun budget is named with the user and the budget; below it,
// or without the Slurm-callback path, nothing is said.
func TestSrunExhausted(t *testing.T) {
	r := policy.PortRange{First: 61000, Last: 62999}
	b := SrunBudget(r)
	at := UserStatus{UserState: UserState{UID: 2001}, SrunClaims: b, SrunBudget: b, SrunRange: "61000-62999"}
	msg := at.SrunExhausted("alice(2001)")
	for _, want := range []string{"alice(2001)", "500", "61000-62999", "all ports in range exhausted"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
	below := at
	below.SrunClaims = b - 1
	none := at
	none.SrunBudget, none.SrunClaims = 0, 0
	for _, u := range []UserStatus{below, none} {
		if m := u.SrunExhausted("alice(2001)"); m != "" {
			t.Errorf("claims %d of %d: %q, want nothing", u.SrunClaims, u.SrunBudget, m)
		}
	}
}
