// Package pktinfo answers a UDP datagram from the address it was sent to.
//
// A UDP service bound to a wildcard address must reply from the exact
// address the query went to: a client with a connected socket (or one that
// checks the answer's source, like the ident client) drops datagrams from
// any other address, and a multi-homed node (eth0 and ib0, or a routed node
// whose address lives on a dummy or loopback interface) would otherwise
// answer from whichever address its route prefers. The kernel reports each
// datagram's destination (IP_PKTINFO, IPV6_PKTINFO) and takes the reply's
// source from the same control message.
package pktinfo

import (
	"encoding/binary"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// OOBSize is enough room for the control messages Enable asks for.
const OOBSize = 128

// Enable asks for the destination of every datagram received on c: IPv4
// (IP_PKTINFO) on an AF_INET socket; IPv6 (IPV6_RECVPKTINFO) and, for the
// IPv4 peers of a dual-stack socket, IPv4 on an AF_INET6 socket.
func Enable(c *net.UDPConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		domain, e := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN)
		if e != nil {
			serr = e
			return
		}
		if domain == unix.AF_INET6 {
			if e := unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1); e != nil {
				serr = e
				return
			}
		}
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
	})
	if err != nil {
		return err
	}
	return serr
}

// Dest is where a datagram was sent: its destination address (IPv4-mapped
// addresses unmapped) and the interface it arrived on. The zero Dest means
// unknown.
type Dest struct {
	Addr    netip.Addr
	IfIndex int
}

// Parse reads the destination from a received datagram's control messages.
func Parse(oob []byte) Dest {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return Dest{}
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			// struct in_pktinfo: ifindex, spec_dst, addr (the header's destination).
			return Dest{Addr: netip.AddrFrom4([4]byte(m.Data[8:12])), IfIndex: int(binary.NativeEndian.Uint32(m.Data[0:4]))}
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			// struct in6_pktinfo: addr, ifindex.
			return Dest{Addr: netip.AddrFrom16([16]byte(m.Data[0:16])).Unmap(), IfIndex: int(binary.NativeEndian.Uint32(m.Data[16:20]))}
		}
	}
	return Dest{}
}

// OOB is the control message that sends a reply from d.Addr: nil when there
// is no address to answer from (unknown, or a multicast group, which cannot
// be a source). An IPv6 link-local source also names the interface (its
// scope); other replies are routed as usual.
func (d Dest) OOB() []byte {
	switch {
	case !d.Addr.IsValid() || d.Addr.IsMulticast() || d.Addr.IsUnspecified():
		return nil
	case d.Addr.Is4():
		return unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: d.Addr.As4()})
	default:
		p := unix.Inet6Pktinfo{Addr: d.Addr.As16()}
		if d.Addr.IsLinkLocalUnicast() {
			p.Ifindex = uint32(d.IfIndex)
		}
		return unix.PktInfo6(&p)
	}
}

// Read reads one datagram into buf, with its sender (unmapped) and where it
// was sent. oob is scratch space of OOBSize bytes (nil: allocated).
func Read(c *net.UDPConn, buf, oob []byte) (n int, from netip.AddrPort, d Dest, err error) {
	if oob == nil {
		oob = make([]byte, OOBSize)
	}
	n, oobn, _, from, err := c.ReadMsgUDPAddrPort(buf, oob)
	if err != nil {
		return 0, netip.AddrPort{}, Dest{}, err
	}
	return n, netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), Parse(oob[:oobn]), nil
}

// Reply sends b to the sender of a datagram that was sent to d, from d.
func Reply(c *net.UDPConn, b []byte, to netip.AddrPort, d Dest) error {
	_, _, err := c.WriteMsgUDPAddrPort(b, d.OOB(), to)
	return err
}
