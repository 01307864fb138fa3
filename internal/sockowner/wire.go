package sockowner

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Protocol: one JSON object per UDP datagram (or per line on the Unix
// socket), a query answered by exactly one answer carrying the same id.
// "v" is the protocol version; a server answers a version it does not speak
// with status "bad-version" so that mixed versions fail loudly during a
// rolling upgrade rather than time out.
const (
	// Version is the protocol version this package speaks.
	Version = 1
	// DefaultPort is the ident service's UDP port: 99, as ident2 and the
	// MIT firewall used — privileged, so only root can serve it, and
	// unassigned in practice (it was "metagram").
	DefaultPort = 99
	// DefaultSocketPath is the local API's Unix socket.
	DefaultSocketPath = "/run/palisade/ident.sock"
	// maxQuery bounds a query datagram/line; maxAnswer an answer.
	maxQuery  = 1024
	maxAnswer = 16 * 1024
	// MaxDataAnswer bounds the answer to a data query (flows, audit): one
	// UDP datagram. The data a node returns must leave room for the
	// envelope (MaxData).
	MaxDataAnswer = 63 * 1024
	MaxData       = 60 * 1024
	// maxGroups bounds the supplementary groups carried in an answer
	// (ident2 carried 350); beyond it the answer says truncated.
	maxGroups = 1024
)

// Answer statuses.
const (
	StatusOK         = "ok"
	StatusNoSocket   = "no-socket"
	StatusBadQuery   = "bad-query"
	StatusBadVersion = "bad-version"
	StatusError      = "error"
	StatusTimeout    = "timeout" // Unix API only: the remote node did not answer
)

// Query asks who owns the socket with local end Addr (and remote end Peer,
// if given) on the answering node. Node is honoured only by the Unix API:
// ask that node's ident service instead of the local kernel.
type Query struct {
	V     int    `json:"v"`
	ID    uint32 `json:"id"`
	Proto string `json:"proto"`
	Addr  string `json:"addr"`
	Peer  string `json:"peer,omitempty"`
	Node  string `json:"node,omitempty"`
	// Kind is empty for an owner lookup, KindStatus for the node's status
	// report (UDP only: `palisade status --all`). A server that predates
	// kinds answers a status query with bad-query (no addr).
	Kind string `json:"kind,omitempty"`
	// Args are the arguments of a data query (KindFlows, KindAudit),
	// opaque to this package.
	Args json.RawMessage `json:"args,omitempty"`
}

// KindStatus asks a node for its status report.
const KindStatus = "status"

// Data queries (UDP only), answered by ServerConfig.Data: the node's
// recent verdicts (`palisade flows`) and its would-be refusals grouped
// (`palisade audit report`).
const (
	KindFlows = "flows"
	KindAudit = "audit"
	// KindGrant: a user grant request (palisade share --node) another
	// node's agent forwards for the user its own socket authenticated.
	KindGrant = "grant"
)

// Answer is the reply to one Query.
type Answer struct {
	V         int    `json:"v"`
	ID        uint32 `json:"id"`
	Status    string `json:"status"`
	Error     string `json:"error,omitempty"`
	Owner     *Owner `json:"owner,omitempty"`
	Truncated bool   `json:"groups_truncated,omitempty"`
	// Node is the address of the node that answered (Unix API).
	Node string `json:"node,omitempty"`
	// Report is the answer to a status query: the agent's report, opaque
	// to this package.
	Report json.RawMessage `json:"report,omitempty"`
	// Data is the answer to a data query, opaque to this package.
	Data json.RawMessage `json:"data,omitempty"`
}

// parsedQuery is a validated Query.
type parsedQuery struct {
	ID    uint32
	Kind  string
	Args  json.RawMessage
	Proto policy.Proto
	Addr  netip.AddrPort
	Peer  netip.AddrPort
	Node  netip.Addr
}

// ParseProto accepts "tcp" and "udp" (any case; empty = tcp).
func ParseProto(s string) (policy.Proto, error) {
	switch strings.ToLower(s) {
	case "", "tcp":
		return policy.TCP, nil
	case "udp":
		return policy.UDP, nil
	}
	return 0, fmt.Errorf("unknown protocol %q (want tcp or udp)", s)
}

// ParseTarget parses ADDR:PORT[/udp|/tcp], e.g. "198.18.0.2:5000/udp" or
// "[2001:2::2]:5000".
func ParseTarget(s string) (netip.AddrPort, policy.Proto, error) {
	addr, proto := s, "tcp"
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		addr, proto = s[:i], s[i+1:]
	}
	p, err := ParseProto(proto)
	if err != nil {
		return netip.AddrPort{}, 0, err
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return netip.AddrPort{}, 0, fmt.Errorf("bad address %q: want ADDR:PORT[/udp], IPv6 as [ADDR]:PORT", addr)
	}
	if ap.Port() == 0 {
		return netip.AddrPort{}, 0, fmt.Errorf("bad address %q: port 0", addr)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), p, nil
}

