// Package join is the egress join protocol: how a job turns a join token into
// a lease and a WireGuard peer configuration.
//
// Tokens are issued by the gateway's operator (`palisade gateway token`) and
// travel with the job (env PALISADE_EGRESS_TOKEN, e.g. through sbatch). A
// token is "pe1.<payload>.<mac>": the payload (base64url JSON) names the user,
// the job, the expiry, the gateway's join endpoint and the gateway's public
// key; the MAC is HMAC-SHA256 under a key derived from the gateway's private
// key, so only the gateway can mint or check tokens.
//
// The exchange is one UDP datagram each way: a Noise IK handshake
// (Noise_IK_25519_ChaChaPoly_BLAKE2s). The client generates a fresh X25519
// key pair per job (its WireGuard key) and is the initiator; the gateway's
// static key is pinned from the token. The first message carries the
// client's static key and the request, the second the answer; both are bound
// to fresh ephemeral keys, so an answer is good for one request only. Every
// request carries a TAI64N timestamp that the gateway refuses unless it is
// newer than the last one it accepted from that client key (as WireGuard's
// handshake initiation does), so a captured request (join, renewal or leave)
// cannot be replayed. The gateway rate-limits datagrams per source address
// and overall before it spends a Diffie-Hellman operation on them. See
// docs/egress.md for the threat model.
package join

import (
	"bytes"
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/flynn/noise"
	"golang.org/x/time/rate"
)

// Key is a Curve25519 key as WireGuard uses it.
type Key [32]byte

// String is the base64 form used in files and tokens.
func (k Key) String() string { return base64.StdEncoding.EncodeToString(k[:]) }

// Hex is the form of wireguard-go's UAPI.
func (k Key) Hex() string { return fmt.Sprintf("%x", k[:]) }

// ParseKey reads a base64 key.
func ParseKey(s string) (Key, error) {
	var k Key
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil || len(b) != 32 {
		return k, fmt.Errorf("invalid key %q: want 32 bytes in base64", s)
	}
	copy(k[:], b)
	return k, nil
}

// NewPrivateKey returns a fresh X25519 private key.
func NewPrivateKey() (Key, error) {
	var k Key
	priv, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return k, err
	}
	copy(k[:], priv.Bytes())
	return k, nil
}

// Public derives the public key of a private key.
func (k Key) Public() Key {
	var p Key
	priv, err := ecdh.X25519().NewPrivateKey(k[:])
	if err != nil {
		panic(err) // any 32 bytes are a valid X25519 scalar
	}
	copy(p[:], priv.PublicKey().Bytes())
	return p
}

// Claims is what a token grants.
type Claims struct {
	User    string `json:"u"`
	Job     string `json:"j"`
	Expires int64  `json:"exp"` // unix seconds
	// Gateway is the join endpoint host:port; GatewayKey the pinned public key.
	Gateway    string `json:"gw"`
	GatewayKey string `json:"pk"`
}

// Errors a gateway reports to clients (texts travel in the answer).
var (
	ErrBadToken = errors.New("invalid join token")
	ErrExpired  = errors.New("join token expired")
	ErrRevoked  = errors.New("credentials revoked")
)

func tokenKey(gwPriv Key) []byte {
	k, err := hkdf.Key(sha256.New, gwPriv[:], nil, "palisade-egress-token-v1", 32)
	if err != nil {
		panic(err)
	}
	return k
}

// IssueToken mints a token for c with the gateway's private key.
func IssueToken(gwPriv Key, c Claims) (string, error) {
	if !validName(c.User) || !validName(c.Job) {
		return "", fmt.Errorf("user and job must be 1-32 characters of [a-z0-9_.] (got %q, %q)", c.User, c.Job)
	}
	c.GatewayKey = gwPriv.Public().String()
	p, err := json.Marshal(c)
	if err != nil {
		return "", err
	}
	body := "pe1." + base64.RawURLEncoding.EncodeToString(p)
	m := hmac.New(sha256.New, tokenKey(gwPriv))
	m.Write([]byte(body))
	return body + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil)), nil
}

// ReadToken decodes a token without checking its MAC (what a client can do:
// it learns where the gateway is and which key to pin).
func ReadToken(tok string) (Claims, error) {
	var c Claims
	parts := strings.Split(strings.TrimSpace(tok), ".")
	if len(parts) != 3 || parts[0] != "pe1" {
		return c, fmt.Errorf("%w: not a pe1.<payload>.<mac> token", ErrBadToken)
	}
	p, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return c, fmt.Errorf("%w: payload is not base64url", ErrBadToken)
	}
	if err := json.Unmarshal(p, &c); err != nil {
		return c, fmt.Errorf("%w: payload: %v", ErrBadToken, err)
	}
	return c, nil
}

