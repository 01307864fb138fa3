package attack

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/lab/check/craft"
	"golang.org/x/sys/unix"
)

// ActSpec is one step of an attack or of its control, run as some user on
// some host: send Payload(Nonce) to Dst over a socket built from Sock.
type ActSpec struct {
	Sock
	Dst   string `json:"dst"`
	Nonce string `json:"nonce"`
	// Connect a datagram socket first (so ICMP errors surface).
	Connect bool `json:"connect,omitempty"`
	// ConnectFirst connects a datagram socket to this address before it
	// sends to Dst with sendto (a connection-time decision the socket
	// keeps: uvn's NAT mark); Disconnect then dissolves that connection
	// with connect(AF_UNSPEC) first.
	ConnectFirst string `json:"connect_first,omitempty"`
	Disconnect   bool   `json:"disconnect,omitempty"`
	// Count datagrams (default 1).
	Count int `json:"count,omitempty"`
	// Size pads each datagram to this many bytes (a datagram too large
	// for a stamp, or one that must be fragmented).
	Size int `json:"size,omitempty"`
	// GSO sends each datagram as one UDP_SEGMENT send of segments of this
	// many bytes (the nonce is in the first).
	GSO int `json:"gso,omitempty"`
	// Reply waits for the victim's echo.
	Reply bool `json:"reply,omitempty"`
	// WaitMS bounds connect and the wait for a reply (default 1500).
	WaitMS int `json:"wait_ms,omitempty"`
	// LoopMS repeats the step (a new socket each time) for this long,
	// every IntervalMS (default 50), each attempt with its own nonce
	// (Nonce + a counter); Loop prints a line per attempt.
	LoopMS     int `json:"loop_ms,omitempty"`
	IntervalMS int `json:"interval_ms,omitempty"`
	// WaitClose (streams with Reply) waits for the victim to close first.
	WaitClose bool `json:"wait_close,omitempty"`
	// SOCKS sends through a SOCKS5 proxy at this address (ssh -D).
	SOCKS string `json:"socks,omitempty"`
	// Raw crafts the packet by hand (root): Bind is the source address,
	// Dst the destination; Proto udp, udplite or tcp (a SYN carrying the
	// payload); the forged stamp claims StampUID/StampGID.
	Raw      bool   `json:"raw,omitempty"`
	Stamp    string `json:"stamp,omitempty"` // "", "v1"
	StampUID uint32 `json:"stamp_uid,omitempty"`
	StampGID uint32 `json:"stamp_gid,omitempty"`
	// PktInfo names the output device of an unconnected datagram in an
	// IP_PKTINFO / IPV6_PKTINFO control message (ipi_ifindex): the kernel
	// checks nothing for unprivileged senders.
	PktInfo string `json:"pktinfo,omitempty"`
	// Creds, for a step run as root: the ids the process takes before it
	// opens its socket (a root daemon acting for a user: real uid 0,
	// effective bob; or a set-uid-root program run by bob).
	Creds *Creds `json:"creds,omitempty"`
}

// Creds are the uids and gid a step takes with setresuid/setresgid.
type Creds struct {
	RUID, EUID, SUID int
	GID              int
}

// take sets the calling process's ids (every thread: syscall's versions).
func (c *Creds) take() error {
	if err := syscall.Setgroups([]int{c.GID}); err != nil {
		return at("setgroups", err)
	}
	if err := syscall.Setresgid(-1, c.GID, -1); err != nil {
		return at("setresgid", err)
	}
	if err := syscall.Setresuid(c.RUID, c.EUID, c.SUID); err != nil {
		return at("setresuid", err)
	}
	return nil
}

// ActResult is what an act reports.
type ActResult struct {
	OK    bool   `json:"ok"` // every step succeeded (for Reply: the echo came)
	Stage string `json:"stage,omitempty"`
	Errno string `json:"errno,omitempty"`
	Error string `json:"error,omitempty"`
	Local string `json:"local,omitempty"` // the socket's own address
	Reply bool   `json:"reply,omitempty"` // the echo of our nonce came back
	// PreBind is what the Sock's PreBind returned ("" = bound).
	PreBind string `json:"pre_bind,omitempty"`
}

// LoopLine is one attempt of a looping act.
type LoopLine struct {
	Nonce string `json:"nonce"`
	OK    bool   `json:"ok"`
	Errno string `json:"errno,omitempty"`
}

// Loop runs spec's step again and again for LoopMS, a line per attempt.
func Loop(spec ActSpec, out io.Writer) {
	enc := json.NewEncoder(out)
	iv := time.Duration(spec.IntervalMS) * time.Millisecond
	if iv <= 0 {
		iv = 50 * time.Millisecond
	}
	base := spec.Nonce
	end := time.Now().Add(time.Duration(spec.LoopMS) * time.Millisecond)
	for i := 0; time.Now().Before(end); i++ {
		t0 := time.Now()
		spec.Nonce = fmt.Sprintf("%s%06x", base, i)
		r := Act(spec)
		enc.Encode(LoopLine{Nonce: spec.Nonce, OK: r.OK, Errno: r.Errno})
		time.Sleep(iv - time.Since(t0))
	}
}

