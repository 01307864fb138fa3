package policy

import (
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
)

// RuleUserGrant: a grant of the listener's owner (`palisade share`) admits
// the connector.
const RuleUserGrant Rule = "user-grant"

// Grant is one user's grant on a TCP port of one node: the connector
// Grantee (a uid, or a gid when Group) may reach the listeners Owner holds
// on Port until Expires. It applies only to a socket Owner owns: another
// user binding the port later is not reached through it.
type Grant struct {
	Owner   uint32    `json:"owner"`
	Port    uint16    `json:"port"`
	Grantee uint32    `json:"grantee"`
	Group   bool      `json:"group,omitempty"`
	Expires time.Time `json:"expires"`
}

// GrantPolicy is the site's switch and bounds for user grants ([policy]
// user_grants, grant_max, grant_default, grant_max_duration).
type GrantPolicy struct {
	// Disabled: no grant decides anything, and the agents refuse new ones.
	Disabled bool
	// MaxPerUser bounds a user's active grants on one node (each grantee
	// of each port counts one).
	MaxPerUser int
	// Default is the duration of a grant made without --for; Max the
	// longest one.
	Default, Max time.Duration
}

// Default bounds of user grants.
const (
	DefaultGrantMax      = 16
	DefaultGrantDuration = 8 * time.Hour
	DefaultGrantMaxDur   = 7 * 24 * time.Hour
	// GrantsPerPort is how many grantees one port of one owner holds (the
	// data plane's fixed slots: bounded per-packet cost).
	GrantsPerPort = 8
)

// DefaultGrantPolicy: grants enabled with the default bounds.
func DefaultGrantPolicy() GrantPolicy {
	return GrantPolicy{MaxPerUser: DefaultGrantMax, Default: DefaultGrantDuration, Max: DefaultGrantMaxDur}
}

// Admits reports whether g lets c through: c reaches a socket of g's owner
// on g's port over TCP, the connector is the grantee or holds the grantee
// group (as the shared-group rule counts groups), and, when c.At is set, g
// has not expired.
func (g Grant) Admits(c Conn) bool {
	if c.Proto != TCP || c.Port != g.Port || c.Listener.UID != g.Owner {
		return false
	}
	if !c.At.IsZero() && !g.Expires.After(c.At) {
		return false
	}
	if g.Group {
		return c.Connector.HasGroup(g.Grantee)
	}
	return c.Connector.UID == g.Grantee
}

// GrantFor returns the grant that admits c (the first of c.Grants), or nil;
// nil too when the site disabled grants.
func (p *Policy) GrantFor(c Conn) *Grant {
	if p.Grants.Disabled {
		return nil
	}
	if i := slices.IndexFunc(c.Grants, func(g Grant) bool { return g.Admits(c) }); i >= 0 {
		return &c.Grants[i]
	}
	return nil
}

// Describe says who granted what to whom, until when ("alice's grant on
// 8888/tcp to bob, expires 2026-11-27 18:00:00 UTC").
func (g Grant) Describe(res identity.Resolver) string {
	to := UserName(res, g.Grantee)
	if g.Group {
		to = "@" + GroupName(res, g.Grantee)
	}
	return fmt.Sprintf("%s's grant on %d/tcp to %s, expires %s", UserName(res, g.Owner), g.Port, to,
		g.Expires.UTC().Format("2006-01-02 15:04:05 UTC"))
}

// UserName is uid's name, or the number when it has none (res may be nil).
func UserName(res identity.Resolver, uid uint32) string {
	if res != nil {
		if n, err := res.LookupUID(uid); err == nil {
			return n
		}
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// GroupName is gid's name, or the number.
func GroupName(res identity.Resolver, gid uint32) string {
	if res != nil {
		if n, err := res.LookupGID(gid); err == nil {
			return n
		}
	}
	return strconv.FormatUint(uint64(gid), 10)
}
