package fuzz

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/palisade-hpc/palisade/lab/check/attack"
	"golang.org/x/sys/unix"
)

// This file is the node side: `palisade-lab probe fuzz` runs a program's
// steps with raw system calls, as whoever started it, and reports what
// each call returned. Every send carries "PALATK <nonce>" lines (the
// sentinels' tag), the nonce naming the program run and the step.

// StepResult is what one step returned.
type StepResult struct {
	I     int    `json:"i"`
	Peer  bool   `json:"peer,omitempty"`
	OK    bool   `json:"ok"`
	Errno string `json:"errno,omitempty"`
	Nonce string `json:"nonce,omitempty"` // sends
	// Local is the socket's own address after the step (bind, connect,
	// sends): bytes that reach a sentinel without a whole nonce line are
	// attributed by it.
	Local string `json:"local,omitempty"`
}

// ExecResult is a program run's report (one JSON line on stdout).
type ExecResult struct {
	Type  string       `json:"type"` // "ready" (a peer, listening), "done"
	Steps []StepResult `json:"steps,omitempty"`
	Error string       `json:"error,omitempty"`
}

// Nonce is the nonce of step i of the run with prefix (peer steps: i+0x8000).
func Nonce(prefix string, i int, peer bool) string {
	if peer {
		i += 0x8000
	}
	return fmt.Sprintf("%s%04x", prefix, i)
}

// ConnectWait bounds a non-blocking connect (and a Fast Open send) so that
// a silently dropped SYN costs a program little (`probe fuzz --wait`; the
// runner gives more under emulation).
var ConnectWait = 700 * time.Millisecond

// peerName is the abstract Unix socket the peer of run prefix listens on.
func peerName(prefix string) string { return "@palfuzz-" + prefix }

// Exec runs steps (the main process of a run; peer: the socket it hands
// sockets to, "" if none) and writes an ExecResult line.
func Exec(steps []Step, prefix string, withPeer bool, out io.Writer) {
	x := &executor{prefix: prefix, slots: map[int]int{}, peerFD: -1, withPeer: withPeer}
	for i, s := range steps {
		x.res = append(x.res, x.step(i, s, false))
	}
	x.finish()
	json.NewEncoder(out).Encode(ExecResult{Type: "done", Steps: x.res})
}

// ExecPeer is the peer of a run: it listens, prints a ready line, takes
// every socket the main process passes until it hangs up, then runs steps
// on them (slot k = the k-th socket received).
func ExecPeer(steps []Step, prefix string, out io.Writer) {
	enc := json.NewEncoder(out)
	ln, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Bind(ln, &unix.SockaddrUnix{Name: peerName(prefix)})
	}
	if err == nil {
		err = unix.Listen(ln, 1)
	}
	if err != nil {
		enc.Encode(ExecResult{Type: "error", Error: err.Error()})
		return
	}
	enc.Encode(ExecResult{Type: "ready"})
	x := &executor{prefix: prefix, slots: map[int]int{}, peerFD: -1}
	tv := unix.NsecToTimeval(int64(20 * time.Second))
	unix.SetsockoptTimeval(ln, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	c, _, err := accept(ln)
	if err == nil {
		unix.SetsockoptTimeval(c, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		for {
			b, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4*4))
			n, oobn, _, _, err := unix.Recvmsg(c, b, oob, 0)
			if err == unix.EINTR {
				continue
			}
			if err != nil || n == 0 {
				break
			}
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				fds, _ := unix.ParseUnixRights(&m)
				for _, fd := range fds {
					x.slots[len(x.slots)] = fd
				}
			}
		}
		unix.Close(c)
	}
	for i, s := range steps {
		x.res = append(x.res, x.step(i, s, true))
	}
	x.finish()
	enc.Encode(ExecResult{Type: "done", Steps: x.res})
}

func sockString(sa unix.Sockaddr) string {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)).String()
	}
	return ""
}

