package uvn

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// lingerBit marks a lingering claim's key in pal_srun_ports (bpf/srun.c's
// enum srun_key, generated).
const lingerBit = uint64(srunbpfSrunKeySRUN_KEY_LINGER) << srunbpfSrunKeySRUN_KEY_TAG_SHIFT

// srunTestColl loads the node part (tc program + its map) for the range.
func srunTestColl(t *testing.T, r policy.PortRange) *ebpf.Collection {
	t.Helper()
	spec, err := srunSpec(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{srunbpfProgPalUvnPbind4, srunbpfProgPalUvnPbind6} {
		delete(spec.Programs, p)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		t.Fatalf("load tc program: %v", err)
	}
	t.Cleanup(coll.Close)
	us := []Underlay{{Nets: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24"), netip.MustParsePrefix("2001:2::/64")}}}
	if err := fillSrunSources(coll, us); err != nil {
		t.Fatal(err)
	}
	return coll
}

// frame builds Ethernet + IPv4 + TCP SYN src:sport → dst:dport.
func frame(src, dst string, sport, dport uint16) []byte {
	return segment(src, dst, sport, dport, 0x02)
}

// segment is frame with the given TCP flags.
func segment(src, dst string, sport, dport uint16, flags byte) []byte {
	var b bytes.Buffer
	b.Write([]byte{2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00}) // dst MAC, src MAC, IPv4
	ip := make([]byte, 20)
	ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(ip[2:], 40)
	s4, d4 := netip.MustParseAddr(src).As4(), netip.MustParseAddr(dst).As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	b.Write(ip)
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	tcp[12], tcp[13] = 5<<4, flags
	b.Write(tcp)
	return b.Bytes()
}

// TestSrunTCProgram runs the hand-over program on crafted frames
// (BPF_PROG_TEST_RUN): only a segment from a cluster address to a claimed
// srun port is redirected, addressed to the VRF device's MAC; everything
// else passes untouched.
func TestSrunTCProgram(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	coll := srunTestColl(t, policy.PortRange{First: 61000, Last: 62999})
	mac := net.HardwareAddr{0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee}
	owner := srunbpfSrunOwner{Ifindex: 1, Port: 61234}
	copy(owner.Mac[:], mac)
	ports := coll.Maps[srunbpfMapPalSrunPorts]
	if err := ports.Put(uint64(61234), owner); err != nil {
		t.Fatal(err)
	}
	// Lingering claims (their listener closed): 61240 has only one, 61234
	// has one of another VRF under its live claim, 61250's closed longer
	// ago than a lingering claim lasts.
	lingerMac := net.HardwareAddr{0x02, 0x11, 0x22, 0x33, 0x44, 0x55}
	now := monotonicNow(t)
	for p, released := range map[uint64]uint64{61240: now, 61234: now, 61250: now - 121e9} {
		linger := srunbpfSrunOwner{Ifindex: 1, Port: uint32(p), Released: released}
		copy(linger.Mac[:], lingerMac)
		if err := ports.Put(lingerBit|p, linger); err != nil {
			t.Fatal(err)
		}
	}
	const ack, finAck, synAck = 0x10, 0x11, 0x12
	prog := coll.Programs[srunbpfProgPalUvnSrunIn]
	for _, c := range []struct {
		name     string
		in       []byte
		redirect bool
		to       net.HardwareAddr
	}{
		{"cluster source, claimed port", frame("198.18.0.1", "198.18.0.2", 40000, 61234), true, mac},
		{"cluster source, unclaimed srun port", frame("198.18.0.1", "198.18.0.2", 40000, 61235), false, nil},
		{"cluster source, port outside the range", frame("198.18.0.1", "198.18.0.2", 40000, 29101), false, nil},
		{"off-cluster source, claimed port", frame("198.18.200.1", "198.18.0.2", 40000, 61234), false, nil},
		// An accepted connection outlives its listener (srun's I/O:
		// slurmstepd's last output and FIN come after srun closed the
		// listener): its segments still reach the VRF, but no new
		// connection is opened there.
		{"lingering claim, ACK", segment("198.18.0.1", "198.18.0.2", 40000, 61240, ack), true, lingerMac},
		{"lingering claim, FIN", segment("198.18.0.1", "198.18.0.2", 40000, 61240, finAck), true, lingerMac},
		{"lingering claim, SYN", frame("198.18.0.1", "198.18.0.2", 40000, 61240), false, nil},
		{"lingering claim, SYN-ACK", segment("198.18.0.1", "198.18.0.2", 40000, 61240, synAck), false, nil},
		{"expired lingering claim, ACK", segment("198.18.0.1", "198.18.0.2", 40000, 61250, ack), false, nil},
		{"lingering claim, off-cluster source", segment("198.18.200.1", "198.18.0.2", 40000, 61240, ack), false, nil},
		{"live claim over a lingering one, ACK", segment("198.18.0.1", "198.18.0.2", 40000, 61234, ack), true, mac},
	} {
		ret, out, err := prog.Test(c.in)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := ret == uint32(netlink.TC_ACT_REDIRECT); got != c.redirect {
			t.Errorf("%s: verdict %d, want redirect=%v", c.name, ret, c.redirect)
		}
		if c.redirect && !bytes.Equal(out[:6], c.to) {
			t.Errorf("%s: destination MAC %x, want the VRF device's %s", c.name, out[:6], c.to)
		}
		if !c.redirect && !bytes.Equal(out, c.in) {
			t.Errorf("%s: frame changed", c.name)
		}
	}
	var o srunbpfSrunOwner
	if err := ports.Lookup(lingerBit|uint64(61250), &o); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("expired lingering claim of 61250 still in the map (%v)", err)
	}
	if err := ports.Lookup(lingerBit|uint64(61240), &o); err != nil {
		t.Errorf("live lingering claim of 61240 gone: %v", err)
	}

	// A default-VRF socket on the claimed port (root's srun, or an exempt
	// account's, sharing it with SO_REUSEADDR) owns the flow: the segment
	// stays in the default VRF. Control: the same segment before it listens.
	inScratchNetns(t, []string{"198.18.0.2/24"}, func(int) error {
		in := frame("198.18.0.1", "198.18.0.2", 40000, 61234)
		if ret, _, err := prog.Test(in); err != nil || ret != uint32(netlink.TC_ACT_REDIRECT) {
			t.Errorf("control, no default-VRF socket: verdict %d (%v), want redirect", ret, err)
		}
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: 61234}); err != nil {
			return err
		}
		if err := unix.Listen(fd, 1); err != nil {
			return err
		}
		if ret, _, err := prog.Test(in); err != nil || ret == uint32(netlink.TC_ACT_REDIRECT) {
			t.Errorf("a default-VRF listener on the claimed port: verdict %d (%v), want no redirect", ret, err)
		}
		return nil
	})
}

