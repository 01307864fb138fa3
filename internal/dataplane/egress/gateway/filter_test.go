package gateway

import (
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.zx2c4.com/wireguard/tun"
)

// sink is the network side: it records what the filter lets through.
type sink struct {
	tun.Device
	got [][]byte
}

func (s *sink) Write(bufs [][]byte, offset int) (int, error) {
	for _, b := range bufs {
		s.got = append(s.got, b[offset:])
	}
	return len(bufs), nil
}
func (s *sink) File() *os.File { return nil }

func pkt(src, dst string, size int) []byte {
	p := make([]byte, size)
	p[0] = 0x45
	s, d := netip.MustParseAddr(src).As4(), netip.MustParseAddr(dst).As4()
	copy(p[12:16], s[:])
	copy(p[16:20], d[:])
	return p
}

func newFilter(userRate, globalRate int64) (*filter, *sink) {
	s := &sink{}
	f := &filter{Device: s, mtu: 1420, pool: netip.MustParsePrefix("100.64.0.0/16"), self: netip.MustParseAddr("100.64.0.1"),
		c: &Counters{}, perUser: userRate, global: newLimit(globalRate), deny: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}}
	f.owners.Store(&owners{
		netip.MustParseAddr("100.64.0.2"): "alice",
		netip.MustParseAddr("100.64.0.3"): "alice",
		netip.MustParseAddr("100.64.0.4"): "bob",
	})
	return f, s
}

func TestIsolation(t *testing.T) {
	f, s := newFilter(0, 0)
	f.Write([][]byte{
		pkt("100.64.0.2", "100.64.0.3", 100),   // alice -> alice: pass
		pkt("100.64.0.2", "100.64.0.4", 100),   // alice -> bob: drop
		pkt("100.64.0.4", "100.64.0.2", 100),   // bob -> alice: drop
		pkt("100.64.0.4", "100.64.0.9", 100),   // bob -> unleased pool address: drop
		pkt("100.64.0.4", "100.64.0.1", 100),   // bob -> gateway (DNS): pass
		pkt("100.64.0.4", "198.18.201.1", 100), // bob -> outside: pass
		pkt("100.64.0.4", "198.18.0.7", 100),   // bob -> cluster (denied): drop
	}, 0)
	if len(s.got) != 3 || f.c.IsolationDrop.Load() != 4 {
		t.Fatalf("passed %d, isolation drops %d; want 3 and 4", len(s.got), f.c.IsolationDrop.Load())
	}
}

// TestRateLimits: a user sending far above its rate gets about rate x time
// through (plus the burst), other users keep their own budget, and the global
// bucket caps everyone together.
func TestRateLimits(t *testing.T) {
	const rate = 1 << 20 // 1 MiB/s per user
	f, s := newFilter(rate, 0)
	send := func(src string, n int) int {
		before := len(s.got)
		for range n {
			f.Write([][]byte{pkt(src, "198.18.201.1", 1400)}, 0)
		}
		return (len(s.got) - before) * 1400
	}
	start := time.Now()
	sent := 0
	for time.Since(start) < 300*time.Millisecond {
		sent += send("100.64.0.2", 100)
		time.Sleep(time.Millisecond)
	}
	el := time.Since(start).Seconds()
	burst := float64(64 << 10)
	if max := rate*el + burst + 1400; float64(sent) > max {
		t.Fatalf("alice passed %d bytes in %.2fs, limit %.0f", sent, el, max)
	}
	if float64(sent) < rate*el*0.5 {
		t.Fatalf("alice passed only %d bytes in %.2fs at %d B/s", sent, el, rate)
	}
	if f.c.RateDrop.Load() == 0 {
		t.Fatal("no rate drops counted")
	}
	// bob's bucket is untouched by alice's excess.
	if got := send("100.64.0.4", 10); got != 10*1400 {
		t.Fatalf("bob passed %d of %d bytes", got, 10*1400)
	}
	// Global limit: two users together stay under the global rate.
	g, gs := newFilter(0, rate)
	start = time.Now()
	for time.Since(start) < 300*time.Millisecond {
		for range 50 {
			g.Write([][]byte{pkt("100.64.0.2", "198.18.201.1", 1400), pkt("100.64.0.4", "198.18.201.1", 1400)}, 0)
		}
		time.Sleep(time.Millisecond)
	}
	el = time.Since(start).Seconds()
	if tot := float64(len(gs.got) * 1400); tot > rate*el+float64(64<<10)+2800 {
		t.Fatalf("global: %.0f bytes in %.2fs over the limit", tot, el)
	}
}
