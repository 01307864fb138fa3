package kernel

// The differential test of the data plane: the real eBPF object, loaded
// without pinning or attaching anything, judges thousands of crafted packets
// with BPF_PROG_TEST_RUN, and a deliberately plain Go reference written from
// docs/userwall.md and policy.Decide judges the same cases. Deliver/drop, the
// deciding rule (from the counters), the stamp's worth and the event must
// agree for every case.
//
// The program runs in test mode (the rewrite constant test_mode): the
// receiving socket's owner, its UDP peer and the clock come from the test_sock
// map instead of skb->sk and the kernel clock.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

var (
	diffSeed  = flag.Uint64("diff.seed", 0, "seed of the differential test (0: from the clock)")
	diffCases = flag.Int("diff.cases", 6000, "cases of the differential test")
)

const (
	ipICMP    = 1
	ipTCP     = 6
	ipUDP     = 17
	ipDCCP    = 33
	ipICMPv6  = 58
	ipDstOpts = 60
	ipSCTP    = 132
	ipUDPLite = 136
	ipUnknown = 253 // RFC 3692 experimentation: no socket type claims it
)

// harness is the eBPF object loaded for test runs.
type harness struct {
	d        *Dataplane
	ingress  *ebpf.Program
	egress   *ebpf.Program
	counters *ebpf.Map
	audited  *ebpf.Map // audit_counters
	testSock *ebpf.Map
	events   *ringbuf.Reader
	ncpu     int
	// remoteIf is an interface index other than lo for the test runs' skb
	// (the remote paths); 0 if the host has none. Nothing is sent on it.
	remoteIf int
}

func newHarness(t *testing.T) *harness { return newHarnessMode(t, 1) }

// newHarnessMode loads the programs with test_mode set as given: 0 runs
// them on the real clock (and real sockets).
func newHarnessMode(t *testing.T, testMode uint32) *harness { return newHarnessNetns(t, testMode, 0) }

// newHarnessNetns also sets the namespace the programs enforce (netns_cookie).
func newHarnessNetns(t *testing.T, testMode uint32, cookie uint64) *harness {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("not root: loading eBPF programs needs CAP_BPF and CAP_NET_ADMIN")
	}
	if err := features.HaveProgramType(ebpf.CGroupSKB); err != nil {
		t.Skipf("this kernel cannot load cgroup_skb programs: %v", err)
	}
	spec, err := loadUwbpf()
	if err != nil {
		t.Fatal(err)
	}
	// Only the programs run here: the LSM and iterator programs cannot load
	// everywhere, and the others are not under test.
	for name := range spec.Programs {
		if name != "uw_skb_ingress" && name != "uw_tc_egress" {
			delete(spec.Programs, name)
		}
	}
	if err := spec.Variables["test_mode"].Set(testMode); err != nil {
		t.Fatal(err)
	}
	if err := spec.Variables["netns_cookie"].Set(cookie); err != nil {
		t.Fatal(err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			t.Fatalf("load: %+v", verr)
		}
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(coll.Close)
	rd, err := ringbuf.NewReader(coll.Maps["events"])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rd.Close() })
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{
		d:        &Dataplane{coll: coll, Node: diffNode},
		ingress:  coll.Programs["uw_skb_ingress"],
		egress:   coll.Programs["uw_tc_egress"],
		counters: coll.Maps["counters"],
		audited:  coll.Maps["audit_counters"],
		testSock: coll.Maps["test_sock"],
		events:   rd,
		ncpu:     ncpu,
	}
	if ifs, err := net.Interfaces(); err == nil {
		for _, i := range ifs {
			if i.Index > 1 {
				h.remoteIf = i.Index
				break
			}
		}
	}
	return h
}

// counts sums the per-CPU decision counters, then the audit counters (the
// second half: refusals audit mode let through).
func (h *harness) counts(t *testing.T) []uint64 {
	t.Helper()
	return append(h.sum(t, h.counters), h.sum(t, h.audited)...)
}

func (h *harness) sum(t *testing.T, m *ebpf.Map) []uint64 {
	t.Helper()
	n := int(m.MaxEntries())
	keys := make([]uint32, n)
	vals := make([]uint64, n*h.ncpu)
	var cur ebpf.MapBatchCursor
	got, err := m.BatchLookup(&cur, keys, vals, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("counters: %v", err)
	}
	if got != n {
		t.Fatalf("counters: %d of %d entries read", got, n)
	}
	sum := make([]uint64, n)
	for i := 0; i < n; i++ {
		for c := 0; c < h.ncpu; c++ {
			sum[keys[i]] += vals[i*h.ncpu+c]
		}
	}
	return sum
}

// skbCtx is a struct __sk_buff prefix for a test run: only ifindex (offset
// 40) is set; the kernel accepts a shorter, zero-filled context.
func skbCtx(ifindex int) []byte {
	b := make([]byte, 44)
	binary.NativeEndian.PutUint32(b[40:], uint32(ifindex))
	return b
}

// verdict is what one run of uw_skb_ingress did.
type verdict struct {
	deliver bool
	rule    uwbpfUwRule // 0: no counter moved
	path    uwbpfUwPath
	audited bool // the count went to audit_counters
	event   *uwbpfUwEvent
}

func (v verdict) String() string {
	s := fmt.Sprintf("deliver=%v rule=%s audited=%v", v.deliver, ruleOrNone(v.rule), v.audited)
	if v.rule != 0 {
		s += " path=" + PathName(uint8(v.path))
	}
	if e := v.event; e != nil {
		s += fmt.Sprintf(" event{rule=%s stamp=%s conn=%v cuid=%d cgid=%d luid=%d lgid=%d audit=%d}",
			RuleName(e.Rule), StampName(e.Stamp), e.HasConnector, e.Cuid, e.Cgid, e.Luid, e.Lgid, e.Audit)
	}
	return s
}

func ruleOrNone(r uwbpfUwRule) string {
	if r == 0 {
		return "none"
	}
	return RuleName(uint8(r))
}

