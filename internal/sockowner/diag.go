package sockowner

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// sock_diag wire layout (linux/inet_diag.h). Ports and addresses are in
// network order; the rest is host order.
const (
	sockDiagByFamily = 20 // SOCK_DIAG_BY_FAMILY
	reqLen           = 56 // struct inet_diag_req_v2
	msgLen           = 72 // struct inet_diag_msg
	noCookie         = 0xffffffff
	tcpListen        = 10 // TCP_LISTEN in enum tcp_state
	allStates        = 0xffffffff
)

// diagSocket is the part of an inet_diag_msg that ident needs.
type diagSocket struct {
	Family uint8
	State  uint8
	Local  netip.AddrPort
	Remote netip.AddrPort
	UID    uint32
	Inode  uint32
}

// listening reports whether the socket accepts from anyone: a TCP listener
// or an unconnected UDP socket.
func (s diagSocket) listening(proto policy.Proto) bool {
	if proto == policy.TCP {
		return s.State == tcpListen
	}
	return s.Remote.Port() == 0
}

func familyOf(a netip.Addr) uint8 {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// encodeReq builds an inet_diag_req_v2. src/dst are written as given; the
// caller decides which is local (TCP and UDP disagree, see lookupExact).
func encodeReq(family uint8, proto policy.Proto, states uint32, src, dst netip.AddrPort) []byte {
	b := make([]byte, reqLen)
	b[0] = family
	b[1] = uint8(proto)
	binary.NativeEndian.PutUint32(b[4:], states)
	binary.BigEndian.PutUint16(b[8:], src.Port())
	binary.BigEndian.PutUint16(b[10:], dst.Port())
	putAddr(b[12:28], src.Addr())
	putAddr(b[28:44], dst.Addr())
	// b[44:48] interface: 0 = any
	binary.NativeEndian.PutUint32(b[48:], noCookie)
	binary.NativeEndian.PutUint32(b[52:], noCookie)
	return b
}

func putAddr(b []byte, a netip.Addr) {
	if !a.IsValid() {
		return
	}
	if a.Is4() {
		v := a.As4()
		copy(b, v[:])
		return
	}
	v := a.As16()
	copy(b, v[:])
}

func decodeMsg(b []byte) (diagSocket, error) {
	if len(b) < msgLen {
		return diagSocket{}, fmt.Errorf("sock_diag: short message (%d bytes)", len(b))
	}
	s := diagSocket{Family: b[0], State: b[1]}
	sport := binary.BigEndian.Uint16(b[4:])
	dport := binary.BigEndian.Uint16(b[6:])
	var src, dst netip.Addr
	switch s.Family {
	case unix.AF_INET:
		src = netip.AddrFrom4([4]byte(b[8:12]))
		dst = netip.AddrFrom4([4]byte(b[24:28]))
	case unix.AF_INET6:
		src = netip.AddrFrom16([16]byte(b[8:24])).Unmap()
		dst = netip.AddrFrom16([16]byte(b[24:40])).Unmap()
	default:
		return diagSocket{}, fmt.Errorf("sock_diag: unexpected family %d", s.Family)
	}
	s.Local = netip.AddrPortFrom(src, sport)
	s.Remote = netip.AddrPortFrom(dst, dport)
	s.UID = binary.NativeEndian.Uint32(b[64:])
	s.Inode = binary.NativeEndian.Uint32(b[68:])
	return s, nil
}

// diagConn is a NETLINK_SOCK_DIAG socket, bound to the network namespace
// that was current when it was opened. The server keeps one for its life,
// so its lookups stay in the node's namespace whatever thread runs them.
type diagConn struct {
	mu sync.Mutex
	c  *netlink.Conn
}

func openDiag() (*diagConn, error) {
	c, err := netlink.Dial(unix.NETLINK_SOCK_DIAG, nil)
	if err != nil {
		return nil, fmt.Errorf("sock_diag: %w", err)
	}
	return &diagConn{c: c}, nil
}

func (d *diagConn) Close() error { return d.c.Close() }

func (d *diagConn) execute(flags netlink.HeaderFlags, req []byte) ([]diagSocket, error) {
	d.mu.Lock()
	msgs, err := d.c.Execute(netlink.Message{
		Header: netlink.Header{Type: sockDiagByFamily, Flags: netlink.Request | flags},
		Data:   req,
	})
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	out := make([]diagSocket, 0, len(msgs))
	for _, m := range msgs {
		if m.Header.Type != sockDiagByFamily {
			continue
		}
		s, err := decodeMsg(m.Data)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// lookupExact asks the kernel for the one socket a packet from remote to
// local would be delivered to — the kernel's own socket lookup, so a
// wildcard or dual-stack listener is found exactly as the stack would find
// it. remote may be zero (then only listeners/unconnected UDP match).
func (d *diagConn) lookupExact(local, remote netip.AddrPort, proto policy.Proto) (diagSocket, bool, error) {
	fam := familyOf(local.Addr())
	if remote.Addr().IsValid() && familyOf(remote.Addr()) != fam {
		return diagSocket{}, false, nil
	}
	if !remote.Addr().IsValid() {
		if fam == unix.AF_INET {
			remote = netip.AddrPortFrom(netip.IPv4Unspecified(), remote.Port())
		} else {
			remote = netip.AddrPortFrom(netip.IPv6Unspecified(), remote.Port())
		}
	}
	var req []byte
	if proto == policy.TCP {
		// tcp_diag: id.src is the socket's local end.
		req = encodeReq(fam, proto, allStates, local, remote)
	} else {
		// udp_diag passes id.src as the packet's source to the UDP lookup
		// ("swapped for historical reasons" in net/ipv4/udp_diag.c).
		req = encodeReq(fam, proto, allStates, remote, local)
	}
	socks, err := d.execute(0, req)
	if errors.Is(err, unix.ENOENT) {
		return diagSocket{}, false, nil
	}
	if err != nil {
		return diagSocket{}, false, fmt.Errorf("sock_diag get: %w", err)
	}
	if len(socks) == 0 {
		return diagSocket{}, false, nil
	}
	return socks[0], true, nil
}

// dumpPort lists the sockets of one family bound to local port port; the
// kernel filters by port, so this stays small on a busy node.
func (d *diagConn) dumpPort(fam uint8, port uint16, proto policy.Proto) ([]diagSocket, error) {
	req := encodeReq(fam, proto, allStates, netip.AddrPortFrom(netip.Addr{}, port), netip.AddrPort{})
	socks, err := d.execute(netlink.Dump, req)
	if err != nil {
		return nil, fmt.Errorf("sock_diag dump: %w", err)
	}
	// Older kernels ignore the port filter for some tables; filter again.
	out := socks[:0]
	for _, s := range socks {
		if s.Local.Port() == port {
			out = append(out, s)
		}
	}
	return out, nil
}

// find returns the socket whose local end is addr (exactly or through a
// wildcard bind) and, if peer is set, whose remote end is peer. Without a
// peer a listener is preferred over connected sockets that share its port
// (accepted connections), and an exact address over a wildcard.
func (d *diagConn) find(addr, peer netip.AddrPort, proto policy.Proto) (diagSocket, error) {
	addr = netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())
	if peer.IsValid() {
		peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	}
	if s, ok, err := d.lookupExact(addr, peer, proto); err != nil {
		return diagSocket{}, err
	} else if ok && s.Inode != 0 {
		return s, nil
	}
	// Fall back to a port-filtered dump: connected UDP sockets without a
	// peer given, TIME_WAIT-only matches, or kernels without exact get.
	var cands []diagSocket
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, err := d.dumpPort(fam, addr.Port(), proto)
		if err != nil {
			return diagSocket{}, err
		}
		cands = append(cands, socks...)
	}
	best, bestScore := diagSocket{}, -1
	for _, s := range cands {
		sc := score(s, addr, peer, proto)
		if sc > bestScore {
			best, bestScore = s, sc
		}
	}
	if bestScore < 0 {
		return diagSocket{}, ErrNoSocket
	}
	return best, nil
}

// score ranks a candidate socket for a query; -1 means it does not match.
func score(s diagSocket, addr, peer netip.AddrPort, proto policy.Proto) int {
	if s.Inode == 0 { // TIME_WAIT and request sockets have no owner
		return -1
	}
	la := s.Local.Addr()
	sc := 0
	switch {
	case la == addr.Addr():
		sc += 2
	case la.IsUnspecified() && (la.Is4() == addr.Addr().Is4() || s.Family == unix.AF_INET6):
		// A v6 wildcard socket also takes IPv4 unless IPV6_V6ONLY; the
		// exact get has already covered the precise case.
	default:
		return -1
	}
	if peer.IsValid() {
		if s.Remote != peer {
			return -1
		}
		return sc + 8
	}
	if s.listening(proto) {
		sc += 4
	}
	return sc
}
