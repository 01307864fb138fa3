package uvn

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// Undo is one journal record: enough to remove one kernel object (or restore
// one setting) that a step created. Records are written to disk before the
// object is made, so a crash or failure half-way leaves a journal that
// removes everything (removing an object that was never made is a no-op).
type Undo struct {
	Kind    string `json:"kind"`               // link, route, rule, sysctl, nft, tc, clsact
	Name    string `json:"name,omitempty"`     // link name, sysctl path, nft table
	Value   string `json:"value,omitempty"`    // sysctl old value; route/rule description
	Table   uint32 `json:"table,omitempty"`    // route/rule table
	Family  int    `json:"family,omitempty"`   // route/rule family
	Dst     string `json:"dst,omitempty"`      // route destination prefix ("" = default)
	Type    int    `json:"type,omitempty"`     // route type
	Metric  uint32 `json:"metric,omitempty"`   // route priority
	Pref    int    `json:"pref,omitempty"`     // rule preference
	Dev     string `json:"dev,omitempty"`      // route device
	Mark    uint32 `json:"mark,omitempty"`     // rule fwmark (full mask)
	Proto   int    `json:"proto,omitempty"`    // rule ipproto
	DportLo uint16 `json:"dport_lo,omitempty"` // rule destination ports
	DportHi uint16 `json:"dport_hi,omitempty"`
	Prog    uint32 `json:"prog,omitempty"` // program id (srun-release, at the cgroup2 root)
}

// Holder is a live session or job step keeping a user's network up: a PID and
// its start time (so a recycled PID is not mistaken for the holder).
type Holder struct {
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
}

// Attachment is the VRF socket-binding program attached to one cgroup.
type Attachment struct {
	// Cgroup is the path relative to the cgroup2 root ("/" never: that
	// would move every process of the node into the VRF).
	Cgroup string `json:"cgroup"`
	// Created is true when Palisade made the cgroup (a child of the
	// session's own cgroup, because that one was shared) and must remove it.
	Created bool   `json:"created,omitempty"`
	ProgID  uint32 `json:"prog_id"`
	// ConnectID and SendmsgID are the underlay-port programs (0: none).
	ConnectID uint32 `json:"connect_id,omitempty"`
	SendmsgID uint32 `json:"sendmsg_id,omitempty"`
	// Bind4ID, Bind6ID and ReleaseID claim SrunPortRange ports for the VRF
	// (bpf/srun.c; 0: none).
	Bind4ID   uint32 `json:"bind4_id,omitempty"`
	Bind6ID   uint32 `json:"bind6_id,omitempty"`
	ReleaseID uint32 `json:"release_id,omitempty"`
	// LinkLocalID refuses the session's link-local binds (bpf/vrf.c);
	// EgressID and IngressID are per-session packet programs of an
	// earlier version, detached with the attachment (0: none).
	EgressID    uint32 `json:"egress_id,omitempty"`
	IngressID   uint32 `json:"ingress_id,omitempty"`
	LinkLocalID uint32 `json:"linklocal_id,omitempty"`
	// Holder is the session or step this attachment was made for; its
	// release removes exactly this attachment.
	Holder Holder `json:"holder"`
}

// UserState is a user's journal and bookkeeping on this node.
type UserState struct {
	UID      uint32       `json:"uid"`
	Complete bool         `json:"complete"`
	VRF      string       `json:"vrf"`
	Table    uint32       `json:"table"`
	NAT      string       `json:"nat,omitempty"`
	Links    []string     `json:"links,omitempty"`
	Undo     []Undo       `json:"undo"`
	Holders  []Holder     `json:"holders,omitempty"`
	Attach   []Attachment `json:"attach,omitempty"`
}

