// Package identity resolves users and groups the way the node's C library
// does (NSS), so that a policy naming "slurm" or "proj1" means the same uid
// and gid the kernel will see on the socket.
//
// The palisade binary is static (CGO_ENABLED=0), so os/user would only read
// /etc/passwd and /etc/group and miss LDAP or SSSD accounts. System() asks
// getent(1) instead, which goes through the full NSS stack, and falls back to
// parsing the /etc files when getent is missing. Tables (from files or a test)
// implement the same Resolver interface.
package identity

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
)

// Resolver maps user and group names to ids and back, and knows group
// membership. Implementations must be safe for concurrent use.
type Resolver interface {
	// LookupUser returns the uid and primary gid of a user name.
	LookupUser(name string) (uid, gid uint32, err error)
	// LookupUID returns the name of a uid.
	LookupUID(uid uint32) (name string, err error)
	// LookupGroup returns the gid of a group name.
	LookupGroup(name string) (gid uint32, err error)
	// LookupGID returns the name of a gid.
	LookupGID(gid uint32) (name string, err error)
	// GroupsOf returns every gid the user holds at login: the primary group
	// first, then the supplementary groups, without duplicates.
	GroupsOf(user string) ([]uint32, error)
	// Members returns the login groups of every user the resolver can
	// enumerate (uid → gids, as GroupsOf orders them).
	Members() (Membership, error)
}

// UnknownUserError is returned for a user name that does not resolve.
type UnknownUserError struct{ Name string }

func (e *UnknownUserError) Error() string { return fmt.Sprintf("unknown user %q", e.Name) }

// UnknownGroupError is returned for a group name that does not resolve.
type UnknownGroupError struct{ Name string }

func (e *UnknownGroupError) Error() string { return fmt.Sprintf("unknown group %q", e.Name) }

// UnknownIDError is returned by LookupUID/LookupGID for an id without a name.
type UnknownIDError struct {
	Kind string // "uid" or "gid"
	ID   uint32
}

func (e *UnknownIDError) Error() string { return fmt.Sprintf("unknown %s %d", e.Kind, e.ID) }

// IsUnknown reports whether err says a name or id does not exist (as opposed
// to the lookup itself failing).
func IsUnknown(err error) bool {
	var u *UnknownUserError
	var g *UnknownGroupError
	var i *UnknownIDError
	return errors.As(err, &u) || errors.As(err, &g) || errors.As(err, &i)
}

// maxID is the largest id accepted as a number: (uid_t)-1 is reserved by the
// kernel to mean "no change" and is never a real owner.
const maxID = 1<<32 - 2

// parseID accepts a decimal id; ok is false when s is not a number at all
// (so it should be looked up as a name).
func parseID(s string) (id uint32, ok bool, err error) {
	if s == "" {
		return 0, false, errors.New("empty name")
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false, nil
		}
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n > maxID {
		return 0, true, fmt.Errorf("id %s out of range (0-%d)", s, uint64(maxID))
	}
	return uint32(n), true, nil
}

// UID resolves a user given as a name or a decimal uid. A number is accepted
// as is, without a lookup: sites exempt service uids that have no name on
// every node.
func UID(r Resolver, s string) (uint32, error) {
	id, isNum, err := parseID(s)
	if isNum || err != nil {
		return id, err
	}
	uid, _, err := r.LookupUser(s)
	return uid, err
}

// GID resolves a group given as a name or a decimal gid (numbers unchecked).
func GID(r Resolver, s string) (uint32, error) {
	id, isNum, err := parseID(s)
	if isNum || err != nil {
		return id, err
	}
	return r.LookupGroup(s)
}

// UserName returns "name(uid)" when the uid has a name, else the number; for
// messages, never for decisions.
func UserName(r Resolver, uid uint32) string {
	if r != nil {
		if n, err := r.LookupUID(uid); err == nil {
			return fmt.Sprintf("%s(%d)", n, uid)
		}
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// GroupName is UserName for gids.
func GroupName(r Resolver, gid uint32) string {
	if r != nil {
		if n, err := r.LookupGID(gid); err == nil {
			return fmt.Sprintf("%s(%d)", n, gid)
		}
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// Membership is a uid → login gids map, the shape the userwall agent loads
// into its BPF group map (the kernel only knows a socket's effective ids; the
// supplementary groups of a remote connector come from here).
type Membership map[uint32][]uint32

// Has reports whether uid holds gid according to the snapshot.
func (m Membership) Has(uid, gid uint32) bool { return slices.Contains(m[uid], gid) }

// Equal reports whether two snapshots hold the same membership, so a
// periodic refresher only rewrites the BPF map when something changed.
func (m Membership) Equal(o Membership) bool {
	if len(m) != len(o) {
		return false
	}
	for uid, gids := range m {
		og, ok := o[uid]
		if !ok || !slices.Equal(gids, og) {
			return false
		}
	}
	return true
}

// Snapshot returns the membership of every user the system resolver can
// enumerate. Accounts an NSS backend refuses to enumerate (LDAP/SSSD with
// enumeration off) are missing; the agent should add users it meets on
// sockets with GroupsOf.
func Snapshot() (Membership, error) { return System().Members() }

// dedupe keeps the first occurrence of each gid, preserving order.
func dedupe(gids []uint32) []uint32 {
	out := gids[:0:0]
	for _, g := range gids {
		if !slices.Contains(out, g) {
			out = append(out, g)
		}
	}
	return out
}
