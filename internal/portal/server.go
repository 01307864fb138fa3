package portal

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/sys/relay"
	"github.com/palisade-hpc/palisade/internal/sys/unixserve"
	"golang.org/x/sys/unix"
)

// Kernel is what the delegation needs of the data plane that enforces.
type Kernel interface {
	// ExemptConnector reports whether the kernel treats uid as an exempt
	// connector (its map, "@group" members included).
	ExemptConnector(uid uint32) (bool, error)
	// SocketOwner is the kernel's owner record of the socket fd.
	SocketOwner(fd int) (uid, gid uint32, err error)
}

// Settings are what the server needs of the configuration, replaced on
// reload.
type Settings struct {
	Config Config
	// Exempt are the configuration's exempt connectors (uids; the kernel's
	// map is asked too).
	Exempt []uint32
}

// Server serves the delegation socket.
type Server struct {
	kernel     Kernel
	res        identity.Resolver
	log        *slog.Logger
	settings   atomic.Pointer[Settings]
	proxyCache atomic.Pointer[proxies]
	now        func() time.Time

	l *unixserve.Listener

	mu       sync.Mutex
	inflight map[uint32]int // requests being served per peer uid
	// userInflight is inflight's sum over users (not the proxies).
	userInflight int
	sessions     map[sessionKey]*session
	holds        map[uint32]int // held sessions per user
	relays       int            // delegated connections open
	userRelays   map[uint32]int // … per user
	gen          uint64
	ctx          context.Context
}

type sessionKey struct{ uid, proxy uint32 }

type session struct {
	Session
	gen  uint64 // which registration (a held one ends only itself)
	done chan struct{}
}

// Bounds: connections served at once, held sessions per user and in all.
const (
	maxClients      = 64
	maxPerUID       = 4  // one uid cannot hold every slot (the socket is 0666)
	maxUsers        = 32 // nor can users together: the proxies keep the rest
	maxHoldsPerUser = 8
	maxHolds        = 4096
	requestTimeout  = 10 * time.Second
	connectTimeout  = 10 * time.Second
)

// NewServer makes a server; Serve starts it.
func NewServer(k Kernel, res identity.Resolver, s Settings, log *slog.Logger) *Server {
	srv := &Server{kernel: k, res: res, log: log, now: time.Now,
		sessions: map[sessionKey]*session{}, holds: map[uint32]int{}, inflight: map[uint32]int{}, userRelays: map[uint32]int{}}
	srv.settings.Store(&s)
	return srv
}

// SetSettings applies a reloaded configuration (sessions stay; a proxy no
// longer listed cannot use its sessions).
func (s *Server) SetSettings(st Settings) {
	s.settings.Store(&st)
	// Sessions with a proxy no longer listed end: putting the name back
	// must not revive them.
	ps := s.proxySet(&st)
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, v := range s.sessions {
		if _, ok := ps.byUID[k.proxy]; !ok {
			close(v.done)
			delete(s.sessions, k)
		}
	}
}

// proxies are the [portal] proxies' uids for one Settings, resolved once
// (the accept loop asks for every connection: a lookup each time let any
// user make it wait on the directory); names that did not resolve are
// tried again after proxyRetry.
type proxies struct {
	st      *Settings
	byUID   map[uint32]string
	missing bool
	at      time.Time
}

const proxyRetry = 30 * time.Second

func (s *Server) proxySet(st *Settings) *proxies {
	if ps := s.proxyCache.Load(); ps != nil && ps.st == st && (!ps.missing || s.now().Sub(ps.at) < proxyRetry) {
		return ps
	}
	ps := &proxies{st: st, byUID: map[uint32]string{}, at: s.now()}
	for _, p := range st.Config.Proxies {
		id, err := identity.UID(s.res, p)
		if err != nil {
			ps.missing = true
			continue
		}
		ps.byUID[id] = p
	}
	s.proxyCache.Store(ps)
	return ps
}

// Listen creates the socket at path (mode 0666: every request is
// authorised by its sender; a stale socket replaced).
func (s *Server) Listen(path string) error {
	l, err := unixserve.Listen(path, 0o666, -1)
	if err != nil {
		return err
	}
	s.l = l
	return nil
}

