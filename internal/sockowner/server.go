package sockowner

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/palisade-hpc/palisade/internal/sys/pktinfo"
	"github.com/palisade-hpc/palisade/internal/sys/unixserve"
)

// ServerConfig configures the ident service.
type ServerConfig struct {
	// UDPPort is the service's UDP port (0 = DefaultPort). It must be a
	// privileged port: peers check that answers come from one.
	UDPPort uint16
	// DisableUDP turns off the network service (Unix API only).
	DisableUDP bool
	// SocketPath is the Unix API socket ("" = DefaultSocketPath).
	SocketPath string
	// SocketGroup (name or gid) may use the Unix API (mode 0660); empty
	// means root only (0600). A web portal or proxy runs in this group.
	SocketGroup string
	// DisableUnix turns off the Unix API.
	DisableUnix bool
	// Policy's ClusterSubnets are the sources the UDP service answers
	// (plus loopback). nil = policy.Default(): loopback only.
	Policy *policy.Policy
	// RemoteTimeout bounds a query the Unix API forwards to another node
	// (0 = 1 s).
	RemoteTimeout time.Duration
	// MaxRate bounds UDP answers per second (0 = 2000); excess queries are
	// dropped, so a flood costs at most this many /proc lookups.
	MaxRate int
	// Logger receives the service's log (nil = slog.Default()).
	Logger *slog.Logger
	// Names resolves uids/gids to names in answers (nil = identity.System()).
	Names identity.Resolver
	// Report answers status queries from other nodes' root (the same
	// privileged-port and cluster-source rules as lookups); nil: such
	// queries get an error answer.
	Report func() (json.RawMessage, error)
	// Data answers data queries (KindFlows, KindAudit) from other nodes'
	// root, under the same rules; its answer must fit in MaxData bytes.
	// nil: such queries get an error answer.
	Data func(kind string, args json.RawMessage) (json.RawMessage, error)
}

// Stats counts what the UDP service did with queries, for the agent's
// metrics.
type Stats struct {
	Answered, NoSocket, BadQuery   uint64
	DroppedUnprivileged            uint64 // source port >= 1024
	DroppedOffCluster, RateLimited uint64
	UnixQueries, ForwardedToRemote uint64
	StatusReports, DataQueries     uint64
}

// Server is the ident service of one node: UDP for peers, a Unix socket
// for local clients. Create it in the node's network namespace; it keeps
// that namespace for its lookups whatever thread later runs it.
type Server struct {
	cfg    ServerConfig
	log    *slog.Logger
	pol    atomic.Pointer[policy.Policy]
	res    *Resolver
	rtnl   *netlink.Handle
	ns     netns.NsHandle
	udp    *net.UDPConn
	unixL  *unixserve.Listener
	client Client
	limit  *rate.Limiter

	closeOnce sync.Once

	answered, noSocket, badQuery, unpriv, offCluster, rateLimited, unixQ, forwarded, reports, data atomic.Uint64
}

