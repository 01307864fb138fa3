package kernel

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/palisade-hpc/palisade/internal/sys/bpfiter"
)

// Program names in the object (C function names).
const (
	progIngressSkb = "uw_skb_ingress"
	progIngress    = "uw_tc_ingress"
	progEgress     = "uw_tc_egress"
	progUnixStream = "uw_unix_stream_connect"
	progUnixDgram  = "uw_unix_may_send"
	progIterTCP    = "uw_iter_tcp"
	progIterUDP    = "uw_iter_udp"
)

// cgroupHooks are attached to the root of the cgroup v2 hierarchy, in this
// order: the owner recorders first (so that every socket created from then
// on has an owner; the release hook before the one that hands out loop
// tokens, so that every token is given back), the check at delivery last.
var cgroupHooks = []struct {
	link, prog string
	attach     ebpf.AttachType
}{
	{"sock_release", "uw_sock_release", ebpf.AttachCgroupInetSockRelease},
	{"sock_create", "uw_sock_create", ebpf.AttachCGroupInetSockCreate},
	{"post_bind4", "uw_post_bind4", ebpf.AttachCGroupInet4PostBind},
	{"post_bind6", "uw_post_bind6", ebpf.AttachCGroupInet6PostBind},
	{"setsockopt", "uw_setsockopt", ebpf.AttachCGroupSetsockopt},
	{"bind4", "uw_bind4", ebpf.AttachCGroupInet4Bind},
	{"bind6", "uw_bind6", ebpf.AttachCGroupInet6Bind},
	{"connect4", "uw_connect4", ebpf.AttachCGroupInet4Connect},
	{"connect6", "uw_connect6", ebpf.AttachCGroupInet6Connect},
	{"sendmsg4", "uw_sendmsg4", ebpf.AttachCGroupUDP4Sendmsg},
	{"sendmsg6", "uw_sendmsg6", ebpf.AttachCGroupUDP6Sendmsg},
	{"skb_egress", "uw_skb_egress", ebpf.AttachCGroupInetEgress},
	{"skb_ingress", progIngressSkb, ebpf.AttachCGroupInetIngress},
}

// staleLinks are pins of earlier versions that this one no longer uses.
var staleLinks = []string{"sockops"}

var lsmHooks = []struct{ link, prog string }{
	{"lsm_unix_stream_connect", progUnixStream},
	{"lsm_unix_may_send", progUnixDgram},
}

// Dataplane is the loaded programs and maps of one network namespace, pinned
// under PinDir (maps directly, links under links/).
//
// One goroutine drives it (the agent's main loop: attach, detach, Set...,
// Close). Others (the metrics scrape) may call Links, LSMErr, Map and
// ReadCounters at any time before Close: mu guards what the driver changes
// under them. PinDir, Cookie, coll and TC are set before the Dataplane is
// shared and only read after; Close comes after every reader has stopped.
type Dataplane struct {
	PinDir string
	Cookie uint64
	coll   *ebpf.Collection
	// TC attaches the tc programs as clsact cls_bpf filters (tc.go)
	// instead of tcx links: kernels before 6.6, or tc_attach = "tc".
	TC bool
	// mig is a changed-layout upgrade in progress (migrate.go): set by
	// Load, ended by Commit or Rollback, driver goroutine only.
	mig *migration

	// Node is the node name site rules' on_nodes are matched against
	// ("": the host name).
	Node string
	// siteMu guards site: the site rules' compiled maps are written by the
	// main loop (ApplyPolicy) and the membership tracker (SetMembers).
	siteMu sync.Mutex
	site   siteState
	// AllowSamples is how many allowed verdicts a second each CPU reports
	// (the flows); ApplyPolicy writes it. Driver goroutine only.
	AllowSamples uint32

	mu    sync.Mutex
	links map[string]link.Link // by pin name
	// sizes are the entries the set maps hold after the last write that
	// succeeded (metrics read them instead of walking the maps).
	sizes map[string]int
	// lsmErr says why abstract Unix sockets are not enforced (nil: they are).
	lsmErr error
}

func (d *Dataplane) linkDir() string { return filepath.Join(d.PinDir, "links") }

// Map returns one of the collection's maps.
func (d *Dataplane) Map(name string) *ebpf.Map { return d.coll.Maps[name] }

// LSMErr says why abstract Unix sockets are not enforced (nil: they are).
func (d *Dataplane) LSMErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lsmErr
}

