package membership

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strconv"
)

// LocalGIDs lists every gid (real, effective, saved, filesystem) that a
// process in the caller's network namespace runs with, read from root
// (normally "/proc"). A listening or bound socket carries its creator's
// effective gid, so the listeners' gids are among these.
func LocalGIDs(root string) ([]uint32, error) {
	self, err := os.Readlink(filepath.Join(root, "self", "ns", "net"))
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	seen := map[uint32]bool{}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		dir := filepath.Join(root, e.Name())
		if ns, err := os.Readlink(filepath.Join(dir, "ns", "net")); err != nil || ns != self {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, "status"))
		if err != nil {
			continue // gone meanwhile
		}
		for _, g := range statusGIDs(b) {
			seen[g] = true
		}
	}
	out := make([]uint32, 0, len(seen))
	for g := range seen {
		out = append(out, g)
	}
	slices.Sort(out)
	return out, nil
}

// statusGIDs parses the "Gid:" line of /proc/PID/status.
func statusGIDs(b []byte) []uint32 {
	for _, l := range bytes.Split(b, []byte("\n")) {
		rest, ok := bytes.CutPrefix(l, []byte("Gid:"))
		if !ok {
			continue
		}
		var out []uint32
		for _, f := range bytes.Fields(rest) {
			if n, err := strconv.ParseUint(string(f), 10, 32); err == nil && !slices.Contains(out, uint32(n)) {
				out = append(out, uint32(n))
			}
		}
		return out
	}
	return nil
}
