package ident

import (
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
)

// nameCache resolves uids and gids to names through NSS (identity.System
// runs getent, so LDAP/SSSD accounts are named too) and remembers answers,
// found or not, for nameTTL: a busy ident service must not run getent per
// query, nor hang on a slow directory more than once a minute per id.
type nameCache struct {
	res identity.Resolver

	mu     sync.Mutex
	users  map[uint32]cachedName
	groups map[uint32]cachedName
}

type cachedName struct {
	name string
	at   time.Time
}

const nameTTL = time.Minute

func newNameCache(res identity.Resolver) *nameCache {
	if res == nil {
		res = identity.System()
	}
	return &nameCache{res: res, users: map[uint32]cachedName{}, groups: map[uint32]cachedName{}}
}

func (c *nameCache) lookup(m map[uint32]cachedName, id uint32, fn func(uint32) (string, error)) string {
	c.mu.Lock()
	e, ok := m[id]
	c.mu.Unlock()
	if ok && time.Since(e.at) < nameTTL {
		return e.name
	}
	name, err := fn(id)
	if err != nil {
		name = "" // unknown (or NSS failing): report the number only
	}
	c.mu.Lock()
	m[id] = cachedName{name, time.Now()}
	c.mu.Unlock()
	return name
}

func (c *nameCache) user(uid uint32) string  { return c.lookup(c.users, uid, c.res.LookupUID) }
func (c *nameCache) group(gid uint32) string { return c.lookup(c.groups, gid, c.res.LookupGID) }
