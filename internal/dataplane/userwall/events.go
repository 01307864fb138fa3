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

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
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
	// a reset / ICMP), "bind", "unix", or "send" (at the sender: unstampable).
	Stage string `json:"stage,omitempty"`
	// Claim: shared on the connector's carried gid alone — this node had
	// not looked the connector's groups up yet (docs/policy.md, "The
	// carried gid is a claim"); logged, not only sampled.
	Claim bool `json:"claim,omitempty"`
	// Grant describes the user grant (palisade share) that admitted a
	// "user-grant" verdict: "alice's grant on 8888/tcp to bob, expires ...".
	Grant string `json:"grant,omitempty"`
}

// eventSink turns ring-buffer records into rate-limited JSON lines and
// syslog messages, and hands every decoded verdict to the flow recorder.
// Its goroutine (run) alone decodes and writes: names are looked up with no
// lock held, so a slow directory delays only the sink, never the agent's
// loop (a reload swaps the outputs without waiting for a write).
type eventSink struct {
	node  string
	log   *slog.Logger
	names *identity.NameCache
	// out are the current outputs; wmu serialises writes with the closing
	// of outputs a reopen replaced.
	out atomic.Pointer[sinkOutputs]
	wmu sync.Mutex
	// seen learns the groups of refused connectors (membership.Tracker).
	seen func(uid uint32)
	// site names the site rule of a site-deny event (nil: not named).
	site func(c policy.Conn, trusted bool) policy.Verdict
	// grant describes the grant that admitted a user-grant event.
	grant func(c policy.Conn) string
	// flows receives every verdict (nil: none recorded).
	flows *flowRecorder

	Logged, Suppressed atomic.Uint64
	// WriteErrors counts lines the event log or syslog did not take;
	// Malformed counts ring-buffer records that did not decode.
	WriteErrors, Malformed atomic.Uint64
	errLog                 logEvery
}

// sinkOutputs are the event log, syslog and the rate limit of one
// configuration.
type sinkOutputs struct {
	path  string
	file  io.WriteCloser
	sys   *syslog.Writer
	limit *rate.Limiter // nil: log nothing (event_rate 0)
}

func (o *sinkOutputs) close() {
	if o.file != nil {
		o.file.Close()
	}
	if o.sys != nil {
		o.sys.Close()
	}
}

func openOutputs(path string, useSyslog bool, perSec int) (*sinkOutputs, error) {
	o := &sinkOutputs{path: path, limit: newEventLimit(perSec)}
	if path != "" {
		if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
			return nil, err
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, fmt.Errorf("event log: %w", err)
		}
		o.file = f
	}
	if useSyslog {
		if _, err := os.Stat("/dev/log"); err == nil {
			if w, err := syslog.Dial("unixgram", "/dev/log", syslog.LOG_WARNING|syslog.LOG_AUTH, "palisade-userwall"); err == nil {
				o.sys = w
			}
		}
	}
	return o, nil
}

func newEventSink(path string, useSyslog bool, perSec int, log *slog.Logger) (*eventSink, error) {
	o, err := openOutputs(path, useSyslog, perSec)
	if err != nil {
		return nil, err
	}
	s := &eventSink{log: log, names: identity.NewNameCache(nil, time.Minute)}
	s.node, _ = os.Hostname()
	s.out.Store(o)
	return s, nil
}

// reopen replaces the sink's outputs; on error the old ones stay. It does
// not wait for a write in progress: the old outputs are closed once it is
// done. A new limiter only for a new rate: a reopen keeps the budget.
func (s *eventSink) reopen(path string, useSyslog bool, perSec int) error {
	n, err := openOutputs(path, useSyslog, perSec)
	if err != nil {
		return err
	}
	old := s.out.Load()
	if old != nil && n.limit != nil && old.limit != nil && n.limit.Limit() == old.limit.Limit() {
		n.limit = old.limit
	}
	s.out.Store(n)
	if old != nil {
		go func() {
			s.wmu.Lock()
			defer s.wmu.Unlock()
			old.close()
		}()
	}
	return nil
}

