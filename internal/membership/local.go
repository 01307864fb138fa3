package membership

import (
	"maps"
	"slices"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// LocalGIDs lists every gid (real, effective, saved, filesystem) that a
// process in the caller's network namespace runs with. A listening or bound
// socket carries its creator's effective gid, so the listeners' gids are
// among these.
func LocalGIDs() ([]uint32, error) {
	return localIDs(func(c procfs.Creds) []uint32 { return c.GIDs })
}

// LocalUIDs lists every uid (real, effective, saved, filesystem) that a
// process in the caller's network namespace runs with: the node's users,
// whose groups a reply's reverse check needs.
func LocalUIDs() ([]uint32, error) {
	return localIDs(func(c procfs.Creds) []uint32 { return c.UIDs })
}

func localIDs(ids func(procfs.Creds) []uint32) ([]uint32, error) {
	self, err := procfs.Namespace(0, "net")
	if err != nil {
		return nil, err
	}
	seen := map[uint32]bool{}
	for _, pid := range procfs.PIDs() {
		if ns, err := procfs.Namespace(pid, "net"); err != nil || ns != self {
			continue
		}
		c, err := procfs.ReadCreds(pid)
		if err != nil {
			continue // gone meanwhile
		}
		for _, id := range ids(c) {
			seen[id] = true
		}
	}
	return slices.Sorted(maps.Keys(seen)), nil
}
