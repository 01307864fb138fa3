package ident

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// procIndex maps socket inodes to the processes holding them, built by
// scanning /proc/*/fd. A scan costs a readlink per open fd on the node, so
// a hit is reused for cacheTTL (ident2 kept 15 s; a miss rescans anyway, so
// a short one is enough), and concurrent misses share one scan: a lookup
// that started before a scan began is answered by that scan, which already
// saw its socket. A flood of lookups thus costs about one scan at a time.
type procIndex struct {
	root string // "/proc"; tests may point elsewhere

	mu       sync.Mutex
	byInode  map[uint32][]int
	scanned  time.Time // when the current map's scan started
	cacheTTL time.Duration
}

const defaultCacheTTL = 2 * time.Second

func newProcIndex() *procIndex {
	return &procIndex{root: "/proc", cacheTTL: defaultCacheTTL}
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
	for _, pid := range pids {
		if _, err := os.Stat(filepath.Join(p.root, strconv.Itoa(pid))); err != nil {
			return false
		}
	}
	return true
}

func (p *procIndex) scan() map[uint32][]int {
	m := make(map[uint32][]int)
	ents, err := os.ReadDir(p.root)
	if err != nil {
		return m
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fdDir := filepath.Join(p.root, e.Name(), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue // exited, or a kernel thread
		}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join(fdDir, fd.Name()))
			if err != nil || !strings.HasPrefix(link, "socket:[") {
				continue
			}
			ino, err := strconv.ParseUint(strings.TrimSuffix(link[len("socket:["):], "]"), 10, 32)
			if err != nil {
				continue
			}
			if l := m[uint32(ino)]; !slices.Contains(l, pid) {
				m[uint32(ino)] = append(l, pid)
			}
		}
	}
	return m
}
