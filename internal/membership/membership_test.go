package membership

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"golang.org/x/time/rate"
)

// dir is an in-memory directory answering like NSS (only for the
// tracker's bookkeeping; the real thing is tested against slapd + SSSD in
// directory_test.go).
type dir struct {
	mu     sync.Mutex
	groups map[uint32][]string
	uids   map[string]uint32
	init   map[uint32][]uint32
	fail   bool
	asked  int
	names  int // names asked (UIDs)
}

func (d *dir) Groups(_ context.Context, gids []uint32) (map[uint32][]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked += len(gids)
	if d.fail {
		return nil, errors.New("directory down")
	}
	out := map[uint32][]string{}
	for _, g := range gids {
		if m, ok := d.groups[g]; ok {
			out[g] = slices.Clone(m)
		}
	}
	return out, nil
}

func (d *dir) UIDs(_ context.Context, names []string) (map[string]uint32, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked += len(names)
	d.names += len(names)
	out := map[string]uint32{}
	for _, n := range names {
		if u, ok := d.uids[n]; ok {
			out[n] = u
		}
	}
	return out, nil
}

func (d *dir) InitGroups(_ context.Context, uid uint32) ([]uint32, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked++
	if g, ok := d.init[uid]; ok {
		return g, nil
	}
	return nil, errors.New("unknown uid")
}

func newDir() *dir {
	return &dir{
		groups: map[uint32][]string{2100: {"alice", "bob"}, 2200: {"carol"}},
		uids:   map[string]uint32{"alice": 2001, "bob": 2002, "carol": 2003, "dave": 2005},
		init:   map[uint32][]uint32{2005: {2500, 2100}},
	}
}

type loaded struct {
	mu sync.Mutex
	m  identity.Membership
}

func (l *loaded) apply(m identity.Membership) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.m = m
	return nil
}

func (l *loaded) get() identity.Membership {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.m
}

