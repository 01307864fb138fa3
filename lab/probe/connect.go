package probe

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Target is one case of a plan: where to connect and how.
type Target struct {
	ID    string `json:"id"`
	Addr  string `json:"addr"`  // host:port, IPv6 in brackets
	Proto string `json:"proto"` // "tcp" or "udp"
}

// Plan is what a connector process probes. Targets are keyed by the
// hostname of the node the connector runs on, so one plan file serves every
// rank of an MPI job or a job whose node Slurm picks; the key "*" applies on
// every host.
type Plan struct {
	// TCPTimeoutMS bounds a TCP connect (default 3000): the handshake is
	// the kernel's and refusals are resets, so only a silent drop reaches
	// it. It was 1000: that raced the kernel's first SYN retransmission
	// (at 1 s) and, on a loaded machine, the scheduling of the connector
	// itself — 13 of 74,400 cases of a 20-run repeat at load average
	// 26–40 timed out, system ports included, with no SYN retransmitted
	// and no listen drop counted in the node.
	TCPTimeoutMS int `json:"tcp_timeout_ms,omitempty"`
	// ReplyTimeoutMS bounds the wait for a TCP listener's reply once
	// connected (default 3000). That needs the listener process to run,
	// which on a loaded machine can take a while, and no firewall refuses
	// by withholding a reply on an accepted connection.
	ReplyTimeoutMS int `json:"reply_timeout_ms,omitempty"`
	// UDPTries datagrams are sent before a UDP case counts as timed out;
	// the first wait is UDPWaitMS and each next one twice as long
	// (defaults 4 and 150: 150+300+600+1200 ms; with 3 tries a listener
	// that did not run within 1 s at load average 40 looked like a drop:
	// 2 system-port cases of 74,400). Refusals by ICMP surface at
	// once; the growing waits only keep a slow listener from looking
	// like a silent drop.
	UDPTries  int `json:"udp_tries,omitempty"`
	UDPWaitMS int `json:"udp_wait_ms,omitempty"`
	// Parallel bounds concurrent cases (default 512).
	Parallel int                 `json:"parallel,omitempty"`
	Hosts    map[string][]Target `json:"hosts"`
}

// Validate checks every target so that a bad plan fails before any traffic.
func (p *Plan) Validate() error {
	for host, ts := range p.Hosts {
		for _, t := range ts {
			if t.Proto == ProtoUnixStream || t.Proto == ProtoUnixDgram {
				if !strings.HasPrefix(t.Addr, "@palprobe-") {
					return fmt.Errorf("plan: host %s case %q: %q is not an abstract probe socket", host, t.ID, t.Addr)
				}
				continue
			}
			if t.Proto != "tcp" && t.Proto != "udp" {
				return fmt.Errorf("plan: host %s case %q: proto %q (want tcp, udp, unix or unixgram)", host, t.ID, t.Proto)
			}
			if _, err := netip.ParseAddrPort(t.Addr); err != nil {
				return fmt.Errorf("plan: host %s case %q: %w", host, t.ID, err)
			}
		}
	}
	return nil
}

// ReadPlan loads and validates a JSON plan.
func ReadPlan(r io.Reader) (*Plan, error) {
	var p Plan
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return nil, fmt.Errorf("plan: %w", err)
	}
	return &p, p.Validate()
}

// For returns the targets for host (its own entry plus "*").
func (p *Plan) For(host string) []Target {
	return append(append([]Target(nil), p.Hosts[host]...), p.Hosts["*"]...)
}

// Line is one line of connector output: a "start" line with the
// connector's identity, one "result" per case, then a "done" line. A reader
// that sees "start" but not "done" knows results were lost.
type Line struct {
	Type string `json:"type"` // start, result, done
	Host string `json:"host"`
	PID  int    `json:"pid,omitempty"`

	// start: who the connector really runs as (launchers change it).
	Self  *Creds `json:"self,omitempty"`
	Cases int    `json:"cases,omitempty"`

	// result
	ID      string    `json:"id,omitempty"`
	Allowed bool      `json:"allowed,omitempty"`
	Peer    *Identity `json:"peer,omitempty"`
	Kind    string    `json:"kind,omitempty"` // why refused: EPERM, ECONNREFUSED, timeout, …
	Error   string    `json:"error,omitempty"`
	Micros  int64     `json:"us,omitempty"`
}

// Result is the outcome of one target.
type Result struct {
	Target
	Allowed bool
	Peer    Identity
	Kind    string
	Err     error
	Elapsed time.Duration
}

