// Package membership keeps the group membership the userwall data plane
// needs for its cross-node group rule — "is the remote connector uid U a
// member of the listener's gid G" — without enumerating the directory.
//
// Sites take accounts from LDAP or AD through SSSD, which does not list
// them (enumerate = false), and a node that listed the whole directory every
// minute would be a load directory administrators forbid. So the tracker
// asks only what the kernel's check can need, with direct lookups a
// directory answers from an index:
//
//   - the member lists (getgrgid) of every gid a process on this node runs
//     with — a listener's socket carries its creator's effective gid, so
//     these are the only G the check looks up (a superset: not every such
//     process listens);
//   - the groups (initgroups) of connectors this node refused (the data
//     plane's denial events): covers users whose primary group is G, which
//     no member list names;
//   - the local files (/etc/passwd, /etc/group), read directly: cheap and
//     complete for files accounts, never an NSS enumeration.
//
// Every tracked gid's member list and every tracked connector's groups are
// looked up again every Refresh (a member name's uid is reused for NameTTL:
// membership changes show in the member lists); new gids are found by a
// local scan every Scan and looked up at once. All lookups go
// through one token bucket (Rate, Burst), so the directory load per node is
// bounded whatever happens on the node. A membership change in the
// directory is in the kernel within Refresh + the NSS cache's lifetime
// (SSSD's entry_cache_timeout; the memory cache is bypassed) + the time the
// bucket makes a sweep wait (tracked keys / Rate). A failed lookup keeps a
// group's last answer for KeepFailed, then drops its members (fail closed).
package membership

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"golang.org/x/time/rate"
)

// DefaultRate is the default bound on NSS lookups per node (keys per
// second); a full round of a node's typical few dozen groups takes well
// under a second of it.
const DefaultRate rate.Limit = 50

// Lookup is what the tracker asks of NSS. Keys that do not exist are
// absent from the answers; an error means the lookup itself failed.
type Lookup interface {
	// Groups returns the member names of each gid.
	Groups(ctx context.Context, gids []uint32) (map[uint32][]string, error)
	// UIDs returns the uid of each user name.
	UIDs(ctx context.Context, names []string) (map[string]uint32, error)
	// InitGroups returns every gid a uid holds at login (primary first).
	InitGroups(ctx context.Context, uid uint32) ([]uint32, error)
}

// Config configures a Tracker.
type Config struct {
	Lookup Lookup
	// Files is read directly each refresh (nil: no files view).
	Files func() (*identity.Table, error)
	// LocalGIDs lists the gids processes on this node run with.
	LocalGIDs func() ([]uint32, error)
	// LocalUIDs lists the uids processes on this node run with: their
	// groups are tracked like a refused connector's, for as long as they
	// run here (a reply's reverse check needs the local user's groups).
	LocalUIDs func() ([]uint32, error)
	// ApplyKnown loads the users whose groups were looked up (their last
	// lookup succeeded): for them the data plane takes membership alone,
	// not the gid a connection carries.
	ApplyKnown func(uids []uint32) error
	// ExtraGIDs are gids always tracked (groups named in exemptions).
	ExtraGIDs func() []uint32
	// Apply loads a complete membership into the data plane.
	Apply func(identity.Membership) error
	// Refresh re-resolves everything tracked (default 60 s).
	Refresh time.Duration
	// KeepFailed is how long a group's last answered member list outlives
	// lookups that fail (default Refresh): a slow or restarting directory
	// is not an empty group, but an outage longer than this drops the
	// group's members (fail closed for sharing).
	KeepFailed time.Duration
	// Scan looks for new local gids (default 1 s).
	Scan time.Duration
	// Rate and Burst bound the NSS lookups (keys) per second (default 50, 500).
	Rate  rate.Limit
	Burst int
	// MaxSeen bounds the refused connectors tracked (default 4096); the
	// least recently refused go first.
	MaxSeen int
	// OnError reports a failed lookup round (nil: ignored).
	OnError func(error)
}

// Stats are counters for metrics and the benchmarks.
type Stats struct {
	Lookups   uint64 // NSS keys asked (each counted once per ask)
	Rounds    uint64 // membership loads
	Groups    int    // tracked gids
	Seen      int    // tracked refused connectors
	Pairs     int    // (uid, gid) pairs loaded
	LastApply time.Time
}