func TestTracker(t *testing.T) {
	d := newDir()
	var l loaded
	local := []uint32{2001, 2100}
	var lmu sync.Mutex
	files := &identity.Table{Users: []identity.User{{Name: "root", UID: 0, GID: 0}, {Name: "op", UID: 900, GID: 900}},
		Groups: []identity.Group{{Name: "ops", GID: 950, Members: []string{"op"}}}}
	tr := New(Config{
		Lookup:    d,
		Files:     func() (*identity.Table, error) { return files, nil },
		LocalGIDs: func() ([]uint32, error) { lmu.Lock(); defer lmu.Unlock(); return slices.Clone(local), nil },
		Apply:     l.apply,
		Refresh:   time.Hour, Scan: 10 * time.Millisecond,
	})
	tr.Load(context.Background())
	m := l.get()
	// Members of the local gids, the files' own membership; not 2200 (no
	// local process holds it) and nothing enumerated.
	if !m.Has(2002, 2100) || !m.Has(2001, 2100) || !m.Has(900, 950) || !m.Has(900, 900) || m.Has(2003, 2200) {
		t.Fatalf("membership %v", m)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { tr.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wait := func(what string, ok func(identity.Membership) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !ok(l.get()) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: membership %v", what, l.get())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// A new local gid is picked up by the scan.
	lmu.Lock()
	local = append(local, 2200)
	lmu.Unlock()
	wait("new local gid", func(m identity.Membership) bool { return m.Has(2003, 2200) })
	// A refused connector's groups (here a primary-group member no list names).
	tr.Seen(2005)
	wait("seen connector", func(m identity.Membership) bool { return m.Has(2005, 2500) && m.Has(2005, 2100) })
	// A membership change applies at the next full round.
	d.mu.Lock()
	d.groups[2100] = []string{"alice"}
	d.mu.Unlock()
	tr.Refresh()
	wait("bob removed", func(m identity.Membership) bool { return !m.Has(2002, 2100) && m.Has(2001, 2100) })
	// The directory failing: within KeepFailed (here Refresh, an hour) the
	// groups' last answers stand — a slow directory is not an empty group.
	d.mu.Lock()
	d.fail = true
	d.mu.Unlock()
	r0 := tr.Stats().Rounds
	tr.Refresh()
	wait("failed round", func(identity.Membership) bool { return tr.Stats().Rounds > r0 })
	if m := l.get(); !m.Has(2001, 2100) || !m.Has(2003, 2200) || !m.Has(900, 950) {
		t.Fatalf("a failed round within KeepFailed dropped members: %v", m)
	}
	// Failing for longer than KeepFailed: the groups lose their members
	// (fail closed for sharing); the files' membership stays.
	tr.mu.Lock()
	tr.cfg.KeepFailed = time.Nanosecond
	tr.mu.Unlock()
	tr.Refresh()
	wait("directory down", func(m identity.Membership) bool { return !m.Has(2001, 2100) && !m.Has(2003, 2200) && m.Has(900, 950) })
	// A gid no process holds any more is dropped.
	d.mu.Lock()
	d.fail = false
	d.mu.Unlock()
	lmu.Lock()
	local = []uint32{2001}
	lmu.Unlock()
	tr.Refresh()
	wait("gid gone", func(m identity.Membership) bool { return tr.Stats().Groups == 1 && !m.Has(2003, 2200) })
	if s := tr.Stats(); s.Seen != 1 || s.Lookups == 0 {
		t.Errorf("stats %+v", s)
	}
}

// The token bucket bounds the lookups whatever the node asks.
func TestRateBound(t *testing.T) {
	d := &dir{groups: map[uint32][]string{}, uids: map[string]uint32{}}
	var gids []uint32
	for g := range uint32(300) {
		gids = append(gids, 10000+g)
		d.groups[10000+g] = nil
	}
	tr := New(Config{Lookup: d, LocalGIDs: func() ([]uint32, error) { return gids, nil }, Rate: rate.Limit(1000), Burst: 100})
	t0 := time.Now()
	tr.Load(context.Background())
	// 300 keys at 1000/s with a burst of 100: at least 0.2 s.
	if el := time.Since(t0); el < 190*time.Millisecond {
		t.Errorf("300 lookups in %v: not rate-limited", el)
	}
	if d.asked != 300 {
		t.Errorf("asked %d keys, want 300", d.asked)
	}
}

func TestLocalGIDs(t *testing.T) {
	got, err := LocalGIDs()
	if err != nil || !slices.Contains(got, uint32(os.Getegid())) {
		t.Errorf("LocalGIDs = %v %v", got, err)
	}
	if os.Geteuid() != 0 {
		t.Skip("the other-namespace half needs root (unshare -n, setpriv)")
	}
	// A process here running with gid 64123 counts; one in another network
	// namespace with 64124 does not.
	here := exec.Command("setpriv", "--regid", "64123", "--clear-groups", "sleep", "60")
	there := exec.Command("unshare", "-n", "setpriv", "--regid", "64124", "--clear-groups", "sleep", "60")
	for _, c := range []*exec.Cmd{here, there} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer c.Wait()
		defer c.Process.Kill()
	}
	// Both have their ids once they run sleep (setpriv and unshare exec).
	deadline := time.Now().Add(10 * time.Second)
	for _, c := range []*exec.Cmd{here, there} {
		for a := procfs.Cmdline(c.Process.Pid); len(a) == 0 || a[0] != "sleep"; a = procfs.Cmdline(c.Process.Pid) {
			if time.Now().After(deadline) {
				t.Fatalf("pid %d never ran sleep: %q", c.Process.Pid, a)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	got, err = LocalGIDs()
	if err != nil || !slices.Contains(got, 64123) || slices.Contains(got, 64124) {
		t.Errorf("LocalGIDs = %v %v: want 64123 (this namespace), not 64124 (another)", got, err)
	}
}

func TestGetent(t *testing.T) {
	g := &Getent{}
	ctx := context.Background()
	m, err := g.Groups(ctx, []uint32{0, 4242424})
	if err != nil || len(m) != 1 {
		t.Fatalf("Groups = %v %v", m, err)
	}
	u, err := g.UIDs(ctx, []string{"root", "pal-nobody-xyz"})
	if err != nil || len(u) != 1 || u["root"] != 0 {
		t.Fatalf("UIDs = %v %v", u, err)
	}
	if gs, err := g.InitGroups(ctx, 0); err != nil || len(gs) == 0 || gs[0] != 0 {
		t.Fatalf("InitGroups(0) = %v %v", gs, err)
	}
	if _, err := (&Getent{Path: "/bin/false"}).Groups(ctx, []uint32{0}); err == nil {
		t.Error("a failing getent is not an error")
	}
}

// The node's own users and the connectors it has looked up are "known"
// (their carried gid stops counting) only after a lookup succeeded, and a
// user's removal from a group reaches the data plane at the next round.
func TestKnownUsers(t *testing.T) {
	d := newDir()
	d.init[2001] = []uint32{2001, 2100}
	var l loaded
	var kmu sync.Mutex
	var known []uint32
	tr := New(Config{
		Lookup:    d,
		LocalGIDs: func() ([]uint32, error) { return nil, nil },
		LocalUIDs: func() ([]uint32, error) { return []uint32{2001}, nil },
		Apply:     l.apply,
		ApplyKnown: func(u []uint32) error {
			kmu.Lock()
			defer kmu.Unlock()
			known = slices.Clone(u)
			return nil
		},
		Refresh: time.Hour, Scan: time.Hour,
	})
	getKnown := func() []uint32 { kmu.Lock(); defer kmu.Unlock(); return known }
	tr.Load(context.Background())
	// The local user's groups are in, though no local process runs with
	// 2100 (a reply's reverse check on this node needs them).
	if m := l.get(); !m.Has(2001, 2100) || !slices.Equal(getKnown(), []uint32{2001}) {
		t.Fatalf("after load: membership %v, known %v", m, getKnown())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { tr.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wait := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: membership %v, known %v", what, l.get(), getKnown())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// A connector that claimed a group (Seen) becomes known with its groups.
	tr.Seen(2005)
	wait("claiming connector known", func() bool { return slices.Contains(getKnown(), 2005) && l.get().Has(2005, 2100) })
	// Removed from 2100 in the directory: gone at the next round, and
	// still known (so its processes' carried 2100 no longer counts).
	d.mu.Lock()
	d.init[2005] = []uint32{2500}
	d.mu.Unlock()
	tr.Refresh()
	wait("revoked", func() bool { return !l.get().Has(2005, 2100) && slices.Contains(getKnown(), 2005) })
	// A failed lookup makes the user unknown again (not "member of nothing").
	d.mu.Lock()
	delete(d.init, 2005)
	d.mu.Unlock()
	tr.Refresh()
	wait("lookup failed", func() bool { return !slices.Contains(getKnown(), 2005) })
}

// A failed round forgets no member names: the next answered round asks the
// member lists only, not thousands of names at once (with a 10,000-user
// directory under load those lookups timed out round after round and the
// groups stayed empty).
func TestFailedRoundKeepsNames(t *testing.T) {
	d := newDir()
	var l loaded
	tr := New(Config{
		Lookup:    d,
		LocalGIDs: func() ([]uint32, error) { return []uint32{2100}, nil },
		Apply:     l.apply,
		Refresh:   time.Hour, Scan: time.Hour, KeepFailed: time.Nanosecond,
	})
	tr.Load(context.Background())
	if !l.get().Has(2002, 2100) {
		t.Fatalf("after load: %v", l.get())
	}
	d.mu.Lock()
	d.fail = true
	d.mu.Unlock()
	tr.Load(context.Background()) // a full round, failing: members dropped
	if l.get().Has(2002, 2100) {
		t.Fatalf("failed beyond KeepFailed, members kept: %v", l.get())
	}
	d.mu.Lock()
	d.fail, d.names = false, 0
	d.mu.Unlock()
	tr.Load(context.Background())
	d.mu.Lock()
	n := d.names
	d.mu.Unlock()
	if !l.get().Has(2002, 2100) || n != 0 {
		t.Fatalf("after recovery: membership %v, %d names asked again", l.get(), n)
	}
}
