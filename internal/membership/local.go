package membership

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"

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
	self, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	seen := map[uint32]bool{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ns, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "net")); err != nil || ns != self {
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
	out := make([]uint32, 0, len(seen))
	for id := range seen {
		out = append(out, id)
	}
	slices.Sort(out)
	return out, nil
}
