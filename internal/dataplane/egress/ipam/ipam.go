// Package ipam hands out overlay addresses from a pool with leases, persisted
// so that concurrent joins and gateway restarts never give one address twice
// (the DHT Create-with-lease of IPOP, reference 003, reduced to one writer:
// the gateway owns the pool and holds an exclusive lock on its state file).
package ipam

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"
)

// Lease binds an address to one client (user, job, node) and its key.
type Lease struct {
	Addr    netip.Addr `json:"addr"`
	User    string     `json:"user"`
	Job     string     `json:"job"`
	Node    string     `json:"node"`
	Key     string     `json:"key"` // client's WireGuard public key (base64)
	Expires time.Time  `json:"expires"`
}

// Name is the overlay DNS label of the lease holder.
func (l Lease) Name() string { return l.User + "-" + l.Job + "-" + l.Node }

// Pool is a persisted address pool.
type Pool struct {
	mu       sync.Mutex
	prefix   netip.Prefix
	reserved map[netip.Addr]bool
	path     string
	lock     *os.File
	leases   map[netip.Addr]*Lease
	next     netip.Addr // where the search for a free address resumes
}

// ErrExhausted means every address of the pool is leased.
var ErrExhausted = errors.New("address pool exhausted")

// Open loads (or creates) the pool state at path. reserved addresses (the
// gateway's own) are never leased. The state file is locked for the life of
// the pool, so two gateways cannot share one pool by mistake.
func Open(path string, prefix netip.Prefix, reserved ...netip.Addr) (*Pool, error) {
	if !prefix.Addr().Is4() || prefix.Bits() > 30 {
		return nil, fmt.Errorf("pool %s: want an IPv4 prefix of /30 or larger", prefix)
	}
	p := &Pool{prefix: prefix.Masked(), path: path, leases: map[netip.Addr]*Lease{}, reserved: map[netip.Addr]bool{}}
	for _, r := range reserved {
		p.reserved[r] = true
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	lf, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lf.Close()
		return nil, fmt.Errorf("lease file %s is in use by another gateway", path)
	}
	p.lock = lf
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		p.Close()
		return nil, err
	default:
		var ls []*Lease
		if err := json.Unmarshal(b, &ls); err != nil {
			p.Close()
			return nil, fmt.Errorf("lease file %s: %v", path, err)
		}
		for _, l := range ls {
			if p.prefix.Contains(l.Addr) {
				p.leases[l.Addr] = l
			}
		}
	}
	p.next = p.prefix.Addr().Next()
	return p, nil
}

// Close releases the state file lock.
func (p *Pool) Close() error {
	if p.lock != nil {
		p.lock.Close()
		p.lock = nil
	}
	return nil
}

// Prefix is the pool's range.
func (p *Pool) Prefix() netip.Prefix { return p.prefix }

// Acquire returns the lease of (user, job, node, key), renewing it, or a new
// one. A client that rejoins with the same key keeps its address; the same
// (user, job, node) with a new key replaces the old lease (a restarted
// client). Expired leases are reclaimed first.
func (p *Pool) Acquire(user, job, node, key string, ttl time.Duration, now time.Time) (Lease, *Lease, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expireLocked(now)
	var replaced *Lease
	for _, l := range p.leases {
		if l.User == user && l.Job == job && l.Node == node {
			if l.Key != key {
				old := *l
				replaced = &old
				l.Key = key
			}
			l.Expires = now.Add(ttl)
			if err := p.saveLocked(); err != nil {
				return Lease{}, nil, err
			}
			return *l, replaced, nil
		}
		if l.Key == key {
			return Lease{}, nil, fmt.Errorf("key already leased to %s", l.Name())
		}
	}
	a, err := p.freeLocked()
	if err != nil {
		return Lease{}, nil, err
	}
	l := &Lease{Addr: a, User: user, Job: job, Node: node, Key: key, Expires: now.Add(ttl)}
	p.leases[a] = l
	if err := p.saveLocked(); err != nil {
		delete(p.leases, a)
		return Lease{}, nil, err
	}
	return *l, replaced, nil
}

func (p *Pool) freeLocked() (netip.Addr, error) {
	a := p.next
	for range 1 << (32 - p.prefix.Bits()) {
		if !p.prefix.Contains(a) {
			a = p.prefix.Addr()
		}
		last := !p.prefix.Contains(a.Next())
		if a != p.prefix.Addr() && !last && !p.reserved[a] && p.leases[a] == nil {
			p.next = a.Next()
			return a, nil
		}
		a = a.Next()
	}
	return netip.Addr{}, ErrExhausted
}

func (p *Pool) expireLocked(now time.Time) []Lease {
	var out []Lease
	for a, l := range p.leases {
		if !now.Before(l.Expires) {
			out = append(out, *l)
			delete(p.leases, a)
		}
	}
	return out
}

// Expire drops leases past their end and returns them (their peers must go).
func (p *Pool) Expire(now time.Time) ([]Lease, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.expireLocked(now)
	if len(out) == 0 {
		return nil, nil
	}
	return out, p.saveLocked()
}

// Release drops the leases matching f and returns them.
func (p *Pool) Release(f func(Lease) bool) ([]Lease, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Lease
	for a, l := range p.leases {
		if f(*l) {
			out = append(out, *l)
			delete(p.leases, a)
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, p.saveLocked()
}

// Lookup returns the lease of an address.
func (p *Pool) Lookup(a netip.Addr) (Lease, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	l, ok := p.leases[a]
	if !ok {
		return Lease{}, false
	}
	return *l, true
}

// Leases lists the current leases by address.
func (p *Pool) Leases() []Lease {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Lease, 0, len(p.leases))
	for _, l := range p.leases {
		out = append(out, *l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr.Less(out[j].Addr) })
	return out
}

// saveLocked writes the whole state atomically (temp file, fsync, rename):
// a crash leaves either the old or the new state, never a torn one.
func (p *Pool) saveLocked() error {
	ls := make([]*Lease, 0, len(p.leases))
	for _, l := range p.leases {
		ls = append(ls, l)
	}
	sort.Slice(ls, func(i, j int) bool { return ls[i].Addr.Less(ls[j].Addr) })
	b, err := json.MarshalIndent(ls, "", " ")
	if err != nil {
		return err
	}
	tmp := p.path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	f.Close()
	return os.Rename(tmp, p.path)
}
