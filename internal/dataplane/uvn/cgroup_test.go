package uvn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// scratchCgroup makes an empty cgroup named for the test; on cleanup the
// test process returns to home (its own cgroup) and the cgroup, with its
// programs, goes.
func scratchCgroup(t *testing.T, name string) (cg *cgroup2, home, path string) {
	t.Helper()
	cg, err := openCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cg.Close)
	if home, err = procfs.Cgroup2(os.Getpid()); err != nil {
		t.Fatal(err)
	}
	path = fmt.Sprintf("/pal-uvntest-%d-%s", os.Getpid(), name)
	if err := unix.Mkdirat(cg.root, rel(path), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cg.writeFile(home, "cgroup.procs", strconv.Itoa(os.Getpid()))
		unix.Unlinkat(cg.root, rel(path), unix.AT_REMOVEDIR)
	})
	return cg, home, path
}

// enterCgroup moves the test process into path (the programs attached there
// run for its sockets).
func enterCgroup(t *testing.T, cg *cgroup2, path string) {
	t.Helper()
	if err := cg.writeFile(path, "cgroup.procs", strconv.Itoa(os.Getpid())); err != nil {
		t.Fatal(err)
	}
}

// inScratchNetns runs fn on a thread in a new network namespace with lo up
// and a device "paltest0" (up, with addrs), whose index fn gets.
func inScratchNetns(t *testing.T, addrs []string, fn func(dummy int) error) {
	t.Helper()
	err := netns.DoNew(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		// A veth pair (this kernel has no dummy device); its peer is up
		// so that paltest0 has a carrier.
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "paltest0"}, PeerName: "paltest1"}
		if err := netlink.LinkAdd(d); err != nil {
			return err
		}
		peer, err := netlink.LinkByName("paltest1")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(peer); err != nil {
			return err
		}
		for _, a := range addrs {
			ad, err := netlink.ParseAddr(a)
			if err != nil {
				return err
			}
			if err := netlink.AddrAdd(d, ad); err != nil {
				return fmt.Errorf("add %s: %w", a, err)
			}
		}
		if err := netlink.LinkSetUp(d); err != nil {
			return err
		}
		return fn(d.Attrs().Index)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// boundIfindex is the device a socket of family/type/proto is bound to when
// it is made (0: none), or the error of socket().
func boundIfindex(family, typ, proto int) (int, error) {
	fd, err := unix.Socket(family, typ|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX)
}

// TestVRFProgram attaches pal_uvn_vrf to a scratch cgroup and makes real
// sockets: inside the cgroup every inet socket is bound to the VRF device
// and MPTCP is refused (EPERM); outside it nothing is bound and MPTCP works.
func TestVRFProgram(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	cg, home, path := scratchCgroup(t, "vrf")
	inScratchNetns(t, nil, func(dev int) error {
		if _, err := cg.attach(path, dev); err != nil {
			return err
		}
		socks := []struct {
			name              string
			family, typ, prot int
		}{
			{"tcp4", unix.AF_INET, unix.SOCK_STREAM, 0},
			{"udp4", unix.AF_INET, unix.SOCK_DGRAM, 0},
			{"tcp6", unix.AF_INET6, unix.SOCK_STREAM, 0},
			{"udp6", unix.AF_INET6, unix.SOCK_DGRAM, 0},
			{"raw4", unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_ICMP},
		}
		// Outside the cgroup: unbound, and this kernel makes MPTCP sockets
		// (so the refusal below is the program's).
		for _, s := range socks {
			if got, err := boundIfindex(s.family, s.typ, s.prot); err != nil || got != 0 {
				t.Errorf("outside: %s bound to %d (%v), want unbound", s.name, got, err)
			}
		}
		if _, err := boundIfindex(unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_MPTCP); err != nil {
			t.Errorf("outside: MPTCP socket: %v (the kernel must support MPTCP for this test)", err)
		}

		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		for _, s := range socks {
			if got, err := boundIfindex(s.family, s.typ, s.prot); err != nil || got != dev {
				t.Errorf("in the cgroup: %s bound to %d (%v), want the VRF device %d", s.name, got, err, dev)
			}
		}
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			if _, err := boundIfindex(fam, unix.SOCK_STREAM, unix.IPPROTO_MPTCP); !errors.Is(err, unix.EPERM) {
				t.Errorf("in the cgroup: MPTCP socket (family %d): %v, want EPERM", fam, err)
			}
		}
		// Not an inet socket: the hook does not run.
		if fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			t.Errorf("in the cgroup: unix socket: %v", err)
		} else {
			unix.Close(fd)
		}
		return nil
	})
}