// Refusal kinds. An errno name when the kernel said no; "timeout" when
// nothing came back; the rest when something answered wrongly.
const (
	KindTimeout  = "timeout"
	KindEOF      = "EOF"      // connection closed before a reply
	KindBadReply = "badreply" // a reply that is not ours (wrong nonce, garbage)
	KindOther    = "other"
)

// Classify names the way an attempt failed. ICMP administratively
// prohibited surfaces as EHOSTUNREACH over IPv4 and EACCES over IPv6; a
// local netfilter drop or a BPF connect/sendmsg hook as EPERM.
func Classify(err error) string {
	for _, e := range []syscall.Errno{syscall.EPERM, syscall.EACCES, syscall.ECONNREFUSED,
		syscall.ECONNRESET, syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EADDRNOTAVAIL,
		syscall.ETIMEDOUT, syscall.EPIPE} {
		if errors.Is(err, e) {
			return errnoName(e)
		}
	}
	var ne net.Error
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return KindTimeout
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return KindEOF
	}
	return KindOther
}

func errnoName(e syscall.Errno) string {
	switch e {
	case syscall.EPERM:
		return "EPERM"
	case syscall.EACCES:
		return "EACCES"
	case syscall.ECONNREFUSED:
		return "ECONNREFUSED"
	case syscall.ECONNRESET:
		return "ECONNRESET"
	case syscall.EHOSTUNREACH:
		return "EHOSTUNREACH"
	case syscall.ENETUNREACH:
		return "ENETUNREACH"
	case syscall.EADDRNOTAVAIL:
		return "EADDRNOTAVAIL"
	case syscall.ETIMEDOUT:
		return "ETIMEDOUT"
	case syscall.EPIPE:
		return "EPIPE"
	}
	return e.Error()
}

type badReply struct{ why string }

func (b badReply) Error() string { return b.why }

// Connector probes targets with a plan's timeouts.
type Connector struct {
	TCPTimeout   time.Duration
	ReplyTimeout time.Duration
	UDPTries     int
	UDPWait      time.Duration
	Parallel     int
}

// NewConnector applies the plan's settings over the defaults.
func NewConnector(p *Plan) *Connector {
	c := &Connector{TCPTimeout: 3 * time.Second, ReplyTimeout: 3 * time.Second, UDPTries: 4,
		UDPWait: 150 * time.Millisecond, Parallel: 512}
	if p != nil {
		if p.ReplyTimeoutMS > 0 {
			c.ReplyTimeout = time.Duration(p.ReplyTimeoutMS) * time.Millisecond
		}
		if p.TCPTimeoutMS > 0 {
			c.TCPTimeout = time.Duration(p.TCPTimeoutMS) * time.Millisecond
		}
		if p.UDPTries > 0 {
			c.UDPTries = p.UDPTries
		}
		if p.UDPWaitMS > 0 {
			c.UDPWait = time.Duration(p.UDPWaitMS) * time.Millisecond
		}
		if p.Parallel > 0 {
			c.Parallel = p.Parallel
		}
	}
	return c
}

// Run probes every target concurrently and calls emit (serialised) as each
// result arrives.
func (c *Connector) Run(ctx context.Context, targets []Target, emit func(Result)) {
	sem := make(chan struct{}, max(c.Parallel, 1))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, t := range targets {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			r := c.Probe(ctx, t)
			<-sem
			mu.Lock()
			emit(r)
			mu.Unlock()
		}()
	}
	wg.Wait()
}

// Probe runs one target.
func (c *Connector) Probe(ctx context.Context, t Target) Result {
	start := time.Now()
	nonce := newNonce()
	var (
		rep Reply
		err error
	)
	switch t.Proto {
	case "udp":
		rep, err = c.udp(ctx, t, nonce)
	case ProtoUnixStream:
		rep, err = c.stream(ctx, "unix", t, nonce)
	case ProtoUnixDgram:
		rep, err = c.unixDgram(ctx, t, nonce)
	default:
		rep, err = c.stream(ctx, "tcp", t, nonce)
	}
	r := Result{Target: t, Elapsed: time.Since(start)}
	if err == nil && rep.Nonce != nonce {
		err = badReply{"reply carries another nonce"}
	}
	if err != nil {
		r.Err = err
		if _, ok := err.(badReply); ok {
			r.Kind = KindBadReply
		} else {
			r.Kind = Classify(err)
		}
		return r
	}
	r.Allowed, r.Peer = true, rep.Identity
	return r
}

