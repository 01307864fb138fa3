package sockowner

import (
	"slices"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// procIndex maps socket inodes to the processes holding them, built by
// scanning /proc/*/fd (procfs.SocketInodes). A scan costs a readlink per open fd on the node, so
// a hit is reused for cacheTTL (ident2 kept 15 s; a miss rescans anyway, so
// a short one is enough), and concurrent misses share one scan: a lookup
// that started before a scan began is answered by that scan, which already
// saw its socket. A flood of lookups thus costs about one scan at a time.
type procIndex struct {
	mu       sync.Mutex
	byInode  map[uint32][]int
	scanned  time.Time // when the current map's scan started
	cacheTTL time.Duration
}

const defaultCacheTTL = 2 * time.Second

func newProcIndex() *procIndex {
	return &procIndex{cacheTTL: defaultCacheTTL}
}

// pids returns the processes holding socket inode, rescanning on a miss or
// a stale entry.
func (p *procIndex) pids(inode uint32) []int {
	asked := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if got := p.byInode[inode]; len(got) > 0 && time.Since(p.scanned) < p.cacheTTL && p.alive(got) {
		return got
	}
	if p.byInode == nil || !p.scanned.After(asked) {
		start := time.Now()
		p.byInode = p.scan()
		p.scanned = start
	}
	return p.byInode[inode]
}

func (p *procIndex) alive(pids []int) bool {
	return !slices.ContainsFunc(pids, func(pid int) bool { return !procfs.Alive(pid) })
}

func (p *procIndex) scan() map[uint32][]int {
	m := make(map[uint32][]int)
	for _, pid := range procfs.PIDs() {
		for _, ino := range procfs.SocketInodes(pid) {
			if l := m[ino]; !slices.Contains(l, pid) {
				m[ino] = append(l, pid)
			}
		}
	}
	return m
}
