package gateway

import (
	"encoding/binary"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"golang.zx2c4.com/wireguard/tun"
)

// owners maps overlay addresses to the user holding the lease; replaced
// wholesale on every lease change so the packet path reads it without locks.
type owners map[netip.Addr]string

// newLimit limits to rate bytes per second; nil (no limit) for rate <= 0.
// Policing (drop when empty) keeps the forwarding path non-blocking: a
// sleeping writer would stall every peer.
func newLimit(bps int64) *rate.Limiter {
	if bps <= 0 {
		return nil
	}
	// A burst of 50 ms at the rate (at least 64 KiB) lets TCP's windows
	// open without overshooting the limit on average.
	return rate.NewLimiter(rate.Limit(bps), int(max(bps/20, 64<<10)))
}

// take reports whether n bytes may pass l at now.
func take(l *rate.Limiter, n int, now time.Time) bool {
	return l == nil || l.AllowN(now, n)
}

// Counters are the gateway's forwarding statistics.
type Counters struct {
	FromClients   atomic.Uint64 `json:"-"`
	ToClients     atomic.Uint64 `json:"-"`
	IsolationDrop atomic.Uint64 `json:"-"`
	RateDrop      atomic.Uint64 `json:"-"`
	JoinDrop      atomic.Uint64 `json:"-"`
	JoinReplay    atomic.Uint64 `json:"-"`
}

// filter sits between wireguard-go and the gateway's network side (kernel
// tun or netstack). It enforces what WireGuard's cryptokey routing cannot:
// users are isolated from each other, and bandwidth is limited per user and
// globally. WireGuard has already dropped packets whose source address is
// not the sending peer's lease, so the source address is the user's identity.
type filter struct {
	tun.Device
	mtu     int
	pool    netip.Prefix
	self    netip.Addr
	owners  atomic.Pointer[owners]
	hairpin func([]byte)   // netstack mode: client-to-client packets
	deny    []netip.Prefix // destinations clients may never reach (cluster nets)
	global  *rate.Limiter
	perUser int64
	users   sync.Map // user -> *rate.Limiter
	c       *Counters
}

func (f *filter) MTU() (int, error) { return f.mtu, nil }

func (f *filter) userLimit(u string) *rate.Limiter {
	if f.perUser <= 0 {
		return nil
	}
	if b, ok := f.users.Load(u); ok {
		return b.(*rate.Limiter)
	}
	b, _ := f.users.LoadOrStore(u, newLimit(f.perUser))
	return b.(*rate.Limiter)
}

func addrs(p []byte) (src, dst netip.Addr, ok bool) {
	if len(p) >= 20 && p[0]>>4 == 4 {
		return netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20])), true
	}
	if len(p) >= 40 && p[0]>>4 == 6 {
		return netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40])), true
	}
	return
}

// Write takes packets from clients toward the network.
func (f *filter) Write(bufs [][]byte, offset int) (int, error) {
	own := *f.owners.Load()
	now := time.Now()
	kept := bufs[:0]
	for _, b := range bufs {
		p := b[offset:]
		src, dst, ok := addrs(p)
		if !ok {
			continue
		}
		srcUser := own[src]
		if denied(f.deny, dst) {
			f.c.IsolationDrop.Add(1)
			continue
		}
		if dst != f.self && f.pool.Contains(dst) {
			if du, ok := own[dst]; !ok || du != srcUser {
				f.c.IsolationDrop.Add(1)
				continue
			}
		}
		if !take(f.global, len(p), now) || !take(f.userLimit(srcUser), len(p), now) {
			f.c.RateDrop.Add(1)
			continue
		}
		f.c.FromClients.Add(uint64(len(p)))
		if f.hairpin != nil && dst != f.self && f.pool.Contains(dst) {
			f.hairpin(p)
			continue
		}
		kept = append(kept, b)
	}
	if len(kept) == 0 {
		return len(bufs), nil
	}
	if _, err := f.Device.Write(kept, offset); err != nil {
		return 0, err
	}
	return len(bufs), nil
}

// Read takes packets from the network toward clients; dropped ones get size
// 0, which wireguard-go skips.
func (f *filter) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	n, err := f.Device.Read(bufs, sizes, offset)
	if f.global == nil && f.perUser <= 0 {
		for i := range n {
			f.c.ToClients.Add(uint64(sizes[i]))
		}
		return n, err
	}
	own := *f.owners.Load()
	now := time.Now()
	for i := range n {
		p := bufs[i][offset : offset+sizes[i]]
		_, dst, ok := addrs(p)
		if !ok {
			continue
		}
		if !take(f.global, len(p), now) || !take(f.userLimit(own[dst]), len(p), now) {
			f.c.RateDrop.Add(1)
			sizes[i] = 0
			continue
		}
		f.c.ToClients.Add(uint64(len(p)))
	}
	return n, err
}

var _ = binary.BigEndian

func denied(deny []netip.Prefix, a netip.Addr) bool {
	for _, p := range deny {
		if p.Contains(a) {
			return true
		}
	}
	return false
}
