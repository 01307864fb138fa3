// Package sockowner answers "who owns this socket?" — the listener's or the
// connector's user, effective group, supplementary groups and process — for
// local sockets through sock_diag and /proc, and for sockets on other
// cluster nodes through the ident service those nodes run (Server). It is
// the successor of ident2 in the MIT user-based firewall (reference 001):
// exact kernel socket lookups for TCP and UDP alike, a versioned JSON
// protocol over UDP from privileged ports answered only inside the cluster,
// and a Unix-socket API for portals and proxies. (Named for what it
// answers; the service itself is `palisade ident`, after the protocol.)
package sockowner

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// ErrNoSocket means no socket matches the query (nothing listens there).
var ErrNoSocket = errors.New("no such socket")

// Owner is the identity behind a socket. UID and GID are the effective ids
// of the process holding the socket (GID is what newgrp/sg changes), Groups
// its supplementary groups. When no process holds the socket (it is being
// torn down, or the caller may not read other users' /proc/PID/fd) PID is
// 0, UID is the socket's creator as the kernel recorded it, and GID is
// 4294967295 ((gid_t)-1: unknown).
type Owner struct {
	UID     uint32   `json:"uid"`
	User    string   `json:"user,omitempty"`
	GID     uint32   `json:"gid"`
	Group   string   `json:"group,omitempty"`
	Groups  []uint32 `json:"groups,omitempty"`
	PID     int      `json:"pid,omitempty"`
	Command string   `json:"command,omitempty"`
}

// Identity is the owner as the policy core sees it.
func (o Owner) Identity() policy.Identity {
	return policy.Identity{UID: o.UID, GID: o.GID, Groups: slices.Clone(o.Groups)}
}

// Resolver looks up local sockets. It holds a sock_diag socket opened in
// the network namespace current when NewResolver ran, and a cache of
// socket inodes to processes; it is safe for concurrent use.
type Resolver struct {
	diag  *diagConn
	proc  *procIndex
	names *identity.NameCache
}

// NewResolver opens a resolver for the calling thread's network namespace,
// naming users and groups through identity.System().
func NewResolver() (*Resolver, error) { return NewResolverWith(nil) }

// NewResolverWith is NewResolver with the given name resolver (nil =
// identity.System()).
func NewResolverWith(names identity.Resolver) (*Resolver, error) {
	d, err := openDiag()
	if err != nil {
		return nil, err
	}
	return &Resolver{diag: d, proc: newProcIndex(), names: identity.NewNameCache(names, time.Minute)}, nil
}

// Close releases the netlink socket.
func (r *Resolver) Close() error { return r.diag.Close() }

// Lookup returns the owner of the local socket whose local end is addr
// (bound to it exactly or through a wildcard/dual-stack bind). A listener
// (TCP LISTEN, unconnected UDP) is preferred to connected sockets sharing
// its port.
func (r *Resolver) Lookup(addr netip.AddrPort, proto policy.Proto) (Owner, error) {
	return r.LookupConn(addr, netip.AddrPort{}, proto)
}

// LookupConn is Lookup for one connection: the socket with local end addr
// and remote end peer (peer zero = any, as Lookup).
func (r *Resolver) LookupConn(addr, peer netip.AddrPort, proto policy.Proto) (Owner, error) {
	if !addr.IsValid() || addr.Port() == 0 {
		return Owner{}, fmt.Errorf("ident: invalid address %v", addr)
	}
	if proto != policy.TCP && proto != policy.UDP {
		return Owner{}, fmt.Errorf("ident: unsupported protocol %d", proto)
	}
	s, err := r.diag.find(addr, peer, proto)
	if err != nil {
		return Owner{}, err
	}
	return r.owner(s)
}

// owner turns a socket into its owning process's credentials. When several
// processes share the socket (fork), the one whose effective uid is the
// socket's creator wins, then the lowest pid (the parent).
func (r *Resolver) owner(s diagSocket) (Owner, error) {
	var fallback *Owner
	for _, pid := range sortedCopy(r.proc.pids(s.Inode)) {
		c, err := procfs.ReadCreds(pid)
		if err != nil || c.Zombie {
			continue
		}
		o := Owner{UID: c.EUID(), GID: c.EGID(), Groups: c.Groups, PID: pid, Command: c.Command}
		if c.EUID() == s.UID {
			return r.named(o), nil
		}
		if fallback == nil {
			fallback = &o
		}
	}
	if fallback != nil {
		return r.named(*fallback), nil
	}
	// No process holds it (closing, or held only by the kernel): report the
	// creator the kernel recorded; its groups are unknown.
	return r.named(Owner{UID: s.UID, GID: noGID}), nil
}

// noGID is (gid_t)-1, which no process runs with: "unknown" in an answer.
const noGID = 1<<32 - 1

func sortedCopy(p []int) []int {
	c := slices.Clone(p)
	slices.Sort(c)
	return c
}

// named fills in user and group names (empty when unknown).
func (r *Resolver) named(o Owner) Owner {
	o.User = r.names.User(o.UID)
	if o.GID != noGID {
		o.Group = r.names.Group(o.GID)
	}
	return o
}

// LookupLocal returns the owner of a local socket in the calling thread's
// network namespace (see Resolver.Lookup). It opens and closes a netlink
// socket per call; long-running callers should keep a Resolver.
func LookupLocal(addr netip.AddrPort, proto policy.Proto) (Owner, error) {
	r, err := NewResolver()
	if err != nil {
		return Owner{}, err
	}
	defer r.Close()
	return r.Lookup(addr, proto)
}

// ListenerUIDs returns the owners the kernel recorded (the creator's fs
// uid, sk_uid) of the TCP listeners bound to port, in either family.
func (r *Resolver) ListenerUIDs(port uint16) ([]uint32, error) {
	var out []uint32
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, err := r.diag.dumpPort(fam, port, policy.TCP)
		if err != nil {
			return nil, err
		}
		for _, s := range socks {
			if s.listening(policy.TCP) && !slices.Contains(out, s.UID) {
				out = append(out, s.UID)
			}
		}
	}
	return out, nil
}