// Act runs spec and reports; it never panics on bad input.
func Act(spec ActSpec) ActResult {
	var r ActResult
	err := act(spec, &r)
	if err != nil {
		r.Error, r.Errno, r.Stage = err.Error(), Errno(err), Stage(err)
	} else {
		r.OK = true
	}
	return r
}

func (s ActSpec) wait() time.Duration {
	if s.WaitMS > 0 {
		return time.Duration(s.WaitMS) * time.Millisecond
	}
	return 1500 * time.Millisecond
}

func act(s ActSpec, r *ActResult) error {
	if s.Count <= 0 {
		s.Count = 1
	}
	if s.Creds != nil {
		if err := s.Creds.take(); err != nil {
			return err
		}
	}
	if s.Raw {
		return actRaw(s)
	}
	if s.SOCKS != "" {
		return actSOCKS(s, r)
	}
	fd, pre, err := bindSockPre(s.Sock)
	if pre != nil {
		r.PreBind = pre.Error()
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(int64(s.wait()))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	dst, err := sockaddr(s.Sock, s.Dst)
	if err != nil {
		return at("address", err)
	}
	if s.MD5Key != "" {
		if err := setMD5(fd, s.Sock, dst, s.MD5Key); err != nil {
			return err
		}
	}
	msg := Payload(s.Nonce)
	if len(msg) < s.Size {
		msg = append(msg, make([]byte, s.Size-len(msg))...)
	}
	if s.stream() {
		if s.FastOpen {
			// Data in the SYN (MSG_FASTOPEN connects and sends at once;
			// without a cookie the kernel sends a cookie request and the
			// data after the handshake).
			if err := sendtoFD(fd, msg, unix.MSG_FASTOPEN, dst); err != nil {
				return at("sendto(MSG_FASTOPEN)", err)
			}
		} else {
			if err := connectFD(fd, dst); err != nil {
				return at("connect", err)
			}
			if local, err := unix.Getsockname(fd); err == nil {
				r.Local = sockString(local)
			}
			if _, err := writeFD(fd, msg); err != nil {
				return at("send", err)
			}
		}
		if local, err := unix.Getsockname(fd); err == nil {
			r.Local = sockString(local)
		}
		if s.Reply {
			if err := readEcho(fd, s.Nonce, r); err != nil || !s.WaitClose {
				return err
			}
			b := make([]byte, 256)
			for {
				if n, err := readFD(fd, b); n <= 0 || err != nil {
					return nil
				}
			}
		}
		// Let the data leave before close (a reset could overtake it).
		unix.Shutdown(fd, unix.SHUT_WR)
		b := make([]byte, 256)
		readFD(fd, b)
		return nil
	}
	if s.Connect {
		if err := connectFD(fd, dst); err != nil {
			return at("connect", err)
		}
	}
	if s.ConnectFirst != "" {
		first, err := sockaddr(s.Sock, s.ConnectFirst)
		if err != nil {
			return at("address", err)
		}
		if err := connectFD(fd, first); err != nil {
			return at("connect", err)
		}
		if s.Disconnect {
			if err := disconnectFD(fd); err != nil {
				return at("connect(AF_UNSPEC)", err)
			}
		}
	}
	if s.GSO > 0 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_UDP, unix.UDP_SEGMENT, s.GSO); err != nil {
			return at("setsockopt(UDP_SEGMENT)", err)
		}
	}
	for i := 0; i < s.Count; i++ {
		switch {
		case s.Connect:
			_, err = writeFD(fd, msg)
		case s.PktInfo != "":
			err = sendPktInfo(fd, s, msg, dst)
		default:
			err = sendtoFD(fd, msg, 0, dst)
		}
		if err != nil {
			return at("send", err)
		}
	}
	if local, err := unix.Getsockname(fd); err == nil {
		r.Local = sockString(local)
	}
	if s.Reply {
		return readEcho(fd, s.Nonce, r)
	}
	if s.Connect {
		// A refusal by ICMP surfaces on the connected socket: wait for it
		// briefly (a short read that ends at the first error).
		tv := unix.NsecToTimeval(int64(200 * time.Millisecond))
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		b := make([]byte, 512)
		if _, err := readFD(fd, b); err != nil && err != unix.EAGAIN {
			return at("recv", err)
		}
	}
	return nil
}

// sendPktInfo sends msg to dst with the output device s.PktInfo named in
// a control message.
func sendPktInfo(fd int, s ActSpec, msg []byte, dst unix.Sockaddr) error {
	ifi, err := net.InterfaceByName(s.PktInfo)
	if err != nil {
		return at("pktinfo", err)
	}
	var oob []byte
	if s.Family == 6 {
		oob = unix.PktInfo6(&unix.Inet6Pktinfo{Ifindex: uint32(ifi.Index)})
	} else {
		oob = unix.PktInfo4(&unix.Inet4Pktinfo{Ifindex: int32(ifi.Index)})
	}
	for {
		err := unix.Sendmsg(fd, msg, oob, dst, 0)
		if err != unix.EINTR {
			return err
		}
	}
}