func accept(fd int) (int, unix.Sockaddr, error) {
	for {
		c, sa, err := unix.Accept4(fd, unix.SOCK_CLOEXEC)
		if err != unix.EINTR {
			return c, sa, err
		}
	}
}

type executor struct {
	prefix   string
	slots    map[int]int
	peerFD   int
	withPeer bool
	res      []StepResult
}

func (x *executor) step(i int, s Step, peer bool) StepResult {
	r := StepResult{I: i, Peer: peer}
	if s.sends() {
		r.Nonce = Nonce(x.prefix, i, peer)
	}
	err := x.do(s, r.Nonce)
	r.OK = err == nil
	switch s.Op {
	case "bind", "connect", "send", "sendto", "sendmsg":
		if fd, ok := x.slots[s.S]; ok {
			if sa, err := unix.Getsockname(fd); err == nil {
				r.Local = sockString(sa)
			}
		}
	}
	if err != nil {
		r.Errno = attack.Errno(err)
		if r.Errno == "" {
			r.Errno = err.Error()
		}
	}
	return r
}

var errNoSocket = unix.EBADF

func (x *executor) fd(s Step) (int, error) {
	fd, ok := x.slots[s.S]
	if !ok {
		return -1, errNoSocket
	}
	return fd, nil
}

func (x *executor) do(s Step, nonce string) error {
	if s.Op == "socket" {
		if old, ok := x.slots[s.S]; ok {
			unix.Close(old)
			delete(x.slots, s.S)
		}
		fd, err := openSocket(s.Fam, s.Proto)
		if err == nil {
			x.slots[s.S] = fd
		}
		return err
	}
	fd, err := x.fd(s)
	if err != nil {
		return err
	}
	switch s.Op {
	case "setsockopt":
		return setOpt(fd, s.Opt, s.Val)
	case "bind":
		sa, err := toSockaddr(fd, s.Addr)
		if err != nil {
			return err
		}
		return unix.Bind(fd, sa)
	case "connect":
		sa, err := toSockaddr(fd, s.Addr)
		if err != nil {
			return err
		}
		return connect(fd, sa)
	case "listen":
		return unix.Listen(fd, 16)
	case "accept":
		c, _, err := unix.Accept4(fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err == nil {
			unix.Close(c)
		}
		return err
	case "shutdown":
		return unix.Shutdown(fd, unix.SHUT_WR)
	case "close":
		delete(x.slots, s.S)
		return unix.Close(fd)
	case "recv":
		b := make([]byte, 2048)
		_, _, err := unix.Recvfrom(fd, b, unix.MSG_DONTWAIT)
		return err
	case "passfd":
		return x.passFD(fd)
	case "send", "sendto", "sendmsg":
		return x.send(fd, s, payload(nonce, s.Size))
	}
	return fmt.Errorf("unknown op %q", s.Op)
}

// payload is size bytes of "PALATK <nonce>\n" lines (at least one): every
// segment a GSO send or a fragmenting stack cuts out of it still holds a
// whole nonce line.
func payload(nonce string, size int) []byte {
	line := attack.Payload(nonce)
	b := append([]byte(nil), line...)
	for len(b)+len(line) <= size {
		b = append(b, line...)
	}
	return b
}

func (x *executor) passFD(fd int) error {
	if !x.withPeer {
		return unix.ENOTCONN
	}
	if x.peerFD < 0 {
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		if err := unix.Connect(c, &unix.SockaddrUnix{Name: peerName(x.prefix)}); err != nil {
			unix.Close(c)
			return err
		}
		x.peerFD = c
	}
	return unix.Sendmsg(x.peerFD, []byte{1}, unix.UnixRights(fd), nil, 0)
}

func (x *executor) send(fd int, s Step, msg []byte) error {
	flags := 0
	for _, f := range s.Flags {
		v, ok := msgFlags[f]
		if !ok {
			return fmt.Errorf("unknown flag %s", f)
		}
		flags |= v
	}
	var sa unix.Sockaddr
	if s.Addr != "" && s.Op != "send" {
		var err error
		if sa, err = toSockaddr(fd, s.Addr); err != nil {
			return err
		}
	}
	var oob []byte
	for _, c := range s.Cmsgs {
		b, err := cmsg(c)
		if err != nil {
			return err
		}
		oob = append(oob, b...)
	}
	for {
		var err error
		switch {
		case s.Op == "send":
			_, err = unix.SendmsgN(fd, msg, nil, nil, flags)
		case s.Op == "sendto":
			err = unix.Sendto(fd, msg, flags, sa)
		default:
			_, err = unix.SendmsgN(fd, msg, oob, sa, flags)
		}
		if err == unix.EINTR {
			continue
		}
		if err == unix.EINPROGRESS && flags&unix.MSG_FASTOPEN != 0 {
			// Fast Open without a cookie: the data follows the handshake.
			if err := waitConnected(fd); err != nil {
				return err
			}
			_, err = unix.SendmsgN(fd, msg, nil, nil, 0)
			return err
		}
		if err == unix.EAGAIN {
			// A stream still connecting (or a full buffer): wait once.
			if werr := waitConnected(fd); werr != nil {
				return werr
			}
			_, err = unix.SendmsgN(fd, msg, oob, nil, flags&^unix.MSG_FASTOPEN)
		}
		return err
	}
}

// finish lets streams deliver what they sent before everything is closed
// (a close with unread data would reset the connection first).
func (x *executor) finish() {
	for _, fd := range x.slots {
		unix.Shutdown(fd, unix.SHUT_WR)
	}
	deadline := time.Now().Add(200 * time.Millisecond)
	b := make([]byte, 4096)
	for _, fd := range x.slots {
		for time.Now().Before(deadline) {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(pfd, int(time.Until(deadline)/time.Millisecond)+1)
			if err == unix.EINTR {
				continue
			}
			if n <= 0 || err != nil {
				break
			}
			if n, err := unix.Read(fd, b); n <= 0 && err != unix.EINTR && err != unix.EAGAIN {
				break
			}
		}
		unix.Close(fd)
	}
	if x.peerFD >= 0 {
		unix.Close(x.peerFD)
	}
}

const (
	ipprotoMPTCP   = 262
	ipprotoUDPLite = 136
	ipprotoSCTP    = 132
	ipprotoDCCP    = 33
	sockDCCP       = 6
)

func openSocket(fam int, proto string) (int, error) {
	dom := unix.AF_INET
	if fam == 6 {
		dom = unix.AF_INET6
	}
	typ, pr := unix.SOCK_DGRAM, 0
	switch proto {
	case "tcp":
		typ = unix.SOCK_STREAM
	case "mptcp":
		typ, pr = unix.SOCK_STREAM, ipprotoMPTCP
	case "sctp":
		typ, pr = unix.SOCK_STREAM, ipprotoSCTP
	case "sctp-seq":
		typ, pr = unix.SOCK_SEQPACKET, ipprotoSCTP
	case "dccp":
		typ, pr = sockDCCP, ipprotoDCCP
	case "udp":
	case "udplite":
		pr = ipprotoUDPLite
	default:
		return -1, fmt.Errorf("unknown protocol %q", proto)
	}
	return unix.Socket(dom, typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, pr)
}

func connect(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err == unix.EINPROGRESS || err == unix.EINTR {
		return waitConnected(fd)
	}
	return err
}

func waitConnected(fd int) error {
	deadline := time.Now().Add(ConnectWait)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return unix.ETIMEDOUT
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(pfd, int(left/time.Millisecond)+1)
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

// toSockaddr parses "addr:port" for fd's family: an IPv4 address on an
// IPv6 socket becomes v4-mapped; a zone is resolved to its ifindex.
func toSockaddr(fd int, addr string) (unix.Sockaddr, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, unix.EINVAL
	}
	dom, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	a := ap.Addr()
	if dom == unix.AF_INET {
		if !a.Unmap().Is4() {
			return nil, unix.EAFNOSUPPORT
		}
		return &unix.SockaddrInet4{Addr: a.Unmap().As4(), Port: int(ap.Port())}, nil
	}
	sa := &unix.SockaddrInet6{Addr: a.As16(), Port: int(ap.Port())}
	if z := a.Zone(); z != "" {
		idx, err := ifindex(z)
		if err != nil {
			return nil, err
		}
		sa.ZoneId = uint32(idx)
	}
	return sa, nil
}

func ifindex(name string) (int, error) {
	if i, err := strconv.Atoi(name); err == nil {
		return i, nil
	}
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return 0, unix.ENODEV
	}
	return ifi.Index, nil
}

