package membership

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
)

// Getent answers lookups with getent(1): the node's whole NSS stack (files,
// SSSD, LDAP...), one process per batch of keys. SSSD's memory cache is
// bypassed (SSS_NSS_USE_MEMCACHE=NO) so the answer is at most SSSD's
// entry_cache_timeout old, not also memcache_timeout.
type Getent struct {
	Path    string        // getent binary (default: from PATH)
	Timeout time.Duration // per call (default 10 s: a hung directory must not hang the agent)
}

var _ Lookup = (*Getent)(nil)

func (g *Getent) run(ctx context.Context, args ...string) ([]byte, error) {
	path := g.Path
	if path == "" {
		p, err := exec.LookPath("getent")
		if err != nil {
			return nil, err
		}
		path = p
	}
	to := g.Timeout
	if to == 0 {
		to = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, to)
	defer cancel()
	var out, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.Env = append(os.Environ(), "SSS_NSS_USE_MEMCACHE=NO")
	err := cmd.Run()
	var ee *exec.ExitError
	// Exit 2: one or more keys not found (the found ones are printed).
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 2) {
		return nil, fmt.Errorf("getent %s: %v %s", args[0], err, strings.TrimSpace(stderr.String()))
	}
	return out.Bytes(), nil
}

func ids(v []uint32) []string {
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = strconv.FormatUint(uint64(x), 10)
	}
	return out
}

// Groups implements Lookup (getent group GID...).
func (g *Getent) Groups(ctx context.Context, gids []uint32) (map[uint32][]string, error) {
	if len(gids) == 0 {
		return nil, nil
	}
	b, err := g.run(ctx, append([]string{"group"}, ids(gids)...)...)
	if err != nil {
		return nil, err
	}
	t, err := identity.ParseTables(nil, b)
	if err != nil {
		return nil, err
	}
	out := make(map[uint32][]string, len(t.Groups))
	for _, gr := range t.Groups {
		if _, dup := out[gr.GID]; !dup {
			out[gr.GID] = append([]string{}, gr.Members...)
		}
	}
	return out, nil
}

// UIDs implements Lookup (getent passwd NAME...).
func (g *Getent) UIDs(ctx context.Context, names []string) (map[string]uint32, error) {
	if len(names) == 0 {
		return nil, nil
	}
	b, err := g.run(ctx, append([]string{"passwd"}, names...)...)
	if err != nil {
		return nil, err
	}
	t, err := identity.ParseTables(b, nil)
	if err != nil {
		return nil, err
	}
	out := make(map[string]uint32, len(t.Users))
	for _, u := range t.Users {
		if _, dup := out[u.Name]; !dup {
			out[u.Name] = u.UID
		}
	}
	return out, nil
}

// InitGroups implements Lookup (getent passwd UID, then initgroups NAME).
func (g *Getent) InitGroups(ctx context.Context, uid uint32) ([]uint32, error) {
	b, err := g.run(ctx, "passwd", strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		return nil, err
	}
	t, err := identity.ParseTables(b, nil)
	if err != nil || len(t.Users) == 0 {
		return nil, err
	}
	u := t.Users[0]
	b, err = g.run(ctx, "initgroups", u.Name)
	if err != nil {
		return nil, err
	}
	gids := []uint32{u.GID}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != u.Name {
			continue
		}
		for _, s := range f[1:] {
			if n, err := strconv.ParseUint(s, 10, 32); err == nil && !containsID(gids, uint32(n)) {
				gids = append(gids, uint32(n))
			}
		}
	}
	return gids, nil
}

func containsID(v []uint32, x uint32) bool {
	for _, y := range v {
		if y == x {
			return true
		}
	}
	return false
}