// Tracker keeps the data plane's membership in step. Run drives it; Seen
// may be called from any goroutine.
type Tracker struct {
	cfg    Config
	lim    *rate.Limiter
	seen   chan uint32
	wake   chan struct{}
	period chan time.Duration

	lookups, rounds atomic.Uint64

	// mu guards everything below (Run writes, Stats reads).
	mu     sync.Mutex
	groups map[uint32][]uint32  // tracked gid → member uids (last answer)
	okAt   map[uint32]time.Time // tracked gid → when its member list was last answered
	users  map[uint32][]uint32  // refused connector uid → its gids
	known  map[uint32]bool      // users whose last lookup succeeded
	lastAt map[uint32]time.Time
	names  map[string]name // member name → uid, with when it was asked
	pairs  int
	last   time.Time
}

// New returns a tracker with defaults filled in.
func New(cfg Config) *Tracker {
	if cfg.Refresh <= 0 {
		cfg.Refresh = time.Minute
	}
	if cfg.Scan <= 0 {
		cfg.Scan = time.Second
	}
	if cfg.KeepFailed <= 0 {
		cfg.KeepFailed = cfg.Refresh
	}
	if cfg.Rate <= 0 {
		cfg.Rate = DefaultRate
	}
	if cfg.Burst <= 0 {
		cfg.Burst = 500
	}
	if cfg.MaxSeen <= 0 {
		cfg.MaxSeen = 4096
	}
	return &Tracker{
		cfg: cfg, lim: rate.NewLimiter(cfg.Rate, cfg.Burst),
		seen: make(chan uint32, 256), wake: make(chan struct{}, 1), period: make(chan time.Duration, 1),
		groups: map[uint32][]uint32{}, okAt: map[uint32]time.Time{}, users: map[uint32][]uint32{}, known: map[uint32]bool{}, lastAt: map[uint32]time.Time{}, names: map[string]name{},
	}
}

// Seen notes a connector the data plane refused (non-blocking: a burst
// beyond the queue is dropped; the connector's next refusal queues it).
func (t *Tracker) Seen(uid uint32) {
	select {
	case t.seen <- uid:
	default:
	}
}

// Refresh asks Run for a full round now (after a configuration reload).
func (t *Tracker) Refresh() {
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

// SetRefresh changes the full-round period (a configuration reload).
func (t *Tracker) SetRefresh(d time.Duration) {
	if d <= 0 {
		return
	}
	select {
	case <-t.period: // replace a pending change
	default:
	}
	t.period <- d
}

// Stats returns the counters.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return Stats{Lookups: t.lookups.Load(), Rounds: t.rounds.Load(), Groups: len(t.groups), Seen: len(t.users),
		Pairs: t.pairs, LastApply: t.last}
}

// Load resolves everything once and loads it (before enforcement starts).
func (t *Tracker) Load(ctx context.Context) { t.round(ctx, true) }

// Run keeps the membership fresh until ctx ends (call Load first).
func (t *Tracker) Run(ctx context.Context) {
	scan := time.NewTicker(t.cfg.Scan)
	defer scan.Stop()
	full := time.NewTicker(t.cfg.Refresh)
	defer full.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-full.C:
			t.round(ctx, true)
		case <-t.wake:
			t.round(ctx, true)
		case d := <-t.period:
			full.Reset(d)
		case <-scan.C:
			t.round(ctx, false)
		case uid := <-t.seen:
			t.mu.Lock()
			_, known := t.users[uid]
			t.lastAt[uid] = time.Now()
			t.mu.Unlock()
			if !known {
				t.round(ctx, false, uid)
			}
		}
	}
}