var msgFlags = map[string]int{
	"MSG_FASTOPEN": unix.MSG_FASTOPEN, "MSG_ZEROCOPY": unix.MSG_ZEROCOPY, "MSG_DONTROUTE": unix.MSG_DONTROUTE,
	"MSG_CONFIRM": unix.MSG_CONFIRM, "MSG_MORE": unix.MSG_MORE, "MSG_OOB": unix.MSG_OOB, "MSG_EOR": unix.MSG_EOR,
}

// optKind says how an option's value is encoded.
type optKind int

const (
	kInt      optKind = iota // a C int
	kDev                     // an interface name (string)
	kIfindex                 // an interface's index (int)
	kIfindexN                // an interface's index in network byte order (IP_UNICAST_IF)
	kMreqn                   // struct ip_mreqn with an ifindex (IP_MULTICAST_IF)
	kHex                     // raw bytes
	kJoin                    // "group%if": IP_ADD_MEMBERSHIP / IPV6_JOIN_GROUP
)

type optDef struct {
	level, name int
	kind        optKind
}

// options are the socket options the generator draws from: every one an
// unprivileged user may set that bears on where a packet goes, what it
// claims or how it is built — and a few that must be refused
// (IP_TRANSPARENT, SO_MARK, TCP_REPAIR need CAP_NET_ADMIN/RAW).
var options = map[string]optDef{
	"SO_REUSEADDR":            {unix.SOL_SOCKET, unix.SO_REUSEADDR, kInt},
	"SO_REUSEPORT":            {unix.SOL_SOCKET, unix.SO_REUSEPORT, kInt},
	"SO_BROADCAST":            {unix.SOL_SOCKET, unix.SO_BROADCAST, kInt},
	"SO_BINDTODEVICE":         {unix.SOL_SOCKET, unix.SO_BINDTODEVICE, kDev},
	"SO_BINDTOIFINDEX":        {unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX, kIfindex},
	"SO_DONTROUTE":            {unix.SOL_SOCKET, unix.SO_DONTROUTE, kInt},
	"SO_PRIORITY":             {unix.SOL_SOCKET, unix.SO_PRIORITY, kInt},
	"SO_MARK":                 {unix.SOL_SOCKET, unix.SO_MARK, kInt},
	"SO_ZEROCOPY":             {unix.SOL_SOCKET, unix.SO_ZEROCOPY, kInt},
	"SO_NO_CHECK":             {unix.SOL_SOCKET, unix.SO_NO_CHECK, kInt},
	"IP_FREEBIND":             {unix.IPPROTO_IP, unix.IP_FREEBIND, kInt},
	"IP_TRANSPARENT":          {unix.IPPROTO_IP, unix.IP_TRANSPARENT, kInt},
	"IP_UNICAST_IF":           {unix.IPPROTO_IP, unix.IP_UNICAST_IF, kIfindexN},
	"IP_MULTICAST_IF":         {unix.IPPROTO_IP, unix.IP_MULTICAST_IF, kMreqn},
	"IP_MULTICAST_LOOP":       {unix.IPPROTO_IP, unix.IP_MULTICAST_LOOP, kInt},
	"IP_MULTICAST_TTL":        {unix.IPPROTO_IP, unix.IP_MULTICAST_TTL, kInt},
	"IP_MULTICAST_ALL":        {unix.IPPROTO_IP, unix.IP_MULTICAST_ALL, kInt},
	"IP_ADD_MEMBERSHIP":       {unix.IPPROTO_IP, unix.IP_ADD_MEMBERSHIP, kJoin},
	"IP_TTL":                  {unix.IPPROTO_IP, unix.IP_TTL, kInt},
	"IP_TOS":                  {unix.IPPROTO_IP, unix.IP_TOS, kInt},
	"IP_OPTIONS":              {unix.IPPROTO_IP, unix.IP_OPTIONS, kHex},
	"IP_PKTINFO":              {unix.IPPROTO_IP, unix.IP_PKTINFO, kInt},
	"IP_MTU_DISCOVER":         {unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, kInt},
	"IP_BIND_ADDRESS_NO_PORT": {unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, kInt},
	"IP_RECVERR":              {unix.IPPROTO_IP, unix.IP_RECVERR, kInt},
	"IPV6_V6ONLY":             {unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, kInt},
	"IPV6_FREEBIND":           {unix.IPPROTO_IPV6, unix.IPV6_FREEBIND, kInt},
	"IPV6_TRANSPARENT":        {unix.IPPROTO_IPV6, unix.IPV6_TRANSPARENT, kInt},
	"IPV6_UNICAST_IF":         {unix.IPPROTO_IPV6, unix.IPV6_UNICAST_IF, kIfindexN},
	"IPV6_MULTICAST_IF":       {unix.IPPROTO_IPV6, unix.IPV6_MULTICAST_IF, kIfindex},
	"IPV6_MULTICAST_LOOP":     {unix.IPPROTO_IPV6, unix.IPV6_MULTICAST_LOOP, kInt},
	"IPV6_MULTICAST_HOPS":     {unix.IPPROTO_IPV6, unix.IPV6_MULTICAST_HOPS, kInt},
	"IPV6_MULTICAST_ALL":      {unix.IPPROTO_IPV6, unix.IPV6_MULTICAST_ALL, kInt},
	"IPV6_JOIN_GROUP":         {unix.IPPROTO_IPV6, unix.IPV6_JOIN_GROUP, kJoin},
	"IPV6_UNICAST_HOPS":       {unix.IPPROTO_IPV6, unix.IPV6_UNICAST_HOPS, kInt},
	"IPV6_TCLASS":             {unix.IPPROTO_IPV6, unix.IPV6_TCLASS, kInt},
	"IPV6_DSTOPTS":            {unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, kHex},
	"IPV6_HOPOPTS":            {unix.IPPROTO_IPV6, unix.IPV6_HOPOPTS, kHex},
	"IPV6_RTHDR":              {unix.IPPROTO_IPV6, unix.IPV6_RTHDR, kHex},
	"IPV6_RECVPKTINFO":        {unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, kInt},
	"IPV6_DONTFRAG":           {unix.IPPROTO_IPV6, unix.IPV6_DONTFRAG, kInt},
	"IPV6_MTU_DISCOVER":       {unix.IPPROTO_IPV6, unix.IPV6_MTU_DISCOVER, kInt},
	"IPV6_ADDRFORM":           {unix.IPPROTO_IPV6, unix.IPV6_ADDRFORM, kInt},
	"IPV6_AUTOFLOWLABEL":      {unix.IPPROTO_IPV6, unix.IPV6_AUTOFLOWLABEL, kInt},
	"TCP_FASTOPEN":            {unix.IPPROTO_TCP, unix.TCP_FASTOPEN, kInt},
	"TCP_FASTOPEN_CONNECT":    {unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, kInt},
	"TCP_NODELAY":             {unix.IPPROTO_TCP, unix.TCP_NODELAY, kInt},
	"TCP_MAXSEG":              {unix.IPPROTO_TCP, unix.TCP_MAXSEG, kInt},
	"TCP_CORK":                {unix.IPPROTO_TCP, unix.TCP_CORK, kInt},
	"TCP_REPAIR":              {unix.IPPROTO_TCP, unix.TCP_REPAIR, kInt},
	"TCP_SAVE_SYN":            {unix.IPPROTO_TCP, unix.TCP_SAVE_SYN, kInt},
	"UDP_SEGMENT":             {unix.IPPROTO_UDP, unix.UDP_SEGMENT, kInt},
	"UDP_CORK":                {unix.IPPROTO_UDP, unix.UDP_CORK, kInt},
	"UDP_GRO":                 {unix.IPPROTO_UDP, unix.UDP_GRO, kInt},
	"UDPLITE_SEND_CSCOV":      {ipprotoUDPLite, 10, kInt},
}

