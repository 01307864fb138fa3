package userwall

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"log/syslog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// Party is one end of a refused connection.
type Party struct {
	UID   uint32 `json:"uid"`
	User  string `json:"user,omitempty"`
	GID   uint32 `json:"gid"`
	Group string `json:"group,omitempty"`
}

// Event is one denial, as written to the event log (one JSON object a line).
type Event struct {
	Time    time.Time `json:"time"`
	Node    string    `json:"node"`
	Verdict string    `json:"verdict"`
	Rule    string    `json:"rule"`
	// SiteRule names the site rule ([[rule]]) of a "site-deny": the one
	// policy.Decide finds for the event's facts ("" if it finds another).
	SiteRule  string `json:"site_rule,omitempty"`
	Path      string `json:"path"`
	Proto     string `json:"proto"`
	Connector *Party `json:"connector,omitempty"` // nil: no trusted identity (off-cluster)
	Listener  Party  `json:"listener"`
	Src       string `json:"src,omitempty"`
	Dst       string `json:"dst"`
	PID       uint32 `json:"pid,omitempty"`
	Comm      string `json:"comm,omitempty"`
	// Stamp says what the packet's identity stamp was worth ("valid",
	// "none", "bad-mac", "stale", ...); empty for local socket calls.
	Stamp string `json:"stamp,omitempty"`
	// Stage is where the refusal happened: "socket" (the packet was dropped
	// at the socket it was queued to), "early" (refused before the stack by
	// a reset / ICMP), "bind" or "unix".
	Stage string `json:"stage,omitempty"`
}

// eventSink turns ring-buffer records into rate-limited JSON lines and
// syslog messages.
type eventSink struct {
	node  string
	log   *slog.Logger
	mu    sync.Mutex
	file  io.WriteCloser
	sys   *syslog.Writer
	limit *rate.Limiter // nil: log nothing (event_rate 0)
	names *identity.NameCache
	// seen learns the groups of refused connectors (membership.Tracker).
	seen func(uid uint32)
	// site names the site rule of a site-deny event (nil: not named).
	site func(c policy.Conn, trusted bool) policy.Verdict

	Logged, Suppressed atomic.Uint64
}

func newEventSink(path string, useSyslog bool, perSec int, log *slog.Logger) (*eventSink, error) {
	s := &eventSink{log: log, limit: newEventLimit(perSec), names: identity.NewNameCache(nil, time.Minute)}
	s.node, _ = os.Hostname()
	if path != "" {
		if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
			return nil, err
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, fmt.Errorf("event log: %w", err)
		}
		s.file = f
	}
	if useSyslog {
		if _, err := os.Stat("/dev/log"); err == nil {
			if w, err := syslog.Dial("unixgram", "/dev/log", syslog.LOG_WARNING|syslog.LOG_AUTH, "palisade-userwall"); err == nil {
				s.sys = w
			}
		}
	}
	return s, nil
}

func (s *eventSink) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file != nil {
		s.file.Close()
		s.file = nil
	}
	if s.sys != nil {
		s.sys.Close()
		s.sys = nil
	}
}

// newEventLimit allows perSec events a second with a burst of 5 s worth;
// nil (nothing logged) for perSec <= 0.
func newEventLimit(perSec int) *rate.Limiter {
	if perSec <= 0 {
		return nil
	}
	return rate.NewLimiter(rate.Limit(perSec), 5*perSec)
}

func (s *eventSink) allow(now time.Time) bool {
	return s.limit != nil && s.limit.AllowN(now, 1)
}

func addrPort(fam uint8, a [16]uint8, port uint16) string {
	ip := netip.AddrFrom16(a)
	if fam == 4 {
		ip = ip.Unmap()
	}
	return netip.AddrPortFrom(ip, port).String()
}

