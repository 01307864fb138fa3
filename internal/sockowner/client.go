package sockowner

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/vishvananda/netns"

	"github.com/palisade-hpc/palisade/internal/policy"
	sysnetns "github.com/palisade-hpc/palisade/internal/sys/netns"
)

// ErrTimeout means the remote ident service did not answer in time: it is
// not running, the node is down, or it dropped the query (not from a
// privileged port, or not from a cluster subnet).
var ErrTimeout = errors.New("ident: no answer")

// ErrUnprivileged means the caller may not bind a privileged source port,
// without which no node answers.
var ErrUnprivileged = errors.New("ident: asking another node needs root (a privileged source port)")

// Client asks other nodes' ident services. The zero value uses DefaultPort
// and a one-second timeout.
type Client struct {
	// Port is the remote service's UDP port (0 = DefaultPort).
	Port uint16
	// Timeout bounds the whole query (0 = 1 s). One retransmission is sent
	// halfway through it, with the same id; there are no other retries.
	Timeout time.Duration

	// ns, when open, is the network namespace to create the socket in
	// (the Server's), whatever namespace the calling thread is in.
	ns    netns.NsHandle
	hasNS bool
}

// QueryRemote asks node's ident service who owns target (on that node),
// from a privileged source port — so it needs root (CAP_NET_BIND_SERVICE).
func QueryRemote(node netip.Addr, target netip.AddrPort, proto policy.Proto) (Owner, error) {
	return Client{}.Query(context.Background(), node, target, netip.AddrPort{}, proto)
}

// Privileged source ports are drawn from 600–1023: clear of the low
// well-known services, as rresvport(3) does.
const (
	srcPortFirst = 600
	srcPortLast  = 1023
)

// bindPrivileged opens a UDP socket on a free privileged port.
func bindPrivileged(family netip.Addr) (*net.UDPConn, error) {
	any := netip.IPv6Unspecified()
	if family.Is4() {
		any = netip.IPv4Unspecified()
	}
	n := srcPortLast - srcPortFirst + 1
	start := rand.IntN(n)
	var lastErr error
	for i := 0; i < 64; i++ {
		port := uint16(srcPortFirst + (start+i*7)%n)
		c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(any, port)))
		if err == nil {
			return c, nil
		}
		if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
			return nil, fmt.Errorf("%w: %w", ErrUnprivileged, err)
		}
		lastErr = err
	}
	return nil, fmt.Errorf("ident: no free privileged port: %w", lastErr)
}

// Query asks node who owns the socket target (with remote end peer, if
// given) on node.
func (c Client) Query(ctx context.Context, node netip.Addr, target, peer netip.AddrPort, proto policy.Proto) (Owner, error) {
	id := rand.Uint32()
	a, err := c.exchange(ctx, node, id, encodeQuery(parsedQuery{ID: id, Proto: proto, Addr: target, Peer: peer}), maxAnswer)
	if err != nil {
		return Owner{}, err
	}
	return a.result()
}

// Status asks node's agent for its status report (what `palisade status`
// knows there), over the ident service. Root only, like Query.
func (c Client) Status(ctx context.Context, node netip.Addr) (json.RawMessage, error) {
	id := rand.Uint32()
	q, _ := json.Marshal(Query{V: Version, ID: id, Kind: KindStatus})
	a, err := c.exchange(ctx, node, id, q, maxAnswer)
	if err != nil {
		return nil, err
	}
	if a.Status == StatusBadQuery {
		return nil, fmt.Errorf("ident: %s does not understand status queries (an older version?): %s", node, a.Error)
	}
	if a.Status != StatusOK || len(a.Report) == 0 {
		return nil, fmt.Errorf("ident: %s: %s", a.Status, a.Error)
	}
	return a.Report, nil
}

// Data asks node's agent a data query (KindFlows, KindAudit) with args,
// over the ident service. Root only, like Query.
func (c Client) Data(ctx context.Context, node netip.Addr, kind string, args json.RawMessage) (json.RawMessage, error) {
	id := rand.Uint32()
	q, _ := json.Marshal(Query{V: Version, ID: id, Kind: kind, Args: args})
	if len(q) > maxQuery {
		return nil, fmt.Errorf("ident: %s query of %d bytes exceeds %d", kind, len(q), maxQuery)
	}
	a, err := c.exchange(ctx, node, id, q, MaxDataAnswer)
	if err != nil {
		return nil, err
	}
	if a.Status == StatusBadQuery {
		return nil, fmt.Errorf("ident: %s does not understand %s queries (an older version?): %s", node, kind, a.Error)
	}
	if a.Status != StatusOK || len(a.Data) == 0 {
		return nil, fmt.Errorf("ident: %s: %s: %s", node, a.Status, a.Error)
	}
	return a.Data, nil
}

