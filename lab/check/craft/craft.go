// Package craft builds and sends hand-made IP packets for the attack suite:
// datagrams and SYNs with any source address and any IP or TCP option, as
// root on a host outside the cluster would send them. It writes whole IP
// headers through raw sockets (IPPROTO_RAW implies IP_HDRINCL / IPV6_HDRINCL),
// so nothing of the sending host's stack decides what goes on the wire.
package craft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Protocol numbers.
const (
	TCP     = 6
	UDP     = 17
	DstOpts = 60
	UDPLite = 136
)

// Identity stamp v1 (userwall before data plane v2): an IPv4 option, an
// IPv6 destination option and a TCP option, each "ExID 0x5542, uid, gid",
// unauthenticated. The suite forges them to prove that a stamp nobody
// signed is worth nothing.
const (
	v1ExID      = 0x5542
	v1IPOpt     = 0x9e
	v1IP6Opt    = 0x1e
	v1TCPOptKnd = 254
)

// StampV1IPv4 is the v1 IPv4 option claiming uid and gid (12 bytes).
func StampV1IPv4(uid, gid uint32) []byte {
	b := []byte{v1IPOpt, 12, v1ExID >> 8, v1ExID & 0xff, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[4:], uid)
	binary.BigEndian.PutUint32(b[8:], gid)
	return b
}

// StampV1IPv6 is the v1 IPv6 destination-options header claiming uid and
// gid (16 bytes; next header filled in by Packet).
func StampV1IPv6(uid, gid uint32) []byte {
	b := []byte{0, 1, v1IP6Opt, 12, v1ExID >> 8, v1ExID & 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0}
	binary.BigEndian.PutUint32(b[6:], uid)
	binary.BigEndian.PutUint32(b[10:], gid)
	return b
}

// StampV1TCP is the v1 TCP option (kind 254, RFC 6994 ExID) claiming uid
// and gid (12 bytes).
func StampV1TCP(uid, gid uint32) []byte {
	b := []byte{v1TCPOptKnd, 12, v1ExID >> 8, v1ExID & 0xff, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[4:], uid)
	binary.BigEndian.PutUint32(b[8:], gid)
	return b
}

// Packet describes one IP packet.
type Packet struct {
	Src, Dst   netip.AddrPort
	Proto      int    // UDP, UDPLite or TCP (a SYN)
	IPOptions  []byte // IPv4 options (padded to 4 bytes here)
	DstOptions []byte // IPv6: one destination-options header, whole (next header is set here)
	TCPOptions []byte // TCP options (padded to 4 bytes here)
	Seq        uint32 // TCP sequence number
	Payload    []byte
	TTL        uint8 // default 64
}

func pad4(b []byte) []byte {
	for len(b)%4 != 0 {
		b = append(b, 0) // end of option list / padding
	}
	return b
}

// Bytes returns the packet from the IP header on, checksums filled in.
func (p Packet) Bytes() ([]byte, error) {
	src, dst := p.Src.Addr().Unmap(), p.Dst.Addr().Unmap()
	if src.Is4() != dst.Is4() {
		return nil, errors.New("craft: source and destination of different families")
	}
	ttl := p.TTL
	if ttl == 0 {
		ttl = 64
	}
	l4, err := p.transport(src, dst)
	if err != nil {
		return nil, err
	}
	if src.Is4() {
		opts := pad4(append([]byte(nil), p.IPOptions...))
		if len(opts) > 40 {
			return nil, errors.New("craft: IPv4 options longer than 40 bytes")
		}
		hl := 20 + len(opts)
		h := make([]byte, hl, hl+len(l4))
		h[0] = 0x40 | byte(hl/4)
		binary.BigEndian.PutUint16(h[2:], uint16(hl+len(l4)))
		binary.BigEndian.PutUint16(h[6:], 0x4000) // DF
		h[8], h[9] = ttl, byte(p.Proto)
		s4, d4 := src.As4(), dst.As4()
		copy(h[12:], s4[:])
		copy(h[16:], d4[:])
		copy(h[20:], opts)
		binary.BigEndian.PutUint16(h[10:], ^fold(sum(0, h)))
		return append(h, l4...), nil
	}
	ext := append([]byte(nil), p.DstOptions...)
	if len(ext) > 0 && (len(ext)%8 != 0 || int(ext[1]+1)*8 != len(ext)) {
		return nil, errors.New("craft: malformed IPv6 destination-options header")
	}
	h := make([]byte, 40, 40+len(ext)+len(l4))
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(ext)+len(l4)))
	h[6], h[7] = byte(p.Proto), ttl
	if len(ext) > 0 {
		h[6], ext[0] = DstOpts, byte(p.Proto)
	}
	s16, d16 := src.As16(), dst.As16()
	copy(h[8:], s16[:])
	copy(h[24:], d16[:])
	return append(append(h, ext...), l4...), nil
}

func (p Packet) transport(src, dst netip.Addr) ([]byte, error) {
	var b []byte
	switch p.Proto {
	case UDP, UDPLite:
		b = make([]byte, 8+len(p.Payload))
		binary.BigEndian.PutUint16(b[0:], p.Src.Port())
		binary.BigEndian.PutUint16(b[2:], p.Dst.Port())
		// UDP: length; UDP-Lite: checksum coverage (0 = whole datagram).
		if p.Proto == UDP {
			binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
		}
		copy(b[8:], p.Payload)
		c := ^fold(sum(pseudo(src, dst, p.Proto, len(b)), b))
		if c == 0 {
			c = 0xffff
		}
		binary.BigEndian.PutUint16(b[6:], c)
	case TCP:
		opts := pad4(append([]byte(nil), p.TCPOptions...))
		if len(opts) > 40 {
			return nil, errors.New("craft: TCP options longer than 40 bytes")
		}
		b = make([]byte, 20+len(opts)+len(p.Payload))
		binary.BigEndian.PutUint16(b[0:], p.Src.Port())
		binary.BigEndian.PutUint16(b[2:], p.Dst.Port())
		binary.BigEndian.PutUint32(b[4:], p.Seq)
		b[12] = byte((20 + len(opts)) / 4 << 4)
		b[13] = 0x02 // SYN
		binary.BigEndian.PutUint16(b[14:], 64240)
		copy(b[20:], opts)
		copy(b[20+len(opts):], p.Payload)
		binary.BigEndian.PutUint16(b[16:], ^fold(sum(pseudo(src, dst, TCP, len(b)), b)))
	default:
		return nil, fmt.Errorf("craft: protocol %d not supported", p.Proto)
	}
	return b, nil
}

func pseudo(src, dst netip.Addr, proto, l4len int) uint32 {
	var s uint32
	s = sum(s, src.AsSlice())
	s = sum(s, dst.AsSlice())
	return s + uint32(proto) + uint32(l4len)
}

func sum(s uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

func fold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// Send writes p through a raw socket (needs CAP_NET_RAW in the network
// namespace's owning user namespace). The kernel adds nothing but the link
// header.
func Send(p Packet) error {
	b, err := p.Bytes()
	if err != nil {
		return err
	}
	dst := p.Dst.Addr().Unmap()
	var fd int
	var sa unix.Sockaddr
	if dst.Is4() {
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		sa = &unix.SockaddrInet4{Addr: dst.As4()}
	} else {
		fd, err = unix.Socket(unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_RAW)
		sa = &unix.SockaddrInet6{Addr: dst.As16()}
	}
	if err != nil {
		return fmt.Errorf("raw socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, b, 0, sa); err != nil {
		return fmt.Errorf("raw send: %w", err)
	}
	return nil
}
