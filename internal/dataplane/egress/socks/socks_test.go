package socks

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

func server(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{User: "egress", Pass: "secret",
		DialTCP: func(ctx context.Context, ap netip.AddrPort) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", ap.String())
		},
		DialUDP: func(ap netip.AddrPort) (net.Conn, error) { return net.Dial("udp", ap.String()) },
		Resolve: func(_ context.Context, host string) (netip.Addr, error) {
			return netip.MustParseAddr("127.0.0.1"), nil
		}}
	go s.Serve(l)
	t.Cleanup(func() { l.Close() })
	return l
}

func greet(t *testing.T, c net.Conn, user, pass string) bool {
	c.Write([]byte{5, 1, 2})
	r := make([]byte, 2)
	io.ReadFull(c, r)
	if r[1] != 2 {
		return false
	}
	msg := append([]byte{1, byte(len(user))}, user...)
	msg = append(append(msg, byte(len(pass))), pass...)
	c.Write(msg)
	if _, err := io.ReadFull(c, r); err != nil {
		return false
	}
	return r[1] == 0
}

func TestConnectNeedsCredentials(t *testing.T) {
	l := server(t)
	target, _ := net.Listen("tcp", "127.0.0.1:0")
	defer target.Close()
	go func() {
		c, err := target.Accept()
		if err == nil {
			c.Write([]byte("hello"))
			c.Close()
		}
	}()
	// No auth offered: refused.
	c, _ := net.Dial("tcp", l.Addr().String())
	c.Write([]byte{5, 1, 0})
	r := make([]byte, 2)
	io.ReadFull(c, r)
	if r[1] != 0xff {
		t.Fatalf("no-auth method accepted: %v", r)
	}
	c.Close()
	// Wrong password: refused.
	c, _ = net.Dial("tcp", l.Addr().String())
	if greet(t, c, "egress", "guess") {
		t.Fatal("wrong password accepted")
	}
	c.Close()
	// Right password, CONNECT by name (socks5h).
	c, _ = net.Dial("tcp", l.Addr().String())
	defer c.Close()
	if !greet(t, c, "egress", "secret") {
		t.Fatal("right password refused")
	}
	port := target.Addr().(*net.TCPAddr).Port
	req := append([]byte{5, 1, 0, 3, byte(len("outside.test"))}, "outside.test"...)
	req = binary.BigEndian.AppendUint16(req, uint16(port))
	c.Write(req)
	rep := make([]byte, 10)
	if _, err := io.ReadFull(c, rep); err != nil || rep[1] != 0 {
		t.Fatalf("connect reply %v %v", rep, err)
	}
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	b, _ := io.ReadAll(c)
	if string(b) != "hello" {
		t.Fatalf("got %q", b)
	}
}

func TestUDPAssociate(t *testing.T) {
	l := server(t)
	echo, _ := net.ListenPacket("udp", "127.0.0.1:0")
	defer echo.Close()
	go func() {
		buf := make([]byte, 100)
		n, from, err := echo.ReadFrom(buf)
		if err == nil {
			echo.WriteTo(append([]byte("echo "), buf[:n]...), from)
		}
	}()
	c, _ := net.Dial("tcp", l.Addr().String())
	defer c.Close()
	if !greet(t, c, "egress", "secret") {
		t.Fatal("auth")
	}
	c.Write([]byte{5, 3, 0, 1, 0, 0, 0, 0, 0, 0})
	rep := make([]byte, 10)
	if _, err := io.ReadFull(c, rep); err != nil || rep[1] != 0 {
		t.Fatalf("associate reply %v %v", rep, err)
	}
	relay := netip.AddrPortFrom(netip.AddrFrom4([4]byte(rep[4:8])), binary.BigEndian.Uint16(rep[8:10]))
	u, _ := net.Dial("udp", relay.String())
	defer u.Close()
	dst := echo.LocalAddr().(*net.UDPAddr).AddrPort()
	msg := appendAddr([]byte{0, 0, 0}, dst)
	u.Write(append(msg, "ping"...))
	u.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 200)
	n, err := u.Read(buf)
	if err != nil || string(buf[10:n]) != "echo ping" {
		t.Fatalf("udp via socks: %q %v", buf[:n], err)
	}
}