// exchange sends query q (with id) to node's service from a privileged
// port and returns its answer (at most size bytes): one retransmission
// halfway through the timeout, answers from any other address or to
// another id ignored.
func (c Client) exchange(ctx context.Context, node netip.Addr, id uint32, q []byte, size int) (*Answer, error) {
	node = node.Unmap()
	port := c.Port
	if port == 0 {
		port = DefaultPort
	}
	timeout := c.Timeout
	if timeout == 0 {
		timeout = time.Second
	}
	var conn *net.UDPConn
	err := inNetns(c.ns, c.hasNS, func() (err error) { conn, err = bindPrivileged(node); return })
	if err != nil {
		if conn != nil {
			conn.Close()
		}
		return nil, err
	}
	defer conn.Close()
	server := netip.AddrPortFrom(node, port)

	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	resend := time.Now().Add(time.Until(deadline) / 2)
	if _, err := conn.WriteToUDPAddrPort(q, server); err != nil {
		return nil, fmt.Errorf("ident: send to %v: %w", server, err)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Now()) })
	defer stop()
	buf := make([]byte, size)
	resent := false
	for {
		wait := deadline
		if !resent {
			wait = resend
		}
		conn.SetReadDeadline(wait)
		n, from, err := conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				if !resent && time.Now().Before(deadline) {
					resent = true
					conn.WriteToUDPAddrPort(q, server)
					continue
				}
				return nil, fmt.Errorf("%w from %v within %v", ErrTimeout, server, timeout)
			}
			// ICMP port unreachable surfaces as ECONNREFUSED on Linux
			// for unconnected sockets only via IP_RECVERR; treat others
			// as fatal.
			return nil, fmt.Errorf("ident: receive from %v: %w", server, err)
		}
		if netip.AddrPortFrom(from.Addr().Unmap(), from.Port()) != server {
			continue // not our server: ignore, keep waiting
		}
		var a Answer
		if err := json.Unmarshal(buf[:n], &a); err != nil {
			return nil, fmt.Errorf("ident: malformed answer: %w", err)
		}
		if a.ID != id {
			continue // an answer to an earlier query
		}
		return &a, nil
	}
}

// QueryLocalAPI asks the ident service's Unix-socket API at path (empty =
// DefaultSocketPath). A zero node means the socket is looked up on the
// node the service runs on, or — if target is not one of that node's
// addresses — on the node that owns target.
func QueryLocalAPI(ctx context.Context, path string, node netip.Addr, target netip.AddrPort, proto policy.Proto) (Owner, *Answer, error) {
	if path == "" {
		path = DefaultSocketPath
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return Owner{}, nil, fmt.Errorf("ident: local API: %w", err)
	}
	defer conn.Close()
	deadline := time.Now().Add(5 * time.Second)
	if d, ok := ctx.Deadline(); ok {
		deadline = d
	}
	conn.SetDeadline(deadline)
	id := rand.Uint32()
	q := encodeQuery(parsedQuery{ID: id, Proto: proto, Addr: target, Node: node})
	if _, err := conn.Write(append(q, '\n')); err != nil {
		return Owner{}, nil, fmt.Errorf("ident: local API: %w", err)
	}
	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 0, 4096), maxAnswer)
	if !sc.Scan() {
		if sc.Err() != nil {
			return Owner{}, nil, fmt.Errorf("ident: local API: %w", sc.Err())
		}
		return Owner{}, nil, errors.New("ident: local API closed without answer")
	}
	var a Answer
	if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
		return Owner{}, nil, fmt.Errorf("ident: local API: malformed answer: %w", err)
	}
	if a.ID != id {
		return Owner{}, nil, errors.New("ident: local API answered another query")
	}
	o, err := a.result()
	return o, &a, err
}

// inNetns runs fn with the calling thread in ns (if ns is open). Sockets
// keep the namespace they were created in, so only their creation needs to
// happen there.
func inNetns(ns netns.NsHandle, has bool, fn func() error) error {
	if !has || !ns.IsOpen() {
		return fn()
	}
	return sysnetns.Do(ns, fn)
}