func setOpt(fd int, name, val string) error {
	d, ok := options[name]
	if !ok {
		return fmt.Errorf("unknown option %s", name)
	}
	level := d.level
	if level == unix.IPPROTO_UDP && name != "UDPLITE_SEND_CSCOV" {
		// UDP options apply to UDP-Lite sockets too (SOL_UDP is checked by
		// level, and UDP-Lite answers to its own).
		if p, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); p == ipprotoUDPLite {
			level = ipprotoUDPLite
		}
	}
	switch d.kind {
	case kInt:
		v, err := strconv.Atoi(val)
		if err != nil {
			return unix.EINVAL
		}
		return unix.SetsockoptInt(fd, level, d.name, v)
	case kDev:
		return unix.SetsockoptString(fd, level, d.name, val)
	case kIfindex, kIfindexN, kMreqn:
		idx, err := ifindex(val)
		if err != nil {
			return err
		}
		switch d.kind {
		case kIfindexN:
			// Both families take it in network byte order.
			var b [4]byte
			binary.BigEndian.PutUint32(b[:], uint32(idx))
			return unix.SetsockoptString(fd, level, d.name, string(b[:]))
		case kMreqn:
			return unix.SetsockoptIPMreqn(fd, level, d.name, &unix.IPMreqn{Ifindex: int32(idx)})
		}
		return unix.SetsockoptInt(fd, level, d.name, idx)
	case kHex:
		b, err := hex.DecodeString(val)
		if err != nil {
			return unix.EINVAL
		}
		return unix.SetsockoptString(fd, level, d.name, string(b))
	case kJoin:
		grp, ifname, _ := strings.Cut(val, "%")
		ip, err := netip.ParseAddr(grp)
		if err != nil {
			return unix.EINVAL
		}
		idx := 0
		if ifname != "" {
			if idx, err = ifindex(ifname); err != nil {
				return err
			}
		}
		if d.name == unix.IP_ADD_MEMBERSHIP {
			if !ip.Is4() {
				return unix.EINVAL
			}
			return unix.SetsockoptIPMreqn(fd, level, d.name, &unix.IPMreqn{Multiaddr: ip.As4(), Ifindex: int32(idx)})
		}
		return unix.SetsockoptIPv6Mreq(fd, level, d.name, &unix.IPv6Mreq{Multiaddr: ip.As16(), Interface: uint32(idx)})
	}
	return unix.EINVAL
}