// round re-resolves everything (full) or only what is new, then loads the
// result if it changed anything.
func (t *Tracker) round(ctx context.Context, full bool, newUIDs ...uint32) {
	var errs []error
	want := map[uint32]bool{}
	if t.cfg.LocalGIDs != nil {
		gids, err := t.cfg.LocalGIDs()
		if err != nil {
			errs = append(errs, err)
		}
		for _, g := range gids {
			want[g] = true
		}
	}
	if t.cfg.ExtraGIDs != nil {
		for _, g := range t.cfg.ExtraGIDs() {
			want[g] = true
		}
	}
	var local []uint32
	if t.cfg.LocalUIDs != nil {
		uids, err := t.cfg.LocalUIDs()
		if err != nil {
			errs = append(errs, err)
		}
		local = uids
	}
	t.mu.Lock()
	var ask []uint32
	for g := range want {
		if _, ok := t.groups[g]; full || !ok {
			ask = append(ask, g)
		}
	}
	changed := false
	for g := range t.groups {
		if !want[g] {
			delete(t.groups, g) // no process holds it any more
			delete(t.okAt, g)
			changed = true
		}
	}
	users := slices.Clone(newUIDs)
	if full {
		users = slices.Collect(maps.Keys(t.users))
		// Forget the least recently refused beyond the bound.
		if over := len(t.lastAt) - t.cfg.MaxSeen; over > 0 {
			byAge := slices.Collect(maps.Keys(t.lastAt))
			slices.SortFunc(byAge, func(a, b uint32) int { return t.lastAt[a].Compare(t.lastAt[b]) })
			for _, u := range byAge[:over] {
				delete(t.lastAt, u)
				delete(t.users, u)
				delete(t.known, u)
			}
			changed = true
		}
	}
	now := time.Now()
	for _, u := range local {
		if _, tracked := t.lastAt[u]; !tracked {
			users = append(users, u)
		}
		t.lastAt[u] = now // kept while a process of u runs here
	}
	t.mu.Unlock()
	if len(ask) == 0 && len(users) == 0 && !full && !changed {
		return
	}

	slices.Sort(ask)
	groups, answered, err := t.resolveGroups(ctx, ask, full)
	if err != nil {
		errs = append(errs, err)
	}
	userGIDs := map[uint32][]uint32{}
	slices.Sort(users)
	users = slices.Compact(users)
	for _, u := range users {
		if ctx.Err() != nil || t.wait(ctx, 1) != nil {
			break
		}
		gids, err := t.cfg.Lookup.InitGroups(ctx, u)
		if err != nil {
			errs = append(errs, err)
			continue // unknown or failed: no groups (fail closed for sharing)
		}
		userGIDs[u] = gids
	}

	t.mu.Lock()
	now = time.Now()
	for g := range want {
		if _, asked := slices.BinarySearch(ask, g); !asked {
			continue
		}
		switch {
		case answered[g]:
			t.groups[g] = groups[g] // nil: not found, no members
			t.okAt[g] = now
		case now.Sub(t.okAt[g]) > t.cfg.KeepFailed:
			t.groups[g] = nil // failed for too long (or never answered): no members
		}
		// Else failed recently: the last answer stands.
	}
	for _, u := range users {
		if _, tracked := t.lastAt[u]; tracked {
			gids, ok := userGIDs[u]
			t.users[u] = gids
			if ok {
				t.known[u] = true
			} else {
				delete(t.known, u) // failed: the carried gid counts again
			}
		}
	}
	known := slices.Sorted(maps.Keys(t.known))
	m := identity.Membership{}
	add := func(uid, gid uint32) {
		if !slices.Contains(m[uid], gid) {
			m[uid] = append(m[uid], gid)
		}
	}
	for g, uids := range t.groups {
		for _, u := range uids {
			add(u, g)
		}
	}
	for u, gids := range t.users {
		for _, g := range gids {
			add(u, g)
		}
	}
	t.mu.Unlock()
	if t.cfg.Files != nil {
		if tb, err := t.cfg.Files(); err != nil {
			errs = append(errs, err)
		} else if fm, err := tb.Members(); err == nil {
			for u, gids := range fm {
				for _, g := range gids {
					add(u, g)
				}
			}
		}
	}
	pairs := 0
	for _, gids := range m {
		pairs += len(gids)
	}
	if t.cfg.Apply != nil {
		if err := t.cfg.Apply(m); err != nil {
			errs = append(errs, err)
		}
	}
	// Known after their memberships are in: never a window where a known
	// user's group is missing.
	if t.cfg.ApplyKnown != nil {
		if err := t.cfg.ApplyKnown(known); err != nil {
			errs = append(errs, err)
		}
	}
	t.rounds.Add(1)
	t.mu.Lock()
	t.pairs, t.last = pairs, time.Now()
	t.mu.Unlock()
	if err := errors.Join(errs...); err != nil && t.cfg.OnError != nil {
		t.cfg.OnError(err)
	}
}