// TestUnderlayPrograms attaches pal_uvn_conn4 and pal_uvn_send4 to a scratch
// cgroup and sends real traffic inside a scratch namespace: TCP connections,
// connected and unconnected UDP to an underlay port on an underlay address
// leave from the NAT address; another port, a port just outside a range, or
// an address outside the underlay prefixes keep the kernel's source.
func TestUnderlayPrograms(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	cg, home, path := scratchCgroup(t, "ul")
	const (
		node  = "198.18.0.3" // an address inside the underlay prefix
		other = "198.19.0.3" // outside it
		nat   = "100.64.7.210"
	)
	ranges := []policy.PortRange{{First: 1, Last: 1023}, {First: 6817, Last: 6819}}
	nets := []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24"), netip.MustParsePrefix("198.20.0.0/16")}
	inScratchNetns(t, []string{node + "/24", other + "/24", nat + "/32"}, func(int) error {
		conn, send, err := underlayPrograms(ranges, nets, netip.MustParseAddr(nat))
		if err != nil {
			return err
		}
		defer conn.Close()
		defer send.Close()
		if _, err := cg.attachProg(path, conn, ebpf.AttachCGroupInet4Connect); err != nil {
			return err
		}
		if _, err := cg.attachProg(path, send, ebpf.AttachCGroupUDP4Sendmsg); err != nil {
			return err
		}
		cases := []struct {
			dst  string
			port int
			nat  bool
		}{
			{node, 22, true},
			{node, 1023, true},
			{node, 6817, true},
			{node, 6819, true},
			{node, 1024, false},
			{node, 6816, false},
			{node, 6820, false},
			{other, 22, false},
			{other, 6818, false},
		}
		want := func(dst string, isNAT bool) string {
			if isNAT {
				return nat
			}
			return dst // a local destination: the kernel picks it as source
		}
		// Listeners and receivers are made outside the cgroup.
		var (
			tcp = map[string]net.Listener{}
			udp = map[string]*net.UDPConn{}
		)
		for _, c := range cases {
			hp := net.JoinHostPort(c.dst, strconv.Itoa(c.port))
			l, err := net.Listen("tcp4", hp)
			if err != nil {
				return err
			}
			defer l.Close()
			tcp[hp] = l
			u, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(hp)))
			if err != nil {
				return err
			}
			defer u.Close()
			udp[hp] = u
		}

		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		for _, c := range cases {
			hp := net.JoinHostPort(c.dst, strconv.Itoa(c.port))
			w := want(c.dst, c.nat)
			// TCP: the listener sees the connection come from the source.
			var d net.Dialer
			d.SetMultipathTCP(false)
			tc, err := d.DialContext(context.Background(), "tcp4", hp)
			if err != nil {
				return fmt.Errorf("tcp %s: %w", hp, err)
			}
			// Only the underlay-port connection is marked for rules
			// 998/999 (a NAT source alone routes nothing).
			if mark := sockMark(t, tc.(*net.TCPConn)); (mark == natMark) != c.nat || (mark != 0 && mark != natMark) {
				t.Errorf("tcp to %s: mark %#x, want %#x if NAT", hp, mark, natMark)
			}
			ac, err := tcp[hp].Accept()
			tc.Close()
			if err != nil {
				return err
			}
			if got := ac.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().String(); got != w {
				t.Errorf("tcp to %s: from %s, want %s", hp, got, w)
			}
			ac.Close()
			// Connected UDP (connect4): the socket's own address.
			uc, err := net.Dial("udp4", hp)
			if err != nil {
				return fmt.Errorf("udp connect %s: %w", hp, err)
			}
			if got := uc.LocalAddr().(*net.UDPAddr).AddrPort().Addr().String(); got != w {
				t.Errorf("connected udp to %s: local address %s, want %s", hp, got, w)
			}
			uc.Close()
			// Unconnected UDP (sendmsg4): the receiver sees the source.
			us, err := net.ListenUDP("udp4", nil)
			if err != nil {
				return err
			}
			_, err = us.WriteToUDPAddrPort([]byte("pal"), netip.MustParseAddrPort(hp))
			us.Close()
			if err != nil {
				return fmt.Errorf("udp sendto %s: %w", hp, err)
			}
			buf := make([]byte, 16)
			udp[hp].SetReadDeadline(time.Now().Add(10 * time.Second)) // bounds a lost datagram
			_, from, err := udp[hp].ReadFromUDPAddrPort(buf)
			if err != nil {
				return err
			}
			if got := from.Addr().String(); got != w {
				t.Errorf("udp datagram to %s: from %s, want %s", hp, got, w)
			}
		}
		// A UDP socket marked for the underlay (connected to an underlay
		// port) sends nowhere else: not with sendto() while connected, not
		// after connect(AF_UNSPEC) (which runs no program and keeps the
		// mark), so the mark never routes another destination by the main
		// table (review s9 M2). Controls: its connected peer, and a socket
		// connected elsewhere (unmarked).
		marked, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(marked)
		if err := unix.Connect(marked, &unix.SockaddrInet4{Port: 22, Addr: netip.MustParseAddr(node).As4()}); err != nil {
			return err
		}
		if m, _ := unix.GetsockoptInt(marked, unix.SOL_SOCKET, unix.SO_MARK); m != natMark {
			t.Errorf("udp connected to an underlay port: mark %#x, want %#x", m, natMark)
		}
		elsewhere := &unix.SockaddrInet4{Port: 1024, Addr: netip.MustParseAddr(node).As4()}
		if err := unix.Send(marked, []byte("pal"), 0); err != nil {
			t.Errorf("control: marked socket to its underlay peer: %v", err)
		}
		if err := unix.Sendto(marked, []byte("pal"), 0, elsewhere); !errors.Is(err, unix.EPERM) {
			t.Errorf("marked socket, sendto another port while connected: %v, want EPERM", err)
		}
		unspec := [16]byte{}
		if _, _, e := unix.Syscall(unix.SYS_CONNECT, uintptr(marked), uintptr(unsafe.Pointer(&unspec[0])), uintptr(len(unspec))); e != 0 {
			t.Errorf("connect(AF_UNSPEC): %v", e)
		}
		if err := unix.Sendto(marked, []byte("pal"), 0, elsewhere); !errors.Is(err, unix.EPERM) {
			t.Errorf("marked socket, sendto another port after connect(AF_UNSPEC): %v, want EPERM", err)
		}
		plain, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(plain)
		if err := unix.Connect(plain, elsewhere); err != nil {
			return err
		}
		if err := unix.Sendto(plain, []byte("pal"), 0, &unix.SockaddrInet4{Port: 6820, Addr: netip.MustParseAddr(node).As4()}); err != nil {
			t.Errorf("control: unmarked connected socket, sendto another port: %v", err)
		}
		return nil
	})
}

