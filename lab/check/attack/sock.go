// Package attack is Palisade's attack suite (`palisade-lab check --attacks`) and
// churn test (`palisade-lab check --churn`): real attacks by the testbed's users
// (and by root on the outside host) against another user's listeners, each
// with a positive control proving that the same path delivers for the
// rightful user. A case passes only when the victim's socket received none
// of the attack's nonce-tagged payloads and did receive its control's.
//
// This file and sink.go/act.go are the node side: `palisade-lab probe sink`
// (the victim: binds one socket as asked and reports every nonce it
// receives) and `palisade-lab probe act` (one attacker or control step). They
// use raw system calls because the suite needs sockets the net package does
// not make: UDP-Lite, MPTCP, device-bound, co-bound, with IP options.
package attack

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Sock is the socket a sink or an act creates.
type Sock struct {
	// Proto: tcp, mptcp, sctp, dccp, udp, udplite, unix-stream, unix-dgram.
	Proto  string `json:"proto"`
	Family int    `json:"family,omitempty"` // 4 or 6 (inet protocols)
	// Bind is addr:port ("[fe80::1%eth0]:5000" for a link-local address),
	// or for unix sockets the abstract name (without the leading NUL).
	Bind   string `json:"bind,omitempty"`
	Dual   bool   `json:"dual,omitempty"` // IPv6 socket that also takes IPv4 (v4-mapped)
	Device string `json:"device,omitempty"`
	// DeviceOpt is the option that sets Device: SO_BINDTODEVICE (default),
	// SO_BINDTODEVICE_LONG (its name in an 8 KiB buffer), SO_BINDTOIFINDEX,
	// IP_UNICAST_IF or IPV6_UNICAST_IF.
	DeviceOpt string `json:"device_opt,omitempty"`
	// PreBind is bound first and its failure ignored: bind() to a scoped
	// link-local address sets the socket's device from sin6_scope_id
	// before the address check fails (EADDRNOTAVAIL) and does not undo
	// it, so a failed bind can still move a socket into another device.
	PreBind   string `json:"pre_bind,omitempty"`
	ReuseAddr bool   `json:"reuseaddr,omitempty"`
	ReusePort bool   `json:"reuseport,omitempty"`
	FastOpen  bool   `json:"fastopen,omitempty"`
	// IPOptions (hex) are set with IP_OPTIONS, DstOpts (hex) with
	// IPV6_DSTOPTS: what an unprivileged user may try to forge a stamp.
	IPOptions string `json:"ip_options,omitempty"`
	DstOpts   string `json:"dstopts,omitempty"`
	// MD5Key sets TCP_MD5SIG for the destination (option space filler).
	MD5Key string `json:"md5,omitempty"`
	// Join lists multicast groups to join, "group%ifname".
	Join        []string `json:"join,omitempty"`
	Broadcast   bool     `json:"broadcast,omitempty"`
	MulticastIf string   `json:"mcast_if,omitempty"`
	// FreeBind sets IP_FREEBIND: bind (and, for IPv6, send from) an
	// address that is not the node's (unprivileged).
	FreeBind bool `json:"freebind,omitempty"`
	// FreeBindOff clears IP_FREEBIND again once bound: the kernel checks
	// the flag at bind time only, so the socket keeps its foreign source.
	FreeBindOff bool `json:"freebind_off,omitempty"`
	// IncomingCPU sets SO_INCOMING_CPU to this CPU + 1 (0: unset): a
	// socket whose incoming CPU is the receiving CPU scores one more in
	// the kernel's UDP lookup (unprivileged).
	IncomingCPU int `json:"incoming_cpu,omitempty"`
	// LocalPort narrows the socket's ephemeral range to this one port
	// (IP_LOCAL_PORT_RANGE, Linux 6.3, unprivileged): the port the kernel
	// picks at bind(port 0) or autobind.
	LocalPort int `json:"local_port,omitempty"`
}

