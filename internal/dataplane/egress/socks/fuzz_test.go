package socks

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"
)

// fuzzConn is a client connection whose bytes are the fuzzer's.
type fuzzConn struct {
	r bytes.Reader
	w bytes.Buffer
}

func (c *fuzzConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *fuzzConn) Write(p []byte) (int, error) { return c.w.Write(p) }
func (c *fuzzConn) Close() error                { return nil }
func (c *fuzzConn) LocalAddr() net.Addr         { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1080} }
func (c *fuzzConn) RemoteAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40000}
}
func (c *fuzzConn) SetDeadline(time.Time) error      { return nil }
func (c *fuzzConn) SetReadDeadline(time.Time) error  { return nil }
func (c *fuzzConn) SetWriteDeadline(time.Time) error { return nil }

var errNoDial = errors.New("fuzz: no dialing")

// FuzzHandle: the SOCKS5 server reads whatever a local program sends.
// Nothing is dialled or resolved unless the client authenticated with the
// job's credentials first.
func FuzzHandle(f *testing.F) {
	auth := []byte{5, 1, 2, 1, 6, 'e', 'g', 'r', 'e', 's', 's', 6, 's', 'e', 'c', 'r', 'e', 't'}
	f.Add(append(append([]byte{}, auth...), 5, 1, 0, 1, 198, 18, 0, 1, 0, 80))
	f.Add(append(append([]byte{}, auth...), 5, 1, 0, 3, 11, 'e', 'x', 'a', 'm', 'p', 'l', 'e', '.', 'o', 'r', 'g', 1, 187))
	f.Add(append(append([]byte{}, auth...), 5, 1, 0, 4, 0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 53))
	f.Add(append(append([]byte{}, auth...), 5, 3, 0, 1, 0, 0, 0, 0, 0, 0))
	f.Add([]byte{5, 1, 0, 5, 1, 0, 1, 198, 18, 0, 1, 0, 80}) // no auth offered
	f.Add([]byte{5, 1, 2, 1, 6, 'e', 'g', 'r', 'e', 's', 's', 5, 'w', 'r', 'o', 'n', 'g', 5, 1, 0, 1, 1, 2, 3, 4, 0, 80})
	f.Fuzz(func(t *testing.T, in []byte) {
		dialled := false
		s := &Server{User: "egress", Pass: "secret",
			DialTCP: func(context.Context, netip.AddrPort) (net.Conn, error) { dialled = true; return nil, errNoDial },
			DialUDP: func(netip.AddrPort) (net.Conn, error) { dialled = true; return nil, errNoDial },
			Resolve: func(context.Context, string) (netip.Addr, error) { dialled = true; return netip.Addr{}, errNoDial },
		}
		c := &fuzzConn{}
		c.r.Reset(in)
		s.handle(c)
		out := c.w.Bytes()
		authed := len(out) >= 4 && bytes.Equal(out[:4], []byte{5, 2, 1, 0})
		if dialled && !authed {
			t.Fatalf("dialled without authentication; server wrote %x", out)
		}
		if authed && !bytes.HasPrefix(in, []byte{5}) {
			t.Fatal("authenticated a non-SOCKS5 client")
		}
	})
}

// FuzzReadAddr: what appendAddr writes, readAddr reads back; and any
// bytes give an address or an error.
func FuzzReadAddr(f *testing.F) {
	f.Add([]byte{1, 198, 18, 0, 1, 0, 80})
	f.Add([]byte{3, 3, 'a', '.', 'b', 0, 53})
	f.Add([]byte{4, 0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 187})
	f.Add([]byte{3, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		host, port, err := readAddr(bytes.NewReader(b))
		if err != nil {
			return
		}
		if ip, err := netip.ParseAddr(host); err == nil && (b[0] == 1 || b[0] == 4) {
			w := appendAddr(nil, netip.AddrPortFrom(ip, port))
			h2, p2, err := readAddr(bytes.NewReader(w))
			if err != nil || h2 != netip.AddrPortFrom(ip, port).Addr().Unmap().String() || p2 != port {
				t.Fatalf("round trip of %s:%d: %s:%d %v", host, port, h2, p2, err)
			}
		}
	})
}