func readEcho(fd int, nonce string, r *ActResult) error {
	b := make([]byte, 2048)
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		n, err := readFD(fd, b)
		if err != nil {
			return at("recv", err)
		}
		if n == 0 {
			return at("recv", errors.New("closed without a reply"))
		}
		for _, nc := range nonces(b[:n]) {
			if nc == nonce {
				r.Reply = true
				return nil
			}
		}
	}
	return at("recv", errors.New("no reply"))
}

// setMD5 installs a TCP-MD5 key for the destination: the option takes 18
// bytes of the SYN's 40 (what a user can do to crowd out other options).
func setMD5(fd int, s Sock, dst unix.Sockaddr, key string) error {
	// struct tcp_md5sig: sockaddr_storage (128), flags u8, prefixlen u8,
	// keylen u16, ifindex i32, key[80].
	var b [128 + 8 + 80]byte
	switch a := dst.(type) {
	case *unix.SockaddrInet4:
		binary.LittleEndian.PutUint16(b[0:], unix.AF_INET)
		copy(b[4:8], a.Addr[:])
	case *unix.SockaddrInet6:
		binary.LittleEndian.PutUint16(b[0:], unix.AF_INET6)
		copy(b[8:24], a.Addr[:])
	default:
		return at("TCP_MD5SIG", errors.New("not an inet address"))
	}
	binary.LittleEndian.PutUint16(b[130:], uint16(len(key)))
	copy(b[136:], key)
	return at("TCP_MD5SIG", unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_MD5SIG, string(b[:])))
}

func actRaw(s ActSpec) error {
	src, err := netip.ParseAddrPort(s.Bind)
	if err != nil {
		return at("address", err)
	}
	dst, err := netip.ParseAddrPort(s.Dst)
	if err != nil {
		return at("address", err)
	}
	p := craft.Packet{Src: src, Dst: dst, Payload: Payload(s.Nonce)}
	switch s.Proto {
	case "udp":
		p.Proto = craft.UDP
	case "udplite":
		p.Proto = craft.UDPLite
	case "tcp":
		p.Proto = craft.TCP
		p.Seq = 0x5041_4c00
		p.TCPOptions = []byte{2, 4, 0x05, 0xb4} // MSS 1460
	default:
		return at("craft", fmt.Errorf("raw %s not supported", s.Proto))
	}
	if s.Stamp == "v1" {
		switch {
		case p.Proto == craft.TCP:
			p.TCPOptions = append(p.TCPOptions, craft.StampV1TCP(s.StampUID, s.StampGID)...)
		case src.Addr().Unmap().Is4():
			p.IPOptions = craft.StampV1IPv4(s.StampUID, s.StampGID)
		default:
			p.DstOptions = craft.StampV1IPv6(s.StampUID, s.StampGID)
		}
	} else if s.IPOptions != "" {
		p.IPOptions, _ = hex.DecodeString(s.IPOptions)
	}
	for i := 0; i < s.Count; i++ {
		if err := craft.Send(p); err != nil {
			return at("send", err)
		}
	}
	return nil
}

// actSOCKS connects to Dst through a SOCKS5 proxy (RFC 1928, no
// authentication, CONNECT) and sends the payload.
func actSOCKS(s ActSpec, r *ActResult) error {
	c, err := net.DialTimeout("tcp", s.SOCKS, s.wait())
	if err != nil {
		return at("connect proxy", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	dst, err := netip.ParseAddrPort(s.Dst)
	if err != nil {
		return at("address", err)
	}
	req := []byte{5, 1, 0}
	if _, err := c.Write(req); err != nil {
		return at("socks", err)
	}
	b := make([]byte, 512)
	if n, err := c.Read(b); err != nil || n < 2 || b[1] != 0 {
		return at("socks", fmt.Errorf("method refused (%v)", err))
	}
	a := dst.Addr().Unmap()
	req = []byte{5, 1, 0, 1}
	if a.Is6() {
		req[3] = 4
	}
	req = append(append(req, a.AsSlice()...), byte(dst.Port()>>8), byte(dst.Port()))
	if _, err := c.Write(req); err != nil {
		return at("socks", err)
	}
	n, err := c.Read(b)
	if err != nil || n < 2 {
		return at("socks connect", fmt.Errorf("no answer (%v)", err))
	}
	if b[1] != 0 {
		return at("socks connect", fmt.Errorf("refused: SOCKS reply %d", b[1]))
	}
	if _, err := c.Write(Payload(s.Nonce)); err != nil {
		return at("send", err)
	}
	if s.Reply {
		for {
			n, err := c.Read(b)
			if err != nil {
				return at("recv", err)
			}
			for _, nc := range nonces(b[:n]) {
				if nc == s.Nonce {
					r.Reply = true
					return nil
				}
			}
		}
	}
	c.(*net.TCPConn).CloseWrite()
	c.Read(b)
	return nil
}