// NewServer validates cfg and opens the service's sockets; nothing is
// served until Run. On error nothing is left open or on disk.
func NewServer(cfg ServerConfig) (_ *Server, err error) {
	if cfg.UDPPort == 0 {
		cfg.UDPPort = DefaultPort
	}
	if !cfg.DisableUDP && cfg.UDPPort >= 1024 {
		return nil, fmt.Errorf("ident: UDP port %d is not privileged (< 1024)", cfg.UDPPort)
	}
	if cfg.SocketPath == "" {
		cfg.SocketPath = DefaultSocketPath
	}
	if cfg.Policy == nil {
		cfg.Policy = policy.Default()
	}
	if cfg.RemoteTimeout == 0 {
		cfg.RemoteTimeout = time.Second
	}
	if cfg.MaxRate == 0 {
		cfg.MaxRate = 2000
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	gid := -1
	if cfg.SocketGroup != "" && !cfg.DisableUnix {
		if gid, err = lookupGroup(cfg.SocketGroup); err != nil {
			return nil, err
		}
	}
	s := &Server{ns: -1, cfg: cfg, log: cfg.Logger.With("component", "ident"), limit: rate.NewLimiter(rate.Limit(cfg.MaxRate), cfg.MaxRate)}
	s.pol.Store(cfg.Policy)
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.ns, err = netns.Get(); err != nil {
		return nil, fmt.Errorf("ident: current netns: %w", err)
	}
	s.client = Client{Timeout: cfg.RemoteTimeout, ns: s.ns, hasNS: true}
	if s.res, err = NewResolverWith(cfg.Names); err != nil {
		return nil, err
	}
	if s.rtnl, err = netlink.NewHandle(); err != nil {
		return nil, fmt.Errorf("ident: rtnetlink: %w", err)
	}
	if !cfg.DisableUDP {
		// One dual-stack socket serves IPv4 and IPv6 peers.
		s.udp, err = net.ListenUDP("udp", &net.UDPAddr{Port: int(cfg.UDPPort)})
		if err != nil {
			return nil, fmt.Errorf("ident: UDP port %d: %w", cfg.UDPPort, err)
		}
		// Answers leave from the address the query was sent to: the client
		// accepts an answer only from the exact service address it asked.
		if err = pktinfo.Enable(s.udp); err != nil {
			return nil, fmt.Errorf("ident: UDP port %d: packet info: %w", cfg.UDPPort, err)
		}
	}
	if !cfg.DisableUnix {
		// Root's and the socket group's only (0600, or 0660 with a group).
		mode := os.FileMode(0o600)
		if gid >= 0 {
			mode = 0o660
		}
		if s.unixL, err = unixserve.Listen(cfg.SocketPath, mode, gid); err != nil {
			return nil, fmt.Errorf("ident: %w", err)
		}
	}
	return s, nil
}

func lookupGroup(g string) (int, error) {
	gid, err := identity.GID(identity.System(), g)
	if err != nil {
		return 0, fmt.Errorf("ident: socket group %q: %w", g, err)
	}
	return int(gid), nil
}

// Close releases everything NewServer opened, for a server that will not
// Run (Run closes by itself). It is safe to call more than once.
func (s *Server) Close() { s.closeOnce.Do(s.close) }

func (s *Server) close() {
	if s.udp != nil {
		s.udp.Close()
	}
	if s.unixL != nil {
		s.unixL.Close() // removes the socket if it is still ours
	}
	if s.res != nil {
		s.res.Close()
	}
	if s.rtnl != nil {
		s.rtnl.Close()
	}
	if s.client.hasNS {
		s.ns.Close()
	}
}

// SetPolicy replaces the policy (cluster subnets) without a restart.
func (s *Server) SetPolicy(p *policy.Policy) {
	if p != nil {
		s.pol.Store(p)
	}
}

// UDPAddr is the bound UDP address (nil when UDP is disabled).
func (s *Server) UDPAddr() *net.UDPAddr {
	if s.udp == nil {
		return nil
	}
	return s.udp.LocalAddr().(*net.UDPAddr)
}

// Stats returns the counters so far.
func (s *Server) Stats() Stats {
	return Stats{
		Answered: s.answered.Load(), NoSocket: s.noSocket.Load(), BadQuery: s.badQuery.Load(),
		DroppedUnprivileged: s.unpriv.Load(), DroppedOffCluster: s.offCluster.Load(),
		RateLimited: s.rateLimited.Load(), UnixQueries: s.unixQ.Load(), ForwardedToRemote: s.forwarded.Load(),
		StatusReports: s.reports.Load(), DataQueries: s.data.Load(),
	}
}

// udpWorkers read the UDP socket in parallel so that one slow /proc scan
// does not hold up other peers.
const udpWorkers = 4

// Run serves until ctx is done, then closes everything (removing the Unix
// socket) and returns nil; it returns an error only if serving failed.
func (s *Server) Run(ctx context.Context) error {
	// Cancelled on any exit, so Unix API clients are let go at once even
	// when serving stops on an error rather than on the caller's ctx.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, udpWorkers+1)
	if s.udp != nil {
		for range udpWorkers {
			wg.Go(func() { errc <- s.serveUDP() })
		}
	}
	if s.unixL != nil {
		wg.Go(func() { errc <- s.serveUnix(ctx) })
	}
	s.log.Info("ident service up", "udp", s.UDPAddr(), "unix", s.cfg.SocketPath)
	if s.udp != nil {
		warnUnprivilegedPorts(s.log)
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
	}
	cancel()
	s.Close()
	wg.Wait()
	return err
}

func (s *Server) serveUDP() error {
	buf := make([]byte, maxQuery+1)
	oob := make([]byte, pktinfo.OOBSize)
	for {
		n, from, dst, err := pktinfo.Read(s.udp, buf, oob)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("ident: UDP: %w", err)
		}
		// Only root on a cluster node can send from a privileged port;
		// everyone else is dropped without an answer (no oracle, no
		// amplification).
		if from.Port() >= 1024 || from.Port() == 0 {
			s.unpriv.Add(1)
			s.log.Debug("ident: dropped query from unprivileged port", "from", from)
			continue
		}
		if !s.pol.Load().InCluster(from.Addr()) {
			s.offCluster.Add(1)
			s.log.Debug("ident: dropped query from outside the cluster", "from", from)
			continue
		}
		if !s.limit.Allow() {
			s.rateLimited.Add(1)
			continue
		}
		if n > maxQuery {
			s.badQuery.Add(1)
			continue
		}
		a := s.answerUDP(buf[:n])
		pktinfo.Reply(s.udp, encodeAnswer(a), from, dst)
	}
}

