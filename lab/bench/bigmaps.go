package bench

// Large maps, lab-only and synthetic: the data plane's group-membership map
// on the nodes doing the work is filled with BigMapMembers entries for
// BigMapUsers made-up users (uids without accounts), the units that run
// the data plane's per-connection and per-datagram checks are measured
// again, and the entries are removed. The agent would replace them at its
// next group refresh; the measurement takes far less than that interval.
// The map is found through the agents' descriptors by its name, which is
// the only name the bench knows of the data plane; without such a map
// (another data plane, a rename) the series is reported as not measured.

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

const (
	BigMapUsers   = 10000
	BigMapMembers = 100000
	// bigMapName is the membership map of the userwall data plane.
	bigMapName = "members"
	// bigMapUIDBase: synthetic users and groups (no accounts).
	bigMapUIDBase = 5000000
	bigMapGIDBase = 6000000
)

// bigMap is one node's membership map, filled for a measurement.
type bigMap struct {
	node string
	m    *ebpf.Map
	keys [][8]byte // the synthetic keys, for removal
	n    int
}

// fillBigMaps fills the membership map of each work node's agent.
func fillBigMaps(procs []Proc, work []string) ([]*bigMap, error) {
	var out []*bigMap
	for _, p := range procs {
		if !slices.Contains(work, p.Node) {
			continue
		}
		var found *ebpf.Map
		for _, id := range procfs.FdinfoIDs(p.PID, "map_id") {
			m, err := ebpf.NewMapFromID(ebpf.MapID(id))
			if err != nil {
				continue
			}
			if info, err := m.Info(); err == nil && info.Name == bigMapName && m.KeySize() == 8 && m.ValueSize() == 1 && m.Type() == ebpf.Hash {
				found = m
				break
			}
			m.Close()
		}
		if found == nil {
			closeBigMaps(out)
			return nil, fmt.Errorf("no %q hash map with 8-byte keys and 1-byte values held by the agent of %s", bigMapName, p.Node)
		}
		bm := &bigMap{node: p.Node, m: found}
		// keys: {uid, gid} in host order, as the C struct; every user in
		// BigMapMembers/BigMapUsers groups.
		per := BigMapMembers / BigMapUsers
		keys := make([][8]byte, 0, BigMapMembers)
		for u := 0; u < BigMapUsers; u++ {
			for g := 0; g < per; g++ {
				var k [8]byte
				binary.NativeEndian.PutUint32(k[:4], uint32(bigMapUIDBase+u))
				binary.NativeEndian.PutUint32(k[4:], uint32(bigMapGIDBase+g*1000+u%1000))
				keys = append(keys, k)
			}
		}
		vals := make([]uint8, len(keys))
		for i := range vals {
			vals[i] = 1
		}
		n, err := found.BatchUpdate(keys, vals, nil)
		bm.keys, bm.n = keys, n
		out = append(out, bm)
		if err != nil {
			closeBigMaps(out)
			return nil, fmt.Errorf("%s: fill %s: %d of %d entries: %w", p.Node, bigMapName, n, BigMapMembers, err)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no agent on the work nodes %v", work)
	}
	return out, nil
}

// memlockMB is the kernel memory of the filled maps.
func memlockMB(bms []*bigMap) float64 {
	t := 0.0
	for _, bm := range bms {
		if info, err := bm.m.Info(); err == nil {
			if b, ok := info.Memlock(); ok {
				t += float64(b)
			}
		}
	}
	return t / (1 << 20) / float64(max(len(bms), 1))
}

// closeBigMaps removes the synthetic entries and closes the maps.
func closeBigMaps(bms []*bigMap) {
	for _, bm := range bms {
		if bm.n > 0 {
			_, _ = bm.m.BatchDelete(bm.keys[:bm.n], nil)
		}
		bm.m.Close()
	}
}

// bigMaps measures connection setup and UDP round trips across nodes with
// the membership map as the agents keep it (x = 0) and filled with
// BigMapMembers synthetic entries (x = BigMapMembers; mode rounds only).
func (s *session) bigMaps() error {
	client, _, cross, err := s.paths()
	if err != nil {
		return err
	}
	work, srv := s.work(client, cross)
	run := func(x float64) error {
		var errs []string
		var r ConnResult
		_, err := s.measure(unit{bench: SuiteScale, series: "bigmap-conn", x: x, opUnit: OpConn, work: work, srv: srv},
			func() (unitResult, error) {
				rs, err := s.connRun(client.Name, BenchUser, netip.AddrPortFrom(cross, PortConn), []int{1}, s.plan.ConnPerThr)
				if err != nil || len(rs) != 1 {
					return unitResult{}, fmt.Errorf("conn: %v (%d results)", err, len(rs))
				}
				r = rs[0]
				return unitResult{ops: float64(r.OK + r.Errors), clientCPU: r.CPUNS}, nil
			})
		if err != nil {
			errs = append(errs, err.Error())
		} else {
			s.emit(SuiteScale, "bigmap-conn", x, "seconds", r.Seconds, "")
		}
		var u UDPResult
		_, err = s.measure(unit{bench: SuiteScale, series: "bigmap-udprr", x: x, opUnit: OpDgram, work: work, srv: srv},
			func() (unitResult, error) {
				rs, err := s.udpRun(client.Name, netip.AddrPortFrom(cross, PortUDPEcho), 64, "--rr", "--iters", strconv.Itoa(s.plan.DgramIters))
				if err != nil {
					return unitResult{}, err
				}
				u = rs
				return unitResult{ops: 2 * float64(u.Sent), clientCPU: u.CPUNS}, nil
			})
		if err != nil {
			errs = append(errs, err.Error())
		} else {
			s.emit(SuiteScale, "bigmap-udprr", x, "rtt_us", u.MedUS, "")
		}
		if len(errs) > 0 {
			return fmt.Errorf("large maps x=%g: %s", x, strings.Join(errs, "; "))
		}
		return nil
	}
	if err := run(0); err != nil {
		return err
	}
	if s.variant != Enforced {
		// The baseline has no maps: the same operations, for the ratio.
		return run(BigMapMembers)
	}
	bms, err := fillBigMaps(s.drv.Processes(s.ctx, s.env), work)
	if err != nil {
		return fmt.Errorf("large maps: %w", err)
	}
	defer closeBigMaps(bms)
	s.emit(SuiteScale, "bigmap-memlock", BigMapMembers, "map_mb", memlockMB(bms), "")
	return run(BigMapMembers)
}