// VerifyToken checks the MAC and expiry with the gateway's private key.
func VerifyToken(gwPriv Key, tok string, now time.Time) (Claims, error) {
	c, err := ReadToken(tok)
	if err != nil {
		return c, err
	}
	tok = strings.TrimSpace(tok)
	i := strings.LastIndexByte(tok, '.')
	mac, err := base64.RawURLEncoding.DecodeString(tok[i+1:])
	if err != nil {
		return c, fmt.Errorf("%w: bad signature encoding", ErrBadToken)
	}
	m := hmac.New(sha256.New, tokenKey(gwPriv))
	m.Write([]byte(tok[:i]))
	if !hmac.Equal(mac, m.Sum(nil)) {
		return c, fmt.Errorf("%w: signature does not match this gateway's key", ErrBadToken)
	}
	if !validName(c.User) || !validName(c.Job) {
		return c, fmt.Errorf("%w: bad user or job name", ErrBadToken)
	}
	if now.Unix() >= c.Expires {
		return c, fmt.Errorf("%w at %s", ErrExpired, time.Unix(c.Expires, 0).UTC().Format(time.RFC3339))
	}
	return c, nil
}

// validName keeps names usable as DNS labels and file keys.
func validName(s string) bool {
	if len(s) == 0 || len(s) > 32 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}

// Request is what a client asks.
type Request struct {
	Op    string `json:"op"` // "join" (also renews) or "leave"
	Token string `json:"token"`
	Node  string `json:"node"` // client's hostname, for its overlay name
}

// Answer is the gateway's reply: a lease and the peer configuration.
type Answer struct {
	Error string `json:"error,omitempty"`
	// Address is the client's overlay address (/32 or /128).
	Address netip.Prefix `json:"address"`
	// Gateway is the gateway's overlay address (next hop, DNS server).
	Gateway  netip.Addr     `json:"gateway"`
	Routes   []netip.Prefix `json:"routes"`
	DNS      []netip.Addr   `json:"dns"`
	Search   []string       `json:"search"`
	Name     string         `json:"name"` // overlay DNS name of this client
	Endpoint string         `json:"endpoint"`
	MTU      int            `json:"mtu"`
	LeaseEnd int64          `json:"lease_end"`
}

// magic starts every datagram of this protocol version; it is also the
// Noise prologue, so a message of another version cannot be mistaken for one.
const magic = "PEJ2"

var suite = noise.NewCipherSuite(noise.DH25519, noise.CipherChaChaPoly, noise.HashBLAKE2s)

// Timestamp is a TAI64N label: 8 bytes of seconds (2^62 + Unix seconds) and
// 4 of nanoseconds, big-endian, so newer compares greater byte-wise.
type Timestamp [12]byte

// StampOf encodes t.
func StampOf(t time.Time) Timestamp {
	var ts Timestamp
	binary.BigEndian.PutUint64(ts[:8], uint64(1<<62+t.Unix()))
	binary.BigEndian.PutUint32(ts[8:], uint32(t.Nanosecond()))
	return ts
}

// After reports whether ts is strictly newer than o.
func (ts Timestamp) After(o Timestamp) bool { return bytes.Compare(ts[:], o[:]) > 0 }

// Time decodes ts (for messages).
func (ts Timestamp) Time() time.Time {
	return time.Unix(int64(binary.BigEndian.Uint64(ts[:8])-1<<62), int64(binary.BigEndian.Uint32(ts[8:]))).UTC()
}

// Initiator is one client's side: it stamps each request strictly later than
// the previous one, even if the wall clock steps back.
type Initiator struct {
	priv, gwPub Key
	mu          sync.Mutex
	last        Timestamp
}

// NewInitiator makes the client side for key clientPriv and pinned gateway key gwPub.
func NewInitiator(clientPriv, gwPub Key) *Initiator {
	return &Initiator{priv: clientPriv, gwPub: gwPub}
}

func (in *Initiator) stamp() Timestamp {
	in.mu.Lock()
	defer in.mu.Unlock()
	ts := StampOf(time.Now())
	if !ts.After(in.last) {
		ts = in.last
		n := binary.BigEndian.Uint32(ts[8:]) + 1
		if n >= 1e9 {
			binary.BigEndian.PutUint64(ts[:8], binary.BigEndian.Uint64(ts[:8])+1)
			n = 0
		}
		binary.BigEndian.PutUint32(ts[8:], n)
	}
	in.last = ts
	return ts
}