func (d *Dataplane) setLSMErr(err error) {
	d.mu.Lock()
	d.lsmErr = err
	d.mu.Unlock()
}

// link returns the attached link of a pin name (nil: none).
func (d *Dataplane) link(name string) link.Link {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.links[name]
}

// setLink records (l != nil) or forgets (nil) the link of a pin name.
func (d *Dataplane) setLink(name string, l link.Link) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if l == nil {
		delete(d.links, name)
	} else {
		d.links[name] = l
	}
}

// TestPeerTTLEnv, in the agent's environment, shortens the 120 s for which a
// datagram socket's peer may answer after the socket last sent to it (tests
// of the refresh, which would otherwise wait two minutes).
const TestPeerTTLEnv = "PALISADE_TEST_UDP_PEER_TTL"

// Load loads the programs for the namespace with the given cookie, reusing
// (adopting) maps already pinned in pinDir, so a restarted agent keeps the
// state and the counters of its predecessor, as e (Plan) says: how the tc
// programs attach, and whether the LSM programs are left out.
func Load(pinDir string, cookie uint64, e Enforcement) (*Dataplane, error) {
	spec, err := loadUwbpf()
	if err != nil {
		return nil, err
	}
	if err := spec.Variables["netns_cookie"].Set(cookie); err != nil {
		return nil, err
	}
	if v := os.Getenv(TestPeerTTLEnv); v != "" {
		// Tests only: how long a datagram socket's peer may answer.
		ttl, err := strconv.ParseUint(v, 10, 32)
		if err != nil || ttl == 0 {
			return nil, fmt.Errorf("%s=%q: want a number of seconds", TestPeerTTLEnv, v)
		}
		if err := spec.Variables["peer_ttl_s"].Set(uint32(ttl)); err != nil {
			return nil, err
		}
	}
	if layoutVariant != nil {
		layoutVariant(spec)
	}
	for name, m := range spec.Maps {
		if !strings.HasPrefix(name, ".") {
			m.Pinning = ebpf.PinByName
		}
	}
	if err := os.MkdirAll(filepath.Join(pinDir, "links"), 0o700); err != nil {
		return nil, err
	}
	if err := removeStaging(pinDir); err != nil {
		return nil, fmt.Errorf("remove an interrupted upgrade's pins: %w", err)
	}
	d := &Dataplane{PinDir: pinDir, Cookie: cookie, TC: e.TC, lsmErr: e.NoLSM, links: map[string]link.Link{}}
	mig, err := planMigration(spec, pinDir)
	if err != nil {
		return nil, err
	}
	if d.lsmErr != nil {
		for _, h := range lsmHooks {
			delete(spec.Programs, h.prog)
		}
	}
	opts := ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pinDir}}
	if mig != nil {
		// Changed maps are created and pinned under next/, the others
		// are the pinned ones (migrate.go).
		if err := os.MkdirAll(filepath.Join(mig.next, "links"), 0o700); err != nil {
			mig.close()
			return nil, err
		}
		opts.Maps.PinPath = mig.next
		opts.MapReplacements = mig.reused
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, opts)
	if err != nil && d.lsmErr == nil {
		// A kernel without CONFIG_BPF_LSM refuses LSM programs: enforce
		// the rest and report it.
		var verr *ebpf.VerifierError
		lsmFailed := errors.As(err, &verr) || strings.Contains(err.Error(), "unix")
		if lsmFailed {
			for _, h := range lsmHooks {
				delete(spec.Programs, h.prog)
			}
			c2, err2 := ebpf.NewCollectionWithOptions(spec, opts)
			if err2 == nil {
				d.lsmErr = fmt.Errorf("LSM programs not loaded: %w", err)
				coll, err = c2, nil
			} else {
				err = err2 // the failure that matters: not the LSM's
			}
		}
	}
	if err != nil {
		if mig != nil {
			mig.close()
			_ = removeStaging(pinDir)
		}
		return nil, fmt.Errorf("load eBPF programs: %w", err)
	}
	d.coll = coll
	if mig != nil {
		d.mig = mig
		if err := mig.carry(coll); err != nil {
			d.Rollback()
			coll.Close()
			return nil, err
		}
	}
	return d, nil
}

