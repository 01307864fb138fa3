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
// The exchange is one UDP datagram each way. The client generates a fresh
// X25519 key pair per job (its WireGuard key) and seals the request with
// AES-256-GCM under HKDF(X25519(client, gateway)). Only the holder of the
// client key and the holder of the pinned gateway key can open the request and
// the answer, so a client cannot be fooled by a rogue gateway and a request
// proves possession of the key the gateway will install as a peer. A replayed
// request gains an attacker nothing: the answer is sealed to the client key.
package join

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"
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

func shared(priv, pub Key, label string) ([]byte, error) {
	sk, err := ecdh.X25519().NewPrivateKey(priv[:])
	if err != nil {
		return nil, err
	}
	pk, err := ecdh.X25519().NewPublicKey(pub[:])
	if err != nil {
		return nil, err
	}
	s, err := sk.ECDH(pk)
	if err != nil {
		return nil, err
	}
	return hkdf.Key(sha256.New, s, nil, label, 32)
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

const (
	labelReq = "palisade-egress-join-req-v1"
	labelAns = "palisade-egress-join-ans-v1"
	magic    = "PEJ1"
)

func seal(key []byte, plain []byte) ([]byte, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, g.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return g.Seal(nonce, nonce, plain, []byte(magic)), nil
}

func open(key []byte, ct []byte) ([]byte, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		return nil, err
	}
	if len(ct) < g.NonceSize() {
		return nil, errors.New("short message")
	}
	return g.Open(nil, ct[:g.NonceSize()], ct[g.NonceSize():], []byte(magic))
}

// SealRequest builds the request datagram: magic, client public key, sealed JSON.
func SealRequest(clientPriv, gwPub Key, r Request) ([]byte, error) {
	k, err := shared(clientPriv, gwPub, labelReq)
	if err != nil {
		return nil, err
	}
	p, _ := json.Marshal(r)
	ct, err := seal(k, p)
	if err != nil {
		return nil, err
	}
	pub := clientPriv.Public()
	return append(append([]byte(magic), pub[:]...), ct...), nil
}

// OpenRequest is the gateway's side: it returns the client key and request.
func OpenRequest(gwPriv Key, msg []byte) (Key, Request, error) {
	var ck Key
	var r Request
	if len(msg) < len(magic)+32 || string(msg[:len(magic)]) != magic {
		return ck, r, errors.New("not a join request")
	}
	copy(ck[:], msg[len(magic):len(magic)+32])
	k, err := shared(gwPriv, ck, labelReq)
	if err != nil {
		return ck, r, err
	}
	p, err := open(k, msg[len(magic)+32:])
	if err != nil {
		return ck, r, errors.New("request not sealed for this gateway")
	}
	if err := json.Unmarshal(p, &r); err != nil {
		return ck, r, err
	}
	return ck, r, nil
}

// SealAnswer seals a reply to the client key.
func SealAnswer(gwPriv, clientPub Key, a Answer) ([]byte, error) {
	k, err := shared(gwPriv, clientPub, labelAns)
	if err != nil {
		return nil, err
	}
	p, _ := json.Marshal(a)
	ct, err := seal(k, p)
	if err != nil {
		return nil, err
	}
	return append([]byte(magic), ct...), nil
}

// OpenAnswer checks that the reply comes from the pinned gateway key.
func OpenAnswer(clientPriv, gwPub Key, msg []byte) (Answer, error) {
	var a Answer
	if len(msg) < len(magic) || string(msg[:len(magic)]) != magic {
		return a, errors.New("not a join answer")
	}
	k, err := shared(clientPriv, gwPub, labelAns)
	if err != nil {
		return a, err
	}
	p, err := open(k, msg[len(magic):])
	if err != nil {
		return a, errors.New("answer not sealed by the pinned gateway key (wrong gateway or key)")
	}
	err = json.Unmarshal(p, &a)
	return a, err
}

// Exchange sends r to the gateway at addr and waits for the answer, retrying
// over UDP's losses. An error answer becomes an error.
func Exchange(addr string, clientPriv, gwPub Key, r Request, timeout time.Duration) (Answer, error) {
	msg, err := SealRequest(clientPriv, gwPub, r)
	if err != nil {
		return Answer{}, err
	}
	c, err := net.Dial("udp", addr)
	if err != nil {
		return Answer{}, fmt.Errorf("join %s: %w", addr, err)
	}
	defer c.Close()
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 65536)
	wait := 250 * time.Millisecond
	for time.Now().Before(deadline) {
		if _, err := c.Write(msg); err != nil {
			return Answer{}, fmt.Errorf("join %s: %w", addr, err)
		}
		c.SetReadDeadline(time.Now().Add(wait))
		n, err := c.Read(buf)
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				if wait < 2*time.Second {
					wait *= 2
				}
				continue
			}
			// ICMP refusals surface as ECONNREFUSED: keep trying until the deadline.
			time.Sleep(wait)
			continue
		}
		a, err := OpenAnswer(clientPriv, gwPub, buf[:n])
		if err != nil {
			return a, err
		}
		if a.Error != "" {
			return a, fmt.Errorf("gateway refused: %s", a.Error)
		}
		return a, nil
	}
	return Answer{}, fmt.Errorf("join %s: no answer within %s (gateway down or unreachable, or it does not hold the key the token pins)", addr, timeout)
}