// stream sends the request on a new stream connection (network "tcp" or
// "unix") and reads the one-line reply.
func (c *Connector) stream(ctx context.Context, network string, t Target, nonce string) (Reply, error) {
	d := net.Dialer{Timeout: c.TCPTimeout}
	conn, err := d.DialContext(ctx, network, t.Addr)
	if err != nil {
		return Reply{}, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(c.ReplyTimeout))
	if _, err := conn.Write(formatRequest(nonce, t.ID)); err != nil {
		return Reply{}, err
	}
	line, err := readLine(conn)
	if err != nil {
		return Reply{}, err
	}
	rep, err := parseReply(line)
	if err != nil {
		return Reply{}, badReply{err.Error()}
	}
	return rep, nil
}

// udp uses a connected socket: the kernel then reports ICMP errors (port
// unreachable, administratively prohibited) on the next send or receive,
// so a refused datagram fails fast instead of waiting out every try.
func (c *Connector) udp(ctx context.Context, t Target, nonce string) (Reply, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "udp", t.Addr)
	if err != nil {
		return Reply{}, err
	}
	defer conn.Close()
	return c.exchange(ctx, conn, t, nonce)
}

// exchange sends the request on a connected datagram socket up to UDPTries
// times, doubling the wait each time, until the reply carrying nonce comes.
func (c *Connector) exchange(ctx context.Context, conn net.Conn, t Target, nonce string) (Reply, error) {
	req := formatRequest(nonce, t.ID)
	buf := make([]byte, maxMsg)
	var last error = os.ErrDeadlineExceeded
	wait := c.UDPWait
	for try := 0; try < c.UDPTries; try, wait = try+1, wait*2 {
		if err := ctx.Err(); err != nil {
			return Reply{}, err
		}
		if _, err := conn.Write(req); err != nil {
			return Reply{}, err
		}
		conn.SetReadDeadline(time.Now().Add(wait))
		for {
			n, err := conn.Read(buf)
			if err != nil {
				if Classify(err) == KindTimeout {
					last = err
					break
				}
				return Reply{}, err
			}
			rep, perr := parseReply(buf[:n])
			if perr == nil && rep.Nonce == nonce {
				return rep, nil
			}
			// Something else answered: keep waiting for ours.
			last = badReply{"unexpected datagram"}
		}
	}
	return Reply{}, last
}

func newNonce() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Creds is a connector's own credentials as the kernel sees them.
type Creds struct {
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Groups []uint32 `json:"groups"`
	Rank   string   `json:"rank,omitempty"` // e.g. OMPI_COMM_WORLD_RANK=1
	// Launch holds the environment a launcher leaves behind (ssh, Slurm,
	// Open MPI), so a reader can tell how the connector really started.
	Launch map[string]string `json:"launch,omitempty"`
}

// launchEnv are the variables that prove a launcher: sshd, slurmstepd and
// Open MPI's orted set them, a plain process has none of them.
var launchEnv = []string{"SSH_CONNECTION", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID",
	"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}

// StartLine describes the calling connector process.
func StartLine(host string, cases int) Line {
	gs, _ := os.Getgroups()
	groups := make([]uint32, 0, len(gs))
	for _, g := range gs {
		groups = append(groups, uint32(g))
	}
	rank := ""
	for _, k := range []string{"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"} {
		if v := os.Getenv(k); v != "" {
			rank = k + "=" + v
			break
		}
	}
	launch := map[string]string{}
	for _, k := range launchEnv {
		if v, ok := os.LookupEnv(k); ok {
			launch[k] = v
		}
	}
	return Line{Type: "start", Host: host, PID: os.Getpid(), Cases: cases,
		Self: &Creds{UID: uint32(os.Getuid()), GID: uint32(os.Getegid()), Groups: groups, Rank: rank, Launch: launch}}
}

// ResultLine is the output line of one result.
func ResultLine(host string, r Result) Line {
	l := Line{Type: "result", Host: host, ID: r.ID, Allowed: r.Allowed, Micros: r.Elapsed.Microseconds()}
	if r.Allowed {
		p := r.Peer
		l.Peer = &p
	} else {
		l.Kind = r.Kind
		if r.Err != nil {
			l.Error = r.Err.Error()
		}
	}
	return l
}

// ParseTarget reads the command-line form proto:host:port (e.g.
// tcp:127.0.0.1:29101, udp:[::1]:29101).
func ParseTarget(s string, n int) (Target, error) {
	proto, addr, ok := strings.Cut(s, ":")
	t := Target{ID: strconv.Itoa(n), Addr: addr, Proto: proto}
	if !ok || (proto != "tcp" && proto != "udp") {
		return t, fmt.Errorf("target %q: want tcp:HOST:PORT or udp:HOST:PORT", s)
	}
	if _, err := netip.ParseAddrPort(addr); err != nil {
		return t, fmt.Errorf("target %q: %w", s, err)
	}
	return t, nil
}