// attach attaches prog under the pinned link name, adopting an existing pin:
// the pinned link is switched to the new program atomically (BPF_LINK_UPDATE),
// or, for link types that cannot be updated, the new link is attached before
// the old one is removed. Either way enforcement has no gap.
func (d *Dataplane) attach(name string, prog *ebpf.Program, attach func() (link.Link, error)) error {
	path := filepath.Join(d.linkDir(), name)
	old, err := link.LoadPinnedLink(path, nil)
	if err == nil {
		if err := d.rememberLink(name, old); err != nil {
			old.Close()
			return err
		}
		if err := old.Update(prog); err == nil {
			d.setLink(name, old)
			return nil
		}
		d.forgetLast()
	}
	nl, err := attach()
	if err != nil {
		if old != nil {
			d.setLink(name, old) // keep the old program enforcing
		}
		return fmt.Errorf("attach %s: %w", name, err)
	}
	if d.mig != nil {
		// Both run until commit, which moves the new pin over the old
		// (a rollback removes the new one).
		if old != nil {
			if err := nl.Pin(filepath.Join(d.mig.next, "links", name)); err != nil {
				nl.Close()
				d.setLink(name, old)
				return fmt.Errorf("pin %s: %w", name, err)
			}
			d.mig.replaced[name] = old
			d.setLink(name, nl)
			return nil
		}
		d.mig.undo = append(d.mig.undo, undoStep{
			restore: func() error { d.detach(name); return nil }, release: func() {}})
	}
	if old != nil {
		_ = old.Unpin()
		_ = old.Close()
	}
	if err := nl.Pin(path); err != nil {
		nl.Close()
		return fmt.Errorf("pin %s: %w", name, err)
	}
	d.setLink(name, nl)
	return nil
}

// AttachCgroup attaches the socket hooks (and the LSM hooks) to the root of
// the cgroup v2 hierarchy at cgroupRoot. Sockets that predate the owner
// recorders get their owner from the socket iterators, run between the two.
func (d *Dataplane) AttachCgroup(cgroupRoot string) error {
	for _, n := range staleLinks {
		d.detach(n)
	}
	for i, h := range cgroupHooks {
		if h.prog == progIngressSkb {
			if err := d.adoptSockets(); err != nil {
				return err
			}
		}
		p := d.coll.Programs[h.prog]
		attachType := cgroupHooks[i].attach
		err := d.attach(h.link, p, func() (link.Link, error) {
			return link.AttachCgroup(link.CgroupOptions{Path: cgroupRoot, Attach: attachType, Program: p})
		})
		if err != nil {
			return err
		}
		if err := d.Fault("cgroup:" + h.link); err != nil {
			return err
		}
	}
	if d.LSMErr() == nil {
		for _, h := range lsmHooks {
			p := d.coll.Programs[h.prog]
			if err := d.attach(h.link, p, func() (link.Link, error) {
				return link.AttachLSM(link.LSMOptions{Program: p})
			}); err != nil {
				d.setLSMErr(err)
				d.detach(lsmHooks[0].link)
				d.detach(lsmHooks[1].link)
				break
			}
		}
	}
	return nil
}

// adoptSockets runs the TCP and UDP socket iterators once in this
// namespace: every socket that exists now gets an owner record (a socket
// created since already has one and keeps it).
func (d *Dataplane) adoptSockets() error {
	return bpfiter.Run(d.coll, progIterTCP, progIterUDP)
}

func tcxLinkName(dir, ifname string) string { return "tcx_" + dir + "_" + ifname }

// AttachInterface attaches the tc programs to one interface with tcx links
// or, with d.TC, clsact filters (egress stamps, ingress refuses early).
// Every managed interface, lo too. Switching between the two attaches the
// new way before removing the old one.
func (d *Dataplane) AttachInterface(ifname string, ifindex int) error {
	if d.TC {
		return d.attachInterfaceTC(ifname, ifindex)
	}
	type dir struct {
		name, prog string
		at         ebpf.AttachType
	}
	dirs := []dir{{"eg", progEgress, ebpf.AttachTCXEgress}, {"in", progIngress, ebpf.AttachTCXIngress}}
	for _, x := range dirs {
		p := d.coll.Programs[x.prog]
		at := x.at
		if err := d.attach(tcxLinkName(x.name, ifname), p, func() (link.Link, error) {
			return link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: p, Attach: at})
		}); err != nil {
			return err
		}
	}
	// Filters of an earlier tc-mode agent (before a kernel upgrade), and
	// its record of lo's filter: NamespaceGone would read the freed
	// program as a deleted namespace once the tcx pin on lo is gone
	// (during an uninstall).
	_ = detachTC(ifindex, tcIngress)
	_ = detachTC(ifindex, tcEgress)
	if ifname == "lo" {
		_ = os.Remove(filepath.Join(d.PinDir, tcLoMap))
	}
	return nil
}

