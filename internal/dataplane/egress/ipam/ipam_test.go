package ipam

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestConcurrentJoinsAndRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "leases.json")
	pfx := netip.MustParsePrefix("100.64.0.0/24")
	gw := netip.MustParseAddr("100.64.0.1")
	p, err := Open(path, pfx, gw)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	var mu sync.Mutex
	seen := map[netip.Addr]string{}
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, _, err := p.Acquire("alice", fmt.Sprint(i), "node1", fmt.Sprint("k", i), time.Hour, now)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if o, dup := seen[l.Addr]; dup {
				t.Errorf("address %s given to %s and %s", l.Addr, o, l.Name())
			}
			if l.Addr == gw || !pfx.Contains(l.Addr) || l.Addr == pfx.Addr() {
				t.Errorf("bad address %s", l.Addr)
			}
			seen[l.Addr] = l.Name()
		}()
	}
	wg.Wait()
	if _, err := Open(path, pfx, gw); err == nil {
		t.Fatal("second gateway opened a locked pool")
	}
	p.Close()
	// Restart: the leases survive and new ones avoid them.
	p2, err := Open(path, pfx, gw)
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	if n := len(p2.Leases()); n != 100 {
		t.Fatalf("after restart %d leases, want 100", n)
	}
	l, _, err := p2.Acquire("bob", "x", "node2", "kb", time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, dup := seen[l.Addr]; dup {
		t.Fatalf("restart reused %s", l.Addr)
	}
	// Same client rejoining keeps its address.
	again, _, _ := p2.Acquire("bob", "x", "node2", "kb", time.Hour, now)
	if again.Addr != l.Addr {
		t.Fatalf("renewal moved %s -> %s", l.Addr, again.Addr)
	}
	// Expired leases are reclaimed.
	gone, err := p2.Expire(now.Add(2 * time.Hour))
	if err != nil || len(gone) != 101 {
		t.Fatalf("expire: %d %v", len(gone), err)
	}
}

func TestExhaustion(t *testing.T) {
	p, err := Open(filepath.Join(t.TempDir(), "l.json"), netip.MustParsePrefix("100.64.0.0/30"), netip.MustParseAddr("100.64.0.1"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	l, _, err := p.Acquire("a", "1", "n", "k1", time.Hour, time.Now())
	if err != nil || l.Addr != netip.MustParseAddr("100.64.0.2") {
		t.Fatalf("%v %v", l, err)
	}
	if _, _, err := p.Acquire("a", "2", "n", "k2", time.Hour, time.Now()); err != ErrExhausted {
		t.Fatalf("want exhausted, got %v", err)
	}
}