// Pending is a sent request waiting for its answer.
type Pending struct {
	in      *Initiator
	seed    [32]byte // the ephemeral key's randomness
	payload []byte
	Msg     []byte // the datagram to send
}

// handshake writes message 1 from p's seed: the same seed and payload give
// the same state, so every answer is read on a fresh copy (a forged answer
// cannot spoil the state the real one needs).
func (p *Pending) handshake() (*noise.HandshakeState, []byte, error) {
	hs, err := noise.NewHandshakeState(noise.Config{CipherSuite: suite, Random: bytes.NewReader(p.seed[:]), Pattern: noise.HandshakeIK,
		Initiator: true, Prologue: []byte(magic), StaticKeypair: dhKey(p.in.priv), PeerStatic: p.in.gwPub[:]})
	if err != nil {
		return nil, nil, err
	}
	msg, _, _, err := hs.WriteMessage([]byte(magic), p.payload)
	return hs, msg, err
}

// Seal builds a request datagram: magic, then Noise IK message 1 whose
// payload is the timestamp and the request.
func (in *Initiator) Seal(r Request) (*Pending, error) {
	p := &Pending{in: in}
	if _, err := rand.Read(p.seed[:]); err != nil {
		return nil, err
	}
	ts := in.stamp()
	body, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	p.payload = append(ts[:], body...)
	if _, p.Msg, err = p.handshake(); err != nil {
		return nil, err
	}
	return p, nil
}

// Open reads the answer to this request; an answer to any other request (or
// from any key but the pinned one) does not open.
func (p *Pending) Open(msg []byte) (Answer, error) {
	var a Answer
	if len(msg) < len(magic) || string(msg[:len(magic)]) != magic {
		return a, errors.New("not a join answer")
	}
	hs, _, err := p.handshake()
	if err != nil {
		return a, err
	}
	pl, _, _, err := hs.ReadMessage(nil, msg[len(magic):])
	if err != nil {
		return a, errors.New("answer not sealed by the pinned gateway key for this request (wrong gateway or key, or a stale answer)")
	}
	err = json.Unmarshal(pl, &a)
	return a, err
}

func dhKey(priv Key) noise.DHKey {
	pub := priv.Public()
	return noise.DHKey{Private: append([]byte(nil), priv[:]...), Public: pub[:]}
}

// Incoming is a request the gateway has opened: authenticated (the client
// proved its static key) but not yet checked for freshness.
type Incoming struct {
	Client Key
	Stamp  Timestamp
	Req    Request
	hs     *noise.HandshakeState
}

// MinRequest is the size of the smallest well-formed request datagram:
// magic, ephemeral key, encrypted static key with its tag, encrypted
// timestamp with its tag. Shorter datagrams are dropped before any DH.
const MinRequest = len(magic) + 32 + 32 + 16 + len(Timestamp{}) + 16

// OpenRequest is the gateway's side of message 1.
func OpenRequest(gwPriv Key, msg []byte) (*Incoming, error) {
	if len(msg) < MinRequest || string(msg[:len(magic)]) != magic {
		return nil, errors.New("not a join request")
	}
	hs, err := noise.NewHandshakeState(noise.Config{CipherSuite: suite, Random: rand.Reader, Pattern: noise.HandshakeIK,
		Prologue: []byte(magic), StaticKeypair: dhKey(gwPriv)})
	if err != nil {
		return nil, err
	}
	pl, _, _, err := hs.ReadMessage(nil, msg[len(magic):])
	if err != nil {
		return nil, errors.New("request not sealed for this gateway")
	}
	in := &Incoming{hs: hs}
	copy(in.Client[:], hs.PeerStatic())
	if len(pl) < len(in.Stamp) {
		return nil, errors.New("request without timestamp")
	}
	copy(in.Stamp[:], pl)
	if err := json.Unmarshal(pl[len(in.Stamp):], &in.Req); err != nil {
		return nil, fmt.Errorf("request: %w", err)
	}
	return in, nil
}

// SealAnswer is message 2: the answer, readable only by the client that
// sent this very request.
func (in *Incoming) SealAnswer(a Answer) ([]byte, error) {
	p, err := json.Marshal(a)
	if err != nil {
		return nil, err
	}
	msg, _, _, err := in.hs.WriteMessage([]byte(magic), p)
	return msg, err
}