// wait takes n tokens (keys) from the bucket.
func (t *Tracker) wait(ctx context.Context, n int) error {
	t.lookups.Add(uint64(n))
	for n > 0 {
		k := min(n, t.cfg.Burst)
		if err := t.lim.WaitN(ctx, k); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// chunk bounds the keys of one getent call.
const chunk = 200

// inChunks looks keys up chunk by chunk, each chunk on the lookup budget;
// done gets every chunk that was answered, and a failed chunk is reported
// and skipped (err: the context ended while waiting for the budget).
func inChunks[K any, V any](ctx context.Context, t *Tracker, keys []K, look func(context.Context, []K) (V, error), done func([]K, V)) (errs []error, err error) {
	for part := range slices.Chunk(keys, chunk) {
		if err := t.wait(ctx, len(part)); err != nil {
			return errs, err
		}
		got, err := look(ctx, part)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done(part, got)
	}
	return errs, nil
}

// name is a member name's uid as last asked.
type name struct {
	uid uint32
	at  time.Time
}

// NameTTL is how long a member name's uid is reused before it is asked
// again: uids are not renumbered in practice, and membership changes are
// seen in the groups' member lists, which every full round asks.
const NameTTL = 30 * time.Minute

// resolveGroups looks up gids' member lists, then the uids of member names
// not known yet, plus — on a full round — a share of the stale ones (at most
// a quarter of a round's lookup budget, oldest first), so that refreshing
// thousands of names never starves the member lists.
func (t *Tracker) resolveGroups(ctx context.Context, gids []uint32, full bool) (map[uint32][]uint32, map[uint32]bool, error) {
	members := map[uint32][]string{}
	answered := map[uint32]bool{} // gids whose lookup answered (found or not)
	errs, err := inChunks(ctx, t, gids, t.cfg.Lookup.Groups, func(part []uint32, got map[uint32][]string) {
		maps.Copy(members, got)
		for _, g := range part {
			answered[g] = true
		}
	})
	if err != nil {
		return nil, nil, err
	}
	t.mu.Lock()
	known := maps.Clone(t.names)
	t.mu.Unlock()
	now := time.Now()
	var need, stale []string
	seen := map[string]bool{}
	for _, ns := range members {
		for _, n := range ns {
			if seen[n] {
				continue
			}
			seen[n] = true
			if e, ok := known[n]; !ok {
				need = append(need, n)
			} else if full && now.Sub(e.at) > NameTTL {
				stale = append(stale, n)
			}
		}
	}
	slices.SortFunc(stale, func(a, b string) int { return known[a].at.Compare(known[b].at) })
	budget := max(1, int(float64(t.cfg.Rate)*t.cfg.Refresh.Seconds()/4))
	names := append(need, stale[:min(len(stale), budget)]...)
	slices.Sort(names)
	uerrs, err := inChunks(ctx, t, names, t.cfg.Lookup.UIDs, func(part []string, got map[string]uint32) {
		for _, n := range part {
			if u, ok := got[n]; ok {
				known[n] = name{u, now}
			} else {
				delete(known, n) // gone from the directory
			}
		}
	})
	if err != nil {
		return nil, nil, err
	}
	errs = append(errs, uerrs...)
	out := make(map[uint32][]uint32, len(members))
	for g, ns := range members {
		uids := []uint32{}
		for _, n := range ns {
			if e, ok := known[n]; ok {
				uids = append(uids, e.uid)
			}
		}
		out[g] = uids
	}
	t.mu.Lock()
	// Keep the names of groups still tracked (and the ones just asked),
	// and every name asked within NameTTL: a group whose lookup failed
	// this round lists none, and forgetting its members' names would make
	// the next round ask thousands at once (a 10,000-user directory under
	// load then timed out round after round, and the group stayed empty).
	keep := map[string]name{}
	for g := range t.groups {
		for _, n := range members[g] {
			if e, ok := known[n]; ok {
				keep[n] = e
			}
		}
	}
	for n, e := range known {
		if seen[n] || now.Sub(e.at) <= NameTTL {
			keep[n] = e
		}
	}
	if full {
		t.names = keep
	} else {
		maps.Copy(t.names, keep)
	}
	t.mu.Unlock()
	return out, answered, errors.Join(errs...)
}
