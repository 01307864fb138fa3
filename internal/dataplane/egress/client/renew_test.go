package client

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/gateway"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/join"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// TestRenewWhileReading: the renewal goroutine moves the lease end while
// the main goroutine reads the session's answer (a data race under -race
// before the lease end had its own atomic), and the renewal reaches a
// real gateway (netstack, in a scratch network namespace).
func TestRenewWhileReading(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	runtime.LockOSThread() // the namespace dies with this thread
	ns, err := netns.New()
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if lo, err := netlink.LinkByName("lo"); err != nil || netlink.LinkSetUp(lo) != nil {
		t.Fatal("lo:", err)
	}
	const port = 29430
	dir := t.TempDir()
	g, err := gateway.Start(gateway.Config{StateDir: dir, ListenPort: port, Mode: "netstack", LeaseTTL: 6 * time.Second, Logf: t.Logf})
	if err != nil {
		if g != nil {
			g.Close()
		}
		t.Fatal(err)
	}
	defer g.Close()
	key, err := gateway.LoadOrCreateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := join.IssueToken(key, join.Claims{User: "alice", Job: "1", Expires: time.Now().Add(time.Hour).Unix(),
		Gateway: fmt.Sprintf("127.0.0.1:%d", port+1)})
	if err != nil {
		t.Fatal(err)
	}
	s, err := Join(Options{Token: tok, Node: "node1"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Leave()
	first := s.leaseEnd.Load()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := netns.Set(ns); err != nil {
			t.Error(err)
			return
		}
		s.renew(ctx, t.Logf)
	}()
	// Read the answer as the data paths do until the renewal lands.
	deadline := time.Now().Add(30 * time.Second)
	for s.leaseEnd.Load() == first {
		if time.Now().After(deadline) {
			t.Fatal("lease never renewed")
		}
		if a := s.Answer; !a.Address.IsValid() || a.MTU == 0 { // a whole copy, as nsConfig takes it
			t.Fatalf("answer changed under the reader: %+v", a)
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
}
