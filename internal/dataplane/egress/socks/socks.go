// Package socks is a small SOCKS5 server (RFC 1928, with the username and
// password method of RFC 1929) for the egress client's fallback data path,
// where user namespaces are unavailable: programs that speak SOCKS (or are
// made to, e.g. by an LD_PRELOAD socksifier) reach the outside through the
// client's userspace stack. CONNECT and UDP ASSOCIATE are supported.
package socks

import (
	"context"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/relay"
)

// Server relays SOCKS5 requests through Dial.
type Server struct {
	// User and Pass, when set, are required (the listener is on a shared
	// node: without them any local user could borrow this job's egress).
	User, Pass string
	// DialTCP and DialUDP open connections toward the outside.
	DialTCP func(ctx context.Context, ap netip.AddrPort) (net.Conn, error)
	DialUDP func(ap netip.AddrPort) (net.Conn, error)
	// Resolve turns a host name into an address (socks5h semantics).
	Resolve func(ctx context.Context, host string) (netip.Addr, error)
	Logf    func(string, ...any)
}

// Serve accepts connections until l is closed.
func (s *Server) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go func() {
			if err := s.handle(c); err != nil && s.Logf != nil {
				s.Logf("socks %s: %v", c.RemoteAddr(), err)
			}
		}()
	}
}

const (
	repOK          = 0
	repFail        = 1
	repNotAllowed  = 2
	repHostUnreach = 4
	repRefused     = 5
	repCmdUnsupp   = 7
	repAddrUnsupp  = 8
)

func (s *Server) handle(c net.Conn) error {
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	hdr := make([]byte, 2)
	if _, err := io.ReadFull(c, hdr); err != nil {
		return err
	}
	if hdr[0] != 5 {
		return fmt.Errorf("not SOCKS5 (version %d)", hdr[0])
	}
	methods := make([]byte, hdr[1])
	if _, err := io.ReadFull(c, methods); err != nil {
		return err
	}
	want := byte(0)
	if s.User != "" {
		want = 2
	}
	ok := false
	for _, m := range methods {
		ok = ok || m == want
	}
	if !ok {
		c.Write([]byte{5, 0xff})
		return errors.New("client offers no acceptable auth method")
	}
	c.Write([]byte{5, want})
	if want == 2 {
		if err := s.auth(c); err != nil {
			return err
		}
	}
	req := make([]byte, 3)
	if _, err := io.ReadFull(c, req); err != nil {
		return err
	}
	host, port, err := readAddr(c)
	if err != nil {
		reply(c, repAddrUnsupp, netip.AddrPort{})
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	switch req[1] {
	case 1: // CONNECT
		ip, err := s.addr(ctx, host)
		if err != nil {
			reply(c, repHostUnreach, netip.AddrPort{})
			return err
		}
		out, err := s.DialTCP(ctx, netip.AddrPortFrom(ip, port))
		if err != nil {
			reply(c, repRefused, netip.AddrPort{})
			return err
		}
		la, _ := netip.ParseAddrPort(out.LocalAddr().String())
		reply(c, repOK, la)
		c.SetDeadline(time.Time{})
		relay.Splice(c, out)
		return nil
	case 3: // UDP ASSOCIATE
		return s.associate(c)
	default:
		reply(c, repCmdUnsupp, netip.AddrPort{})
		return fmt.Errorf("command %d not supported", req[1])
	}
}

func (s *Server) auth(c net.Conn) error {
	h := make([]byte, 2)
	if _, err := io.ReadFull(c, h); err != nil {
		return err
	}
	u := make([]byte, h[1])
	if _, err := io.ReadFull(c, u); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, h[:1]); err != nil {
		return err
	}
	p := make([]byte, h[0])
	if _, err := io.ReadFull(c, p); err != nil {
		return err
	}
	if subtle.ConstantTimeCompare(u, []byte(s.User)) != 1 || subtle.ConstantTimeCompare(p, []byte(s.Pass)) != 1 {
		c.Write([]byte{1, 1})
		return errors.New("bad credentials")
	}
	_, err := c.Write([]byte{1, 0})
	return err
}

func (s *Server) addr(ctx context.Context, host string) (netip.Addr, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		return ip, nil
	}
	if s.Resolve == nil {
		return netip.Addr{}, errors.New("no resolver")
	}
	return s.Resolve(ctx, host)
}