// run judges frame with the receiving socket sock.
func (h *harness) run(t *testing.T, frame []byte, sock uwbpfUwTestSock, ifindex int) verdict {
	t.Helper()
	if err := h.testSock.Update(uint32(0), sock, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	before := h.counts(t)
	opts := &ebpf.RunOptions{Data: frame}
	if ifindex > 1 {
		opts.Context = skbCtx(ifindex)
	}
	ret, err := h.ingress.Run(opts)
	if err != nil {
		t.Fatalf("test run: %v", err)
	}
	after := h.counts(t)
	var v verdict
	switch ret {
	case 0:
	case 1:
		v.deliver = true
	default:
		t.Fatalf("uw_skb_ingress returned %d", ret)
	}
	for i := range after {
		d := after[i] - before[i]
		if d == 0 {
			continue
		}
		if d != 1 || v.rule != 0 {
			t.Fatalf("counters moved by more than one decision (index %d by %d)", i, d)
		}
		j := i % (len(after) / 2)
		v.rule, v.path, v.audited = uwbpfUwRule(j%numRules), uwbpfUwPath(j/numRules), i != j
	}
	if h.events.AvailableBytes() > 0 {
		h.events.SetDeadline(time.Now().Add(time.Second))
		rec, err := h.events.Read()
		if err != nil {
			t.Fatalf("event: %v", err)
		}
		var e uwbpfUwEvent
		if err := binary.Read(bytes.NewReader(rec.RawSample), binary.NativeEndian, &e); err != nil {
			t.Fatalf("event: %v", err)
		}
		v.event = &e
		if h.events.AvailableBytes() > 0 {
			t.Fatal("more than one event for one packet")
		}
	}
	return v
}

// world is one configuration of the data plane: the policy, keys, addresses
// and group membership, written through the agent's own map writers.
type world struct {
	name    string
	pol     *policy.Policy
	keys    []Key // keys[0] seals; all verify
	local   []netip.Addr
	members identity.Membership
	known   []uint32 // users whose groups the node looked up (a carried gid is only a claim)
	audit   bool
	samples uint32 // allowed verdicts reported per second and CPU
	enabled bool
	offset  int64 // wall clock minus boot clock
	// grants are the node's user grants (palisade share); at is the
	// current case's wall clock, against which they expire.
	grants []policy.Grant
	at     time.Time
}

func (w *world) apply(t *testing.T, h *harness) {
	t.Helper()
	d := h.d
	if err := d.ApplyPolicy(w.pol, w.audit); err != nil {
		t.Fatal(err)
	}
	if err := d.SetKeys(w.keys); err != nil {
		t.Fatal(err)
	}
	if err := d.SetLocalAddrs(w.local); err != nil {
		t.Fatal(err)
	}
	if err := d.SetMembers(w.members); err != nil {
		t.Fatal(err)
	}
	if err := d.SetKnownUsers(w.known); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteGrants(w.grants); err != nil {
		t.Fatal(err)
	}
	if err := d.SetInterfaces(map[int]int{1: 14}); err != nil {
		t.Fatal(err)
	}
	cfg := uwbpfUwConfig{SystemPortMax: uint32(w.pol.SystemPortMax), ClockOffsetNs: w.offset, AllowSamples: w.samples}
	if w.enabled {
		cfg.Enabled = 1
	}
	if w.audit {
		cfg.Audit = 1
	}
	if err := d.Map("settings").Update(uint32(0), cfg, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
}

// Stamp kinds of a case.
type stampKind int

const (
	stNone       stampKind = iota
	stValid                // sealed with keys[0]
	stRotation             // sealed with keys[1] (unknown if the world has one key)
	stBadMAC               // one tag bit flipped
	stUnknownKey           // sealed with a key whose id the node does not know
	stSameIDKey            // sealed with a foreign key that has keys[0]'s id
	stWindow               // sealed in another time window (skew or stale)
	stV1                   // the v1 format: option 0x9e length 12
	stBadVersion           // v2 length, version byte 3
	stForgedUID            // sealed for one uid, carrying another
	stForgedGID            // sealed for one gid, carrying another
	stForgedPort           // sealed for another source port
	numStampKinds
)

var stampKindNames = [...]string{"none", "valid", "rotation", "bad-mac", "unknown-key", "same-id-key",
	"window", "v1", "bad-version", "forged-uid", "forged-gid", "forged-port"}

// tcase is one packet and the socket it is delivered to.
type tcase struct {
	v6           bool
	proto        uint8
	tcpFlags     uint8
	src, dst     netip.Addr
	sport, dport uint16
	stamp        stampKind
	cuid, cgid   uint32 // carried in the stamp
	windowDelta  int64  // stWindow: the stamp's window minus the receiver's
	badBit       int    // stBadMAC: the tag bit flipped
	sock         uwbpfUwTestSock
	ifindex      int
}

func (c *tcase) String() string {
	peer := "no peer"
	if c.sock.HasPeer != 0 {
		peer = fmt.Sprintf("peer %s:%d", netip.AddrFrom16(c.sock.Peer).Unmap(), c.sock.PeerPort)
	}
	return fmt.Sprintf("v6=%v proto=%d flags=%#x %s:%d -> %s:%d stamp=%s(cuid=%d cgid=%d dw=%d) "+
		"listener uid=%d gid=%d, %s, now=%d ifindex=%d",
		c.v6, c.proto, c.tcpFlags, c.src, c.sport, c.dst, c.dport, stampKindNames[c.stamp], c.cuid, c.cgid,
		c.windowDelta, c.sock.Uid, c.sock.Gid, peer, c.sock.NowNs, c.ifindex)
}

// ipv4Checksum is the Internet checksum of an IPv4 header.
func ipv4Checksum(h []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(h); i += 2 {
		s += uint32(h[i])<<8 | uint32(h[i+1])
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// l4 is a transport header (and a little payload) for proto.
func l4(proto, flags uint8, sport, dport uint16) []byte {
	b := make([]byte, 24)
	switch proto {
	case ipICMP, ipICMPv6:
		b[0] = 8 // echo request
		if proto == ipICMPv6 {
			b[0] = 128
		}
		binary.BigEndian.PutUint16(b[4:], 0x4242) // identifier
		return b
	case ipUnknown:
		copy(b, "palisade-unknown-proto!!")
		return b
	}
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	switch proto {
	case ipTCP:
		binary.BigEndian.PutUint32(b[4:], 0x01020304)
		b[12] = 5 << 4
		b[13] = flags
		binary.BigEndian.PutUint16(b[14:], 65535)
	case ipUDP, ipUDPLite:
		binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
	}
	return b
}

// frame builds the Ethernet frame; opt is the stamp's 18 bytes after its
// type and length (Stamp.Option), or nil.
func buildFrame(v6 bool, proto, flags uint8, src, dst netip.Addr, sport, dport uint16, kind stampKind, opt []byte) []byte {
	pay := l4(proto, flags, sport, dport)
	eth := []byte{0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00}
	if !v6 {
		var opts []byte
		switch {
		case kind == stV1:
			opts = append([]byte{0x9e, 12}, make([]byte, 10)...)
			opts[2] = 1
		case opt != nil:
			opts = append([]byte{0x9e, 20}, opt...)
		}
		ip := make([]byte, 20, 20+len(opts))
		ip = append(ip, opts...)
		ip[0] = 0x40 | byte(len(ip)/4)
		binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)+len(pay)))
		binary.BigEndian.PutUint16(ip[4:], 0x1234)
		binary.BigEndian.PutUint16(ip[6:], 0x4000) // DF
		ip[8] = 64
		ip[9] = proto
		s4, d4 := src.As4(), dst.As4()
		copy(ip[12:], s4[:])
		copy(ip[16:], d4[:])
		binary.BigEndian.PutUint16(ip[10:], ipv4Checksum(ip))
		return slices.Concat(eth, ip, pay)
	}
	eth[12], eth[13] = 0x86, 0xdd
	var ext []byte
	switch {
	case kind == stV1:
		ext = append([]byte{proto, 1, 0x1e, 12}, make([]byte, 12)...)
		ext[4] = 1
	case opt != nil:
		ext = slices.Concat([]byte{proto, 2, 0x1e, 20}, opt, []byte{1, 0})
	}
	ip := make([]byte, 40)
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], uint16(len(ext)+len(pay)))
	ip[6] = proto
	if ext != nil {
		ip[6] = ipDstOpts
	}
	ip[7] = 64
	s16, d16 := src.As16(), dst.As16()
	copy(ip[8:], s16[:])
	copy(ip[24:], d16[:])
	return slices.Concat(eth, ip, ext, pay)
}

// frame is the case's packet, its stamp made with Go's Stamp.
func (c *tcase) frame(w *world, foreign Key) []byte {
	now := (c.sock.NowNs + w.offset) >> WindowShift
	s := Stamp{Src: c.src, Dst: c.dst, Sport: c.sport, Dport: c.dport, Proto: c.proto,
		UID: c.cuid, GID: c.cgid, Window: uint64(now)}
	key := w.keys[0]
	var opt []byte
	switch c.stamp {
	case stNone, stV1:
	case stRotation:
		if len(w.keys) > 1 {
			key = w.keys[1]
		} else {
			key = foreign
		}
	case stUnknownKey:
		key = foreign
	case stSameIDKey:
		key = sameIDAs(w.keys[0])
	case stWindow:
		s.Window = uint64(now + c.windowDelta)
	}
	if c.stamp != stNone && c.stamp != stV1 {
		s.KeyID = key.ID()
		opt = s.Option(key)
		switch c.stamp {
		case stBadMAC:
			opt[10+c.badBit/8] ^= 1 << (c.badBit % 8)
		case stBadVersion:
			opt[0] = 3
		case stForgedUID:
			binary.BigEndian.PutUint32(opt[2:], c.cuid^0x40)
		case stForgedGID:
			binary.BigEndian.PutUint32(opt[6:], c.cgid^0x1)
		case stForgedPort:
			s.Sport ^= 0x100
			binary.LittleEndian.PutUint64(opt[10:], s.MAC(key))
		}
	}
	return buildFrame(c.v6, c.proto, c.tcpFlags, c.src, c.dst, c.sport, c.dport, c.stamp, opt)
}

// The reference: docs/userwall.md ("How it works", "The identity stamp",
// "UDP replies", "Audit mode") with the rule order of policy.Decide. It is
// written plainly, from the documents, not from the C.

// carried is the uid/gid the packet's stamp carries (what the kernel reports).
func (c *tcase) carried() (uid, gid uint32) {
	switch c.stamp {
	case stForgedUID:
		return c.cuid ^ 0x40, c.cgid
	case stForgedGID:
		return c.cuid, c.cgid ^ 0x1
	}
	return c.cuid, c.cgid
}