const (
	ipprotoMPTCP   = 262
	ipprotoUDPLite = 136
	ipprotoSCTP    = 132
	ipprotoDCCP    = 33
	sockDCCP       = 6
)

// stageErr names the system call that failed.
type stageErr struct {
	stage string
	err   error
}

func (e *stageErr) Error() string { return e.stage + ": " + e.err.Error() }
func (e *stageErr) Unwrap() error { return e.err }

func at(stage string, err error) error {
	if err == nil {
		return nil
	}
	return &stageErr{stage, err}
}

// Errno names the errno inside err ("EPERM"), or "".
func Errno(err error) string {
	var e syscall.Errno
	if errors.As(err, &e) {
		if n := unix.ErrnoName(e); n != "" {
			return n
		}
		return strconv.Itoa(int(e))
	}
	return ""
}

// Stage names the failing call of err ("bind"), or "".
func Stage(err error) string {
	var s *stageErr
	if errors.As(err, &s) {
		return s.stage
	}
	return ""
}

func (s Sock) stream() bool {
	switch s.Proto {
	case "tcp", "mptcp", "sctp", "dccp", "unix-stream":
		return true
	}
	return false
}

func (s Sock) unix() bool { return strings.HasPrefix(s.Proto, "unix-") }

// open creates and configures the socket (not bound).
func (s Sock) open() (int, error) {
	dom := unix.AF_INET
	if s.Family == 6 {
		dom = unix.AF_INET6
	}
	typ, proto := unix.SOCK_DGRAM, 0
	switch s.Proto {
	case "tcp":
		typ = unix.SOCK_STREAM
	case "mptcp":
		typ, proto = unix.SOCK_STREAM, ipprotoMPTCP
	case "sctp":
		typ, proto = unix.SOCK_STREAM, ipprotoSCTP
	case "dccp":
		typ, proto = sockDCCP, ipprotoDCCP
	case "udp":
	case "udplite":
		proto = ipprotoUDPLite
	case "unix-stream":
		dom, typ = unix.AF_UNIX, unix.SOCK_STREAM
	case "unix-dgram":
		dom = unix.AF_UNIX
	default:
		return -1, fmt.Errorf("unknown protocol %q", s.Proto)
	}
	fd, err := unix.Socket(dom, typ|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return -1, at("socket", err)
	}
	fail := func(stage string, err error) (int, error) {
		unix.Close(fd)
		return -1, at(stage, err)
	}
	if s.unix() {
		return fd, nil
	}
	if s.Family == 6 {
		v6only := 1
		if s.Dual {
			v6only = 0
		}
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, v6only); err != nil {
			return fail("IPV6_V6ONLY", err)
		}
	}
	if s.ReuseAddr {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return fail("SO_REUSEADDR", err)
		}
	}
	if s.ReusePort {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return fail("SO_REUSEPORT", err)
		}
	}
	if s.FreeBind {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_FREEBIND, 1); err != nil {
			return fail("IP_FREEBIND", err)
		}
	}
	if s.IncomingCPU > 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_INCOMING_CPU, s.IncomingCPU-1); err != nil {
			return fail("SO_INCOMING_CPU", err)
		}
	}
	if s.LocalPort > 0 {
		const ipLocalPortRange = 51
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, ipLocalPortRange, s.LocalPort|s.LocalPort<<16); err != nil {
			return fail("IP_LOCAL_PORT_RANGE", err)
		}
	}
	if s.Broadcast {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BROADCAST, 1); err != nil {
			return fail("SO_BROADCAST", err)
		}
	}
	if s.Device != "" {
		if err := setDevice(fd, s.DeviceOpt, s.Device); err != nil {
			return fail(deviceOpt(s.DeviceOpt), err)
		}
	}
	if s.IPOptions != "" {
		b, err := hex.DecodeString(s.IPOptions)
		if err != nil {
			return fail("IP_OPTIONS", err)
		}
		if err := unix.SetsockoptString(fd, unix.IPPROTO_IP, unix.IP_OPTIONS, string(b)); err != nil {
			return fail("IP_OPTIONS", err)
		}
	}
	if s.DstOpts != "" {
		b, err := hex.DecodeString(s.DstOpts)
		if err != nil {
			return fail("IPV6_DSTOPTS", err)
		}
		if err := unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, string(b)); err != nil {
			return fail("IPV6_DSTOPTS", err)
		}
	}
	if s.MulticastIf != "" {
		ifi, err := net.InterfaceByName(s.MulticastIf)
		if err != nil {
			return fail("IP_MULTICAST_IF", err)
		}
		if s.Family == 6 {
			err = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_MULTICAST_IF, ifi.Index)
		} else {
			err = unix.SetsockoptIPMreqn(fd, unix.IPPROTO_IP, unix.IP_MULTICAST_IF, &unix.IPMreqn{Ifindex: int32(ifi.Index)})
		}
		if err != nil {
			return fail("IP_MULTICAST_IF", err)
		}
	}
	if s.FastOpen && s.Bind != "" {
		// A listener: accept data in the SYN (qlen 16).
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_FASTOPEN, 16); err != nil {
			return fail("TCP_FASTOPEN", err)
		}
	}
	return fd, nil
}