func decodeQuery(b []byte) (parsedQuery, *Answer) {
	var q Query
	if err := json.Unmarshal(b, &q); err != nil {
		return parsedQuery{}, &Answer{V: Version, Status: StatusBadQuery, Error: "malformed JSON"}
	}
	bad := func(format string, a ...any) (parsedQuery, *Answer) {
		return parsedQuery{}, &Answer{V: Version, ID: q.ID, Status: StatusBadQuery, Error: fmt.Sprintf(format, a...)}
	}
	if q.V != Version {
		return parsedQuery{}, &Answer{V: Version, ID: q.ID, Status: StatusBadVersion,
			Error: fmt.Sprintf("protocol version %d not supported (this node speaks %d)", q.V, Version)}
	}
	switch q.Kind {
	case "":
	case KindStatus, KindFlows, KindAudit, KindGrant:
		return parsedQuery{ID: q.ID, Kind: q.Kind, Args: q.Args}, nil
	default:
		return bad("unknown kind %q", q.Kind)
	}
	pq := parsedQuery{ID: q.ID}
	var err error
	if pq.Proto, err = ParseProto(q.Proto); err != nil {
		return bad("%v", err)
	}
	if pq.Addr, err = netip.ParseAddrPort(q.Addr); err != nil || pq.Addr.Port() == 0 {
		return bad("bad addr %q", q.Addr)
	}
	if q.Peer != "" {
		if pq.Peer, err = netip.ParseAddrPort(q.Peer); err != nil {
			return bad("bad peer %q", q.Peer)
		}
	}
	if q.Node != "" {
		if pq.Node, err = netip.ParseAddr(q.Node); err != nil {
			return bad("bad node %q", q.Node)
		}
	}
	return pq, nil
}

func encodeQuery(pq parsedQuery) []byte {
	q := Query{V: Version, ID: pq.ID, Proto: pq.Proto.String(), Addr: pq.Addr.String()}
	if pq.Peer.IsValid() {
		q.Peer = pq.Peer.String()
	}
	if pq.Node.IsValid() {
		q.Node = pq.Node.String()
	}
	b, _ := json.Marshal(q)
	return b
}

// answerFor builds the answer to a lookup result.
func answerFor(id uint32, o Owner, err error) *Answer {
	switch {
	case errors.Is(err, ErrNoSocket):
		return &Answer{V: Version, ID: id, Status: StatusNoSocket}
	case err != nil:
		return &Answer{V: Version, ID: id, Status: StatusError, Error: err.Error()}
	}
	a := &Answer{V: Version, ID: id, Status: StatusOK, Owner: &o}
	if len(o.Groups) > maxGroups {
		o.Groups = o.Groups[:maxGroups]
		a.Truncated = true
	}
	return a
}

func encodeAnswer(a *Answer) []byte {
	b, _ := json.Marshal(a)
	return b
}

// decodeAnswer validates an answer to query id and turns it into a result.
func decodeAnswer(b []byte, id uint32) (Owner, error) {
	var a Answer
	if err := json.Unmarshal(b, &a); err != nil {
		return Owner{}, fmt.Errorf("ident: malformed answer: %w", err)
	}
	if a.ID != id {
		return Owner{}, errStaleAnswer
	}
	return a.result()
}

var errStaleAnswer = errors.New("ident: answer to another query")

func (a *Answer) result() (Owner, error) {
	switch a.Status {
	case StatusOK:
		if a.Owner == nil {
			return Owner{}, errors.New("ident: answer without owner")
		}
		return *a.Owner, nil
	case StatusNoSocket:
		return Owner{}, ErrNoSocket
	case StatusTimeout:
		return Owner{}, fmt.Errorf("%w: %s", ErrTimeout, a.Error)
	}
	return Owner{}, fmt.Errorf("ident: %s: %s", a.Status, a.Error)
}