// Serve accepts until Close.
func (s *Server) Serve(ctx context.Context) {
	s.mu.Lock()
	s.ctx = ctx
	s.mu.Unlock()
	unixserve.Serve(s.l, unixserve.Options{Max: maxClients, Name: "portal", Log: s.log,
		// Any user may connect: a user who opens connections and sends
		// nothing holds each for requestTimeout. Slots are bounded per
		// peer uid before the shared ones, so he cannot starve the
		// proxies (or other users) of the delegation.
		Admit: func(peer *unix.Ucred) (func(), bool) {
			slot := peer.Uid
			if _, proxy := s.proxyUID(s.settings.Load(), slot); proxy {
				slot = proxyPeer // the proxies share the whole budget
			}
			if !s.take(slot) {
				return nil, false
			}
			return func() { s.give(slot) }, true
		}},
		// A bug in one request must not end the agent (and with it
		// enforcement's upkeep): it fails that request only.
		func(c *net.UnixConn, peer *unix.Ucred, release func()) { s.serveConn(ctx, c, peer, release) })
}

// Close stops accepting, removes the socket and ends held sessions.
func (s *Server) Close() {
	if s.l != nil {
		s.l.Close()
	}
}

// proxyPeer stands for every [portal] proxy in the per-uid count: a busy
// portal makes many delegations at once, bounded by maxClients alone.
const proxyPeer = ^uint32(0)

// take counts a request of uid in flight, unless uid has maxPerUID already.
func (s *Server) take(uid uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if uid != proxyPeer {
		if s.inflight[uid] >= maxPerUID || s.userInflight >= maxUsers {
			return false
		}
		s.userInflight++
	}
	s.inflight[uid]++
	return true
}

// give ends a request of uid taken with take.
func (s *Server) give(uid uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if uid != proxyPeer {
		s.userInflight--
	}
	if s.inflight[uid]--; s.inflight[uid] <= 0 {
		delete(s.inflight, uid)
	}
}

func (s *Server) serveConn(ctx context.Context, c *net.UnixConn, cr *unix.Ucred, release func()) {
	c.SetDeadline(time.Now().Add(requestTimeout))
	r := bufio.NewReaderSize(c, 4096)
	line, err := r.ReadSlice('\n')
	if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
		return
	}
	var req Request
	if err := json.Unmarshal(line, &req); err != nil {
		reply(c, fail(CodeBadRequest, "malformed request: %v", err), -1)
		return
	}
	switch req.Op {
	case OpConnect:
		resp, fd := s.connect(ctx, cr.Uid, req)
		reply(c, resp, fd)
	case OpSession:
		resp, sess := s.register(cr.Uid, req)
		if sess == nil || !req.Hold {
			reply(c, resp, -1)
			return
		}
		// Held: the session lives while this connection does (and no
		// longer than its expiry). It no longer counts against the
		// clients served at once.
		reply(c, resp, -1)
		release()
		s.hold(ctx, c, cr.Uid, sess)
	case OpEnd:
		reply(c, s.end(cr.Uid, req), -1)
	case OpSessions:
		reply(c, s.list(cr.Uid), -1)
	default:
		reply(c, fail(CodeBadRequest, "unknown op %q (want %s, %s, %s or %s)", req.Op, OpSession, OpEnd, OpSessions, OpConnect), -1)
	}
}

func fail(code, format string, args ...any) Response {
	return Response{Code: code, Error: fmt.Sprintf(format, args...)}
}

// reply writes resp, with fd (if ≥ 0) as SCM_RIGHTS, and closes fd.
func reply(c *net.UnixConn, resp Response, fd int) {
	b, _ := json.Marshal(resp)
	b = append(b, '\n')
	c.SetWriteDeadline(time.Now().Add(requestTimeout))
	if fd >= 0 {
		c.WriteMsgUnix(b, unixRights(fd), nil)
		closeFD(fd)
		return
	}
	c.Write(b)
}

// proxyUID reports whether uid is a [portal] proxy, and its name.
func (s *Server) proxyUID(st *Settings, uid uint32) (string, bool) {
	p, ok := s.proxySet(st).byUID[uid]
	return p, ok
}