// NodeState is the node-wide journal (sysctls, RPDB reordering, nft table),
// undone when the last user is torn down.
type NodeState struct {
	Complete bool `json:"complete"`
	// ForwardGuard: uvn turned forwarding on, so the guard's forward
	// chain admits only NAT-pool traffic.
	ForwardGuard bool `json:"forward_guard,omitempty"`
	// SrunRange is the SrunPortRange the Slurm-callback path was built for
	// ("" = none) and SrunMap the id of its port map (bpf/srun.c).
	SrunRange string `json:"srun_range,omitempty"`
	SrunMap   uint32 `json:"srun_map,omitempty"`
	// SrunCount is the id of the map of claims per VRF, live and lingering (budget).
	SrunCount uint32 `json:"srun_count,omitempty"`
	// SrunRelease is the id of the claims' release program (cgroup2 root).
	SrunRelease uint32 `json:"srun_release,omitempty"`
	// GuardProgs are the device guard's programs at the cgroup2 root
	// (bpf/guard.c, in guardAttach's order); GuardDevs and GuardNames
	// the ids of its maps of users' devices.
	GuardProgs []uint32 `json:"guard_progs,omitempty"`
	GuardDevs  uint32   `json:"guard_devs,omitempty"`
	GuardNames uint32   `json:"guard_names,omitempty"`
	Undo       []Undo   `json:"undo"`
}

// store is the state directory with its locks.
type store struct{ dir string }

func (s store) userPath(uid uint32) string {
	return filepath.Join(s.dir, "user-"+strconv.FormatUint(uint64(uid), 10)+".json")
}
func (s store) nodePath() string { return filepath.Join(s.dir, "node.json") }

// lock takes an exclusive flock on name in the state directory. Same-user
// setups serialise on the user's lock; different users only meet briefly on
// the node lock.
func (s store) lock(name string) (func(), error) {
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(s.dir, name+".lock"), os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, syscall.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	return func() { f.Close() }, nil
}

func (s store) lockUser(uid uint32) (func(), error) {
	return s.lock("user-" + strconv.FormatUint(uint64(uid), 10))
}
func (s store) lockNode() (func(), error) { return s.lock("node") }

// writeJSON replaces path atomically.
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err = f.Write(append(b, '\n')); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}

func readJSON(path string, v any) (bool, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, fmt.Errorf("%s: %w", path, err)
	}
	return true, nil
}

func (s store) loadUser(uid uint32) (*UserState, bool, error) {
	st := &UserState{UID: uid}
	ok, err := readJSON(s.userPath(uid), st)
	return st, ok, err
}
func (s store) saveUser(st *UserState) error { return writeJSON(s.userPath(st.UID), st) }
func (s store) removeUser(uid uint32) error {
	err := os.Remove(s.userPath(uid))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

func (s store) loadNode() (*NodeState, bool, error) {
	st := &NodeState{}
	ok, err := readJSON(s.nodePath(), st)
	return st, ok, err
}
func (s store) saveNode(st *NodeState) error { return writeJSON(s.nodePath(), st) }

// users lists the uids that have a state file.
func (s store) users() ([]uint32, error) {
	ents, err := os.ReadDir(s.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var uids []uint32
	for _, e := range ents {
		n := e.Name()
		if !strings.HasPrefix(n, "user-") || !strings.HasSuffix(n, ".json") {
			continue
		}
		u, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(n, "user-"), ".json"), 10, 32)
		if err == nil {
			uids = append(uids, uint32(u))
		}
	}
	sort.Slice(uids, func(i, j int) bool { return uids[i] < uids[j] })
	return uids, nil
}

// procStart returns the start time of pid and whether the process is alive
// (zombies count as dead: this machine kind's init reaps slowly).
func procStart(pid int) (uint64, bool) {
	s, ok := procfs.Read(pid)
	return s.Start, ok && !s.Zombie()
}

// alive reports whether h is still the same live process.
func (h Holder) alive() bool {
	st, ok := procStart(h.PID)
	return ok && st == h.Start
}

// pruneHolders drops dead holders and the one equal to drop (if > 0).
func (st *UserState) pruneHolders(drop int) {
	kept := st.Holders[:0]
	for _, h := range st.Holders {
		if h.PID != drop && h.alive() {
			kept = append(kept, h)
		}
	}
	st.Holders = kept
}