func sockMark(t *testing.T, c syscall.Conn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mark int
	var serr error
	if err := rc.Control(func(fd uintptr) { mark, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	return mark
}

// TestUnderlayProgramsLimits: more ranges or prefixes than the C programs
// hold are refused with an error, not cut short.
func TestUnderlayProgramsLimits(t *testing.T) {
	nat := netip.MustParseAddr("100.64.0.1")
	many := make([]policy.PortRange, vrfbpfUvnLimitUVN_MAX_PORT_RANGES+1)
	if _, _, err := underlayPrograms(many, nil, nat); err == nil {
		t.Error("too many port ranges accepted")
	}
	nets := make([]netip.Prefix, vrfbpfUvnLimitUVN_MAX_NETS4+1)
	if _, _, err := underlayPrograms(nil, nets, nat); err == nil {
		t.Error("too many prefixes accepted")
	}
}

// TestLinkLocalProgram attaches pal_uvn_bind6 to a scratch cgroup: a bind
// to a link-local address with a scope (which the kernel would take as the
// socket's device even when the bind fails) is refused and leaves the
// socket unbound; other binds are not refused.
func TestLinkLocalProgram(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	cg, home, path := scratchCgroup(t, "ll")
	inScratchNetns(t, nil, func(dev int) error {
		p, err := linkLocalProgram()
		if err != nil {
			return err
		}
		defer p.Close()
		if _, err := cg.attachProg(path, p, ebpf.AttachCGroupInet6Bind); err != nil {
			return err
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		bind6 := func(addr string, want error) {
			t.Helper()
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			err = unix.Bind(fd, &unix.SockaddrInet6{Addr: netip.MustParseAddr(addr).As16(), ZoneId: uint32(dev)})
			if want != nil && !errors.Is(err, want) {
				t.Errorf("bind [%s%%paltest0]: %v, want %v", addr, err, want)
			}
			if want == nil && errors.Is(err, unix.EPERM) {
				t.Errorf("bind [%s]: %v, want no refusal", addr, err)
			}
			if got, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX); want != nil && got != 0 {
				t.Errorf("bind [%s%%paltest0] refused but the socket is bound to device %d", addr, got)
			}
		}
		bind6("fe80::1", unix.EPERM)
		bind6("ff02::1", unix.EPERM)
		bind6("ff12::1", unix.EPERM) // transient flag, link scope
		// Interface-local multicast: the kernel takes its scope id as the
		// device too (review s9 L3).
		bind6("ff01::1", unix.EPERM)
		bind6("::1", nil)
		bind6("ff05::1", nil) // site-local: no scope id
		return nil
	})
}

// TestGuardRootPrograms runs the node's device guard (bpf/guard.c) on a
// scratch cgroup (the product attaches it at the root) in a scratch
// namespace where paltest2 is registered as another user's device (uid
// 4242) and paltest0 is not (a default-VRF device). With min_uid 0 the
// test's root counts as a user: every way of naming the foreign device is
// refused — socket options with EPERM, IP_PKTINFO and the route at the
// packet, a socket moved there by a failed scoped bind at every packet —
// while the default device works; exempting uid 0 lets an unbound socket
// reach the device again (system services serve every VRF).
func TestGuardRootPrograms(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	cg, home, path := scratchCgroup(t, "groot")
	inScratchNetns(t, []string{"198.18.5.1/24"}, func(own int) error {
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "paltest2"}, PeerName: "paltest3"}
		if err := netlink.LinkAdd(v); err != nil {
			return err
		}
		for _, n := range []string{"paltest2", "paltest3"} {
			l, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		foreign, err := netlink.LinkByName("paltest2")
		if err != nil {
			return err
		}
		fi := foreign.Attrs().Index
		if err := netlink.AddrAdd(foreign, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("198.18.6.1"), Mask: net.CIDRMask(24, 32)}}); err != nil {
			return err
		}
		cookie, err := netns.Cookie()
		if err != nil {
			return err
		}
		coll, err := loadGuard(cookie, 0, nil, policy.PortRange{First: 61000, Last: 62999})
		if err != nil {
			return err
		}
		defer coll.Close()
		o := guardbpfGuardOwner{Vrf: uint32(fi), Uid: 4242}
		var k guardbpfGuardName
		for i, c := range "paltest2" {
			k.Name[i] = int8(c)
		}
		if err := coll.Maps[guardbpfMapPalUvnDevs].Put(uint32(fi), o); err != nil {
			return err
		}
		if err := coll.Maps[guardbpfMapPalUvnNames].Put(k, o); err != nil {
			return err
		}
		for _, a := range guardAttach {
			if _, err := cg.attachProg(path, coll.Programs[a.prog], a.at); err != nil {
				return err
			}
		}
		// Listeners on an SrunPortRange port and another, made outside.
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		for _, p := range []string{"61000", "29000"} {
			l, err := lc.Listen(context.Background(), "tcp4", "127.0.0.1:"+p)
			if err != nil {
				return err
			}
			defer l.Close()
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					c.Close()
				}
			}()
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)

		// A user's unbound socket does not call srun's listeners (the
		// hand-over would take it for Slurm's); other ports work.
		if c, err := net.DialTimeout("tcp4", "127.0.0.1:29000", 20*time.Second); err != nil {
			t.Errorf("control: connect to a port outside SrunPortRange: %v", err)
		} else {
			c.Close()
		}
		if c, err := net.DialTimeout("tcp4", "127.0.0.1:61000", 2*time.Second); err == nil {
			t.Errorf("a user's unbound socket connected to an SrunPortRange port")
			c.Close()
		}

		udp := func() int {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			return fd
		}
		send := func(name string, fd, pktinfo int, dst [4]byte, want error) {
			t.Helper()
			var oob []byte
			if pktinfo != 0 {
				oob = unix.PktInfo4(&unix.Inet4Pktinfo{Ifindex: int32(pktinfo)})
			}
			err := unix.Sendmsg(fd, []byte("pal"), oob, &unix.SockaddrInet4{Port: 9, Addr: dst}, 0)
			if !errors.Is(err, want) && !(want == nil && err == nil) {
				t.Errorf("%s: sendmsg: %v, want %v", name, err, want)
			}
		}
		ownPeer, foreignPeer := [4]byte{198, 18, 5, 2}, [4]byte{198, 18, 6, 2}
		opts := []struct {
			name string
			set  func(fd int) error
		}{
			{"SO_BINDTODEVICE", func(fd int) error { return unix.BindToDevice(fd, "paltest2") }},
			{"SO_BINDTOIFINDEX", func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX, fi) }},
			{"IP_UNICAST_IF", func(fd int) error {
				return unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_UNICAST_IF, int(htonl(uint32(fi))))
			}},
			{"IP_MULTICAST_IF", func(fd int) error {
				return unix.SetsockoptIPMreqn(fd, unix.IPPROTO_IP, unix.IP_MULTICAST_IF, &unix.IPMreqn{Ifindex: int32(fi)})
			}},
			// Longer than a page: the program sees the first page only
			// (review s9 L2: it used to let these through unread).
			{"SO_BINDTODEVICE, optlen 8192", func(fd int) error {
				b := make([]byte, 8192)
				copy(b, "paltest2")
				return unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, string(b))
			}},
			{"SO_BINDTOIFINDEX, optlen 8192", func(fd int) error {
				b := make([]byte, 8192)
				*(*int32)(unsafe.Pointer(&b[0])) = int32(fi)
				return unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX, string(b))
			}},
		}
		for _, o := range opts {
			fd := udp()
			if err := o.set(fd); !errors.Is(err, unix.EPERM) {
				t.Errorf("%s naming the foreign device: %v, want EPERM", o.name, err)
			}
			unix.Close(fd)
		}
		fd := udp()
		if err := unix.BindToDevice(fd, "paltest0"); err != nil {
			t.Errorf("control: SO_BINDTODEVICE to a default device: %v", err)
		}
		long := make([]byte, 8192)
		copy(long, "paltest0")
		if err := unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, string(long)); err != nil {
			t.Errorf("control: SO_BINDTODEVICE to a default device, optlen 8192: %v", err)
		}
		send("control: bound to a default device", fd, 0, ownPeer, nil)
		unix.Close(fd)
		fd = udp()
		send("IP_PKTINFO foreign device", fd, fi, foreignPeer, unix.EPERM)
		send("route through the foreign device", fd, 0, foreignPeer, unix.EPERM)
		send("control: IP_PKTINFO default device", fd, own, ownPeer, nil)
		unix.Close(fd)
		// A failed scoped bind moves the socket to the device.
		fd6, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		unix.Bind(fd6, &unix.SockaddrInet6{Addr: netip.MustParseAddr("fe80::1").As16(), ZoneId: uint32(fi)})
		if dev, _ := unix.GetsockoptInt(fd6, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX); dev != fi {
			t.Logf("scoped bind left the socket on device %d (not %d): the kernel changed", dev, fi)
		}
		err = unix.Sendto(fd6, []byte("pal"), 0, &unix.SockaddrInet6{Port: 9, Addr: netip.MustParseAddr("::ffff:198.18.6.2").As16()})
		if !errors.Is(err, unix.EPERM) {
			t.Errorf("socket moved by a scoped bind: sendto: %v, want EPERM", err)
		}
		unix.Close(fd6)
		// Exempt (a system account): the unbound socket reaches it.
		if err := coll.Maps[guardbpfMapPalUvnExempt].Put(uint32(0), uint8(1)); err != nil {
			return err
		}
		fd = udp()
		send("exempt: IP_PKTINFO foreign device", fd, fi, foreignPeer, nil)
		unix.Close(fd)
		return nil
	})
}

