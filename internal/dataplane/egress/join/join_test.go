package join

import (
	"errors"
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

	cl, _ := NewPrivateKey()
	msg, _ := SealRequest(cl, gw.Public(), Request{Op: "join", Token: tok, Node: "node1"})
	ck, req, err := OpenRequest(gw, msg)
	if err != nil || ck != cl.Public() || req.Token != tok {
		t.Fatalf("open request: %v", err)
	}
	if _, _, err := OpenRequest(other, msg); err == nil {
		t.Fatal("request opened by a gateway it was not sealed for")
	}
	ans, _ := SealAnswer(gw, cl.Public(), Answer{Name: "alice-42-node1"})
	if a, err := OpenAnswer(cl, gw.Public(), ans); err != nil || a.Name != "alice-42-node1" {
		t.Fatalf("open answer: %v", err)
	}
	// An answer from a gateway other than the pinned one is rejected.
	fake, _ := SealAnswer(other, cl.Public(), Answer{Name: "evil"})
	if _, err := OpenAnswer(cl, gw.Public(), fake); err == nil {
		t.Fatal("answer from an unpinned gateway accepted")
	}
}
