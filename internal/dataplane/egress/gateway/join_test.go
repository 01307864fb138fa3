package gateway

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/join"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/time/rate"
)

// startScratch runs a netstack gateway in a scratch network namespace (this
// test's thread, discarded at the end).
func startScratch(t *testing.T, port int) *Gateway {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	runtime.LockOSThread()
	if _, err := netns.New(); err != nil {
		t.Fatal(err)
	}
	if lo, err := netlink.LinkByName("lo"); err != nil || netlink.LinkSetUp(lo) != nil {
		t.Fatal("lo:", err)
	}
	g, err := Start(Config{StateDir: t.TempDir(), ListenPort: port, Mode: "netstack", Logf: t.Logf})
	if err != nil {
		if g != nil {
			g.Close()
		}
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	return g
}

func hasLease(g *Gateway, k join.Key) bool {
	for _, l := range g.pool.Leases() {
		if l.Key == k.String() {
			return true
		}
	}
	return false
}

// TestLeaveReplay: a leave captured on the wire (kept from the gateway)
// and replayed after the client renewed releases nothing, and gets no
// answer; the client's own later leave does release the lease (positive
// control).
func TestLeaveReplay(t *testing.T) {
	const port = 29410
	g := startScratch(t, port)
	addr := fmt.Sprintf("127.0.0.1:%d", port+1)
	tok, err := join.IssueToken(g.key, join.Claims{User: "alice", Job: "42", Expires: time.Now().Add(time.Hour).Unix(), Gateway: addr})
	if err != nil {
		t.Fatal(err)
	}
	ck, _ := join.NewPrivateKey()
	cl := join.NewInitiator(ck, g.PublicKey())
	req := join.Request{Op: "join", Token: tok, Node: "node1"}
	if _, err := cl.Exchange(addr, req, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if !hasLease(g, ck.Public()) {
		t.Fatal("no lease after join")
	}
	leave := req
	leave.Op = "leave"
	captured, err := cl.Seal(leave)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Exchange(addr, req, 10*time.Second); err != nil { // renewal
		t.Fatal(err)
	}
	c, err := net.Dial("udp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	replays := g.counters.JoinReplay.Load()
	if _, err := c.Write(captured.Msg); err != nil {
		t.Fatal(err)
	}
	// The gateway counts the replay when it has dropped it.
	for deadline := time.Now().Add(10 * time.Second); g.counters.JoinReplay.Load() == replays; {
		if time.Now().After(deadline) {
			t.Fatal("replayed leave not counted as a replay")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !hasLease(g, ck.Public()) {
		t.Fatal("replayed leave released the lease")
	}
	c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if n, err := c.Read(make([]byte, 2048)); err == nil {
		t.Fatalf("replay answered (%d bytes)", n)
	}
	// Positive control: a fresh leave from the client releases it.
	if _, err := cl.Exchange(addr, leave, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if hasLease(g, ck.Public()) {
		t.Fatal("lease still held after the client's leave")
	}
}

// TestJoinLogLimited: anyone can make the join socket log; past the limit
// lines are counted, and the count is logged when logging resumes.
func TestJoinLogLimited(t *testing.T) {
	var lines []string
	g := &Gateway{cfg: Config{Logf: func(f string, a ...any) { lines = append(lines, fmt.Sprintf(f, a...)) }},
		joinLog: rate.NewLimiter(0, 2)}
	for i := range 5 {
		g.logJoin("junk %d", i)
	}
	if len(lines) != 2 {
		t.Fatalf("%d lines logged, want 2: %q", len(lines), lines)
	}
	g.joinLog = rate.NewLimiter(rate.Inf, 1)
	g.logJoin("later")
	if len(lines) != 4 || lines[2] != "join: 3 messages not logged (rate limit)" || lines[3] != "later" {
		t.Fatalf("after the limit: %q", lines)
	}
}
