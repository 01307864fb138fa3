package pktinfo

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

func TestParse(t *testing.T) {
	v4 := unix.PktInfo4(&unix.Inet4Pktinfo{Ifindex: 3, Spec_dst: [4]byte{198, 18, 0, 9}, Addr: [4]byte{198, 18, 0, 1}})
	if d := Parse(v4); d != (Dest{netip.MustParseAddr("198.18.0.1"), 3}) {
		t.Errorf("IPv4: %+v (want the header's destination, not spec_dst)", d)
	}
	v6 := unix.PktInfo6(&unix.Inet6Pktinfo{Addr: netip.MustParseAddr("2001:2::1").As16(), Ifindex: 7})
	if d := Parse(v6); d != (Dest{netip.MustParseAddr("2001:2::1"), 7}) {
		t.Errorf("IPv6: %+v", d)
	}
	mapped := unix.PktInfo6(&unix.Inet6Pktinfo{Addr: netip.MustParseAddr("::ffff:198.18.0.1").As16()})
	if d := Parse(mapped); d.Addr != netip.MustParseAddr("198.18.0.1") {
		t.Errorf("mapped: %v, want unmapped", d.Addr)
	}
	if d := Parse(nil); d != (Dest{}) {
		t.Errorf("no control message: %+v", d)
	}
}

func TestOOB(t *testing.T) {
	for _, c := range []struct {
		d    Dest
		want []byte
	}{
		{Dest{}, nil},
		{Dest{Addr: netip.MustParseAddr("224.0.0.1")}, nil},
		{Dest{Addr: netip.MustParseAddr("ff02::1"), IfIndex: 2}, nil},
		{Dest{Addr: netip.MustParseAddr("0.0.0.0")}, nil},
		{Dest{Addr: netip.MustParseAddr("198.18.0.1"), IfIndex: 2},
			unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: [4]byte{198, 18, 0, 1}})},
		{Dest{Addr: netip.MustParseAddr("2001:2::1"), IfIndex: 2},
			unix.PktInfo6(&unix.Inet6Pktinfo{Addr: netip.MustParseAddr("2001:2::1").As16()})},
		{Dest{Addr: netip.MustParseAddr("fe80::1"), IfIndex: 2},
			unix.PktInfo6(&unix.Inet6Pktinfo{Addr: netip.MustParseAddr("fe80::1").As16(), Ifindex: 2})},
	} {
		if got := c.d.OOB(); !bytes.Equal(got, c.want) {
			t.Errorf("%+v: %x, want %x", c.d, got, c.want)
		}
	}
}

// TestReplyFromDestination runs a wildcard-bound server in a scratch network
// namespace with two addresses of each family and two link-local ones on lo:
// every answer must come from the address its query was sent to, and,
// without the control message, the same answer comes from the route's
// choice instead (so the test can tell the two apart).
func TestReplyFromDestination(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	// The namespace belongs to this test's thread, which stays locked and
	// is discarded when the test ends; sockets keep their namespace. No
	// subtests: they would run on other threads, in the host's namespace.
	runtime.LockOSThread()
	if _, err := netns.New(); err != nil {
		t.Fatal(err)
	}
	replyFromDestination(t)
}

func replyFromDestination(t *testing.T) {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"198.18.90.1/32", "198.18.90.2/32", "2001:2:90::1/128", "2001:2:90::2/128"} {
		addr, _ := netlink.ParseAddr(a)
		addr.Flags = unix.IFA_F_NODAD
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(a, err)
		}
	}
	for _, a := range []string{"fe80::90:1/64", "fe80::90:2/64"} {
		addr, _ := netlink.ParseAddr(a)
		addr.Flags = unix.IFA_F_NODAD
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(a, err)
		}
	}
	// IPv6 addresses are routed once their (skipped) duplicate address
	// detection completes in a kernel work item, after AddrAdd returns:
	// wait until each one is a local destination.
	for _, a := range []string{"198.18.90.1", "198.18.90.2", "2001:2:90::1", "2001:2:90::2", "fe80::90:1", "fe80::90:2"} {
		if err := waitLocal(net.ParseIP(a), lo.Attrs().Index); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name, net, bind string
		client, to      string // the client's address; the query's destination
	}{
		{"udp4", "udp4", "0.0.0.0:0", "198.18.90.1", "198.18.90.2"},
		{"udp6", "udp6", "[::]:0", "2001:2:90::1", "2001:2:90::2"},
		{"dual-stack-v4", "udp", "[::]:0", "198.18.90.1", "198.18.90.2"},
		{"dual-stack-v6", "udp", "[::]:0", "2001:2:90::1", "2001:2:90::2"},
		{"link-local", "udp6", "[::]:0", "fe80::90:1%lo", "fe80::90:2%lo"},
	} {
		if err := replyCase(c.net, c.bind, c.client, c.to); err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

// waitLocal waits until ip is routed as one of this namespace's own addresses.
func waitLocal(ip net.IP, ifindex int) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		rs, err := netlink.RouteGetWithOptions(ip, &netlink.RouteGetOptions{OifIndex: ifindex})
		if err == nil && len(rs) > 0 && rs[0].Type == unix.RTN_LOCAL {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%v not a local address after 5 s: %v %v", ip, rs, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replyCase sends a query from client to dest (the server's port) twice
// and answers it once with the destination's control message, once without.
func replyCase(network, bind, client, dest string) error {
	ua, _ := net.ResolveUDPAddr(network, bind)
	srv, err := net.ListenUDP(network, ua)
	if err != nil {
		return err
	}
	defer srv.Close()
	if err := Enable(srv); err != nil {
		return fmt.Errorf("Enable: %w", err)
	}
	port := srv.LocalAddr().(*net.UDPAddr).AddrPort().Port()
	cli, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(client), 0)))
	if err != nil {
		return err
	}
	defer cli.Close()
	to := netip.AddrPortFrom(netip.MustParseAddr(dest), port)
	for _, usePktinfo := range []bool{true, false} {
		if _, err := cli.WriteToUDPAddrPort([]byte("q"), to); err != nil {
			return err
		}
		srv.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 16)
		n, from, d, err := Read(srv, buf, nil)
		if err != nil {
			return err
		}
		if string(buf[:n]) != "q" || from.Addr().WithZone("") != netip.MustParseAddr(client).WithZone("") {
			return fmt.Errorf("read %q from %v", buf[:n], from)
		}
		if d.Addr.WithZone("") != to.Addr().WithZone("") || d.IfIndex == 0 {
			return fmt.Errorf("destination %+v, want %v and an interface", d, to.Addr())
		}
		if !usePktinfo {
			d = Dest{}
		}
		if err := Reply(srv, []byte("a"), from, d); err != nil {
			return fmt.Errorf("reply (pktinfo %v): %w", usePktinfo, err)
		}
		cli.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, src, err := cli.ReadFromUDPAddrPort(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("no reply (pktinfo %v)", usePktinfo)
		} else if err != nil {
			return err
		}
		fromDest := src.Addr().Unmap().WithZone("") == to.Addr().WithZone("")
		if string(buf[:n]) != "a" || fromDest != usePktinfo {
			return fmt.Errorf("pktinfo %v: reply %q from %v (the query went to %v)", usePktinfo, buf[:n], src, to)
		}
	}
	return nil
}