func (s *eventSink) close() {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if o := s.out.Swap(nil); o != nil {
		o.close()
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
	o := s.out.Load()
	return o != nil && o.limit != nil && o.limit.AllowN(now, 1)
}

func addrPort(fam uint8, a [16]uint8, port uint16) string {
	ip := netip.AddrFrom16(a)
	if fam == 4 {
		ip = ip.Unmap()
	}
	return netip.AddrPortFrom(ip, port).String()
}

func (s *eventSink) decode(raw []byte) (Event, error) {
	var r kernel.RawEvent
	if err := binary.Read(bytes.NewReader(raw), binary.NativeEndian, &r); err != nil {
		return Event{}, err
	}
	return s.decodeRecord(&r), nil
}

// decodeRecord names the parties of a record (NSS: may be slow; no lock).
func (s *eventSink) decodeRecord(r *kernel.RawEvent) Event {
	e := Event{Time: time.Now().UTC(), Node: s.node, Verdict: "deny", Rule: kernel.RuleName(r.Rule), Path: kernel.PathName(r.Path), PID: r.Pid}
	switch {
	case r.Audit != 0:
		e.Verdict = "audit" // refused by the rules, let through (audit mode)
	case kernel.RuleAllows(r.Rule):
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
	case kernel.Path(r.Path) == kernel.PathBind:
		e.Stage = "bind"
	case kernel.Path(r.Path) == kernel.PathSource:
		e.Stage = "send" // refused at the sender (rule unstampable)
	case r.Polite != 0:
		e.Stage = "early"
	default:
		e.Stage = "socket"
	}
	if r.Family != 1 && kernel.Path(r.Path) != kernel.PathBind && kernel.Path(r.Path) != kernel.PathSource {
		e.Stamp = kernel.StampName(r.Stamp)
	}
	e.Listener = Party{UID: r.Luid, User: s.names.User(r.Luid), GID: r.Lgid, Group: s.names.Group(r.Lgid)}
	if kernel.Rule(r.Rule) == kernel.RuleSiteDeny && s.site != nil && r.Family != 1 {
		c := policy.Conn{Source: netip.AddrFrom16(r.Saddr).Unmap(), Connector: policy.Identity{UID: r.Cuid, GID: r.Cgid},
			Listener: policy.Identity{UID: r.Luid, GID: r.Lgid}, Port: r.Dport, Proto: policy.Proto(r.Proto), Node: s.node}
		if v := s.site(c, r.HasConnector != 0); !v.Allow && v.Rule != policy.RuleDenied {
			e.SiteRule = string(v.Rule)
		}
	}
	if kernel.Rule(r.Rule) == kernel.RuleUserGrant && s.grant != nil {
		e.Grant = s.grant(policy.Conn{Connector: policy.Identity{UID: r.Cuid, GID: r.Cgid},
			Listener: policy.Identity{UID: r.Luid, GID: r.Lgid}, Port: r.Dport, Proto: policy.Proto(r.Proto)})
	}
	e.Claim = r.Claim != 0
	if r.HasConnector != 0 {
		e.Connector = &Party{UID: r.Cuid, User: s.names.User(r.Cuid), GID: r.Cgid, Group: s.names.Group(r.Cgid)}
	}
	if r.Family == 1 {
		name := bytes.TrimRight(r.Daddr[:], "\x00")
		e.Dst = "@" + string(name)
	} else {
		e.Dst = addrPort(r.Family, r.Daddr, r.Dport)
		if kernel.Path(r.Path) != kernel.PathBind { // the packet's source
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
	return e
}

// sampled reports whether e is an allowed verdict recorded within the
// sampling budget: for the flows only, never logged.
func (e *Event) sampled() bool {
	return e.Verdict == "allow" && e.Rule != "unverified" && e.Rule != string(policy.RuleUserGrant) && !e.Claim
}

func (s *eventSink) handle(raw []byte) {
	var r kernel.RawEvent
	if err := binary.Read(bytes.NewReader(raw), binary.NativeEndian, &r); err != nil {
		s.Malformed.Add(1)
		return
	}
	if s.seen != nil && r.HasConnector != 0 && (!kernel.RuleAllows(r.Rule) || r.Claim != 0) {
		s.seen(r.Cuid)
	}
	e := s.decodeRecord(&r)
	if s.flows != nil {
		s.flows.offer(&e, r.Pid)
	}
	if e.sampled() {
		return
	}
	if !s.allow(time.Now()) {
		s.Suppressed.Add(1)
		return
	}
	s.Logged.Add(1)
	line, _ := json.Marshal(e)
	s.write(line)
}

// write puts one line into the event log and syslog; what they do not take
// is counted and logged (once a minute at most, with the count).
func (s *eventSink) write(line []byte) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	o := s.out.Load()
	if o == nil {
		return
	}
	if o.file != nil {
		if _, err := o.file.Write(append(line, '\n')); err != nil {
			s.writeFailed("event log "+o.path, err)
		}
	}
	if o.sys != nil {
		if err := o.sys.Warning(string(line)); err != nil {
			s.writeFailed("syslog", err)
		}
	}
}

func (s *eventSink) writeFailed(what string, err error) {
	n := s.WriteErrors.Add(1)
	if s.errLog.due(time.Now()) {
		s.log.Error("event not written", "to", what, "err", err, "write_errors_total", n)
	}
}

// logEvery lets a repeated error through to the log once a minute.
type logEvery struct {
	mu   sync.Mutex
	last time.Time
}

func (l *logEvery) due(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < time.Minute {
		return false
	}
	l.last = now
	return true
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
