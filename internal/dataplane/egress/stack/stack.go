// Package stack is a gVisor userspace TCP/IP stack presented to wireguard-go
// as a tun device. It serves two roles that need no privilege at all:
//
//   - the unprivileged gateway: the stack accepts every flow the clients send
//     (promiscuous + spoofing) and relays it through ordinary host sockets,
//     which is masquerading done in userspace (slirp's job in reference 002);
//   - the client's userspace data path: the SOCKS5 server dials through it.
package stack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/relay"

	"golang.zx2c4.com/wireguard/tun"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/channel"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/icmp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"
)

const nic = 1

// allowLoopback lets tests relay to 127.0.0.1 (the only host address a unit
// test may use); never set in production, where a client must not reach the
// gateway host's loopback.
var allowLoopback = false

// Stack is a netstack and the tun.Device that feeds it.
type Stack struct {
	s      *stack.Stack
	ep     *channel.Endpoint
	mtu    int
	events chan tun.Event
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
}

// New creates a stack owning addrs with a default route through the tunnel.
func New(addrs []netip.Addr, mtu int) (*Stack, error) {
	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocolWithOptions(ipv4.Options{AllowExternalLoopbackTraffic: allowLoopback}), ipv6.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol, icmp.NewProtocol4, icmp.NewProtocol6},
		// HandleLocal must stay off: in promiscuous mode gVisor would take
		// every source address for one of its own and drop the packet.
		HandleLocal: false,
	})
	st := &Stack{s: s, ep: channel.New(1024, uint32(mtu), ""), mtu: mtu, events: make(chan tun.Event, 1)}
	st.ctx, st.cancel = context.WithCancel(context.Background())
	sack := tcpip.TCPSACKEnabled(true)
	s.SetTransportProtocolOption(tcp.ProtocolNumber, &sack)
	// Larger windows than gVisor's defaults: the tunnel is a fat, short pipe.
	rcv := tcpip.TCPReceiveBufferSizeRangeOption{Min: 4096, Default: 1 << 20, Max: 8 << 20}
	s.SetTransportProtocolOption(tcp.ProtocolNumber, &rcv)
	snd := tcpip.TCPSendBufferSizeRangeOption{Min: 4096, Default: 1 << 20, Max: 8 << 20}
	s.SetTransportProtocolOption(tcp.ProtocolNumber, &snd)
	if err := s.CreateNIC(nic, st.ep); err != nil {
		return nil, fmt.Errorf("netstack: %v", err)
	}
	for _, a := range addrs {
		proto := ipv4.ProtocolNumber
		if a.Is6() {
			proto = ipv6.ProtocolNumber
		}
		pa := tcpip.ProtocolAddress{Protocol: proto, AddressWithPrefix: tcpip.AddrFromSlice(a.AsSlice()).WithPrefix()}
		if err := s.AddProtocolAddress(nic, pa, stack.AddressProperties{}); err != nil {
			return nil, fmt.Errorf("netstack address %s: %v", a, err)
		}
	}
	s.AddRoute(tcpip.Route{Destination: header.IPv4EmptySubnet, NIC: nic})
	s.AddRoute(tcpip.Route{Destination: header.IPv6EmptySubnet, NIC: nic})
	st.events <- tun.EventUp
	return st, nil
}

// File implements tun.Device (no file: the stack is in memory).
func (st *Stack) File() *os.File { return nil }

// MTU implements tun.Device.
func (st *Stack) MTU() (int, error) { return st.mtu, nil }

// Name implements tun.Device.
func (st *Stack) Name() (string, error) { return "netstack", nil }

// Events implements tun.Device.
func (st *Stack) Events() <-chan tun.Event { return st.events }

// BatchSize implements tun.Device.
func (st *Stack) BatchSize() int { return 64 }

// Read hands packets the stack sends to wireguard-go (toward the peers).
func (st *Stack) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	pkt := st.ep.ReadContext(st.ctx)
	if pkt == nil {
		return 0, os.ErrClosed
	}
	n := 0
	for {
		v := pkt.ToView()
		sizes[n] = copy(bufs[n][offset:], v.AsSlice())
		v.Release()
		pkt.DecRef()
		n++
		if n == len(bufs) {
			return n, nil
		}
		if pkt = st.ep.Read(); pkt == nil {
			return n, nil
		}
	}
}

// Write injects packets from the peers into the stack.
func (st *Stack) Write(bufs [][]byte, offset int) (int, error) {
	for i, b := range bufs {
		p := b[offset:]
		if len(p) == 0 {
			continue
		}
		var proto tcpip.NetworkProtocolNumber
		switch p[0] >> 4 {
		case 4:
			proto = ipv4.ProtocolNumber
		case 6:
			proto = ipv6.ProtocolNumber
		default:
			continue
		}
		pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(p)})
		st.ep.InjectInbound(proto, pkt)
		pkt.DecRef()
		_ = i
	}
	return len(bufs), nil
}

// Close implements tun.Device.
func (st *Stack) Close() error {
	st.once.Do(func() {
		st.cancel()
		st.s.Close()
		st.ep.Close()
		close(st.events)
	})
	return nil
}

func full(ap netip.AddrPort) (tcpip.FullAddress, tcpip.NetworkProtocolNumber) {
	p := ipv4.ProtocolNumber
	if ap.Addr().Is6() {
		p = ipv6.ProtocolNumber
	}
	return tcpip.FullAddress{NIC: nic, Addr: tcpip.AddrFromSlice(ap.Addr().Unmap().AsSlice()), Port: ap.Port()}, p
}