// stampWorth: what the stamp proves, before the source-address test.
func (w *world) stampWorth(c *tcase) uwbpfUwStamp {
	switch c.stamp {
	case stNone:
		return uwbpfUwStampS_NONE
	case stV1, stBadVersion:
		return uwbpfUwStampS_OLD_VERSION
	case stUnknownKey:
		return uwbpfUwStampS_UNKNOWN_KEY
	case stRotation:
		if len(w.keys) < 2 {
			return uwbpfUwStampS_UNKNOWN_KEY
		}
		return uwbpfUwStampS_VALID
	case stBadMAC, stSameIDKey, stForgedUID, stForgedGID, stForgedPort:
		return uwbpfUwStampS_BAD_MAC
	case stWindow:
		d := c.windowDelta
		if d >= -1 && d <= 1 {
			return uwbpfUwStampS_VALID // the receiver accepts the window before, at and after its own
		}
		// Outside: stale, unless the 4 carried bits name one of the
		// three accepted windows — then the MAC (over the real window)
		// cannot match it.
		for _, a := range []int64{-1, 0, 1} {
			if (d-a)%16 == 0 {
				return uwbpfUwStampS_BAD_MAC
			}
		}
		return uwbpfUwStampS_STALE
	}
	return uwbpfUwStampS_VALID
}