// Replay remembers, per client key, the newest timestamp accepted and how
// long it matters: until the token that request carried expires, since a
// replay needs an unexpired token to be acted on at all. Only requests with
// a valid token are recorded, so its size is bounded by the tokens issued.
type Replay struct {
	mu   sync.Mutex
	last map[Key]replayEntry
}

type replayEntry struct {
	ts    Timestamp
	until time.Time
}

// Accept records ts for k (kept until `until`) if it is newer than the last
// accepted one, and reports whether it was.
func (r *Replay) Accept(k Key, ts Timestamp, until time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last == nil {
		r.last = map[Key]replayEntry{}
	}
	prev, ok := r.last[k]
	if ok && !ts.After(prev.ts) {
		return false
	}
	if prev.until.After(until) {
		until = prev.until
	}
	r.last[k] = replayEntry{ts: ts, until: until}
	return true
}

// Expire forgets entries whose tokens have expired.
func (r *Replay) Expire(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, e := range r.last {
		if !now.Before(e.until) {
			delete(r.last, k)
		}
	}
}

// Limiter is the gateway's cheap check before any Diffie-Hellman: a token
// bucket per source address and one for all sources.
type Limiter struct {
	mu        sync.Mutex
	global    *rate.Limiter
	per       map[netip.Addr]*rate.Limiter
	perRate   rate.Limit
	perBurst  int
	maxSource int
}

// NewLimiter allows each source perRate datagrams a second (burst perBurst)
// and all of them together globalRate (burst globalBurst).
func NewLimiter(perRate rate.Limit, perBurst int, globalRate rate.Limit, globalBurst int) *Limiter {
	return &Limiter{global: rate.NewLimiter(globalRate, globalBurst), per: map[netip.Addr]*rate.Limiter{},
		perRate: perRate, perBurst: perBurst, maxSource: 4096}
}

// Allow reports whether a datagram from src may be processed now.
func (l *Limiter) Allow(src netip.Addr) bool {
	src = src.Unmap()
	l.mu.Lock()
	defer l.mu.Unlock()
	pl, ok := l.per[src]
	if !ok {
		if len(l.per) >= l.maxSource {
			// Forget sources whose bucket is full again: they lose nothing.
			for a, x := range l.per {
				if x.Tokens() >= float64(l.perBurst) {
					delete(l.per, a)
				}
			}
			if len(l.per) >= l.maxSource {
				return false // a flood of sources: only the known ones go on
			}
		}
		pl = rate.NewLimiter(l.perRate, l.perBurst)
		l.per[src] = pl
	}
	return pl.Allow() && l.global.Allow()
}

// Exchange sends r to the gateway at addr and waits for the answer, retrying
// over UDP's losses. Every retry is a new handshake with a new timestamp (a
// resent datagram would be refused as a replay); an answer to any of them is
// taken. An error answer becomes an error.
func (in *Initiator) Exchange(addr string, r Request, timeout time.Duration) (Answer, error) {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return Answer{}, fmt.Errorf("join %s: %w", addr, err)
	}
	defer c.Close()
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 65536)
	wait := 250 * time.Millisecond
	var sent []*Pending
	var lastErr error
	for time.Now().Before(deadline) {
		p, err := in.Seal(r)
		if err != nil {
			return Answer{}, err
		}
		sent = append(sent, p)
		if _, err := c.Write(p.Msg); err != nil {
			return Answer{}, fmt.Errorf("join %s: %w", addr, err)
		}
		until := time.Now().Add(wait)
		for {
			c.SetReadDeadline(until)
			n, err := c.Read(buf)
			if err != nil {
				if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
					// ICMP refusals surface as ECONNREFUSED: keep trying until the deadline.
					time.Sleep(time.Until(until))
				}
				break
			}
			for _, p := range sent {
				a, err := p.Open(buf[:n])
				if err != nil {
					lastErr = err
					continue
				}
				if a.Error != "" {
					return a, fmt.Errorf("gateway refused: %s", a.Error)
				}
				return a, nil
			}
		}
		if wait < 2*time.Second {
			wait *= 2
		}
	}
	if lastErr != nil {
		return Answer{}, fmt.Errorf("join %s: %w", addr, lastErr)
	}
	return Answer{}, fmt.Errorf("join %s: no answer within %s (gateway down or unreachable, or it does not hold the key the token pins)", addr, timeout)
}