func deviceOpt(opt string) string {
	if opt == "" {
		return "SO_BINDTODEVICE"
	}
	return opt
}

// setDevice ties fd to the device dev with the option opt.
func setDevice(fd int, opt, dev string) error {
	if deviceOpt(opt) == "SO_BINDTODEVICE" {
		return unix.BindToDevice(fd, dev)
	}
	ifi, err := net.InterfaceByName(dev)
	if err != nil {
		return err
	}
	switch opt {
	case "SO_BINDTODEVICE_LONG":
		// The name in a buffer longer than a page: a cgroup setsockopt
		// program sees only the first page of it.
		b := make([]byte, 8192)
		copy(b, dev)
		return unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, string(b))
	case "SO_BINDTOIFINDEX":
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX, ifi.Index)
	case "IP_UNICAST_IF", "IPV6_UNICAST_IF":
		// The index in network byte order (both options, see ip(7)).
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], uint32(ifi.Index))
		level, name := unix.IPPROTO_IP, unix.IP_UNICAST_IF
		if opt == "IPV6_UNICAST_IF" {
			level, name = unix.IPPROTO_IPV6, unix.IPV6_UNICAST_IF
		}
		return unix.SetsockoptInt(fd, level, name, int(binary.NativeEndian.Uint32(b[:])))
	}
	return fmt.Errorf("unknown device option %q", opt)
}

// sockaddr turns "addr:port" (zones allowed) or an abstract unix name into
// a socket address for a socket of family fam.
func sockaddr(s Sock, addr string) (unix.Sockaddr, error) {
	if s.unix() {
		return &unix.SockaddrUnix{Name: "@" + addr}, nil
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	a := ap.Addr()
	if s.Family != 6 {
		if !a.Unmap().Is4() {
			return nil, fmt.Errorf("%s: not an IPv4 address", addr)
		}
		return &unix.SockaddrInet4{Addr: a.Unmap().As4(), Port: int(ap.Port())}, nil
	}
	sa := &unix.SockaddrInet6{Addr: a.As16(), Port: int(ap.Port())}
	if z := a.Zone(); z != "" {
		ifi, err := net.InterfaceByName(z)
		if err != nil {
			return nil, err
		}
		sa.ZoneId = uint32(ifi.Index)
	}
	return sa, nil
}

func sockString(sa unix.Sockaddr) string {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		ip := netip.AddrFrom16(a.Addr)
		if a.ZoneId != 0 {
			if ifi, err := net.InterfaceByIndex(int(a.ZoneId)); err == nil {
				ip = ip.WithZone(ifi.Name)
			}
		}
		return netip.AddrPortFrom(ip, uint16(a.Port)).String()
	case *unix.SockaddrUnix:
		return a.Name
	}
	return ""
}