func inAny(prefixes []netip.Prefix, a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

func (w *world) isLocal(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() || a.IsUnspecified() {
		return true
	}
	return slices.Contains(w.local, a)
}

// unknownGID is the gid of an owner whose effective gid is not known (a
// socket adopted without file credentials): it matches no group.
const unknownGID = ^uint32(0)

// reach is policy.Decide for a trusted connector from src, the listener on
// node ("" another node): groups are the members map's (an unknown gid,
// policy.NoGID, names no group).
func (w *world) reach(src netip.Addr, node string, cuid, cgid, luid, lgid uint32, port uint16, proto policy.Proto) policy.Verdict {
	return w.pol.DecideTrusted(policy.Conn{Source: src, Connector: policy.Identity{UID: cuid, GID: cgid, Groups: w.members[cuid], GroupsKnown: slices.Contains(w.known, cuid)},
		Listener: policy.Identity{UID: luid, GID: lgid, Groups: w.members[luid]}, Port: port, Proto: proto, Node: node,
		Grants: w.grants, At: w.at}, true)
}

// offCluster is policy.Decide for a source without a trusted identity.
func (w *world) offCluster(src netip.Addr, luid, lgid uint32, port uint16, proto policy.Proto) policy.Verdict {
	return w.pol.DecideTrusted(policy.Conn{Source: src, Listener: policy.Identity{UID: luid, GID: lgid, Groups: w.members[luid]},
		Port: port, Proto: proto, Node: diffNode}, false)
}

// diffNode is the node the harness's data plane is (site rules' on_nodes).
const diffNode = "node1"

var ruleByName = func() map[string]uwbpfUwRule {
	m := map[string]uwbpfUwRule{}
	for r, n := range ruleNames {
		m[n] = r
	}
	return m
}()

// expect is the reference verdict.
func (w *world) expect(c *tcase) (deliver bool, rule uwbpfUwRule, path uwbpfUwPath, st uwbpfUwStamp, event bool) {
	local := c.ifindex <= 1
	pathFor := func(proto uint8) uwbpfUwPath {
		switch {
		case proto == ipTCP && local:
			return uwbpfUwPathP_LOCAL_TCP
		case proto == ipTCP:
			return uwbpfUwPathP_REMOTE_TCP
		case (proto == ipUDP || proto == ipUDPLite) && local:
			return uwbpfUwPathP_LOCAL_UDP
		case proto == ipUDP || proto == ipUDPLite:
			return uwbpfUwPathP_REMOTE_UDP
		case local:
			return uwbpfUwPathP_LOCAL_OTHER
		}
		return uwbpfUwPathP_REMOTE_OTHER
	}
	luid, lgid := c.sock.Uid, c.sock.Gid
	if !w.enabled {
		return true, 0, 0, 0, false // idle until the agent has filled the maps
	}
	switch c.proto {
	case ipTCP:
		if c.tcpFlags&0x12 != 0x02 {
			return true, 0, 0, 0, false // not a connection request: its SYN was checked
		}
	case ipICMP, ipICMPv6:
		return true, 0, 0, 0, false // allow-list: ping sockets
	case ipUDP, ipUDPLite, ipSCTP, ipDCCP:
	default:
		// Unclassified: only exempt listeners (root) receive it.
		if slices.Contains(w.pol.ExemptListeners, luid) {
			return true, 0, 0, 0, false
		}
		return w.audit, uwbpfUwRuleR_UNCLASSIFIED, pathFor(c.proto), uwbpfUwStampS_NONE, true
	}
	st = w.stampWorth(c)
	// A valid stamp is trusted only from the cluster, the node itself or
	// link-local sources.
	if st == uwbpfUwStampS_VALID && !inAny(w.pol.ClusterSubnets, c.src) && !w.isLocal(c.src) &&
		!c.src.Unmap().IsLinkLocalUnicast() {
		st = uwbpfUwStampS_UNTRUSTED_SOURCE
	}
	trusted := st == uwbpfUwStampS_VALID
	proto := policy.Proto(c.proto)
	cuid, cgid := c.carried()
	w.at = time.Unix(0, c.sock.NowNs+w.offset)
	var v policy.Verdict
	switch {
	case c.dport <= w.pol.SystemPortMax:
		v = w.reach(c.src, diffNode, 0, 0, 0, 0, c.dport, proto) // system-port, whoever asks
	case trusted:
		v = w.reach(c.src, diffNode, cuid, cgid, luid, lgid, c.dport, proto)
	case !w.isLocal(c.src) && inAny(w.pol.UnenforcedNodes, c.src):
		v = policy.Verdict{Allow: true, Rule: "unverified"} // staged rollout
	default:
		v = w.offCluster(c.src, luid, lgid, c.dport, proto)
	}
	// UDP replies: the socket sent to exactly this source, and its owner
	// could reach the sender's socket. "Could reach" is policy.Decide on the
	// sender's port, so a system port counts (the C missed that once: found
	// by this test). Without a valid stamp the sender is unknown: such an
	// answer is a reply only from off-cluster (not the cluster's subnets,
	// not this node, not link-local), where no stamp can be had — from
	// anywhere else it may be anyone's (redteam: IP options, fragments and
	// spoofed sources leave a datagram unstamped).
	offCluster := !inAny(w.pol.ClusterSubnets, c.src) && !w.isLocal(c.src) && !c.src.Unmap().IsLinkLocalUnicast()
	if !v.Allow && (c.proto == ipUDP || c.proto == ipUDPLite) && c.sock.HasPeer != 0 &&
		c.sock.PeerPort == c.sport && netip.AddrFrom16(c.sock.Peer) == netip.AddrFrom16(c.src.As16()) {
		// The reverse direction: from this node's address (the
		// packet's destination) to a listener on another node.
		if c.sport <= w.pol.SystemPortMax || (trusted && w.reach(c.dst, "", luid, lgid, cuid, cgid, c.sport, proto).Allow) ||
			(!trusted && offCluster) {
			v = policy.Verdict{Allow: true, Rule: "udp-reply"}
		}
	}
	// A refusal for want of identity from where a stamp should have come
	// is reported apart from off-cluster sources, which never have one.
	if v.Rule == policy.RuleOffClusterDenied && !offCluster {
		v.Rule = RuleUnstamped
	}
	rule, ok := ruleByName[string(v.Rule)]
	if w.pol.SiteRule(v.Rule) != nil {
		rule, ok = uwbpfUwRuleR_SITE_DENY, true
		if v.Allow {
			rule = uwbpfUwRuleR_SITE_ALLOW
		}
	}
	if !ok {
		panic("no C rule for " + v.Rule)
	}
	// Allowed verdicts are reported too where sampling is on (a budget no
	// test exhausts), except at system ports (counted before any look).
	// A share that rests on the carried gid alone is reported every time:
	// the agent then looks up the connector's groups.
	claim := rule == uwbpfUwRuleR_SHARED_GROUP && cgid == lgid && !slices.Contains(w.known, cuid) &&
		!slices.Contains(w.members[cuid], lgid)
	event = !v.Allow || rule == uwbpfUwRuleR_UNVERIFIED || rule == uwbpfUwRuleR_USER_GRANT || claim || (w.samples > 0 && c.dport > w.pol.SystemPortMax)
	return v.Allow || w.audit, rule, pathFor(c.proto), st, event
}

// check compares the kernel's verdict with the reference; "" if they agree.
func (w *world) check(c *tcase, got verdict) string {
	deliver, rule, path, st, event := w.expect(c)
	var diffs []string
	if got.deliver != deliver {
		diffs = append(diffs, fmt.Sprintf("deliver %v, want %v", got.deliver, deliver))
	}
	if got.rule != rule {
		diffs = append(diffs, fmt.Sprintf("rule %s, want %s", ruleOrNone(got.rule), ruleOrNone(rule)))
	} else if rule != 0 && got.path != path {
		diffs = append(diffs, fmt.Sprintf("path %s, want %s", PathName(uint8(got.path)), PathName(uint8(path))))
	}
	// Metrics never count a would-be refusal as a refusal.
	if want := w.audit && rule != 0 && !RuleAllows(uint8(rule)); got.audited != want {
		diffs = append(diffs, fmt.Sprintf("counted in audit_counters %v, want %v", got.audited, want))
	}
	e := got.event
	switch {
	case event && e == nil:
		diffs = append(diffs, "no event, want one")
	case !event && e != nil:
		diffs = append(diffs, "an event, want none")
	case e != nil:
		if uwbpfUwRule(e.Rule) != rule || uwbpfUwStamp(e.Stamp) != st {
			diffs = append(diffs, fmt.Sprintf("event rule %s stamp %s, want %s %s", RuleName(e.Rule),
				StampName(e.Stamp), ruleOrNone(rule), StampName(uint8(st))))
		}
		cuid, cgid := c.carried()
		hasConn := st == uwbpfUwStampS_VALID
		wantAudit := uint8(0)
		if w.audit && !RuleAllows(uint8(rule)) {
			wantAudit = 1
		}
		if (e.HasConnector == 1) != hasConn || (hasConn && (e.Cuid != cuid || e.Cgid != cgid)) ||
			e.Luid != c.sock.Uid || e.Lgid != c.sock.Gid || e.Audit != wantAudit || e.Proto != c.proto {
			diffs = append(diffs, fmt.Sprintf("event has_connector=%d cuid=%d cgid=%d luid=%d lgid=%d audit=%d proto=%d",
				e.HasConnector, e.Cuid, e.Cgid, e.Luid, e.Lgid, e.Audit, e.Proto))
		}
		if c.proto != ipUnknown && (e.Sport != c.sport || e.Dport != c.dport ||
			netip.AddrFrom16(e.Saddr) != netip.AddrFrom16(c.src.As16()) ||
			netip.AddrFrom16(e.Daddr) != netip.AddrFrom16(c.dst.As16())) {
			diffs = append(diffs, fmt.Sprintf("event %s:%d -> %s:%d", netip.AddrFrom16(e.Saddr).Unmap(), e.Sport,
				netip.AddrFrom16(e.Daddr).Unmap(), e.Dport))
		}
	}
	if len(diffs) == 0 {
		return ""
	}
	return fmt.Sprintf("%s\n    kernel:    %s\n    reference: deliver=%v rule=%s stamp=%s event=%v",
		strings.Join(diffs, "; "), got, deliver, ruleOrNone(rule), StampName(uint8(st)), event)
}

// Users and groups of the worlds: small sets, so that same-user,
// shared-group and exempt cases are frequent.
const (
	uRoot, uAlice, uBob, uCarol, uSvc, uDaemon = 0, 2001, 2002, 2003, 2004, 2005
	gProj                                      = 2100
)

var (
	uids = []uint32{uRoot, uAlice, uBob, uCarol, uSvc, uDaemon}
	gids = []uint32{0, uAlice, uBob, uCarol, uSvc, gProj, unknownGID}
)

func key(b byte) Key {
	var k Key
	for i := range k {
		k[i] = b + byte(i)*7
	}
	return k
}

// keySet returns three keys with distinct ids: two for the worlds, and a
// foreign one whose id neither has.
func keySet() (a, b, foreign Key) {
	a = key(1)
	var seen []Key
	for i := byte(2); len(seen) < 2; i++ {
		k := key(i * 3)
		if k.ID() != a.ID() && (len(seen) == 0 || k.ID() != seen[0].ID()) {
			seen = append(seen, k)
		}
	}
	return a, seen[0], seen[1]
}

// sameIDAs returns another key with k's 4-bit id.
func sameIDAs(k Key) Key {
	for i := byte(100); ; i++ {
		o := key(i)
		if o != k && o.ID() == k.ID() {
			return o
		}
	}
}

func worlds() []*world {
	k0, k1, _ := keySet()
	members := identity.Membership{uAlice: {gProj}, uBob: {gProj, uAlice}, uCarol: {uAlice}}
	local := []netip.Addr{netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.201"),
		netip.MustParseAddr("2001:2:0:1::1")}
	pfx := func(ss ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, s := range ss {
			out = append(out, netip.MustParsePrefix(s))
		}
		return out
	}
	return []*world{
		{name: "rotation", enabled: true, samples: 1 << 30, keys: []Key{k0, k1}, local: local, members: members, known: []uint32{uBob, uCarol}, offset: 1_700_000_000_000_000_000,
			pol: &policy.Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{uRoot, uSvc}, ExemptListeners: []uint32{uRoot, uDaemon},
				ClusterSubnets:  pfx("198.18.0.0/24", "2001:2:0:1::/64"),
				OffClusterPorts: []policy.PortRange{{First: 8443, Last: 8443}, {First: 9000, Last: 9100}},
				UnenforcedNodes: pfx("198.18.0.200/29", "198.18.7.0/24", "2001:2:0:1:ffff::/80", "2001:2:0:7::/64")}},
		{name: "one-key", enabled: true, keys: []Key{k1}, local: local, members: members, offset: 1_700_000_123_456_789_012,
			pol: &policy.Policy{SystemPortMax: 5000, ExemptConnectors: []uint32{uRoot}, ExemptListeners: []uint32{uRoot},
				ClusterSubnets: pfx("198.18.0.0/16", "2001:2::/48"), OffClusterPorts: []policy.PortRange{{First: 5001, Last: 5003}}}},
		{name: "audit", enabled: true, audit: true, keys: []Key{k0}, local: local, members: members, known: []uint32{uBob}, offset: 1_650_000_000_000_000_000,
			pol: &policy.Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{uSvc}, ExemptListeners: []uint32{uDaemon},
				ClusterSubnets:  pfx("198.18.0.0/24", "2001:2:0:1::/64"),
				UnenforcedNodes: pfx("198.18.7.0/24")}},
		{name: "disabled", enabled: false, keys: []Key{k0}, local: local, members: members,
			pol: &policy.Policy{SystemPortMax: 1023}},
		{name: "site", enabled: true, keys: []Key{k0, k1}, local: local, members: members, offset: 1_700_000_000_000_000_000,
			pol: &policy.Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{uRoot, uSvc}, ExemptListeners: []uint32{uRoot, uDaemon},
				ClusterSubnets:  pfx("198.18.0.0/24", "2001:2:0:1::/64"),
				OffClusterPorts: []policy.PortRange{{First: 8443, Last: 8443}},
				UnenforcedNodes: pfx("198.18.7.0/24"),
				Rules:           siteRules()},
			grants: diffGrants(1_700_000_000_000_000_000)},
	}
}

// diffGrants are user grants on the worlds' users and ports (the case
// generator's 8080, 8888, 12345, 7777, 30000), expiring within the cases'
// 100 days of clock: about half of them are expired at a case's time.
func diffGrants(offset int64) []policy.Grant {
	at := func(days int64) time.Time { return time.Unix(0, offset+days*24*3600*1e9) }
	return []policy.Grant{
		{Owner: uAlice, Port: 8080, Grantee: uBob, Expires: at(50)},
		{Owner: uAlice, Port: 8080, Grantee: uCarol, Expires: at(20)},
		{Owner: uAlice, Port: 8888, Grantee: gProj, Group: true, Expires: at(80)},
		{Owner: uBob, Port: 12345, Grantee: uCarol, Expires: at(60)},
		{Owner: uCarol, Port: 30000, Grantee: uAlice, Group: true, Expires: at(40)},
		{Owner: uCarol, Port: 7777, Grantee: uDaemon, Expires: at(90)},
		{Owner: uDaemon, Port: 8888, Grantee: uBob, Expires: at(30)},
	}
}