// intCmsgs are the control messages that carry one integer: level, type.
var intCmsgs = map[string][2]int{
	"IP_TTL": {unix.IPPROTO_IP, unix.IP_TTL}, "IP_TOS": {unix.IPPROTO_IP, unix.IP_TOS},
	"IPV6_HOPLIMIT": {unix.IPPROTO_IPV6, unix.IPV6_HOPLIMIT}, "IPV6_TCLASS": {unix.IPPROTO_IPV6, unix.IPV6_TCLASS},
	"SO_MARK": {unix.SOL_SOCKET, unix.SO_MARK}, "IPV6_DONTFRAG": {unix.IPPROTO_IPV6, unix.IPV6_DONTFRAG},
	"SO_PRIORITY": {unix.SOL_SOCKET, unix.SO_PRIORITY},
}

// cmsg encodes one control message.
func cmsg(c Cmsg) ([]byte, error) {
	build := func(level, typ int, data []byte) []byte {
		b := make([]byte, unix.CmsgSpace(len(data)))
		h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
		h.Level, h.Type = int32(level), int32(typ)
		h.SetLen(unix.CmsgLen(len(data)))
		copy(b[unix.CmsgLen(0):], data)
		return b
	}
	i32 := func(v string) ([]byte, error) {
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, unix.EINVAL
		}
		b := make([]byte, 4)
		binary.NativeEndian.PutUint32(b, uint32(n))
		return b, nil
	}
	switch c.Type {
	case "IP_PKTINFO", "IPV6_PKTINFO":
		// "addr%ifname": the source address the packet claims and the
		// interface it leaves by (either may be empty).
		a, ifname, _ := strings.Cut(c.Val, "%")
		idx := 0
		if ifname != "" {
			var err error
			if idx, err = ifindex(ifname); err != nil {
				return nil, err
			}
		}
		var ip netip.Addr
		if a != "" {
			var err error
			if ip, err = netip.ParseAddr(a); err != nil {
				return nil, unix.EINVAL
			}
		}
		if c.Type == "IP_PKTINFO" {
			// struct in_pktinfo { int ifindex; in_addr spec_dst; in_addr addr; }
			b := make([]byte, 12)
			binary.NativeEndian.PutUint32(b, uint32(idx))
			if ip.Is4() {
				a4 := ip.As4()
				copy(b[4:8], a4[:])
			}
			return build(unix.IPPROTO_IP, unix.IP_PKTINFO, b), nil
		}
		// struct in6_pktinfo { in6_addr addr; int ifindex; }
		b := make([]byte, 20)
		if ip.IsValid() {
			a16 := ip.As16()
			copy(b[:16], a16[:])
		}
		binary.NativeEndian.PutUint32(b[16:], uint32(idx))
		return build(unix.IPPROTO_IPV6, unix.IPV6_PKTINFO, b), nil
	case "IP_TTL", "IP_TOS", "IPV6_HOPLIMIT", "IPV6_TCLASS", "SO_MARK", "IPV6_DONTFRAG", "SO_PRIORITY":
		b, err := i32(c.Val)
		if err != nil {
			return nil, err
		}
		if c.Type == "IP_TOS" {
			b = b[:1]
		}
		lt := intCmsgs[c.Type]
		return build(lt[0], lt[1], b), nil
	case "UDP_SEGMENT":
		n, err := strconv.Atoi(c.Val)
		if err != nil {
			return nil, unix.EINVAL
		}
		b := make([]byte, 2)
		binary.NativeEndian.PutUint16(b, uint16(n))
		return build(unix.IPPROTO_UDP, unix.UDP_SEGMENT, b), nil
	case "IP_RETOPTS", "IPV6_DSTOPTS", "IPV6_HOPOPTS", "IPV6_RTHDR":
		b, err := hex.DecodeString(c.Val)
		if err != nil {
			return nil, unix.EINVAL
		}
		lv, ty := unix.IPPROTO_IPV6, 0
		switch c.Type {
		case "IP_RETOPTS":
			lv, ty = unix.IPPROTO_IP, unix.IP_RETOPTS
		case "IPV6_DSTOPTS":
			ty = unix.IPV6_DSTOPTS
		case "IPV6_HOPOPTS":
			ty = unix.IPV6_HOPOPTS
		case "IPV6_RTHDR":
			ty = unix.IPV6_RTHDR
		}
		return build(lv, ty, b), nil
	}
	return nil, fmt.Errorf("unknown control message %s", c.Type)
}