func htonl(v uint32) uint32 { return v>>24 | v>>8&0xff00 | v<<8&0xff0000 | v<<24 }

// TestGuardCost reports what the device guard's packet programs cost per
// run on this kernel (PALISADE_UVN_GUARD_COST=1; BPF run-time statistics):
// UDP datagrams over lo, as every packet of the node pays.
func TestGuardCost(t *testing.T) {
	if os.Getenv("PALISADE_UVN_GUARD_COST") == "" || os.Geteuid() != 0 {
		t.Skip("PALISADE_UVN_GUARD_COST=1, as root")
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatal(err)
	}
	defer stats.Close()
	cg, home, path := scratchCgroup(t, "gcost")
	inScratchNetns(t, nil, func(own int) error {
		cookie, err := netns.Cookie()
		if err != nil {
			return err
		}
		coll, err := loadGuard(cookie, 1000, nil, policy.PortRange{First: 61000, Last: 62999})
		if err != nil {
			return err
		}
		defer coll.Close()
		if err := coll.Maps[guardbpfMapPalUvnDevs].Put(uint32(own), guardbpfGuardOwner{Vrf: uint32(own), Uid: 4242}); err != nil {
			return err
		}
		progs := map[string]*ebpf.Program{"egress": coll.Programs[guardbpfProgPalUvnOut], "ingress": coll.Programs[guardbpfProgPalUvnIn]}
		for _, a := range guardAttach {
			if _, err := cg.attachProg(path, coll.Programs[a.prog], a.at); err != nil {
				return err
			}
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		// As root (a system account: only the device checks) and as a
		// user's stray sockets (fs uid 4001, unbound: each datagram over lo
		// also looks up its receiving socket, the stray-to-stray check).
		for _, who := range []struct {
			name string
			uid  int
		}{{"root", 0}, {"stray user", 4001}} {
			unix.Setfsuid(who.uid)
			r, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			if err != nil {
				return err
			}
			s, err := net.DialUDP("udp4", nil, r.LocalAddr().(*net.UDPAddr))
			unix.Setfsuid(0)
			if err != nil {
				return err
			}
			before := map[string]*ebpf.ProgramStats{}
			for name, p := range progs {
				if before[name], err = p.Stats(); err != nil {
					return err
				}
			}
			buf := make([]byte, 64)
			const n = 20000
			for i := 0; i < n; i++ {
				if _, err := s.Write(buf); err != nil {
					return err
				}
				if _, err := r.Read(buf); err != nil {
					return err
				}
			}
			s.Close()
			r.Close()
			for name, p := range progs {
				st, err := p.Stats()
				if err != nil {
					return err
				}
				if runs := st.RunCount - before[name].RunCount; runs > 0 {
					t.Logf("%-10s %-16s %6d runs, %5.0f ns per run", who.name, name, runs,
						float64((st.Runtime-before[name].Runtime).Nanoseconds())/float64(runs))
				}
			}
		}
		return nil
	})
}

// TestGuardStrayPeers: within a node, two users' unbound sockets (stray
// processes, in the default VRF) do not meet: bob's SYN and datagram to
// alice's sockets over lo are dropped at his egress (EPERM to his
// datagram, the SYN never answered); alice's own,
// root's, and an exempt account's reach them.
func TestGuardStrayPeers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const alice, bob = 4001, 4002
	cg, home, path := scratchCgroup(t, "gstray")
	inScratchNetns(t, nil, func(own int) error {
		cookie, err := netns.Cookie()
		if err != nil {
			return err
		}
		coll, err := loadGuard(cookie, 1000, nil, policy.PortRange{First: 61000, Last: 62999})
		if err != nil {
			return err
		}
		defer coll.Close()
		for _, a := range guardAttach {
			if _, err := cg.attachProg(path, coll.Programs[a.prog], a.at); err != nil {
				return err
			}
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		// The socket's owner is the creator's fs uid (this thread's: the
		// test holds it locked in the namespace).
		as := func(uid int, f func()) {
			unix.Setfsuid(uid)
			defer unix.Setfsuid(0)
			f()
		}
		sock := func(typ int) int {
			fd, err := unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			return fd
		}
		lo := [4]byte{127, 0, 0, 1}
		var lis, udp int
		as(alice, func() {
			lis, udp = sock(unix.SOCK_STREAM), sock(unix.SOCK_DGRAM)
			if err := unix.Bind(lis, &unix.SockaddrInet4{Port: 29100, Addr: lo}); err != nil {
				t.Fatal(err)
			}
			if err := unix.Listen(lis, 16); err != nil {
				t.Fatal(err)
			}
			if err := unix.Bind(udp, &unix.SockaddrInet4{Port: 29101, Addr: lo}); err != nil {
				t.Fatal(err)
			}
		})
		defer unix.Close(lis)
		defer unix.Close(udp)
		tv := unix.NsecToTimeval(int64(2 * time.Second))
		try := func(name string, uid int, want error) {
			t.Helper()
			as(uid, func() {
				c := sock(unix.SOCK_STREAM)
				defer unix.Close(c)
				unix.SetsockoptTimeval(c, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
				// A dropped SYN is retransmitted: connect times out
				// (EINPROGRESS under SO_SNDTIMEO), it does not fail.
				if err := unix.Connect(c, &unix.SockaddrInet4{Port: 29100, Addr: lo}); (err == nil) != (want == nil) {
					t.Errorf("%s: tcp connect: %v, want refused %v", name, err, want != nil)
				}
				d := sock(unix.SOCK_DGRAM)
				defer unix.Close(d)
				err := unix.Sendto(d, []byte(name), 0, &unix.SockaddrInet4{Port: 29101, Addr: lo})
				if !errors.Is(err, want) && !(err == nil && want == nil) {
					t.Errorf("%s: udp sendto: %v, want %v", name, err, want)
				}
				b := make([]byte, 64)
				if want != nil {
					if n, _, err := unix.Recvfrom(udp, b, unix.MSG_DONTWAIT); err == nil {
						t.Errorf("%s: alice's socket got %q", name, b[:n])
					}
					return
				}
				unix.SetsockoptTimeval(udp, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
				if n, _, err := unix.Recvfrom(udp, b, 0); err != nil || string(b[:n]) != name {
					t.Errorf("%s: alice's socket got %q, %v", name, b[:max(n, 0)], err)
				}
			})
		}
		try("bob", bob, unix.EPERM)
		try("control: alice", alice, nil)
		try("control: root", 0, nil)
		if err := coll.Maps[guardbpfMapPalUvnExempt].Put(uint32(bob), uint8(1)); err != nil {
			return err
		}
		try("control: bob exempt", bob, nil)
		return nil
	})
}