// siteRules has a site rule of every kind, on the worlds' users, groups,
// addresses and ports.
func siteRules() []policy.SiteRule {
	pr := func(a, b uint16) []policy.PortRange { return []policy.PortRange{{First: a, Last: b}} }
	pfx := func(s string) []netip.Prefix { return []netip.Prefix{netip.MustParsePrefix(s)} }
	return []policy.SiteRule{
		{Name: "mon", Allow: true, FromGroups: []uint32{gProj}, Ports: pr(9100, 9199)},
		{Name: "no-bob-here", From: []uint32{uBob}, Nodes: []string{"node1", "node3"}, Ports: pr(6000, 6099)},
		{Name: "lab-udp", Allow: true, Sources: pfx("100.64.0.0/10"), Ports: pr(7000, 7010), Proto: policy.UDP},
		{Name: "portal", Allow: true, From: []uint32{uSvc}, Ports: pr(8000, 8999)},
		{Name: "portal-rest", From: []uint32{uSvc}},
		{Name: "alice-group-from-half", Allow: true, ToGroups: []uint32{uAlice}, Sources: pfx("198.18.0.0/25")},
		{Name: "no-project-tcp", Relation: policy.SharedGroup, Ports: pr(12000, 12999), Proto: policy.TCP},
		{Name: "own-debug-v6", Allow: true, Relation: policy.SameUser, Sources: pfx("2001:2:0:1::/64"), Ports: pr(7777, 7777)},
		{Name: "node2-only", Nodes: []string{"node2"}, Ports: pr(1024, 65535)},
		{Name: "daemon-udp", Allow: true, To: []uint32{uDaemon}, Proto: policy.UDP},
		{Name: "upper-half-not-carol", Sources: append(pfx("198.18.0.128/25"), pfx("2001:2:0:1::/80")...), To: []uint32{uCarol}},
		{Name: "outside-v6", Allow: true, Sources: pfx("2001:2:0:7::/64"), Ports: []policy.PortRange{{First: 9000, Last: 9100}, {First: 5001, Last: 5003}}},
		{Name: "udp-lite-any", Allow: true, From: []uint32{uCarol}, To: []uint32{uBob}, Ports: pr(20000, 40000)},
	}
}

// randomSiteRules draws n site rules from the worlds' pools.
func randomSiteRules(r *rand.Rand, n int) []policy.SiteRule {
	var out []policy.SiteRule
	prefixes := []string{"198.18.0.0/24", "198.18.0.0/25", "198.18.0.128/26", "198.18.0.1/32", "100.64.0.0/10", "100.64.0.0/12",
		"127.0.0.0/8", "2001:2:0:1::/64", "2001:2:0:1::/96", "2001:2:0:7::/64", "2001:2:ff::/48", "198.19.0.0/16", "169.254.0.0/16"}
	for i := 0; i < n; i++ {
		ru := policy.SiteRule{Name: fmt.Sprintf("r%d", i), Allow: r.IntN(2) == 0}
		if r.IntN(3) == 0 {
			ru.From = append(ru.From, pick(r, uids))
		}
		if r.IntN(4) == 0 {
			ru.FromGroups = append(ru.FromGroups, pick(r, []uint32{gProj, uAlice, uBob, 0}))
		}
		if r.IntN(3) == 0 {
			ru.To = append(ru.To, pick(r, uids))
		}
		if r.IntN(4) == 0 {
			ru.ToGroups = append(ru.ToGroups, pick(r, []uint32{gProj, uAlice, uCarol}))
		}
		for j := r.IntN(3); j > 0 && r.IntN(2) == 0; j-- {
			ru.Sources = append(ru.Sources, netip.MustParsePrefix(pick(r, prefixes)))
		}
		if r.IntN(4) == 0 {
			ru.Nodes = []string{pick(r, []string{"node1", "node2"})}
		}
		for j := r.IntN(3); j > 0; j-- {
			a := uint16(1024 + r.IntN(64512))
			b := a + uint16(r.IntN(int(min(2000, 65535-int(a)))+1))
			ru.Ports = append(ru.Ports, policy.PortRange{First: a, Last: b})
		}
		ru.Proto = pick(r, []policy.Proto{0, 0, policy.TCP, policy.UDP})
		ru.Relation = pick(r, []policy.Relation{0, 0, 0, policy.SameUser, policy.SharedGroup})
		out = append(out, ru)
	}
	return out
}

// Source and destination address pools.
func addrPick(r *rand.Rand, v6 bool, kind int) netip.Addr {
	b := byte(r.IntN(250) + 2)
	if !v6 {
		return [...]netip.Addr{
			netip.AddrFrom4([4]byte{198, 18, 0, b}),         // cluster
			netip.AddrFrom4([4]byte{198, 18, 0, 1}),         // local
			netip.AddrFrom4([4]byte{127, 0, 0, b}),          // loopback
			netip.AddrFrom4([4]byte{169, 254, b, 7}),        // link-local
			netip.AddrFrom4([4]byte{198, 18, 0, 200 + b%8}), // unenforced inside the cluster (.201 is local)
			netip.AddrFrom4([4]byte{198, 18, 7, b}),         // unenforced outside
			netip.AddrFrom4([4]byte{100, 64 + b%64, b, 9}),  // outside
			netip.AddrFrom4([4]byte{198, 19, b, 3}),         // outside
			netip.AddrFrom4([4]byte{198, 18, 1 + b%200, b}), // in the cluster of "one-key" (/16) only
			netip.AddrFrom4([4]byte{224, 0, 0, 1}),          // multicast
		}[kind%10]
	}
	var a [16]byte
	switch kind % 10 {
	case 0:
		a = netip.MustParseAddr("2001:2:0:1::").As16()
		a[15] = b
	case 1:
		return netip.MustParseAddr("2001:2:0:1::1")
	case 2:
		return netip.IPv6Loopback()
	case 3:
		a = netip.MustParseAddr("fe80::").As16()
		a[15], a[9] = b, 0x11
	case 4:
		a = netip.MustParseAddr("2001:2:0:1:ffff::").As16()
		a[15] = b
	case 5:
		a = netip.MustParseAddr("2001:2:0:7::").As16()
		a[15] = b
	case 6:
		a = netip.MustParseAddr("2001:2:ff::").As16()
		a[15] = b
	case 7:
		a = netip.MustParseAddr("2001:3::").As16()
		a[15] = b
	case 8:
		a = netip.MustParseAddr("2001:2:0:9::").As16()
		a[15] = b
	case 9:
		return netip.MustParseAddr("ff02::1")
	}
	return netip.AddrFrom16(a)
}

func pick[T any](r *rand.Rand, s []T) T { return s[r.IntN(len(s))] }

