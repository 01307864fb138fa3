package stack

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/fdbased"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

// Front is the job-facing stack of the client's netstack data path: it
// reads the job namespace's frames from a packet socket on a veth, ends every
// TCP connection and UDP flow there (slirp's role, without TCP over TCP) and
// relays them through the tunnel stack.
type Front struct {
	s      *stack.Stack
	cancel context.CancelFunc
}

// NewFront serves the Ethernet segment behind fd (an AF_PACKET socket bound
// to the veth end, whose MAC is self). The job's address and MAC are
// installed as a static neighbour, so no ARP is needed in either direction.
func NewFront(fd, mtu int, self, jobMAC net.HardwareAddr, job netip.Addr, via *Stack) (*Front, error) {
	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
	})
	sack := tcpip.TCPSACKEnabled(true)
	s.SetTransportProtocolOption(tcp.ProtocolNumber, &sack)
	rcv := tcpip.TCPReceiveBufferSizeRangeOption{Min: 4096, Default: 1 << 20, Max: 8 << 20}
	s.SetTransportProtocolOption(tcp.ProtocolNumber, &rcv)
	ep, err := fdbased.New(&fdbased.Options{
		FDs: []int{fd}, MTU: uint32(mtu), EthernetHeader: true, Address: tcpip.LinkAddress(self),
		// The veth hands over frames whose checksums the kernel left to
		// "hardware": do not verify them (the flows end here anyway).
		RXChecksumOffload:  true,
		PacketDispatchMode: fdbased.RecvMMsg,
	})
	if err != nil {
		return nil, fmt.Errorf("packet endpoint: %v", err)
	}
	if terr := s.CreateNIC(nic, ep); terr != nil {
		return nil, fmt.Errorf("front NIC: %v", terr)
	}
	s.AddRoute(tcpip.Route{Destination: header.IPv4EmptySubnet, NIC: nic})
	if terr := s.AddStaticNeighbor(nic, ipv4.ProtocolNumber, tcpip.AddrFromSlice(job.AsSlice()), tcpip.LinkAddress(jobMAC)); terr != nil {
		return nil, fmt.Errorf("static neighbour: %v", terr)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Front{s: s, cancel: cancel}
	forward(ctx, s, func(src, dst netip.AddrPort, _ string) bool { return src.Addr() == job },
		via.DialTCP, via.DialUDP)
	return f, nil
}

// Close stops the front stack.
func (f *Front) Close() {
	f.cancel()
	f.s.Close()
}
