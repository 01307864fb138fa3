package userwall

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/membership"
)

// newMembers is the agent's membership tracker (package membership): direct
// NSS lookups of the groups local processes hold and of refused connectors,
// plus the local files; never an enumeration of the directory.
func (a *agent) newMembers() *membership.Tracker {
	c := &a.cfg.Agent
	return membership.New(membership.Config{
		Lookup:    &membership.Getent{},
		Files:     func() (*identity.Table, error) { return identity.ReadFiles("/etc/passwd", "/etc/group") },
		LocalGIDs: func() ([]uint32, error) { return membership.LocalGIDs("/proc") },
		Apply:     a.dp.SetMembers,
		Refresh:   c.GroupRefreshInterval(),
		Rate:      membership.DefaultRate,
		OnError: func(err error) {
			a.log.Warn("group membership lookups failed (those groups have no members until the next round)", "err", err)
		},
	})
}

// runMembers runs the tracker; the returned func stops it and waits.
func (a *agent) runMembers(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.members.Run(ctx)
	}()
	return func() { cancel(); <-done }
}

// refusedConnector returns the uid of a refused connector with a trusted
// identity (a denial event of the data plane).
func refusedConnector(raw []byte) (uint32, bool) {
	var r uwbpfUwEvent
	if err := binary.Read(bytes.NewReader(raw), binary.NativeEndian, &r); err != nil || r.HasConnector == 0 {
		return 0, false
	}
	return r.Cuid, true
}

// MemberPair is one (uid, gid) entry of the kernel's membership map.
type MemberPair struct{ UID, GID uint32 }

// MissingMembers returns the pairs the members map pinned in pinDir lacks.
func MissingMembers(pinDir string, pairs []MemberPair) ([]MemberPair, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "members"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	var missing []MemberPair
	var v uint8
	for _, p := range pairs {
		err := m.Lookup(uwbpfUwMemberKey{Uid: p.UID, Gid: p.GID}, &v)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			missing = append(missing, p)
		} else if err != nil {
			return nil, err
		}
	}
	return missing, nil
}