// actable says why no connection may be made as uid ("" = it may).
func (s *Server) actable(st *Settings, uid uint32) string {
	if uid == 0 {
		return "root is never acted for"
	}
	if int64(uid) < st.Config.MinUID {
		return fmt.Sprintf("uid %d is below [portal] min_uid %d (system accounts are never acted for)", uid, st.Config.MinUID)
	}
	if slices.Contains(st.Exempt, uid) {
		return fmt.Sprintf("uid %d is an exempt connector: a connection as it would reach everyone", uid)
	}
	ex, err := s.kernel.ExemptConnector(uid)
	if err != nil {
		return fmt.Sprintf("the kernel's exempt connectors cannot be read: %v", err)
	}
	if ex {
		return fmt.Sprintf("uid %d is an exempt connector: a connection as it would reach everyone", uid)
	}
	return ""
}

// register records the session a user asks for.
func (s *Server) register(uid uint32, req Request) (Response, *session) {
	st := s.settings.Load()
	if why := s.actable(st, uid); why != "" {
		return fail(CodeForbidden, "no session: %s", why), nil
	}
	if req.Proxy == "" {
		return fail(CodeBadRequest, "a session names its proxy (proxy)"), nil
	}
	puid, err := identity.UID(s.res, req.Proxy)
	if err != nil {
		return fail(CodeBadRequest, "proxy %q: %v", req.Proxy, err), nil
	}
	pname, ok := s.proxyUID(st, puid)
	if !ok {
		return fail(CodeForbidden, "%q is not a [portal] proxy", req.Proxy), nil
	}
	name, err := s.res.LookupUID(uid)
	if err != nil {
		return fail(CodeForbidden, "uid %d: %v", uid, err), nil
	}
	_, gid, err := s.res.LookupUser(name)
	if err != nil {
		return fail(CodeForbidden, "user %s: %v", name, err), nil
	}
	group := ""
	if req.Group != "" {
		g, err := identity.GID(s.res, req.Group)
		if err != nil {
			return fail(CodeBadRequest, "group %q: %v", req.Group, err), nil
		}
		gids, err := s.res.GroupsOf(name)
		if err != nil {
			return fail(CodeInternal, "groups of %s: %v", name, err), nil
		}
		if !slices.Contains(gids, g) {
			return fail(CodeForbidden, "%s is not a member of group %s", name, req.Group), nil
		}
		gid, group = g, identity.GroupName(s.res, g)
	}
	ttl := st.Config.MaxSessionDuration()
	if req.TTL != "" {
		d, err := time.ParseDuration(req.TTL)
		if err != nil || d <= 0 {
			return fail(CodeBadRequest, "ttl %q: want a positive duration", req.TTL), nil
		}
		ttl = min(ttl, d)
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if req.Hold {
		total := 0
		for _, n := range s.holds {
			total += n
		}
		if s.holds[uid] >= maxHoldsPerUser || total >= maxHolds {
			return fail(CodeForbidden, "too many held sessions"), nil
		}
		s.holds[uid]++
	}
	s.gen++
	sess := &session{Session: Session{User: name, UID: uid, Proxy: pname, ProxyUID: puid, Group: group, GID: gid,
		Started: now, Expires: now.Add(ttl), Held: req.Hold}, gen: s.gen, done: make(chan struct{})}
	k := sessionKey{uid, puid}
	if old := s.sessions[k]; old != nil {
		close(old.done)
	}
	s.sessions[k] = sess
	s.log.Info("portal session", "user", name, "proxy", pname, "gid", gid, "expires", sess.Expires.UTC(), "held", req.Hold)
	return Response{OK: true, UID: uid, GID: gid, Expires: sess.Expires}, sess
}

// hold keeps a held session until its connection closes, it is replaced or
// ended, it expires, or the server stops.
func (s *Server) hold(ctx context.Context, c *net.UnixConn, uid uint32, sess *session) {
	defer func() {
		s.mu.Lock()
		s.holds[uid]--
		if s.holds[uid] <= 0 {
			delete(s.holds, uid)
		}
		k := sessionKey{uid, sess.ProxyUID}
		if cur := s.sessions[k]; cur != nil && cur.gen == sess.gen {
			delete(s.sessions, k)
			s.log.Info("portal session ended (its holder went away)", "user", sess.User, "proxy", sess.Proxy)
		}
		s.mu.Unlock()
	}()
	c.SetDeadline(time.Time{})
	closed := make(chan struct{})
	go func() {
		var b [64]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				close(closed)
				return
			}
		}
	}()
	t := time.NewTimer(time.Until(sess.Expires))
	defer t.Stop()
	select {
	case <-closed:
	case <-sess.done:
	case <-t.C:
	case <-ctx.Done():
	}
	c.Close()
	<-closed
}