func (s *eventSink) decode(raw []byte) (Event, error) {
	var r uwbpfUwEvent
	if err := binary.Read(bytes.NewReader(raw), binary.NativeEndian, &r); err != nil {
		return Event{}, err
	}
	e := Event{Time: time.Now().UTC(), Node: s.node, Verdict: "deny", Rule: ruleName(r.Rule), Path: pathName(r.Path), PID: r.Pid}
	switch {
	case r.Audit != 0:
		e.Verdict = "audit" // refused by the rules, let through (audit mode)
	case ruleAllows(r.Rule):
		e.Verdict = "allow" // admitted and reported (unverified)
	}
	switch r.Proto {
	case 6:
		e.Proto = "tcp"
	case 17:
		e.Proto = "udp"
	case 136:
		e.Proto = "udplite"
	case 132:
		e.Proto = "sctp"
	case 33:
		e.Proto = "dccp"
	case 1:
		if r.Family == 1 {
			e.Proto = "unix"
		} else {
			e.Proto = "icmp"
		}
	default:
		e.Proto = strconv.Itoa(int(r.Proto))
	}
	switch {
	case r.Family == 1:
		e.Stage = "unix"
	case uwbpfUwPath(r.Path) == uwbpfUwPathP_BIND:
		e.Stage = "bind"
	case r.Polite != 0:
		e.Stage = "early"
	default:
		e.Stage = "socket"
	}
	if r.Family != 1 && uwbpfUwPath(r.Path) != uwbpfUwPathP_BIND {
		e.Stamp = stampName(r.Stamp)
	}
	e.Listener = Party{UID: r.Luid, User: s.names.User(r.Luid), GID: r.Lgid, Group: s.names.Group(r.Lgid)}
	if uwbpfUwRule(r.Rule) == uwbpfUwRuleR_SITE_DENY && s.site != nil && r.Family != 1 {
		c := policy.Conn{Source: netip.AddrFrom16(r.Saddr).Unmap(), Connector: policy.Identity{UID: r.Cuid, GID: r.Cgid},
			Listener: policy.Identity{UID: r.Luid, GID: r.Lgid}, Port: r.Dport, Proto: policy.Proto(r.Proto), Node: s.node}
		if v := s.site(c, r.HasConnector != 0); !v.Allow && v.Rule != policy.RuleDenied {
			e.SiteRule = string(v.Rule)
		}
	}
	if r.HasConnector != 0 {
		e.Connector = &Party{UID: r.Cuid, User: s.names.User(r.Cuid), GID: r.Cgid, Group: s.names.Group(r.Cgid)}
	}
	if r.Family == 1 {
		name := bytes.TrimRight(r.Daddr[:], "\x00")
		e.Dst = "@" + string(name)
	} else {
		e.Dst = addrPort(r.Family, r.Daddr, r.Dport)
		if uwbpfUwPath(r.Path) != uwbpfUwPathP_BIND { // the packet's source
			e.Src = addrPort(r.Family, r.Saddr, r.Sport)
		}
	}
	var comm []byte
	for _, c := range r.Comm {
		if c == 0 {
			break
		}
		comm = append(comm, byte(c))
	}
	e.Comm = string(comm)
	return e, nil
}

func (s *eventSink) handle(raw []byte) {
	if s.seen != nil {
		if uid, ok := refusedConnector(raw); ok {
			s.seen(uid)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.allow(time.Now()) {
		s.Suppressed.Add(1)
		return
	}
	e, err := s.decode(raw)
	if err != nil {
		return
	}
	s.Logged.Add(1)
	line, _ := json.Marshal(e)
	if s.file != nil {
		s.file.Write(append(line, '\n'))
	}
	if s.sys != nil {
		s.sys.Warning(string(line))
	}
}

// run reads the ring buffer until it is closed.
func (s *eventSink) run(rd *ringbuf.Reader) {
	for {
		rec, err := rd.Read()
		if err != nil {
			if errors.Is(err, ringbuf.ErrClosed) {
				return
			}
			continue
		}
		s.handle(rec.RawSample)
	}
}