// TestSrunClaims attaches the claiming programs of two "VRFs" to two
// scratch cgroups and binds real sockets from each: a port in the range is
// claimed by the first binder, refused (EPERM) to the other VRF, kept when
// an accepted connection closes, and given back when the listener closes;
// ports outside the range are never claimed.
func TestSrunClaims(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	r := policy.PortRange{First: 61000, Last: 62999}
	coll := srunTestColl(t, r)
	ports := coll.Maps[srunbpfMapPalSrunPorts]
	// The node's release program at the top (as at the cgroup2 root),
	// each VRF's claim programs in a cgroup below it.
	cg, home, top := scratchCgroup(t, "top")
	if _, err := cg.attachProg(top, coll.Programs[srunbpfProgPalUvnRelease], ebpf.AttachCgroupInetSockRelease); err != nil {
		t.Fatal(err)
	}
	mk := func(parent, name string, ifindex int) (string, Attachment) {
		path := parent + "/" + name
		if err := unix.Mkdirat(cg.root, rel(path), 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cg.writeFile(home, "cgroup.procs", strconv.Itoa(os.Getpid()))
			unix.Unlinkat(cg.root, rel(path), unix.AT_REMOVEDIR)
		})
		spec, err := srunSpec(r)
		if err != nil {
			t.Fatal(err)
		}
		var mac [6]byte
		spec.Variables[srunbpfVarVrfIfindex].Set(uint32(ifindex))
		spec.Variables[srunbpfVarVrfMac].Set(mac)
		delete(spec.Programs, srunbpfProgPalUvnSrunIn)
		delete(spec.Programs, srunbpfProgPalUvnRelease)
		delete(spec.Maps, srunbpfMapPalSrunSrc4)
		delete(spec.Maps, srunbpfMapPalSrunSrc6)
		c, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{
			srunbpfMapPalSrunPorts: ports, srunbpfMapPalSrunCount: coll.Maps[srunbpfMapPalSrunCount]}})
		if err != nil {
			t.Fatalf("load claim programs: %v", err)
		}
		defer c.Close()
		a := Attachment{Cgroup: path}
		for name, p := range map[string]struct {
			at ebpf.AttachType
			id *uint32
		}{srunbpfProgPalUvnPbind4: {ebpf.AttachCGroupInet4PostBind, &a.Bind4ID},
			srunbpfProgPalUvnPbind6: {ebpf.AttachCGroupInet6PostBind, &a.Bind6ID}} {
			id, err := cg.attachProg(path, c.Programs[name], p.at)
			if err != nil {
				t.Fatal(err)
			}
			*p.id = id
		}
		return path, a
	}
	a, _ := mk(top, "a", 101)
	b, _ := mk(top, "b", 102)
	c, progsC := mk(top, "c", 103)
	enter := func(path string) { enterCgroup(t, cg, path) }
	// entries counts live claims (port and socket entries), not the
	// lingering ones.
	entries := func() int {
		var (
			k uint64
			v srunbpfSrunOwner
			n int
		)
		for it := ports.Iterate(); it.Next(&k, &v); {
			if k&lingerBit == 0 {
				n++
			}
		}
		return n
	}
	lingering := func(port int) uint32 {
		var o srunbpfSrunOwner
		if err := ports.Lookup(lingerBit|uint64(port), &o); err != nil {
			return 0
		}
		// Stamped by the release program with the programs' clock.
		if now := monotonicNow(t); o.Released > now || now-o.Released > 10e9 {
			t.Errorf("lingering claim of %d released at %d, now %d", port, o.Released, now)
		}
		return o.Ifindex
	}
	owner := func(port int) uint32 {
		var o srunbpfSrunOwner
		if err := ports.Lookup(uint64(port), &o); err != nil {
			return 0
		}
		return o.Ifindex
	}
	// Plain TCP, as in a VRF cgroup, where the VRF program refuses MPTCP
	// (Go's default): an MPTCP listener's claim would be made by its
	// kernel subflow and never given back.
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	listen := func(port int) (net.Listener, error) {
		return lc.Listen(context.Background(), "tcp4", "127.0.0.1:"+strconv.Itoa(port))
	}

	enter(a)
	la, err := listen(61777)
	if err != nil {
		t.Fatalf("VRF a binds 61777: %v", err)
	}
	if owner(61777) != 101 {
		t.Fatalf("61777 claimed by %d, want 101", owner(61777))
	}
	lo, err := listen(29777)
	if err != nil {
		t.Fatal(err)
	}
	lo.Close()
	if owner(29777) != 0 {
		t.Errorf("a port outside SrunPortRange was claimed")
	}
	// An accepted connection shares the port; closing it keeps the claim.
	go func() {
		if c, err := net.Dial("tcp4", "127.0.0.1:61777"); err == nil {
			c.Close()
		}
	}()
	conn, err := la.Accept()
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if owner(61777) != 101 {
		t.Errorf("closing an accepted connection dropped the claim")
	}

	// The other VRF cannot take the port: another address, so the kernel
	// itself sees no conflict; the claim refuses it.
	enter(b)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	err = unix.Bind(fd, &unix.SockaddrInet4{Port: 61777, Addr: [4]byte{127, 0, 0, 2}})
	if !errors.Is(err, unix.EPERM) {
		t.Errorf("VRF b bound VRF a's claimed port: %v", err)
	}
	if owner(61777) != 101 {
		t.Errorf("VRF b took the claim: owner %d", owner(61777))
	}

	// Slurm's callback reaches the listener through the hand-over (tc
	// marks the claim used: its accepted connections may outlive it).
	if ret, _, err := coll.Programs[srunbpfProgPalUvnSrunIn].Test(frame("198.18.0.1", "198.18.0.2", 40000, 61777)); err != nil || ret != uint32(netlink.TC_ACT_REDIRECT) {
		t.Fatalf("hand-over to 61777: verdict %d (%v), want redirect", ret, err)
	}
	// The listener closes: the claim goes (it lingers for its accepted
	// connections), and b may have the port.
	enter(a)
	if lingering(61777) != 0 {
		t.Errorf("61777 lingers while its listener is open")
	}
	la.Close()
	if owner(61777) != 0 {
		t.Errorf("claim kept after the listener closed")
	}
	if lingering(61777) != 101 {
		t.Errorf("61777 lingers for %d after its listener closed, want 101", lingering(61777))
	}
	// While a's claim lingers (its step's last I/O), b may not take the
	// port: its claim would carry a's segments into b's VRF.
	enter(b)
	if l, err := listen(61777); !errors.Is(err, unix.EPERM) {
		t.Errorf("VRF b bound the port a's claim lingers on: %v", err)
		if l != nil {
			l.Close()
		}
	}
	if lingering(61777) != 101 || owner(61777) != 0 {
		t.Errorf("b's refused bind changed the claims: lingering %d, owner %d", lingering(61777), owner(61777))
	}
	// Once it has expired (tc deletes expired lingering claims; here
	// the test does), b may have the port.
	if err := ports.Delete(lingerBit | uint64(61777)); err != nil {
		t.Fatal(err)
	}
	lb, err := listen(61777)
	if err != nil {
		t.Fatalf("VRF b binds the released port: %v", err)
	}
	if owner(61777) != 102 {
		t.Errorf("61777 owner %d, want 102", owner(61777))
	}
	if lingering(61777) != 0 {
		t.Errorf("a's lingering claim of 61777 outlived b's new claim")
	}
	lb.Close()
	// A claim no segment was handed to (a bind and close, a listener
	// nobody called) does not linger: the port is free at once.
	if lingering(61777) != 0 || owner(61777) != 0 {
		t.Errorf("61777 after b's uncalled listener closed: lingering %d, owner %d, want neither", lingering(61777), owner(61777))
	}

	// Two sockets of one VRF bind one port at once (srun's threads do, with
	// SO_REUSEADDR, from the same first port; the kernel lets both bind
	// until one listens): the second is refused, so it moves on to the
	// next port instead of failing its listen.
	reuse := func() int {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	enter(a)
	fd1, fd2 := reuse(), reuse()
	if err := unix.Bind(fd1, &unix.SockaddrInet4{Port: 61800}); err != nil {
		t.Fatalf("first socket binds 61800: %v", err)
	}
	if err := unix.Bind(fd2, &unix.SockaddrInet4{Port: 61800}); !errors.Is(err, unix.EPERM) {
		t.Errorf("second socket of the same VRF bound the claimed 61800: %v", err)
	}
	if err := unix.Bind(fd2, &unix.SockaddrInet4{Port: 61801}); err != nil {
		t.Errorf("refused socket binds the next port: %v", err)
	}
	if err := unix.Listen(fd1, 1); err != nil {
		t.Errorf("the claiming socket listens: %v", err)
	}
	if err := unix.Listen(fd2, 1); err != nil {
		t.Errorf("the other socket listens on the next port: %v", err)
	}
	unix.Close(fd1)
	unix.Close(fd2)

	// A socket that outlives its cgroup's programs and its cgroup (srun
	// still closing its listeners when its step's attachment is pruned)
	// gives its claim back all the same: the release program is above.
	enter(c)
	late, err := listen(61900)
	if err != nil {
		t.Fatal(err)
	}
	enter(home)
	if err := cg.detachAll(progsC); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unlinkat(cg.root, rel(c), unix.AT_REMOVEDIR); err != nil {
		t.Fatalf("remove cgroup c: %v", err)
	}
	if owner(61900) != 103 {
		t.Fatalf("claim of 61900 gone before its socket closed (owner %d)", owner(61900))
	}
	late.Close()
	if owner(61900) != 0 {
		t.Errorf("a socket closed after its cgroup's programs and cgroup went kept its claim")
	}
	if n := entries(); n != 0 {
		t.Errorf("%d claim entries left with no socket open", n)
	}

	// Nested sessions: the claim programs at two levels (a session set up
	// from inside another of the same user) meet the socket's own claim:
	// no conflict, one claim.
	d, _ := mk(top, "d", 104)
	e, _ := mk(d, "e", 104)
	enter(e)
	nested, err := listen(61910)
	if err != nil {
		t.Fatalf("bind under nested claim programs: %v", err)
	}
	if owner(61910) != 104 {
		t.Errorf("61910 owner %d, want 104", owner(61910))
	}
	nested.Close()
	enter(home)
	if n := entries(); n != 0 {
		t.Errorf("%d claim entries left after the nested listener closed", n)
	}

	// A user's budget: SrunBudget(r) live claims, then EPERM; a claim
	// given back makes room again; none is left counted.
	f, _ := mk(top, "f", 106)
	enter(f)
	budget := int(SrunBudget(r))
	var fds []int
	for p := 61000; len(fds) < budget && p <= 62999; p++ {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: p}); err != nil {
			unix.Close(fd)
			continue // held by an earlier case's lingering claim
		}
		fds = append(fds, fd)
	}
	over, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(over, &unix.SockaddrInet4{Port: 62999}); !errors.Is(err, unix.EPERM) {
		t.Errorf("claim %d of a budget of %d: %v, want EPERM", budget+1, budget, err)
	}
	unix.Close(fds[0])
	if err := unix.Bind(over, &unix.SockaddrInet4{Port: 62999}); err != nil {
		t.Errorf("claim after one was given back: %v", err)
	}
	unix.Close(over)
	for _, fd := range fds[1:] {
		unix.Close(fd)
	}
	enter(home)
	var n uint32
	if err := coll.Maps[srunbpfMapPalSrunCount].Lookup(uint32(106), &n); err == nil && n != 0 {
		t.Errorf("%d claims still counted for a VRF with no socket", n)
	}

	// No user holds the range by binding and closing every port of it
	// (review s9 M4: each close left a lingering claim, outside the
	// budget, refusing every other VRF for 120 s): g does; h then claims
	// every port.
	g, _ := mk(top, "g", 107)
	h, _ := mk(top, "h", 108)
	bindClose := func(p int) error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		return unix.Bind(fd, &unix.SockaddrInet4{Port: p})
	}
	enter(g)
	for p := 61000; p <= 62999; p++ {
		bindClose(p)
	}
	enter(h)
	refused := 0
	for p := 61000; p <= 62999; p++ {
		// (EADDRINUSE: a time-wait of an earlier case's connection.)
		if err := bindClose(p); errors.Is(err, unix.EPERM) {
			refused++
		}
	}
	if refused != 0 {
		t.Errorf("after g bound and closed every port, h was refused (EPERM) %d of 2000", refused)
	}
	count := func(vrf uint32) uint32 {
		var n uint32
		coll.Maps[srunbpfMapPalSrunCount].Lookup(vrf, &n)
		return n
	}
	if count(107) != 0 || count(108) != 0 {
		t.Errorf("counted after every socket closed: g %d, h %d", count(107), count(108))
	}
	// A lingering claim holds its port against other VRFs, so it counts
	// in its VRF's budget until it goes; a VRF over its budget makes room
	// among its own lingering claims (expired ones first, else its oldest:
	// its own earlier step yields to its new one), never another's.
	enter(g)
	used := func(p int) {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: p}); err != nil {
			t.Fatalf("g binds %d: %v", p, err)
		}
		if ret, _, err := coll.Programs[srunbpfProgPalUvnSrunIn].Test(segment("198.18.0.1", "198.18.0.2", 40000, uint16(p), 0x10)); err != nil || ret != uint32(netlink.TC_ACT_REDIRECT) {
			t.Fatalf("hand-over to %d: verdict %d (%v)", p, ret, err)
		}
		unix.Close(fd)
	}
	used(62001)
	used(62002)
	if lingering(62001) != 107 || lingering(62002) != 107 || count(107) != 2 {
		t.Fatalf("g's used claims: lingering %d, %d; counted %d, want 107, 107, 2", lingering(62001), lingering(62002), count(107))
	}
	// An expired one of g's too, the way release leaves it (counted).
	if err := ports.Put(lingerBit|uint64(62003), srunbpfSrunOwner{Ifindex: 107, Port: 62003, Used: 1, Released: monotonicNow(t) - 121e9}); err != nil {
		t.Fatal(err)
	}
	if err := coll.Maps[srunbpfMapPalSrunCount].Put(uint32(107), uint32(3)); err != nil {
		t.Fatal(err)
	}
	enter(h)
	if err := bindClose(62001); !errors.Is(err, unix.EPERM) {
		t.Errorf("h bound 62001, where g's claim lingers: %v", err)
	}
	enter(g)
	fds = fds[:0]
	for p := 61000; len(fds) < budget-3; p++ {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: p}); err != nil {
			t.Fatalf("g's claim %d (port %d), within its budget: %v", len(fds)+4, p, err)
		}
		fds = append(fds, fd)
	}
	if count(107) != uint32(budget) {
		t.Errorf("g counted %d, want its budget %d (live and lingering)", count(107), budget)
	}
	// Over the budget: the expired claim goes first, then the oldest.
	for i, p := range []int{62990, 62991} {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: p}); err != nil {
			t.Errorf("g's claim %d over its budget, with lingering claims to give up: %v", i+1, err)
		}
		fds = append(fds, fd)
	}
	var o srunbpfSrunOwner
	if err := ports.Lookup(lingerBit|uint64(62003), &o); err == nil {
		t.Errorf("g's expired lingering claim of 62003 kept over its budget")
	}
	if lingering(62001) != 0 || lingering(62002) != 107 {
		t.Errorf("g over its budget: lingering 62001 %d, 62002 %d; want the oldest (62001) given up", lingering(62001), lingering(62002))
	}
	if count(107) != uint32(budget) {
		t.Errorf("g counted %d, want %d", count(107), budget)
	}
	// With only live claims left to give up, the next is refused.
	ports.Delete(lingerBit | uint64(62002))
	coll.Maps[srunbpfMapPalSrunCount].Put(uint32(107), uint32(budget-1))
	last, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(last, &unix.SockaddrInet4{Port: 62992}); err != nil {
		t.Errorf("g's last claim within its budget: %v", err)
	}
	fds = append(fds, last)
	if err := bindClose(62995); !errors.Is(err, unix.EPERM) {
		t.Errorf("g's claim over a budget of live claims: %v, want EPERM", err)
	}
	for _, fd := range fds {
		unix.Close(fd)
	}
	enter(home)
	if count(107) != 0 {
		t.Errorf("g counted %d with no socket and no lingering claim", count(107))
	}

}

// monotonicNow is bpf_ktime_get_ns()'s clock.
func monotonicNow(t *testing.T) uint64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}