// end removes the caller's sessions (with one proxy, or all).
func (s *Server) end(uid uint32, req Request) Response {
	var puid uint32
	if req.Proxy != "" {
		id, err := identity.UID(s.res, req.Proxy)
		if err != nil {
			return fail(CodeBadRequest, "proxy %q: %v", req.Proxy, err)
		}
		puid = id
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, v := range s.sessions {
		if k.uid == uid && (req.Proxy == "" || k.proxy == puid) {
			close(v.done)
			delete(s.sessions, k)
			n++
		}
	}
	return Response{OK: true, Ended: n}
}

func (s *Server) list(uid uint32) Response {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []Session{}
	for k, v := range s.sessions {
		if now.After(v.Expires) {
			continue
		}
		if uid == 0 || k.uid == uid || k.proxy == uid {
			out = append(out, v.Session)
		}
	}
	slices.SortFunc(out, func(a, b Session) int {
		if a.User != b.User {
			if a.User < b.User {
				return -1
			}
			return 1
		}
		return int(a.ProxyUID) - int(b.ProxyUID)
	})
	return Response{OK: true, Sessions: out}
}

// sessionFor is the live session of uid with proxy (nil: none).
func (s *Server) sessionFor(uid, proxy uint32) *Session {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	k := sessionKey{uid, proxy}
	v := s.sessions[k]
	if v == nil {
		return nil
	}
	if !now.Before(v.Expires) {
		if !v.Held {
			delete(s.sessions, k)
		}
		return nil
	}
	c := v.Session
	return &c
}

// maxRelays bounds the delegated connections open at once, maxRelaysPerUID
// those of one user (her app decides when a connection ends: an app that
// never closes must not use up everyone's).
const (
	maxRelays       = 4096
	maxRelaysPerUID = 256
)

// relay keeps the user's connected TCP socket (fd, taken) in the agent and
// returns the proxy's end of a Unix stream pair that carries its bytes. The
// proxy never holds the user's socket: with it, it could disconnect it
// (connect AF_UNSPEC) and connect it again anywhere, or bind and listen on
// it, as the user, long after her session ended (redteam, session 7).
func (s *Server) relay(fd int, uid uint32) (proxyEnd int, err error) {
	// What is still this function's when it fails, released in one place:
	// the descriptors and connections not handed on, the relay's count.
	fds := []int{fd}
	var conns []net.Conn
	var done func()
	defer func() {
		if err == nil {
			return
		}
		for _, c := range conns {
			c.Close()
		}
		for _, f := range fds {
			closeFD(f)
		}
		if done != nil {
			done()
		}
	}()
	// fileConn takes its descriptor, whatever it returns.
	conn := func(fd int, name string) (net.Conn, error) {
		fds = slices.DeleteFunc(fds, func(f int) bool { return f == fd })
		c, err := fileConn(fd, name)
		if err == nil {
			conns = append(conns, c)
		}
		return c, err
	}
	s.mu.Lock()
	if s.relays >= maxRelays || s.userRelays[uid] >= maxRelaysPerUID {
		err = fmt.Errorf("too many delegated connections open (%d of %d in all, %d of %d for uid %d)",
			s.relays, maxRelays, s.userRelays[uid], maxRelaysPerUID, uid)
		s.mu.Unlock()
		return -1, err
	}
	s.relays++
	s.userRelays[uid]++
	s.mu.Unlock()
	done = func() {
		s.mu.Lock()
		s.relays--
		if s.userRelays[uid]--; s.userRelays[uid] <= 0 {
			delete(s.userRelays, uid)
		}
		s.mu.Unlock()
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	fds = append(fds, pair[0], pair[1])
	up, err := conn(fd, "portal-user")
	if err != nil {
		return -1, err
	}
	down, err := conn(pair[0], "portal-proxy")
	if err != nil {
		return -1, err
	}
	go func() {
		defer done()
		relay.Splice(up, down) // half-closes: the other direction goes on
	}()
	return pair[1], nil
}

// fileConn makes a net.Conn of fd (taken).
func fileConn(fd int, name string) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), name)
	defer f.Close() // FileConn dups it
	return net.FileConn(f)
}

