package uvn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"
	"time"

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
		return nil
	})
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
