package identity

import (
	"sync"
	"time"
)

// NameCache resolves uids and gids to names through a Resolver (System runs
// getent, so LDAP/SSSD accounts are named too) and remembers every answer,
// found or not, for its TTL: a busy caller (the ident service, the event
// log) must not run getent per query, nor hang on a slow directory more
// than once per TTL and id; and a user created after a miss is named once
// the miss expires. Safe for concurrent use.
type NameCache struct {
	res Resolver
	ttl time.Duration
	now func() time.Time // tests

	mu     sync.Mutex // guards users and groups
	users  map[uint32]cachedName
	groups map[uint32]cachedName
}

type cachedName struct {
	name string
	at   time.Time
}

// maxCachedNames bounds each map: past it, expired entries are dropped, and
// if none is, the map is emptied.
const maxCachedNames = 4096

// NewNameCache returns a cache over res (System() if nil) keeping answers
// for ttl.
func NewNameCache(res Resolver, ttl time.Duration) *NameCache {
	if res == nil {
		res = System()
	}
	return &NameCache{res: res, ttl: ttl, now: time.Now, users: map[uint32]cachedName{}, groups: map[uint32]cachedName{}}
}

// User returns the name of uid, "" if it has none (or NSS fails).
func (c *NameCache) User(uid uint32) string { return c.lookup(c.users, uid, c.res.LookupUID) }

// Group returns the name of gid, "" if it has none (or NSS fails).
func (c *NameCache) Group(gid uint32) string { return c.lookup(c.groups, gid, c.res.LookupGID) }

func (c *NameCache) lookup(m map[uint32]cachedName, id uint32, fn func(uint32) (string, error)) string {
	c.mu.Lock()
	e, ok := m[id]
	c.mu.Unlock()
	if ok && c.now().Sub(e.at) < c.ttl {
		return e.name
	}
	// Resolved without the lock: a slow directory must not block lookups
	// of cached ids.
	name, err := fn(id)
	if err != nil {
		name = "" // unknown (or NSS failing): callers report the number only
	}
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(m) >= maxCachedNames {
		for k, v := range m {
			if now.Sub(v.at) >= c.ttl {
				delete(m, k)
			}
		}
		if len(m) >= maxCachedNames {
			clear(m)
		}
	}
	m[id] = cachedName{name, now}
	return name
}