// DialTCP opens a TCP connection through the tunnel.
func (st *Stack) DialTCP(ctx context.Context, ap netip.AddrPort) (net.Conn, error) {
	fa, p := full(ap)
	return gonet.DialContextTCP(ctx, st.s, fa, p)
}

// DialUDP opens a connected UDP socket through the tunnel.
func (st *Stack) DialUDP(ap netip.AddrPort) (net.Conn, error) {
	fa, p := full(ap)
	return gonet.DialUDP(st.s, nil, &fa, p)
}

// ListenUDP binds a UDP socket in the stack (e.g. the gateway's DNS).
func (st *Stack) ListenUDP(ap netip.AddrPort) (net.PacketConn, error) {
	fa, p := full(ap)
	return gonet.DialUDP(st.s, &fa, nil, p)
}

// ListenTCP binds a TCP listener in the stack.
func (st *Stack) ListenTCP(ap netip.AddrPort) (net.Listener, error) {
	fa, p := full(ap)
	return gonet.ListenTCP(st.s, fa, p)
}

// Forward makes the stack a userspace router: every TCP connection and UDP
// flow addressed to anyone but the stack itself is relayed through host
// sockets. allow vets each flow (source, destination) first.
func (st *Stack) Forward(allow func(src, dst netip.AddrPort, proto string) bool) {
	d := &net.Dialer{Timeout: 10 * time.Second}
	forward(st.ctx, st.s, allow,
		func(ctx context.Context, ap netip.AddrPort) (net.Conn, error) {
			return d.DialContext(ctx, "tcp", ap.String())
		},
		func(ap netip.AddrPort) (net.Conn, error) { return net.Dial("udp", ap.String()) })
}

// forward installs TCP and UDP forwarders on s that terminate every flow
// and relay it through the given dialers.
func forward(ctx context.Context, s *stack.Stack, allow func(src, dst netip.AddrPort, proto string) bool,
	dialTCP func(context.Context, netip.AddrPort) (net.Conn, error), dialUDP func(netip.AddrPort) (net.Conn, error)) {
	s.SetPromiscuousMode(nic, true)
	s.SetSpoofing(nic, true)
	tf := tcp.NewForwarder(s, 0, 2048, func(r *tcp.ForwarderRequest) {
		id := r.ID()
		src := addrPort(id.RemoteAddress, id.RemotePort)
		dst := addrPort(id.LocalAddress, id.LocalPort)
		if allow != nil && !allow(src, dst, "tcp") {
			r.Complete(true)
			return
		}
		// Connect onward first so that a refusal reaches the client as a RST.
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		out, err := dialTCP(dctx, dst)
		cancel()
		if err != nil {
			r.Complete(true)
			return
		}
		var wq waiter.Queue
		ep, terr := r.CreateEndpoint(&wq)
		if terr != nil {
			out.Close()
			r.Complete(true)
			return
		}
		r.Complete(false)
		ep.SocketOptions().SetKeepAlive(true)
		in := gonet.NewTCPConn(&wq, ep)
		go relay.Splice(in, out)
	})
	s.SetTransportProtocolHandler(tcp.ProtocolNumber, tf.HandlePacket)
	uf := udp.NewForwarder(s, func(r *udp.ForwarderRequest) {
		id := r.ID()
		src := addrPort(id.RemoteAddress, id.RemotePort)
		dst := addrPort(id.LocalAddress, id.LocalPort)
		if allow != nil && !allow(src, dst, "udp") {
			return
		}
		var wq waiter.Queue
		ep, terr := r.CreateEndpoint(&wq)
		if terr != nil {
			return
		}
		in := gonet.NewUDPConn(&wq, ep)
		out, err := dialUDP(dst)
		if err != nil {
			in.Close()
			return
		}
		go relayUDP(in, out)
	})
	s.SetTransportProtocolHandler(udp.ProtocolNumber, uf.HandlePacket)
}

func addrPort(a tcpip.Address, port uint16) netip.AddrPort {
	ip, _ := netip.AddrFromSlice(a.AsSlice())
	return netip.AddrPortFrom(ip, port)
}

// relayUDP moves datagrams of one flow until it has been idle for a minute.
func relayUDP(in, out net.Conn) {
	const idle = 60 * time.Second
	done := make(chan struct{})
	var once sync.Once
	stop := func() { once.Do(func() { close(done); in.Close(); out.Close() }) }
	cp := func(dst, src net.Conn) {
		defer stop()
		buf := make([]byte, 65535)
		for {
			src.SetReadDeadline(time.Now().Add(idle))
			n, err := src.Read(buf)
			if err != nil {
				var ne net.Error
				if errors.Is(err, net.ErrClosed) || errors.As(err, &ne) && ne.Timeout() {
					return
				}
				// ICMP errors on the host socket (refused): keep the flow.
				select {
				case <-done:
					return
				default:
					continue
				}
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				select {
				case <-done:
					return
				default:
				}
			}
		}
	}
	go cp(out, in)
	cp(in, out)
}

// Hairpin queues an IP packet back toward the peers without entering the
// stack: client-to-client traffic in the unprivileged gateway.
func (st *Stack) Hairpin(p []byte) {
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(append([]byte(nil), p...))})
	var l stack.PacketBufferList
	l.PushBack(pkt)
	st.ep.WritePackets(l)
	pkt.DecRef()
}
