package stack

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// pipe shuttles packets from a to b as wireguard-go would.
func pipe(a, b *Stack) {
	bufs := make([][]byte, 64)
	for i := range bufs {
		bufs[i] = make([]byte, 65535)
	}
	sizes := make([]int, 64)
	for {
		n, err := a.Read(bufs, sizes, 0)
		if err != nil {
			return
		}
		out := make([][]byte, n)
		for i := range n {
			out[i] = append([]byte(nil), bufs[i][:sizes[i]]...)
		}
		b.Write(out, 0)
	}
}

// TestForwarding: a client stack reaches a host listener through a gateway
// stack that relays over host sockets, TCP and UDP.
func TestForwarding(t *testing.T) {
	allowLoopback = true
	defer func() { allowLoopback = false }()
	cl, err := New([]netip.Addr{netip.MustParseAddr("100.64.0.2")}, 1420)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	gw, err := New([]netip.Addr{netip.MustParseAddr("100.64.0.1")}, 1420)
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()
	gw.Forward(nil)
	go pipe(cl, gw)
	go pipe(gw, cl)

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		c.Write([]byte("hello from host"))
		c.Close()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := cl.DialTCP(ctx, netip.MustParseAddrPort(l.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(c)
	if string(b) != "hello from host" {
		t.Fatalf("got %q", b)
	}
	u, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	go func() {
		buf := make([]byte, 100)
		n, from, err := u.ReadFrom(buf)
		if err == nil {
			u.WriteTo(append([]byte("echo "), buf[:n]...), from)
		}
	}()
	uc, err := cl.DialUDP(netip.MustParseAddrPort(u.LocalAddr().String()))
	if err != nil {
		t.Fatal(err)
	}
	uc.Write([]byte("ping"))
	uc.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 100)
	n, err := uc.Read(buf)
	if err != nil || string(buf[:n]) != "echo ping" {
		t.Fatalf("udp: %q %v", buf[:n], err)
	}
	// A listener in the gateway stack (the DNS responder's case).
	pc, err := gw.ListenUDP(netip.MustParseAddrPort("100.64.0.1:53"))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 100)
		n, from, err := pc.ReadFrom(buf)
		if err == nil {
			pc.WriteTo(buf[:n], from)
		}
	}()
	dc, _ := cl.DialUDP(netip.MustParseAddrPort("100.64.0.1:53"))
	dc.Write([]byte("q"))
	dc.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := dc.Read(buf); err != nil || string(buf[:n]) != "q" {
		t.Fatalf("local udp: %q %v", buf[:n], err)
	}
}