func (s *Server) answerUDP(b []byte) *Answer {
	q, bad := decodeQuery(b)
	if bad != nil {
		s.badQuery.Add(1)
		return bad
	}
	switch q.Kind {
	case KindStatus:
		return s.report(q.ID)
	case KindFlows, KindAudit, KindGrant:
		return s.answerData(q)
	}
	// Peers are never relayed onwards: Node is a Unix-API feature.
	o, err := s.res.LookupConn(q.Addr, q.Peer, q.Proto)
	return s.count(answerFor(q.ID, o, err))
}

func (s *Server) report(id uint32) *Answer {
	if s.cfg.Report == nil {
		return &Answer{V: Version, ID: id, Status: StatusError, Error: "this ident service has no status report"}
	}
	r, err := s.cfg.Report()
	if err != nil {
		return &Answer{V: Version, ID: id, Status: StatusError, Error: err.Error()}
	}
	s.reports.Add(1)
	return &Answer{V: Version, ID: id, Status: StatusOK, Report: r}
}

func (s *Server) answerData(q parsedQuery) *Answer {
	if s.cfg.Data == nil {
		return &Answer{V: Version, ID: q.ID, Status: StatusError, Error: "this ident service has no " + q.Kind}
	}
	d, err := s.cfg.Data(q.Kind, q.Args)
	if err == nil && len(d) > MaxData {
		err = fmt.Errorf("%s answer of %d bytes exceeds %d", q.Kind, len(d), MaxData)
	}
	if err != nil {
		return &Answer{V: Version, ID: q.ID, Status: StatusError, Error: err.Error()}
	}
	s.data.Add(1)
	return &Answer{V: Version, ID: q.ID, Status: StatusOK, Data: d}
}

func (s *Server) count(a *Answer) *Answer {
	switch a.Status {
	case StatusOK:
		s.answered.Add(1)
	case StatusNoSocket:
		s.noSocket.Add(1)
	}
	return a
}

// maxUnixConns bounds concurrent Unix API clients.
const maxUnixConns = 64

func (s *Server) serveUnix(ctx context.Context) error {
	// Busy: the client sees EOF and may retry.
	err := unixserve.Serve(s.unixL, unixserve.Options{Max: maxUnixConns, Name: "ident unix API", Log: s.log},
		func(c *net.UnixConn, peer *unix.Ucred, _ func()) { s.serveUnixConn(ctx, c, int(peer.Uid)) })
	if err != nil {
		return fmt.Errorf("ident: unix API: %w", err)
	}
	return nil
}