// randomCase draws one case for world w.
func randomCase(r *rand.Rand, w *world, remoteIf int) *tcase {
	c := &tcase{v6: r.IntN(2) == 0}
	c.proto = pick(r, []uint8{ipTCP, ipTCP, ipTCP, ipUDP, ipUDP, ipUDP, ipUDPLite, ipSCTP, ipDCCP, ipICMP, ipUnknown})
	if c.proto == ipICMP && c.v6 {
		c.proto = ipICMPv6
	}
	if c.proto == ipTCP {
		c.tcpFlags = pick(r, []uint8{0x02, 0x02, 0x02, 0x02, 0xc2, 0x12, 0x10, 0x18, 0x04, 0x11, 0x03})
	}
	srcKind := r.IntN(9) // no multicast sources
	c.src = addrPick(r, c.v6, srcKind)
	c.dst = addrPick(r, c.v6, pick(r, []int{1, 1, 1, 2, 0, 9, 3}))
	spm := int(w.pol.SystemPortMax)
	port := func() uint16 {
		switch r.IntN(6) {
		case 0:
			return uint16(max(0, spm-2+r.IntN(5)))
		case 1:
			return pick(r, []uint16{53, 123, 8443, 9000, 9100, 9101, 5001, 5003, 5004, 1024,
				9150, 6050, 7005, 8080, 12345, 7777, 30000, 8888}) // the last ones: the site world's rules and grants
		case 2:
			return uint16(1 + r.IntN(1024))
		default:
			return uint16(1024 + r.IntN(64512))
		}
	}
	c.sport, c.dport = port(), port()
	c.stamp = stampKind(r.IntN(int(numStampKinds)))
	if r.IntN(3) == 0 {
		c.stamp = stValid // the valid stamp is the interesting common case
	}
	c.cuid = pick(r, uids)
	c.cgid = c.cuid
	if r.IntN(3) == 0 {
		c.cgid = pick(r, gids)
	}
	switch c.stamp {
	case stWindow:
		c.windowDelta = pick(r, []int64{-1, 1, -2, 2, -3, 3, -15, 15, -16, 16, -17, 17, 100})
	case stBadMAC:
		c.badBit = r.IntN(64)
	}
	c.sock.Uid = pick(r, uids)
	c.sock.Gid = c.sock.Uid
	if r.IntN(3) == 0 {
		c.sock.Gid = pick(r, gids)
	}
	c.sock.TcpListener = 1
	if c.proto != ipTCP {
		c.sock.TcpListener = 0
	}
	if r.IntN(2) == 0 {
		c.sock.HasPeer = 1
		peer, pport := c.src, c.sport
		switch r.IntN(5) {
		case 0:
			peer = addrPick(r, c.v6, r.IntN(9))
		case 1:
			pport ^= uint16(1 + r.IntN(0xffff))
		}
		c.sock.Peer, c.sock.PeerPort = peer.As16(), pport
	}
	// A boot clock anywhere in 100 days; the windows' edges come up often.
	c.sock.NowNs = int64(r.Uint64N(100*24*3600*1e9)) + 1
	if r.IntN(4) == 0 {
		edge := (c.sock.NowNs + w.offset) >> WindowShift << WindowShift
		c.sock.NowNs = edge - w.offset + int64(r.IntN(3)) - 1
	}
	if remoteIf > 0 && r.IntN(3) == 0 {
		c.ifindex = remoteIf
	}
	// Aim at a grant now and then: its port and owner, its grantee (or,
	// half the time, anyone), a TCP SYN mostly with a valid stamp.
	if len(w.grants) > 0 && r.IntN(4) == 0 {
		g := pick(r, w.grants)
		c.dport, c.sock.Uid = g.Port, g.Owner
		if r.IntN(4) > 0 {
			c.proto, c.tcpFlags, c.sock.TcpListener = ipTCP, 0x02, 1
		}
		if r.IntN(4) > 0 {
			c.stamp = stValid
		}
		if r.IntN(2) == 0 {
			if g.Group {
				c.cuid, c.cgid = pick(r, uids), g.Grantee
			} else {
				c.cuid = g.Grantee
			}
		}
	}
	return c
}

// TestDifferential runs uw_skb_ingress (BPF_PROG_TEST_RUN) on randomized
// packets and sockets and compares every verdict with the reference.
// Reproduce a failure with -args -diff.seed=N (printed).
func TestDifferential(t *testing.T) {
	h := newHarness(t)
	seed := *diffSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (reproduce: go test -run TestDifferential ./internal/dataplane/userwall/kernel -args -diff.seed=%d)", seed, seed)
	r := rand.New(rand.NewPCG(seed, 0x9e))
	_, _, foreign := keySet()
	ws := worlds()
	// Random site rules: many, so that rule order and every mask mix.
	rw := *ws[0]
	rw.name, rw.pol = "site-random", &policy.Policy{}
	*rw.pol = *ws[0].pol
	rw.pol.Rules = randomSiteRules(r, 300)
	rw.grants = diffGrants(rw.offset)
	ws = append(ws, &rw)
	share := []int{25, 15, 15, 5, 20, 20} // percent of the cases per world
	stats := map[string]int{}
	fails := 0
	for wi, w := range ws {
		w.apply(t, h)
		n := *diffCases * share[wi] / 100
		for i := 0; i < n; i++ {
			c := randomCase(r, w, h.remoteIf)
			got := h.run(t, c.frame(w, foreign), c.sock, c.ifindex)
			if d := w.check(c, got); d != "" {
				fails++
				if fails <= 20 {
					t.Errorf("seed %d world %s case %d: %s\n    case: %s", seed, w.name, i, d, c)
				}
				continue
			}
			stats[ruleOrNone(got.rule)+"/"+map[bool]string{true: "deliver", false: "drop"}[got.deliver]]++
		}
	}
	if fails > 0 {
		t.Fatalf("seed %d: %d disagreements", seed, fails)
	}
	t.Logf("verdicts: %v", stats)
	// The generator must reach every rule the ingress program can take.
	for _, want := range []string{"site-allow/deliver", "site-deny/drop", "user-grant/deliver", "same-user/deliver", "shared-group/deliver", "system-port/deliver",
		"exempt-connector/deliver", "exempt-listener/deliver", "off-cluster-port/deliver",
		"off-cluster-denied/drop", "unstamped-from-cluster/drop", "default-deny/drop", "udp-reply/deliver", "unverified/deliver",
		"unclassified/drop", "none/deliver", "default-deny/deliver"} {
		if stats[want] == 0 {
			t.Errorf("no case ended %s: the generator misses it", want)
		}
	}
}

// TestSipHashVectors checks the Go SipHash-2-4 against the reference
// implementation's published vectors (vectors_sip64 in
// https://github.com/veorq/SipHash/blob/master/vectors.h, also in Linux's
// lib/tests/siphash_kunit.c): key 00 01 .. 0f, message 00 01 .. n-1.
func TestSipHashVectors(t *testing.T) {
	var k Key
	for i := range k {
		k[i] = byte(i)
	}
	for _, v := range []struct {
		words []uint64 // the message as little-endian 64-bit words
		want  uint64
	}{
		{nil, 0x726fdb47dd0e0e31},                                              // len 0
		{[]uint64{0x0706050403020100}, 0x93f5f5799a932462},                     // len 8: 00..07
		{[]uint64{0x0706050403020100, 0x0f0e0d0c0b0a0908}, 0x3f2acc7f57c29bdb}, // len 16
	} {
		if got := siphash(k, v.words); got != v.want {
			t.Errorf("SipHash-2-4 of %d bytes: %#x, want %#x", 8*len(v.words), got, v.want)
		}
	}
}

// stampAt parses the stamp of an IP packet (at offset l3 of frame): its 18
// bytes after type and length, and the transport header's offset.
func stampAt(t *testing.T, frame []byte, v6 bool) (opt []byte, l4 int) {
	t.Helper()
	ip := frame[14:]
	if !v6 {
		ihl := int(ip[0]&0xf) * 4
		if ihl != 40 || ip[20] != 0x9e || ip[21] != 20 {
			return nil, ihl
		}
		if int(binary.BigEndian.Uint16(ip[2:])) != len(ip) {
			t.Errorf("IPv4 total length %d, packet %d", binary.BigEndian.Uint16(ip[2:]), len(ip))
		}
		if ipv4Checksum(ip[:ihl]) != 0 {
			t.Errorf("IPv4 header checksum wrong after stamping: % x", ip[:ihl])
		}
		return ip[22:40], ihl
	}
	if ip[6] != ipDstOpts || ip[41] != 2 || ip[42] != 0x1e || ip[43] != 20 {
		return nil, 40
	}
	if int(binary.BigEndian.Uint16(ip[4:])) != len(ip)-40 {
		t.Errorf("IPv6 payload length %d, packet %d", binary.BigEndian.Uint16(ip[4:]), len(ip)-40)
	}
	if ip[62] != 1 || ip[63] != 0 {
		t.Errorf("IPv6 destination options: no PadN at the end: % x", ip[40:64])
	}
	return ip[44:62], 64
}