// connect makes the connection a proxy asks for, as the user; the
// descriptor returned (≥ 0) is the caller's to send and close.
func (s *Server) connect(ctx context.Context, peer uint32, req Request) (Response, int) {
	st := s.settings.Load()
	pname, ok := s.proxyUID(st, peer)
	refuse := func(code, format string, args ...any) (Response, int) {
		r := fail(code, format, args...)
		s.log.Warn("portal connection refused", "proxy_uid", peer, "user", req.User, "address", req.Address, "err", r.Error)
		return r, -1
	}
	if !ok {
		return refuse(CodeForbidden, "uid %d is not a [portal] proxy", peer)
	}
	if req.User == "" || req.Address == "" {
		return refuse(CodeBadRequest, "connect needs user and address")
	}
	// A name, never a number: a login made of digits ("2001", a student
	// number) would otherwise be read as another user's uid.
	uid, _, err := s.res.LookupUser(req.User)
	if err != nil {
		return refuse(CodeForbidden, "user %q: %v (a user name is wanted)", req.User, err)
	}
	if why := s.actable(st, uid); why != "" {
		return refuse(CodeForbidden, "%s", why)
	}
	sess := s.sessionFor(uid, peer)
	if sess == nil {
		return refuse(CodeForbidden, "%s has no session with proxy %s (only the user's own process can register one: palisade portal session)", req.User, pname)
	}
	// The session's group is re-checked: a user removed from it since
	// gets her primary group.
	gid := sess.GID
	if sess.Group == "" {
		// Her primary group now, not at registration.
		if _, gid, err = s.res.LookupUser(sess.User); err != nil {
			return refuse(CodeForbidden, "user %s: %v", sess.User, err)
		}
	} else {
		if gids, err := s.res.GroupsOf(sess.User); err != nil || !slices.Contains(gids, gid) {
			_, gid, err = s.res.LookupUser(sess.User)
			if err != nil {
				return refuse(CodeForbidden, "user %s: %v", sess.User, err)
			}
		}
	}
	host, port, err := net.SplitHostPort(req.Address)
	if err != nil {
		return refuse(CodeBadRequest, "address %q: %v", req.Address, err)
	}
	pn, err := strconv.ParseUint(port, 10, 16)
	if err != nil || pn == 0 {
		return refuse(CodeBadRequest, "address %q: bad port", req.Address)
	}
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(cctx, "ip", host)
	if err != nil || len(addrs) == 0 {
		return refuse(CodeUnreachable, "%s: cannot resolve: %v", host, err)
	}
	var lastErr error
	for _, a := range addrs {
		fd, err := connectAs(cctx, s.kernel, uid, gid, a.Unmap(), uint16(pn))
		if err != nil {
			lastErr = err
			var oe *ownerError
			if errors.As(err, &oe) {
				return refuse(CodeInternal, "%v", err)
			}
			continue
		}
		to := net.JoinHostPort(a.Unmap().String(), port)
		// The session may have ended, or the proxy left the list, while
		// this connection was being made.
		if s.sessionFor(uid, peer) == nil {
			closeFD(fd)
			return refuse(CodeForbidden, "%s's session with proxy %s ended", req.User, pname)
		}
		if _, ok := s.proxyUID(s.settings.Load(), peer); !ok {
			closeFD(fd)
			return refuse(CodeForbidden, "uid %d is no longer a [portal] proxy", peer)
		}
		pfd, err := s.relay(fd, uid)
		if err != nil {
			return refuse(CodeInternal, "relay: %v", err)
		}
		s.log.Info("portal connection", "proxy", pname, "user", sess.User, "uid", uid, "gid", gid, "address", to)
		return Response{OK: true, UID: uid, GID: gid, Address: to}, pfd
	}
	return refuse(CodeUnreachable, "%s: %v", req.Address, lastErr)
}