func (d *Dataplane) attachInterfaceTC(ifname string, ifindex int) error {
	type dir struct {
		tc   tcDir
		prog string
	}
	dirs := []dir{{tcEgress, progEgress}, {tcIngress, progIngress}}
	for _, x := range dirs {
		p := d.coll.Programs[x.prog]
		if err := d.rememberTC(ifindex, x.tc, x.prog); err != nil {
			return err
		}
		// lo's egress program marks the namespace alive (NamespaceGone):
		// record the new one before the filter switches to it, so that
		// the recorded program exists at every moment.
		var prevLo uint32
		loEgress := ifname == "lo" && x.tc == tcEgress
		if loEgress {
			info, err := p.Info()
			if err != nil {
				return err
			}
			id, _ := info.ID()
			prevLo = readTCLo(d.PinDir)
			if err := recordTCLo(d.PinDir, uint32(id)); err != nil {
				d.forgetLast()
				return fmt.Errorf("record lo's filter: %w", err)
			}
		}
		if err := attachTC(ifindex, x.tc, p, x.prog); err != nil {
			d.forgetLast()
			if loEgress && prevLo != 0 {
				_ = recordTCLo(d.PinDir, prevLo)
			}
			return err
		}
		if loEgress && prevLo != 0 && d.mig != nil {
			d.mig.undo = append(d.mig.undo, undoStep{
				restore: func() error { return recordTCLo(d.PinDir, prevLo) }, release: func() {}})
		}
		d.detach(tcxLinkName(x.tc.name, ifname))
	}
	return nil
}

// Interfaces lists the interfaces with pinned tc links.
func (d *Dataplane) Interfaces() []string {
	seen := map[string]bool{}
	for _, n := range pinnedNames(d.linkDir()) {
		for _, p := range []string{"tcx_eg_", "tcx_in_"} {
			if s, ok := strings.CutPrefix(n, p); ok {
				seen[s] = true
			}
		}
	}
	fs, _ := ourTCFilters()
	for _, f := range fs {
		seen[f.ifname] = true
	}
	var out []string
	for s := range seen {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

// DetachInterface removes the tc links of one interface.
func (d *Dataplane) DetachInterface(ifname string) {
	d.detach(tcxLinkName("eg", ifname))
	d.detach(tcxLinkName("in", ifname))
	if l, err := netlink.LinkByName(ifname); err == nil {
		_ = detachTC(l.Attrs().Index, tcIngress)
		_ = detachTC(l.Attrs().Index, tcEgress)
	}
}

func (d *Dataplane) detach(name string) {
	l := d.link(name)
	if l == nil {
		var err error
		if l, err = link.LoadPinnedLink(filepath.Join(d.linkDir(), name), nil); err != nil {
			_ = os.Remove(filepath.Join(d.linkDir(), name))
			return
		}
	}
	_ = l.Unpin()
	_ = l.Close()
	d.setLink(name, nil)
}

// Links returns the names of the attached links (and tc filters).
func (d *Dataplane) Links() []string {
	d.mu.Lock()
	out := slices.Collect(maps.Keys(d.links))
	d.mu.Unlock()
	if d.TC {
		fs, _ := ourTCFilters()
		for _, f := range fs {
			out = append(out, f.linkName())
		}
	}
	sort.Strings(out)
	return out
}

// Close releases the agent's handles; the pins keep everything enforcing.
// A second Close does nothing (a failed install closes before the deferred
// Close runs).
func (d *Dataplane) Close() {
	d.mu.Lock()
	for n, l := range d.links {
		l.Close()
		delete(d.links, n)
	}
	d.mu.Unlock()
	if d.coll != nil {
		d.coll.Close()
		d.coll = nil
	}
}

func pinnedNames(dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// RemovePins detaches every pinned link and removes every pinned map of the
// namespace (the kernel frees an object when its last pin and fd are gone).
func RemovePins(pinDir string) error {
	err := removePinTree(pinDir) // staged pins (next/) included
	// The shared parent goes only when no other namespace uses it.
	_ = os.Remove(filepath.Dir(pinDir))
	return err
}