// unixIdle closes an API connection that sends nothing for this long.
const unixIdle = 30 * time.Second

func (s *Server) serveUnixConn(ctx context.Context, c *net.UnixConn, asker int) {
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	r := bufio.NewReaderSize(c, maxQuery+1)
	for {
		c.SetReadDeadline(time.Now().Add(unixIdle))
		line, err := r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			c.Write(append(encodeAnswer(&Answer{V: Version, Status: StatusBadQuery, Error: "query too long"}), '\n'))
			return
		}
		if err != nil {
			if len(line) == 0 || !errors.Is(err, io.EOF) {
				return
			}
		}
		s.unixQ.Add(1)
		a := s.answerUnix(ctx, line)
		s.log.Debug("ident: unix API query", "uid", asker, "status", a.Status, "node", a.Node)
		c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(append(encodeAnswer(a), '\n')); err != nil {
			return
		}
	}
}

func (s *Server) answerUnix(ctx context.Context, b []byte) *Answer {
	q, bad := decodeQuery(b)
	if bad != nil {
		return bad
	}
	if q.Kind != "" {
		return &Answer{V: Version, ID: q.ID, Status: StatusBadQuery, Error: "kind " + q.Kind + " is served over UDP only"}
	}
	node := q.Node
	if !node.IsValid() && !s.isLocal(q.Addr.Addr()) {
		node = q.Addr.Addr().Unmap() // the listener's address is its node's
	}
	if !node.IsValid() || s.isLocal(node) {
		o, err := s.res.LookupConn(q.Addr, q.Peer, q.Proto)
		return s.count(answerFor(q.ID, o, err))
	}
	if !s.pol.Load().InCluster(node) {
		return &Answer{V: Version, ID: q.ID, Status: StatusBadQuery,
			Error: fmt.Sprintf("%v is not in a cluster subnet: no ident service to ask", node)}
	}
	s.forwarded.Add(1)
	o, err := s.client.Query(ctx, node, q.Addr, q.Peer, q.Proto)
	a := answerFor(q.ID, o, err)
	if errors.Is(err, ErrTimeout) {
		a = &Answer{V: Version, ID: q.ID, Status: StatusTimeout, Error: err.Error()}
	}
	a.Node = node.String()
	return a
}

// isLocal reports whether a is loopback or an address of this node. The
// server asks through its own rtnetlink handle, opened in the namespace it
// serves, whichever thread it runs on.
func (s *Server) isLocal(a netip.Addr) bool { return isLocalIn(s.rtnl, a) }

// IsLocalAddr reports whether a is loopback, unspecified or assigned to an
// interface in the caller's network namespace: such a target is looked up
// here, not asked of another node.
func IsLocalAddr(a netip.Addr) bool { return isLocalIn(nil, a) }

// isLocalIn asks h, or the calling thread's namespace when h is nil.
func isLocalIn(h *netlink.Handle, a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() || a.IsUnspecified() {
		return true
	}
	list := netlink.AddrList
	if h != nil {
		list = h.AddrList
	}
	addrs, err := nldump.Retry(func() ([]netlink.Addr, error) { return list(nil, netlink.FAMILY_ALL) })
	if err != nil {
		return false
	}
	for _, x := range addrs {
		if ip, ok := netip.AddrFromSlice(x.IP); ok && ip.Unmap() == a {
			return true
		}
	}
	return false
}

// warnUnprivilegedPorts warns when this node lets ordinary users bind
// "privileged" ports: then a user here could send queries the cluster's
// ident services take for root's.
func warnUnprivilegedPorts(log *slog.Logger) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_unprivileged_port_start")
	if err != nil {
		return
	}
	if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n < 1024 {
		log.Warn("net.ipv4.ip_unprivileged_port_start is below 1024: users on this node can send ident queries that peers trust as root's", "value", n)
	}
}