// join subscribes fd to the multicast groups "group%ifname".
func join(fd int, s Sock) error {
	for _, g := range s.Join {
		grp, ifname, _ := strings.Cut(g, "%")
		ip, err := netip.ParseAddr(grp)
		if err != nil {
			return at("join", err)
		}
		idx := 0
		if ifname != "" {
			ifi, err := net.InterfaceByName(ifname)
			if err != nil {
				return at("join", err)
			}
			idx = ifi.Index
		}
		if ip.Is4() {
			err = unix.SetsockoptIPMreqn(fd, unix.IPPROTO_IP, unix.IP_ADD_MEMBERSHIP,
				&unix.IPMreqn{Multiaddr: ip.As4(), Ifindex: int32(idx)})
		} else {
			err = unix.SetsockoptIPv6Mreq(fd, unix.IPPROTO_IPV6, unix.IPV6_JOIN_GROUP,
				&unix.IPv6Mreq{Multiaddr: ip.As16(), Interface: uint32(idx)})
		}
		if err != nil {
			return at("join "+g, err)
		}
	}
	return nil
}

// Payloads carry "PALATK <nonce>": the victim reports every nonce it sees,
// wherever it sits in what arrived (a TFO SYN's data, a SOCKS stream...).
const tag = "PALATK "

var nonceRE = regexp.MustCompile(`PALATK ([0-9a-f]{4,32})`)

// Payload is what an act sends for nonce.
func Payload(nonce string) []byte { return []byte(tag + nonce + "\n") }

func nonces(b []byte) []string {
	var out []string
	for _, m := range nonceRE.FindAllSubmatch(b, -1) {
		out = append(out, string(m[1]))
	}
	return out
}

// Go's runtime preempts goroutines with a signal (SIGURG): a blocking
// system call made directly can fail with EINTR at any time. These retry
// it, so that a signal is never mistaken for a refusal.

func readFD(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Read(fd, b)
		if err != unix.EINTR {
			return n, err
		}
	}
}

func writeFD(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Write(fd, b)
		if err != unix.EINTR {
			return n, err
		}
	}
}

func sendtoFD(fd int, b []byte, flags int, to unix.Sockaddr) error {
	for {
		err := unix.Sendto(fd, b, flags, to)
		if err != unix.EINTR {
			return err
		}
		if flags&unix.MSG_FASTOPEN != 0 {
			// The connection attempt goes on: wait for it, then send
			// (a duplicate nonce is harmless).
			if err := awaitConnect(fd); err != nil {
				return err
			}
			_, err := writeFD(fd, b)
			return err
		}
	}
}

// connectFD connects; after EINTR the attempt goes on in the kernel, so it
// waits for the outcome (bounded by the socket's send timeout).
// disconnectFD dissolves a datagram socket's connection: connect() with
// an address of family AF_UNSPEC (x/sys/unix has no such Sockaddr).
func disconnectFD(fd int) error {
	var sa [16]byte // sa_family 0: AF_UNSPEC
	_, _, e := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa[0])), uintptr(len(sa)))
	if e != 0 {
		return e
	}
	return nil
}

func connectFD(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err != unix.EINTR {
		return err
	}
	return awaitConnect(fd)
}

func awaitConnect(fd int) error {
	tv, err := unix.GetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO)
	ms := 2000
	if err == nil && tv.Nano() > 0 {
		ms = int(tv.Nano() / 1e6)
	}
	deadline := time.Now().Add(time.Duration(ms) * time.Millisecond)
	for {
		left := int(time.Until(deadline) / time.Millisecond)
		if left <= 0 {
			return unix.ETIMEDOUT
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(pfd, left)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return unix.ETIMEDOUT
		}
		v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if v != 0 {
			return syscall.Errno(v)
		}
		return nil
	}
}
