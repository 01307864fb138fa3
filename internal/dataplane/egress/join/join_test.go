package join

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"
)

func TestTokenAndSealing(t *testing.T) {
	gw, _ := NewPrivateKey()
	other, _ := NewPrivateKey()
	tok, err := IssueToken(gw, Claims{User: "alice", Job: "42", Expires: time.Now().Add(time.Hour).Unix(), Gateway: "198.18.0.253:51821"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := VerifyToken(gw, tok, time.Now())
	if err != nil || c.User != "alice" || c.Job != "42" || c.GatewayKey != gw.Public().String() {
		t.Fatalf("%+v %v", c, err)
	}
	if _, err := VerifyToken(other, tok, time.Now()); !errors.Is(err, ErrBadToken) {
		t.Fatalf("token accepted by another gateway key: %v", err)
	}
	// Changing the payload (e.g. the user) breaks the signature.
	forged := strings.Replace(tok, tok[4:10], "eyJ1Ijo", 1)
	if _, err := VerifyToken(gw, forged+"x", time.Now()); err == nil {
		t.Fatal("forged token accepted")
	}
	if _, err := VerifyToken(gw, tok, time.Now().Add(2*time.Hour)); !errors.Is(err, ErrExpired) {
		t.Fatalf("expired token: %v", err)
	}
	if _, err := IssueToken(gw, Claims{User: "Alice;rm", Job: "1"}); err == nil {
		t.Fatal("bad user name accepted")
	}

}

// gatewaySide is what the gateway does with a datagram, without the
// network: open, check freshness, answer.
func gatewaySide(t *testing.T, gw Key, r *Replay, msg []byte) (*Incoming, bool) {
	t.Helper()
	in, err := OpenRequest(gw, msg)
	if err != nil {
		t.Fatalf("open request: %v", err)
	}
	return in, r.Accept(in.Client, in.Stamp, time.Now().Add(time.Hour))
}

func TestHandshake(t *testing.T) {
	gw, _ := NewPrivateKey()
	other, _ := NewPrivateKey()
	cl, _ := NewPrivateKey()
	ini := NewInitiator(cl, gw.Public())
	p, err := ini.Seal(Request{Op: "join", Token: "tok", Node: "node1"})
	if err != nil {
		t.Fatal(err)
	}
	var r Replay
	in, fresh := gatewaySide(t, gw, &r, p.Msg)
	if !fresh || in.Client != cl.Public() || in.Req.Token != "tok" || in.Req.Node != "node1" {
		t.Fatalf("open request: %+v fresh=%v", in, fresh)
	}
	if _, err := OpenRequest(other, p.Msg); err == nil {
		t.Fatal("request opened by a gateway it was not sealed for")
	}
	ans, err := in.SealAnswer(Answer{Name: "alice-42-node1"})
	if err != nil {
		t.Fatal(err)
	}
	// A forged answer first must not spoil the state the real one needs.
	if _, err := p.Open(append([]byte(magic), make([]byte, 80)...)); err == nil {
		t.Fatal("forged answer accepted")
	}
	if a, err := p.Open(ans); err != nil || a.Name != "alice-42-node1" {
		t.Fatalf("open answer: %v", err)
	}
	// An answer made by another key, or to another request, does not open.
	evil := NewInitiator(cl, other.Public())
	pe, _ := evil.Seal(Request{Op: "join"})
	ine, err := OpenRequest(other, pe.Msg)
	if err != nil {
		t.Fatal(err)
	}
	fake, _ := ine.SealAnswer(Answer{Name: "evil"})
	if _, err := p.Open(fake); err == nil {
		t.Fatal("answer from an unpinned gateway accepted")
	}
	p2, _ := ini.Seal(Request{Op: "join"})
	if _, err := p2.Open(ans); err == nil {
		t.Fatal("answer to an earlier request accepted for a later one")
	}
}

// TestReplay: a captured request is refused when replayed, whatever its
// op: the captured leave of a client that renewed since (or that joined
// again with the same key) cannot release the lease. Positive control: the
// client's own next request is accepted.
func TestReplay(t *testing.T) {
	gw, _ := NewPrivateKey()
	cl, _ := NewPrivateKey()
	ini := NewInitiator(cl, gw.Public())
	var r Replay
	join1, _ := ini.Seal(Request{Op: "join"})
	if _, ok := gatewaySide(t, gw, &r, join1.Msg); !ok {
		t.Fatal("first join refused")
	}
	if _, ok := gatewaySide(t, gw, &r, join1.Msg); ok {
		t.Fatal("replayed join accepted")
	}
	// The attacker captures a leave (and keeps it from the gateway); the
	// client renews afterwards.
	leave, _ := ini.Seal(Request{Op: "leave"})
	renew, _ := ini.Seal(Request{Op: "join"})
	if _, ok := gatewaySide(t, gw, &r, renew.Msg); !ok {
		t.Fatal("renewal refused")
	}
	if in, ok := gatewaySide(t, gw, &r, leave.Msg); ok {
		t.Fatalf("captured leave replayed after a renewal accepted (op %s)", in.Req.Op)
	}
	// Another client's first request is independent.
	cl2, _ := NewPrivateKey()
	p, _ := NewInitiator(cl2, gw.Public()).Seal(Request{Op: "join"})
	if _, ok := gatewaySide(t, gw, &r, p.Msg); !ok {
		t.Fatal("other client refused")
	}
	// Entries last as long as the token: after its expiry they go.
	r.Expire(time.Now().Add(2 * time.Hour))
	if len(r.last) != 0 {
		t.Fatalf("%d entries after expiry", len(r.last))
	}
}

// TestStampMonotonic: stamps grow even when requests come faster than the
// clock's resolution.
func TestStampMonotonic(t *testing.T) {
	ini := NewInitiator(Key{1}, Key{2})
	prev := ini.stamp()
	for range 1000 {
		ts := ini.stamp()
		if !ts.After(prev) {
			t.Fatalf("stamp %x not after %x", ts, prev)
		}
		prev = ts
	}
	now := time.Now()
	if got := StampOf(now).Time(); !got.Equal(now.Truncate(0).UTC()) {
		t.Fatalf("round trip %v != %v", got, now)
	}
}

func TestLimiter(t *testing.T) {
	l := NewLimiter(0, 3, 0, 5) // no refill: only bursts
	a, b := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	n := 0
	for range 10 {
		if l.Allow(a) {
			n++
		}
	}
	if n != 3 {
		t.Fatalf("per-source burst: %d allowed, want 3", n)
	}
	n = 0
	for range 10 {
		if l.Allow(b) {
			n++
		}
	}
	if n != 2 { // the global bucket had 5 - 3 left
		t.Fatalf("global burst: %d allowed, want 2", n)
	}
}

// FuzzOpenRequest: the gateway's decoder of what anyone can send.
func FuzzOpenRequest(f *testing.F) {
	gw := Key{7}
	cl := Key{9}
	p, err := NewInitiator(cl, gw.Public()).Seal(Request{Op: "join", Token: "pe1.x.y", Node: "n"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(p.Msg)
	f.Add([]byte(magic))
	f.Add(append([]byte(magic), make([]byte, MinRequest)...))
	f.Fuzz(func(t *testing.T, msg []byte) {
		in, err := OpenRequest(gw, msg)
		if err != nil {
			return
		}
		if _, err := in.SealAnswer(Answer{Error: "x"}); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzOpenAnswer: the client's decoder of what comes back.
func FuzzOpenAnswer(f *testing.F) {
	gw := Key{7}
	p, err := NewInitiator(Key{9}, gw.Public()).Seal(Request{Op: "join"})
	if err != nil {
		f.Fatal(err)
	}
	in, err := OpenRequest(gw, p.Msg)
	if err != nil {
		f.Fatal(err)
	}
	ans, _ := in.SealAnswer(Answer{Name: "a"})
	f.Add(ans)
	f.Add([]byte(magic))
	f.Fuzz(func(t *testing.T, msg []byte) {
		p.Open(msg)
	})
}

// FuzzReadToken: tokens come from the environment and the request.
func FuzzReadToken(f *testing.F) {
	gw := Key{7}
	tok, _ := IssueToken(gw, Claims{User: "alice", Job: "1", Expires: 1 << 40, Gateway: "198.18.0.1:1"})
	f.Add(tok)
	f.Add("pe1..")
	f.Fuzz(func(t *testing.T, tok string) {
		if c, err := VerifyToken(gw, tok, time.Unix(0, 0)); err == nil && (!validName(c.User) || !validName(c.Job)) {
			t.Fatalf("verified token with bad names: %+v", c)
		}
	})
}