// readAddr reads ATYP + address + port.
func readAddr(r io.Reader) (string, uint16, error) {
	t := make([]byte, 1)
	if _, err := io.ReadFull(r, t); err != nil {
		return "", 0, err
	}
	var host string
	switch t[0] {
	case 1:
		b := make([]byte, 4)
		if _, err := io.ReadFull(r, b); err != nil {
			return "", 0, err
		}
		host = netip.AddrFrom4([4]byte(b)).String()
	case 4:
		b := make([]byte, 16)
		if _, err := io.ReadFull(r, b); err != nil {
			return "", 0, err
		}
		host = netip.AddrFrom16([16]byte(b)).String()
	case 3:
		if _, err := io.ReadFull(r, t); err != nil {
			return "", 0, err
		}
		b := make([]byte, t[0])
		if _, err := io.ReadFull(r, b); err != nil {
			return "", 0, err
		}
		host = string(b)
	default:
		return "", 0, fmt.Errorf("address type %d", t[0])
	}
	p := make([]byte, 2)
	if _, err := io.ReadFull(r, p); err != nil {
		return "", 0, err
	}
	return host, binary.BigEndian.Uint16(p), nil
}

func appendAddr(b []byte, ap netip.AddrPort) []byte {
	a := ap.Addr().Unmap()
	if a.Is6() {
		b = append(b, 4)
	} else {
		b = append(b, 1)
		if !a.IsValid() {
			a = netip.IPv4Unspecified()
		}
	}
	b = append(b, a.AsSlice()...)
	return binary.BigEndian.AppendUint16(b, ap.Port())
}

func reply(c net.Conn, code byte, bound netip.AddrPort) {
	c.Write(appendAddr([]byte{5, code, 0}, bound))
}

// associate relays the client's UDP datagrams (each with a SOCKS header)
// while the control connection stays open.
func (s *Server) associate(c net.Conn) error {
	la, _ := netip.ParseAddrPort(c.LocalAddr().String())
	pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(la.Addr(), 0)))
	if err != nil {
		reply(c, repFail, netip.AddrPort{})
		return err
	}
	defer pc.Close()
	reply(c, repOK, pc.LocalAddr().(*net.UDPAddr).AddrPort())
	c.SetDeadline(time.Time{})
	clientIP, _ := netip.ParseAddrPort(c.RemoteAddr().String())
	var mu sync.Mutex
	flows := map[netip.AddrPort]net.Conn{}
	var client netip.AddrPort
	defer func() {
		mu.Lock()
		for _, f := range flows {
			f.Close()
		}
		mu.Unlock()
	}()
	go func() {
		io.Copy(io.Discard, c) // the association ends with the TCP connection
		pc.Close()
	}()
	buf := make([]byte, 65535)
	for {
		n, from, err := pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			return nil
		}
		if from.Addr().Unmap() != clientIP.Addr().Unmap() || n < 4 || buf[2] != 0 {
			continue // not our client, or fragmented (unsupported)
		}
		r := &sliceReader{b: buf[3:n]}
		host, port, err := readAddr(r)
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		ip, err := s.addr(ctx, host)
		cancel()
		if err != nil {
			continue
		}
		dst := netip.AddrPortFrom(ip, port)
		mu.Lock()
		client = from
		f := flows[dst]
		if f == nil {
			if f, err = s.DialUDP(dst); err != nil {
				mu.Unlock()
				continue
			}
			flows[dst] = f
			go func() {
				rb := make([]byte, 65535)
				for {
					m, err := f.Read(rb)
					if err != nil {
						return
					}
					msg := appendAddr([]byte{0, 0, 0}, dst)
					mu.Lock()
					to := client
					mu.Unlock()
					pc.WriteToUDPAddrPort(append(msg, rb[:m]...), to)
				}
			}()
		}
		mu.Unlock()
		f.Write(r.b)
	}
}

type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// URL is the proxy URL programs understand (curl, git, pip: ALL_PROXY).
func URL(addr net.Addr, user, pass string) string {
	if user == "" {
		return "socks5h://" + addr.String()
	}
	return "socks5h://" + user + ":" + pass + "@" + addr.String()
}

var _ = strconv.Itoa
