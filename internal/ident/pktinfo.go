package ident

import (
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Answers must leave from the address the query was sent to: the client
// accepts an answer only from the exact service address it asked, and a
// node whose address lives on a loopback or dummy interface (routed
// clusters) would otherwise answer from whatever address routing picks.
// The service socket is dual-stack, so both IPv4 (IP_PKTINFO) and IPv6
// (IPV6_RECVPKTINFO) destination addresses are requested, and the reply
// names its source with the matching control message.

func enablePktinfo(c *net.UDPConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		if e := unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1); e != nil {
			serr = e
		}
		// IPv4 packets on a dual-stack socket carry IP_PKTINFO.
		if e := unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1); e != nil && serr == nil {
			serr = e
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// pktDst returns the destination address of a received datagram from its
// control messages (zero if absent).
func pktDst(oob []byte) netip.Addr {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			return netip.AddrFrom4([4]byte(m.Data[8:12])) // ipi_addr: the header's destination
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			return netip.AddrFrom16([16]byte(m.Data[0:16])).Unmap()
		}
	}
	return netip.Addr{}
}

// srcOOB is the control message that sends a reply from src.
func srcOOB(src netip.Addr) []byte {
	switch {
	case !src.IsValid() || src.IsMulticast():
		return nil
	case src.Is4():
		return unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: src.As4()})
	default:
		return unix.PktInfo6(&unix.Inet6Pktinfo{Addr: src.As16()})
	}
}
