package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/pktinfo"
)

// ListenConfig says what a Listener serves.
type ListenConfig struct {
	Ports []uint16
	TCP   bool
	UDP   bool
	// Families lists 4 and/or 6. Each family gets its own socket (IPv6
	// sockets are v6-only) so that IPv4 is never tested through a mapped
	// IPv6 socket by accident.
	Families []int
	// Addr4 and Addr6 are the bind addresses; empty means the wildcard.
	Addr4, Addr6 string
	// Unix also serves abstract Unix stream and datagram sockets per port
	// (unix.go).
	Unix bool
}

// Listener serves probe requests on every configured socket.
type Listener struct {
	self     Identity
	tcp      []net.Listener
	udp      []*net.UDPConn
	unix     []net.Listener
	unixgram []*net.UnixConn
	ports    []uint16
	wg       sync.WaitGroup
	once     sync.Once
}

// Listen binds every socket of cfg or none: on any failure the sockets
// bound so far are closed and the error names the one that failed.
func Listen(cfg ListenConfig) (*Listener, error) {
	if len(cfg.Ports) == 0 {
		return nil, errors.New("probe listen: no ports")
	}
	if !cfg.TCP && !cfg.UDP && !cfg.Unix {
		return nil, errors.New("probe listen: neither tcp nor udp")
	}
	if len(cfg.Families) == 0 {
		cfg.Families = []int{4, 6}
	}
	l := &Listener{self: Self(), ports: cfg.Ports}
	fail := func(err error) (*Listener, error) {
		l.Close()
		return nil, err
	}
	for _, fam := range cfg.Families {
		var host, tnet, unet string
		switch fam {
		case 4:
			host, tnet, unet = cfg.Addr4, "tcp4", "udp4"
			if host == "" {
				host = "0.0.0.0"
			}
		case 6:
			// Go sets IPV6_V6ONLY on "tcp6"/"udp6" sockets.
			host, tnet, unet = cfg.Addr6, "tcp6", "udp6"
			if host == "" {
				host = "::"
			}
		default:
			return fail(fmt.Errorf("probe listen: bad family %d", fam))
		}
		for _, p := range cfg.Ports {
			addr := net.JoinHostPort(host, strconv.Itoa(int(p)))
			if cfg.TCP {
				tl, err := net.Listen(tnet, addr)
				if err != nil {
					return fail(fmt.Errorf("probe listen: %w", err))
				}
				l.tcp = append(l.tcp, tl)
			}
			if cfg.UDP {
				ua, err := net.ResolveUDPAddr(unet, addr)
				if err != nil {
					return fail(fmt.Errorf("probe listen: %w", err))
				}
				uc, err := net.ListenUDP(unet, ua)
				if err != nil {
					return fail(fmt.Errorf("probe listen: %w", err))
				}
				l.udp = append(l.udp, uc)
				// Replies leave from the address the connector sent to: a
				// connected UDP socket ignores datagrams from any other
				// source, and a multi-homed node (eth0 and ib0) would
				// otherwise answer from whichever address its route prefers.
				if err := pktinfo.Enable(uc); err != nil {
					return fail(fmt.Errorf("probe listen: %s pktinfo: %w", addr, err))
				}
			}
		}
	}
	if cfg.Unix {
		if err := l.listenUnix(cfg.Ports); err != nil {
			return fail(err)
		}
	}
	return l, nil
}

// Self is the identity the listener reports.
func (l *Listener) Self() Identity { return l.self }

// Ports are the ports served.
func (l *Listener) Ports() []uint16 { return l.ports }

// Serve answers requests until ctx ends, then closes every socket.
func (l *Listener) Serve(ctx context.Context) {
	for _, tl := range l.tcp {
		l.wg.Add(1)
		go l.serveStream(tl, uint16(tl.Addr().(*net.TCPAddr).Port), "tcp")
	}
	for _, uc := range l.udp {
		l.wg.Add(1)
		go l.serveUDP(uc)
	}
	for _, tl := range l.unix {
		l.wg.Add(1)
		go l.serveStream(tl, portOfUnixName(tl.Addr().String()), ProtoUnixStream)
	}
	for _, uc := range l.unixgram {
		l.wg.Add(1)
		go l.serveUnixgram(uc)
	}
	<-ctx.Done()
	l.Close()
	l.wg.Wait()
}

// Close closes every socket (idempotent).
func (l *Listener) Close() {
	l.once.Do(func() {
		for _, tl := range l.tcp {
			tl.Close()
		}
		for _, uc := range l.udp {
			uc.Close()
		}
		for _, tl := range l.unix {
			tl.Close()
		}
		for _, uc := range l.unixgram {
			uc.Close()
		}
	})
}

// serveStream answers each connection of a stream listener (TCP, or an
// abstract Unix socket) with one reply line.
func (l *Listener) serveStream(tl net.Listener, port uint16, proto string) {
	defer l.wg.Done()
	for {
		c, err := tl.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and friends: back off briefly rather than spin.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go func() {
			defer c.Close()
			// Longer than any connector waits for its reply (20 s under
			// emulation, lab/check/run.go): a connector that got no CPU
			// for seconds after its handshake must not find the
			// connection closed (EOF, a reset) and report a refusal.
			c.SetDeadline(time.Now().Add(time.Minute))
			line, err := readLine(c)
			if err != nil {
				return
			}
			nonce, err := parseRequest(line)
			if err != nil {
				return
			}
			c.Write(formatReply(Reply{Nonce: nonce, Identity: l.self, Port: port, Proto: proto}))
		}()
	}
}

func (l *Listener) serveUDP(uc *net.UDPConn) {
	defer l.wg.Done()
	port := uint16(uc.LocalAddr().(*net.UDPAddr).Port)
	buf := make([]byte, maxMsg)
	oob := make([]byte, pktinfo.OOBSize)
	for {
		n, from, dst, err := pktinfo.Read(uc, buf, oob)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		nonce, err := parseRequest(buf[:n])
		if err != nil {
			continue
		}
		pktinfo.Reply(uc, formatReply(Reply{Nonce: nonce, Identity: l.self, Port: port, Proto: "udp"}), from, dst)
	}
}