// TestStampMatchesKernel: stamps sealed by the real uw_tc_egress verify in
// Go, and are what Go's Stamp computes; stamps sealed in Go verify in the
// kernel; one flipped bit of any sealed field makes the stamp invalid there.
func TestStampMatchesKernel(t *testing.T) {
	h := newHarness(t)
	w := worlds()[0]
	w.samples = 0 // no allowed verdict reported
	w.apply(t, h)
	r := rand.New(rand.NewPCG(7, 7))
	for i := 0; i < 200; i++ {
		v6 := i%2 == 1
		proto := pick(r, []uint8{ipTCP, ipUDP, ipUDPLite, ipSCTP, ipDCCP})
		src := addrPick(r, v6, pick(r, []int{0, 1, 2, 3}))
		dst := addrPick(r, v6, pick(r, []int{0, 1, 2, 9}))
		sport, dport := uint16(1024+r.IntN(64512)), uint16(1024+r.IntN(64512))
		now := int64(r.Uint64N(100*24*3600*1e9)) + 1
		sock := uwbpfUwTestSock{NowNs: now}
		if err := h.testSock.Update(uint32(0), sock, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		in := buildFrame(v6, proto, 0x02, src, dst, sport, dport, stNone, nil)
		ret, out, err := h.egress.Test(in)
		if err != nil {
			t.Fatalf("tc egress test run: %v", err)
		}
		opt, l4off := stampAt(t, out, v6)
		if opt == nil {
			t.Fatalf("case %d: uw_tc_egress left the packet unstamped:\n in % x\nout % x", i, in, out)
		}
		if !bytes.Equal(out[14+l4off:], in[len(in)-24:]) {
			t.Errorf("case %d: transport header changed by stamping", i)
		}
		uid, gid := binary.BigEndian.Uint32(opt[2:]), binary.BigEndian.Uint32(opt[6:])
		s := Stamp{Src: src, Dst: dst, Sport: sport, Dport: dport, Proto: proto, UID: uid, GID: gid,
			Window: uint64(now+w.offset) >> WindowShift, KeyID: w.keys[0].ID()}
		if want := s.Option(w.keys[0]); !bytes.Equal(opt, want) {
			t.Fatalf("case %d (%s:%d -> %s:%d proto %d): kernel stamp % x, Go % x", i, src, sport, dst, dport, proto, opt, want)
		}
		if ret != 0 {
			t.Fatalf("case %d: uw_tc_egress returned %d, want TC_ACT_OK", i, ret)
		}
		// The kernel's own stamp verifies at delivery: the listener is the
		// stamped uid, not exempt as a listener (root would be same-user too).
		sock.Uid, sock.Gid = uid, gid
		if v := h.run(t, out, sock, 1); !v.deliver || v.rule != uwbpfUwRuleR_SAME_USER || v.event != nil {
			t.Fatalf("case %d: the egress stamp (uid %d gid %d) at ingress: %s", i, uid, gid, v)
		}
		if i == 0 {
			t.Logf("uw_tc_egress stamps a test run's socket as uid %d gid %d", uid, gid)
		}
	}
}

// TestSealedGID: the real uw_tc_egress seals the owner's gid only when
// this node can vouch for it, as policy.SealedGID says: every (uid, gid) of
// the sending socket, in every world (members and known users differ),
// both families.
func TestSealedGID(t *testing.T) {
	h := newHarness(t)
	src, dst := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	src6, dst6 := netip.MustParseAddr("2001:2:0:1::1"), netip.MustParseAddr("2001:2:0:1::2")
	n := 0
	for _, w := range worlds() {
		if !w.enabled {
			continue
		}
		w.samples = 0
		w.apply(t, h)
		for _, uid := range uids {
			for _, gid := range gids {
				v6 := n%2 == 1
				n++
				sock := uwbpfUwTestSock{Uid: uid, Gid: gid, NowNs: 1}
				if err := h.testSock.Update(uint32(0), sock, ebpf.UpdateAny); err != nil {
					t.Fatal(err)
				}
				s, d := src, dst
				if v6 {
					s, d = src6, dst6
				}
				_, out, err := h.egress.Test(buildFrame(v6, ipUDP, 0, s, d, 40000, 40001, stNone, nil))
				if err != nil {
					t.Fatal(err)
				}
				opt, _ := stampAt(t, out, v6)
				if opt == nil {
					t.Fatalf("%s: uid %d gid %d: unstamped", w.name, uid, gid)
				}
				got := binary.BigEndian.Uint32(opt[6:])
				want := policy.SealedGID(gid, slices.Contains(w.known, uid), w.members[uid])
				if binary.BigEndian.Uint32(opt[2:]) != uid || got != want {
					t.Errorf("%s: socket of uid %d gid %d (known %v, groups %v): sealed uid %d gid %d, want gid %d",
						w.name, uid, gid, slices.Contains(w.known, uid), w.members[uid], binary.BigEndian.Uint32(opt[2:]), got, want)
				}
			}
		}
	}
}

// TestAdoptAtDelivery: a datagram socket without an owner record (one older
// than the agent, bound by a send the kernel refused before its sendmsg hook)
// of a user is never permission: at delivery, the real uw_skb_ingress (not
// in test mode) reads the socket's namespace from the socket itself; this
// namespace's socket is decided with its kernel owner (the test run's socket
// is root's: not exempt here, as a user's), another namespace's is left to
// its own agent, and a kernel or system socket (exempt owner) passes. An unstamped datagram from a cluster node is the probe: refused at
// this namespace's socket, passed at another's.
func TestAdoptAtDelivery(t *testing.T) {
	self, err := NetnsCookie()
	if err != nil {
		t.Fatal(err)
	}
	frame := buildFrame(false, ipUDP, 0, netip.MustParseAddr("198.18.0.2"), netip.MustParseAddr("198.18.0.1"), 40000, 40001, stNone, nil)
	for _, tc := range []struct {
		cookie     uint64
		rootExempt bool
		deliver    bool
		rule       uwbpfUwRule
	}{
		{self, false, false, uwbpfUwRuleR_UNSTAMPED_FROM_CLUSTER}, // this namespace's user socket: decided
		{self + 1, false, true, 0},                                // another namespace's: not this copy's
		{self, true, true, 0},                                     // a kernel or system socket: passes as before
	} {
		h := newHarnessNetns(t, 0, tc.cookie)
		w := worlds()[0]
		w.samples = 0
		w.pol.ExemptListeners = nil
		if tc.rootExempt {
			w.pol.ExemptListeners = []uint32{uRoot}
		}
		w.apply(t, h)
		v := h.run(t, frame, uwbpfUwTestSock{}, 1)
		if v.deliver != tc.deliver || v.rule != tc.rule {
			t.Errorf("recordless socket, programs enforcing netns %d (this one is %d): %s, want deliver=%v rule=%s",
				tc.cookie, self, v, tc.deliver, ruleOrNone(tc.rule))
		}
	}
}

// TestStampBitFlips: a stamp sealed in Go is valid in the kernel; flipping any
// one bit of a sealed field (uid, gid, tag, version, meta, ports, addresses)
// makes it no identity there.
func TestStampBitFlips(t *testing.T) {
	h := newHarness(t)
	w := worlds()[0]
	w.samples = 0 // no allowed verdict reported
	w.apply(t, h)
	for _, v6 := range []bool{false, true} {
		src, dst := netip.MustParseAddr("198.18.0.2"), netip.MustParseAddr("198.18.0.1")
		if v6 {
			src, dst = netip.MustParseAddr("2001:2:0:1::2"), netip.MustParseAddr("2001:2:0:1::1")
		}
		const sport, dport = 41000, 40000
		now := int64(1234567890123456)
		s := Stamp{Src: src, Dst: dst, Sport: sport, Dport: dport, Proto: ipUDP, UID: uBob, GID: gProj,
			Window: uint64(now+w.offset) >> WindowShift, KeyID: w.keys[0].ID()}
		good := buildFrame(v6, ipUDP, 0, src, dst, sport, dport, stValid, s.Option(w.keys[0]))
		sock := uwbpfUwTestSock{Uid: uBob, Gid: uBob, NowNs: now}
		if v := h.run(t, good, sock, 1); !v.deliver || v.rule != uwbpfUwRuleR_SAME_USER {
			t.Fatalf("v6=%v: Go's stamp at the kernel: %s, want same-user", v6, v)
		}
		// Another user is refused by the rules, not for the stamp.
		if v := h.run(t, good, uwbpfUwTestSock{Uid: uCarol, Gid: uCarol, NowNs: now}, 1); v.deliver ||
			v.rule != uwbpfUwRuleR_DENIED || v.event == nil || uwbpfUwStamp(v.event.Stamp) != uwbpfUwStampS_VALID {
			t.Fatalf("v6=%v: Go's stamp to carol's socket: %s, want default-deny with a valid stamp", v6, v)
		}
		// Byte ranges of the frame under the MAC.
		var fields []struct {
			name     string
			off, len int
		}
		add := func(name string, off, n int) {
			fields = append(fields, struct {
				name     string
				off, len int
			}{name, off, n})
		}
		optOff, ipSrc, ipDst, l4 := 14+22, 14+12, 14+16, 14+40
		if v6 {
			optOff, ipSrc, ipDst, l4 = 14+44, 14+8, 14+24, 14+64
			add("src", ipSrc, 16)
			add("dst", ipDst, 16)
		} else {
			add("src", ipSrc, 4)
			add("dst", ipDst, 4)
		}
		add("version", optOff, 1)
		add("meta", optOff+1, 1)
		add("uid", optOff+2, 4)
		add("gid", optOff+6, 4)
		add("tag", optOff+10, 8)
		add("sport", l4, 2)
		add("dport", l4+2, 2)
		for _, f := range fields {
			for bit := 0; bit < 8*f.len; bit++ {
				bad := slices.Clone(good)
				bad[f.off+bit/8] ^= 1 << (bit % 8)
				v := h.run(t, bad, sock, 1)
				// Refused without identity: unstamped-from-cluster, or
				// off-cluster-denied if the flip moved the source out.
				if v.deliver || (v.rule != uwbpfUwRuleR_OFFCLUSTER_DENIED && v.rule != uwbpfUwRuleR_UNSTAMPED_FROM_CLUSTER) ||
					v.event == nil || uwbpfUwStamp(v.event.Stamp) == uwbpfUwStampS_VALID {
					t.Errorf("v6=%v: %s bit %d flipped: %s, want a refusal without identity", v6, f.name, bit, v)
				}
			}
		}
	}
}

// TestProgramClock: the programs' clock plus the agent's ClockOffset is the
// wall clock, within two ticks of the coarse clock. Read through the real
// code path: uw_tc_egress (real clock, not test mode) seals its window's low
// bits into the stamp; the offset is shifted so that a window edge falls
// two ticks after, then two ticks before, the Go side's wall clock, and
// the stamp must name the window before the edge, then the one after it.
func TestProgramClock(t *testing.T) {
	h := newHarnessMode(t, 0)
	w := worlds()[0]
	w.samples = 0 // no allowed verdict reported
	w.apply(t, h)
	var res unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &res); err != nil {
		t.Fatal(err)
	}
	tick := res.Nano()
	src, dst := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	frame := buildFrame(false, ipUDP, 0, src, dst, 40000, 40001, stNone, nil)
	// window seals a stamp with the edge shift ns after Go's wall clock and
	// reports whether the program put it in the window after the edge.
	window := func(shift int64) (after bool) {
		t.Helper()
		wall := time.Now().UnixNano()
		edge := (wall>>WindowShift + 2) << WindowShift
		// With offset o the program computes prog + o; the edge is where
		// prog + ClockOffset() == wall + shift.
		cfg := uwbpfUwConfig{SystemPortMax: uint32(w.pol.SystemPortMax), Enabled: 1,
			ClockOffsetNs: ClockOffset() + edge - wall - shift}
		if err := h.d.Map("settings").Update(uint32(0), cfg, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		_, out, err := h.egress.Test(frame)
		if err != nil {
			t.Fatal(err)
		}
		opt, _ := stampAt(t, out, false)
		if opt == nil {
			t.Fatalf("unstamped: % x", out)
		}
		got := opt[1] & 0xf
		lo, hi := uint8(edge>>WindowShift-1)&0xf, uint8(edge>>WindowShift)&0xf
		if got != lo && got != hi {
			t.Fatalf("window %d: neither %d nor %d (clock off by more than a window)", got, lo, hi)
		}
		return got == hi
	}
	for i := 0; i < 5; i++ {
		if window(2 * tick) {
			t.Errorf("edge 2 ticks (%d ns) after the wall clock: the program sealed the later window: its clock runs ahead", 2*tick)
		}
		if !window(-2 * tick) {
			t.Errorf("edge 2 ticks (%d ns) before the wall clock: the program sealed the earlier window: its clock lags", 2*tick)
		}
	}
}

// TestStampFirstFragment: the first fragment of a fragmented datagram is
// stamped (IPv4: the option; IPv6: the destination options in front of the
// fragment header), a later fragment is left alone, and the stamp verifies
// at delivery both on the first fragment (what tc ingress parses) and on
// the reassembled datagram (what the socket's check sees: the first
// fragment's headers without the fragment header).
func TestStampFirstFragment(t *testing.T) {
	h := newHarness(t)
	w := worlds()[0]
	w.apply(t, h)
	for _, v6 := range []bool{false, true} {
		src, dst := addrPick(rand.New(rand.NewPCG(1, 2)), v6, 0), addrPick(rand.New(rand.NewPCG(3, 4)), v6, 0)
		sock := uwbpfUwTestSock{NowNs: 1e18}
		if err := h.testSock.Update(uint32(0), sock, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		whole := buildFrame(v6, ipUDP, 0, src, dst, 40000, 5000, stNone, nil)
		var first, later []byte
		if !v6 {
			first = slices.Clone(whole)
			binary.BigEndian.PutUint16(first[14+6:], 0x2000) // MF, offset 0
			first[14+10], first[14+11] = 0, 0
			binary.BigEndian.PutUint16(first[14+10:], ipv4Checksum(first[14:34]))
			later = slices.Clone(first)
			binary.BigEndian.PutUint16(later[14+6:], 0x0001) // offset 8, last
			later[14+10], later[14+11] = 0, 0
			binary.BigEndian.PutUint16(later[14+10:], ipv4Checksum(later[14:34]))
		} else {
			// IPv6 header, fragment header (offset 0, M), UDP.
			frag := []byte{ipUDP, 0, 0, 1, 0, 0, 0x12, 0x34}
			first = slices.Concat(whole[:14+40], frag, whole[14+40:])
			first[14+6] = 44
			binary.BigEndian.PutUint16(first[14+4:], uint16(len(first)-14-40))
			later = slices.Clone(first)
			later[14+40+2], later[14+40+3] = 0, 8 // offset 1 (8 bytes), last
		}
		ret, out, err := h.egress.Test(later)
		if err != nil || ret != 0 || !bytes.Equal(out, later) {
			t.Fatalf("v6=%v: a later fragment was changed (ret %d, err %v):\n in % x\nout % x", v6, ret, err, later, out)
		}
		ret, out, err = h.egress.Test(first)
		if err != nil || ret != 0 {
			t.Fatalf("v6=%v: egress on the first fragment: ret %d, %v", v6, ret, err)
		}
		var opt []byte
		var reasm []byte
		if !v6 {
			opt, _ = stampAt(t, out, false)
			if opt == nil || binary.BigEndian.Uint16(out[14+6:]) != 0x2000 {
				t.Fatalf("v4 first fragment not stamped, or its fragment field changed:\n% x", out)
			}
			reasm = slices.Clone(out)
			binary.BigEndian.PutUint16(reasm[14+6:], 0)
		} else {
			ip := out[14:]
			if ip[6] != ipDstOpts || ip[40] != 44 || ip[42] != 0x1e || ip[64] != ipUDP ||
				int(binary.BigEndian.Uint16(ip[4:])) != len(ip)-40 {
				t.Fatalf("v6 first fragment: want IPv6, destination options (stamp), fragment header, UDP:\n% x", ip)
			}
			opt = ip[44:62]
			// Reassembly drops the fragment header and points the
			// destination options at the upper layer.
			reasm = slices.Concat(out[:14+64], out[14+72:])
			reasm[14+40] = ipUDP
			binary.BigEndian.PutUint16(reasm[14+4:], uint16(len(reasm)-14-40))
		}
		uid, gid := binary.BigEndian.Uint32(opt[2:]), binary.BigEndian.Uint32(opt[6:])
		sock.Uid, sock.Gid = uid, gid
		for name, f := range map[string][]byte{"first fragment": out, "reassembled": reasm} {
			if v := h.run(t, f, sock, 2); !v.deliver || v.rule != uwbpfUwRuleR_SAME_USER {
				t.Errorf("v6=%v %s: %s, want same-user (the stamp verifies)", v6, name, v)
			}
		}
		// The stamp's uid altered: no identity (the MAC covers it).
		bad := slices.Clone(reasm)
		off := 14 + 22 + 2 // IPv4: option type, length, version, meta
		if v6 {
			off = 14 + 44 + 2
		}
		bad[off+3] ^= 1
		if v := h.run(t, bad, sock, 2); v.deliver || v.event == nil || uwbpfUwStamp(v.event.Stamp) != uwbpfUwStampS_BAD_MAC {
			t.Errorf("v6=%v reassembled, uid altered: %s, want a refusal for a bad MAC", v6, v)
		}
	}
}
