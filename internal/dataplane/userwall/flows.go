package userwall

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/policy"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
)

// Flows: the verdicts of this node, recent and live (`palisade flows`), and
// its would-be refusals grouped over time (`palisade audit report`).
//
// Source: the ring buffer the programs feed. Refusals (and audit-mode
// would-be refusals, and unverified admissions) are always reported there;
// allowed verdicts only within a per-CPU budget of [agent] flow_samples a
// second (uw_skb_ingress, sample_allowed), so an allowed flood costs one
// per-CPU array update per decision and nothing more; system ports (sshd,
// slurmd) are counted, never sampled. The sink decodes each record and
// offers it here without blocking (a full queue drops it, counted); this
// recorder's goroutine names the processes of both ends where the kernel
// still knows them (sock_diag and /proc, rate-bounded, cached) and keeps
//   - a ring of the last flow_history verdicts (bounded memory), and
//   - per-minute groups of refusals (listener user, port, connector, rule,
//     verdict) with counts, first/last seen and process names, at most
//     maxAuditGroups of them (the oldest minutes go first).

// FlowEnd is one end of a flow: its identity and, where known, process.
type FlowEnd struct {
	UID   uint32 `json:"uid"`
	User  string `json:"user,omitempty"`
	GID   uint32 `json:"gid"`
	Group string `json:"group,omitempty"`
	PID   int    `json:"pid,omitempty"`
	Comm  string `json:"comm,omitempty"`
	// Node is the end's node: a name from [cluster] nodes, or its address.
	Node string `json:"node,omitempty"`
}

// Flow is one verdict.
type Flow struct {
	Seq  uint64    `json:"seq"`
	Time time.Time `json:"time"`
	// Verdict is "allow", "deny", or "audit" (refused by the rules, let
	// through by audit mode).
	Verdict string `json:"verdict"`
	// Sampled: an allowed verdict recorded within the sampling budget
	// (others like it may have gone unrecorded; the counters have them all).
	Sampled bool   `json:"sampled,omitempty"`
	Rule    string `json:"rule"`
	Proto   string `json:"proto"`
	Path    string `json:"path"`
	Stage   string `json:"stage,omitempty"`
	Stamp   string `json:"stamp,omitempty"`
	Src     string `json:"src,omitempty"`
	Dst     string `json:"dst"`
	// Connector is nil when no identity was trusted (off-cluster, no or a
	// bad stamp); SrcNode then names its node if it is a cluster node's.
	Connector *FlowEnd `json:"connector,omitempty"`
	SrcNode   string   `json:"src_node,omitempty"`
	Listener  FlowEnd  `json:"listener"`
	// Grant names the user grant that allowed a "user-grant" flow.
	Grant string `json:"grant,omitempty"`
}

// FlowFilter selects flows and audit groups. Zero fields select all.
type FlowFilter struct {
	User          *uint32   `json:"user,omitempty"` // either end
	ListenerUser  *uint32   `json:"listener_user,omitempty"`
	ConnectorUser *uint32   `json:"connector_user,omitempty"`
	Port          uint16    `json:"port,omitempty"`
	Proto         string    `json:"proto,omitempty"`
	Rule          string    `json:"rule,omitempty"`
	Verdicts      []string  `json:"verdicts,omitempty"`
	Since         time.Time `json:"since,omitzero"`
	// AsUID restricts the answer to flows with AsUID at one end: set by
	// the agent from the asker's credentials (a user other than root), or
	// by the asking node's agent over the ident service.
	AsUID *uint32 `json:"as_uid,omitempty"`
}

func (f *FlowFilter) matchEnds(luid uint32, cuid *uint32) bool {
	either := func(u uint32) bool { return luid == u || (cuid != nil && *cuid == u) }
	if f.AsUID != nil && !either(*f.AsUID) {
		return false
	}
	if f.User != nil && !either(*f.User) {
		return false
	}
	if f.ListenerUser != nil && luid != *f.ListenerUser {
		return false
	}
	if f.ConnectorUser != nil && (cuid == nil || *cuid != *f.ConnectorUser) {
		return false
	}
	return true
}

func (f *FlowFilter) matchRest(verdict, rule, proto string, port uint16) bool {
	return (f.Port == 0 || port == f.Port) && (f.Proto == "" || proto == f.Proto) &&
		(f.Rule == "" || rule == f.Rule) && (len(f.Verdicts) == 0 || slices.Contains(f.Verdicts, verdict))
}

func (f *FlowFilter) match(x *Flow) bool {
	var cuid *uint32
	if x.Connector != nil {
		cuid = &x.Connector.UID
	}
	return f.matchEnds(x.Listener.UID, cuid) && f.matchRest(x.Verdict, x.Rule, x.Proto, dstPort(x.Dst)) &&
		(f.Since.IsZero() || !x.Time.Before(f.Since))
}

func dstPort(dst string) uint16 {
	if ap, err := netip.ParseAddrPort(dst); err == nil {
		return ap.Port()
	}
	return 0
}

// FlowQuery asks a node for its flows after a cursor.
type FlowQuery struct {
	Filter FlowFilter `json:"filter"`
	// After is the cursor: only flows with a greater Seq (0: all held).
	After uint64 `json:"after,omitempty"`
	// Limit is the most flows returned, the newest (0: defaultFlowLimit).
	Limit int `json:"limit,omitempty"`
}

// FlowAnswer is a node's answer to a FlowQuery.
type FlowAnswer struct {
	Node  string `json:"node"`
	Flows []Flow `json:"flows"`
	// Next is the cursor for the next query (the newest Seq held).
	Next uint64 `json:"next"`
	// Omitted flows matched but were left out (limit, answer size).
	Omitted int `json:"omitted,omitempty"`
	// Oldest is the time of the oldest flow held (what the ring covers).
	Oldest time.Time `json:"oldest,omitzero"`
	// Dropped verdicts were not recorded (recorder queue full, ring
	// buffer full), since the agent started.
	Dropped uint64 `json:"dropped,omitempty"`
	Audit   bool   `json:"audit,omitempty"` // the node is in audit mode
}

// AuditQuery asks a node for its refusals grouped.
type AuditQuery struct {
	Filter FlowFilter `json:"filter"`
	Limit  int        `json:"limit,omitempty"` // most groups, by count (0: defaultAuditLimit)
}

// AuditGroup is the refusals of one (listener user, port, connector, rule,
// verdict) over the window asked.
type AuditGroup struct {
	Verdict   string   `json:"verdict"`
	Rule      string   `json:"rule"`
	Proto     string   `json:"proto"`
	Port      uint16   `json:"port"`
	Listener  FlowEnd  `json:"listener"`
	Connector *FlowEnd `json:"connector,omitempty"`
	// Src is the source address of connectors without a trusted identity.
	Src            string    `json:"src,omitempty"`
	Count          uint64    `json:"count"`
	First          time.Time `json:"first"`
	Last           time.Time `json:"last"`
	ListenerProcs  []string  `json:"listener_procs,omitempty"`
	ConnectorProcs []string  `json:"connector_procs,omitempty"`
	Nodes          []string  `json:"nodes,omitempty"`
}

// AuditAnswer is a node's answer to an AuditQuery.
type AuditAnswer struct {
	Node    string       `json:"node"`
	Groups  []AuditGroup `json:"groups"`
	Omitted int          `json:"omitted,omitempty"`
	// Covered is the start of the oldest minute still held: counts before
	// it are gone (agent restart, or the group bound).
	Covered time.Time `json:"covered,omitzero"`
	Dropped uint64    `json:"dropped,omitempty"`
	Audit   bool      `json:"audit,omitempty"`
}

const (
	defaultFlowLimit  = 100
	defaultAuditLimit = 500
	// maxAuditGroups bounds the per-minute groups held (~300 B each).
	maxAuditGroups = 20000
	// maxProcs bounds the process names kept per group and end.
	maxProcs = 4
	// lookupTTL is how long a socket's process is remembered.
	lookupTTL = 10 * time.Second
)

// flowRecorder records the node's verdicts. offer is called by the sink's
// goroutine; run is the recorder's own goroutine; Flows, Audit and Stats by
// anyone (mu guards the ring and the groups).
type flowRecorder struct {
	log  *slog.Logger
	node string
	in   chan *pending
	res  *ident.Resolver // nil: no process names from sock_diag
	// local tells this node's addresses (the connector of a local flow).
	local func(netip.Addr) bool
	// nodes names cluster nodes by address; audit says the node's mode
	// (both set by the main loop at start and reload).
	nodes atomic.Pointer[map[netip.Addr]string]
	audit atomic.Bool
	// remote asks other nodes' ident services for connectors' processes,
	// at most remoteLimit a second, never a node that timed out lately.
	remote      func(ctx context.Context, node netip.Addr, target, peer netip.AddrPort, proto policy.Proto) (ident.Owner, error)
	remoteQ     chan remoteLookup
	remoteLimit *rate.Limiter
	localLimit  *rate.Limiter
	deadNodes   map[netip.Addr]time.Time // remote worker only
	// lost reads the programs' count of reports the ring buffer had no
	// room for (nil: not watched); run logs its increases.
	lost     func() (uint64, error)
	lastLost uint64
	cache    map[lookupKey]lookupEntry

	mu      sync.Mutex
	ring    []Flow
	next    int // ring index of the next write
	seq     uint64
	buckets map[int64]map[groupKey]*AuditGroup // minute → groups
	minutes []int64                            // ascending
	ngroups int
	// maxGroups bounds ngroups (maxAuditGroups; tests use less).
	maxGroups int

	Recorded, Dropped, Enriched, Unresolved atomic.Uint64
	dropLog                                 logEvery
}

type pending struct {
	e   Event
	pid uint32
}

type lookupKey struct {
	proto      policy.Proto
	addr, peer netip.AddrPort
}

type lookupEntry struct {
	o   ident.Owner
	ok  bool
	exp time.Time
}

type remoteLookup struct {
	seq       uint64
	key       groupKey
	minute    int64
	proto     policy.Proto
	src, dst  netip.AddrPort
	connector bool
}

type groupKey struct {
	verdict, rule, proto string
	port                 uint16
	luid                 uint32
	cuid                 int64 // -1: no trusted identity
	src                  string
}

func newFlowRecorder(history int, log *slog.Logger, node string, res *ident.Resolver, local func(netip.Addr) bool) *flowRecorder {
	if history <= 0 {
		history = 1
	}
	r := &flowRecorder{
		log: log, node: node, res: res, local: local,
		in:          make(chan *pending, 4096),
		remoteQ:     make(chan remoteLookup, 64),
		remoteLimit: rate.NewLimiter(20, 20),
		localLimit:  rate.NewLimiter(100, 100),
		deadNodes:   map[netip.Addr]time.Time{},
		cache:       map[lookupKey]lookupEntry{},
		ring:        make([]Flow, 0, history),
		buckets:     map[int64]map[groupKey]*AuditGroup{},
		maxGroups:   maxAuditGroups,
	}
	r.nodes.Store(&map[netip.Addr]string{})
	return r
}

// resize keeps the newest n flows from now on (a reload's flow_history).
func (r *flowRecorder) resize(n int) {
	if n <= 0 {
		n = 1
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if n == cap(r.ring) {
		return
	}
	old := len(r.ring)
	ring := make([]Flow, 0, n)
	for i := max(0, old-n); i < old; i++ { // oldest kept first
		ring = append(ring, r.ring[(r.next-old+i+cap(r.ring))%cap(r.ring)])
	}
	r.ring, r.next = ring, len(ring)%n
}

// setNodes names the cluster's nodes by address (main loop).
func (r *flowRecorder) setNodes(m map[netip.Addr]string) { r.nodes.Store(&m) }

// offer hands a decoded verdict over without blocking (sink goroutine).
func (r *flowRecorder) offer(e *Event, pid uint32) {
	select {
	case r.in <- &pending{e: *e, pid: pid}:
	default:
		n := r.Dropped.Add(1)
		if r.dropLog.due(time.Now()) {
			r.log.Warn("flow recorder behind: verdicts not recorded", "dropped_total", n)
		}
	}
}

// run records until ctx ends (and the remote worker beside it).
func (r *flowRecorder) run(ctx context.Context) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.runRemote(ctx)
	}()
	defer func() { <-done }()
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case p := <-r.in:
			r.record(p)
		case <-tick.C:
			r.watchLost()
		}
	}
}

// watchLost logs the reports lost in the kernel since the last look.
func (r *flowRecorder) watchLost() {
	if r.lost == nil {
		return
	}
	n, err := r.lost()
	if err != nil || n <= r.lastLost {
		return
	}
	r.log.Warn("ring buffer full: refusal reports lost (event log, flows, audit report miss them; counters have them)",
		"lost", n-r.lastLost, "lost_total", n)
	r.lastLost = n
}

func (r *flowRecorder) nodeName(a netip.Addr) string {
	a = a.Unmap()
	if n, ok := (*r.nodes.Load())[a]; ok {
		return n
	}
	if r.local != nil && r.local(a) {
		return r.node
	}
	return ""
}

func (r *flowRecorder) record(p *pending) {
	e := &p.e
	f := Flow{Time: e.Time, Verdict: e.Verdict, Sampled: e.sampled(), Rule: e.Rule, Proto: e.Proto, Path: e.Path,
		Stage: e.Stage, Stamp: e.Stamp, Src: e.Src, Dst: e.Dst, Grant: e.Grant,
		Listener: FlowEnd{UID: e.Listener.UID, User: e.Listener.User, GID: e.Listener.GID, Group: e.Listener.Group, Node: r.node}}
	if c := e.Connector; c != nil {
		f.Connector = &FlowEnd{UID: c.UID, User: c.User, GID: c.GID, Group: c.Group}
	}
	src, _ := netip.ParseAddrPort(e.Src)
	dst, _ := netip.ParseAddrPort(e.Dst)
	if src.IsValid() {
		f.SrcNode = r.nodeName(src.Addr())
		if f.Connector != nil {
			f.Connector.Node = f.SrcNode
			if f.Connector.Node == "" {
				f.Connector.Node = src.Addr().Unmap().String()
			}
		}
	}
	var remote *remoteLookup
	switch {
	case e.Stage == "bind" || e.Stage == "unix":
		// The kernel named the calling process: the binder or connector.
		if f.Connector != nil && p.pid != 0 {
			f.Connector.PID, f.Connector.Comm = int(p.pid), e.Comm
			f.Connector.Node = r.node
		}
	default:
		proto, ok := protoOf(e.Proto)
		if !ok || !dst.IsValid() {
			break
		}
		if o, ok := r.lookup(lookupKey{proto: proto, addr: dst}, true); ok {
			f.Listener.PID, f.Listener.Comm = o.PID, o.Command
		}
		if f.Connector == nil || !src.IsValid() {
			break
		}
		if r.local != nil && r.local(src.Addr()) {
			if o, ok := r.lookup(lookupKey{proto: proto, addr: src, peer: dst}, false); ok {
				f.Connector.PID, f.Connector.Comm = o.PID, o.Command
			}
		} else if f.SrcNode != "" && r.remote != nil {
			remote = &remoteLookup{proto: proto, src: src, dst: dst, connector: true}
		}
	}
	r.mu.Lock()
	r.seq++
	f.Seq = r.seq
	if len(r.ring) < cap(r.ring) {
		r.ring = append(r.ring, f)
	} else {
		r.ring[r.next] = f
	}
	r.next = (r.next + 1) % cap(r.ring)
	var k groupKey
	var minute int64
	if f.Verdict != "allow" {
		k, minute = r.group(&f)
	}
	r.mu.Unlock()
	r.Recorded.Add(1)
	if remote != nil {
		remote.seq, remote.key, remote.minute = f.Seq, k, minute
		select {
		case r.remoteQ <- *remote:
		default:
			r.Unresolved.Add(1)
		}
	}
}

func protoOf(s string) (policy.Proto, bool) {
	switch s {
	case "tcp":
		return policy.TCP, true
	case "udp":
		return policy.UDP, true
	}
	return 0, false
}

// lookup finds the process holding a local socket: cached, and at most
// localLimit fresh lookups a second (a /proc scan on a miss).
func (r *flowRecorder) lookup(k lookupKey, cacheIt bool) (ident.Owner, bool) {
	if r.res == nil {
		return ident.Owner{}, false
	}
	now := time.Now()
	if c, ok := r.cache[k]; ok && now.Before(c.exp) {
		return c.o, c.ok
	}
	if !r.localLimit.AllowN(now, 1) {
		r.Unresolved.Add(1)
		return ident.Owner{}, false
	}
	var o ident.Owner
	var err error
	if k.peer.IsValid() {
		o, err = r.res.LookupConn(k.addr, k.peer, k.proto)
	} else {
		o, err = r.res.LookupConn(k.addr, netip.AddrPort{}, k.proto)
	}
	ok := err == nil && o.PID != 0
	if !ok {
		r.Unresolved.Add(1)
	} else {
		r.Enriched.Add(1)
	}
	if cacheIt {
		if len(r.cache) >= 4096 {
			clear(r.cache)
		}
		r.cache[k] = lookupEntry{o: o, ok: ok, exp: now.Add(lookupTTL)}
	}
	return o, ok
}

// runRemote asks the connectors' nodes for their processes (they answer
// while the connecting socket exists) and completes the records.
func (r *flowRecorder) runRemote(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case q := <-r.remoteQ:
			node := q.src.Addr().Unmap()
			now := time.Now()
			if t, ok := r.deadNodes[node]; ok && now.Sub(t) < 30*time.Second {
				r.Unresolved.Add(1)
				continue
			}
			if err := r.remoteLimit.Wait(ctx); err != nil {
				return
			}
			o, err := r.remote(ctx, node, q.src, q.dst, q.proto)
			if errors.Is(err, ident.ErrTimeout) {
				r.deadNodes[node] = now
			}
			if err != nil || o.PID == 0 {
				r.Unresolved.Add(1)
				continue
			}
			r.Enriched.Add(1)
			r.patchConnector(q, o)
		}
	}
}

func (r *flowRecorder) patchConnector(q remoteLookup, o ident.Owner) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.ring {
		if f := &r.ring[i]; f.Seq == q.seq && f.Connector != nil {
			f.Connector.PID, f.Connector.Comm = o.PID, o.Command
			break
		}
	}
	if g := r.buckets[q.minute][q.key]; g != nil {
		g.ConnectorProcs = addProc(g.ConnectorProcs, o.Command)
	}
}

func addProc(list []string, comm string) []string {
	if comm == "" || slices.Contains(list, comm) || len(list) >= maxProcs {
		return list
	}
	return append(list, comm)
}

// group counts a refusal in its minute's group (mu held).
func (r *flowRecorder) group(f *Flow) (groupKey, int64) {
	port := dstPort(f.Dst)
	k := groupKey{verdict: f.Verdict, rule: f.Rule, proto: f.Proto, port: port, luid: f.Listener.UID, cuid: -1}
	if f.Connector != nil {
		k.cuid = int64(f.Connector.UID)
	} else if ap, err := netip.ParseAddrPort(f.Src); err == nil {
		k.src = ap.Addr().Unmap().String()
	}
	minute := f.Time.Unix() / 60
	b := r.buckets[minute]
	if b == nil {
		b = map[groupKey]*AuditGroup{}
		r.buckets[minute] = b
		r.minutes = append(r.minutes, minute)
		if n := len(r.minutes); n > 1 && r.minutes[n-2] > minute { // clock stepped back
			slices.Sort(r.minutes)
		}
	}
	g := b[k]
	if g == nil {
		g = &AuditGroup{Verdict: f.Verdict, Rule: f.Rule, Proto: f.Proto, Port: port, Src: k.src, First: f.Time,
			Listener: FlowEnd{UID: f.Listener.UID, User: f.Listener.User, GID: f.Listener.GID, Group: f.Listener.Group}}
		if c := f.Connector; c != nil {
			g.Connector = &FlowEnd{UID: c.UID, User: c.User, GID: c.GID, Group: c.Group}
		}
		b[k] = g
		r.ngroups++
		for r.ngroups > r.maxGroups && len(r.minutes) > 1 {
			old := r.minutes[0]
			r.minutes = r.minutes[1:]
			r.ngroups -= len(r.buckets[old])
			delete(r.buckets, old)
		}
	}
	g.Count++
	g.Last = f.Time
	g.ListenerProcs = addProc(g.ListenerProcs, f.Listener.Comm)
	if f.Connector != nil {
		g.ConnectorProcs = addProc(g.ConnectorProcs, f.Connector.Comm)
	}
	return k, minute
}

// Flows answers a FlowQuery; the answer's JSON fits in maxBytes if > 0
// (the oldest flows are left out first).
func (r *flowRecorder) Flows(q FlowQuery, maxBytes int) FlowAnswer {
	limit := q.Limit
	if limit <= 0 {
		limit = defaultFlowLimit
	}
	a := FlowAnswer{Node: r.node, Dropped: r.Dropped.Load(), Audit: r.audit.Load()}
	r.mu.Lock()
	a.Next = r.seq
	n := len(r.ring)
	var match []Flow
	for i := 0; i < n; i++ { // oldest first
		f := &r.ring[(r.next-n+i+cap(r.ring))%cap(r.ring)]
		if i == 0 {
			a.Oldest = f.Time
		}
		if f.Seq > q.After && q.Filter.match(f) {
			c := cloneFlow(f)
			redactFlow(&c, q.Filter.AsUID)
			match = append(match, c)
		}
	}
	r.mu.Unlock()
	if len(match) > limit {
		a.Omitted = len(match) - limit
		match = match[len(match)-limit:]
	}
	a.Flows = match
	for maxBytes > 0 && len(a.Flows) > 0 {
		b, _ := json.Marshal(a)
		if len(b) <= maxBytes {
			break
		}
		drop := max(1, len(a.Flows)*(len(b)-maxBytes)/len(b)+1)
		drop = min(drop, len(a.Flows))
		a.Flows = a.Flows[drop:]
		a.Omitted += drop
	}
	if a.Flows == nil {
		a.Flows = []Flow{}
	}
	return a
}

// redactFlow leaves a user (as, not nil) the processes of their own ends
// only: another user's process is theirs to know (hidepid sites), the
// other end's user, group and node are what the user needs.
func redactFlow(f *Flow, as *uint32) {
	if as == nil {
		return
	}
	if f.Listener.UID != *as {
		f.Listener.PID, f.Listener.Comm = 0, ""
	}
	if c := f.Connector; c != nil && c.UID != *as {
		c.PID, c.Comm = 0, ""
	}
}

func cloneFlow(f *Flow) Flow {
	c := *f
	if f.Connector != nil {
		x := *f.Connector
		c.Connector = &x
	}
	return c
}

// Audit answers an AuditQuery: the groups of refusals since the filter's
// Since (at minute granularity), largest first; the JSON fits in maxBytes
// if > 0.
func (r *flowRecorder) Audit(q AuditQuery, maxBytes int) AuditAnswer {
	limit := q.Limit
	if limit <= 0 {
		limit = defaultAuditLimit
	}
	a := AuditAnswer{Node: r.node, Dropped: r.Dropped.Load(), Audit: r.audit.Load()}
	f := &q.Filter
	from := int64(0)
	if !f.Since.IsZero() {
		from = f.Since.Unix() / 60
	}
	merged := map[groupKey]*AuditGroup{}
	r.mu.Lock()
	if len(r.minutes) > 0 {
		a.Covered = time.Unix(r.minutes[0]*60, 0).UTC()
	}
	for _, m := range r.minutes {
		if m < from {
			continue
		}
		for k, g := range r.buckets[m] {
			var cuid *uint32
			if g.Connector != nil {
				cuid = &g.Connector.UID
			}
			if !f.matchEnds(g.Listener.UID, cuid) || !f.matchRest(g.Verdict, g.Rule, g.Proto, g.Port) {
				continue
			}
			mg := merged[k]
			if mg == nil {
				c := *g
				if g.Connector != nil {
					x := *g.Connector
					c.Connector = &x
				}
				c.ListenerProcs = slices.Clone(g.ListenerProcs)
				c.ConnectorProcs = slices.Clone(g.ConnectorProcs)
				c.Nodes = []string{r.node}
				merged[k] = &c
				continue
			}
			mg.Count += g.Count
			mg.Last = g.Last // minutes ascend
			for _, p := range g.ListenerProcs {
				mg.ListenerProcs = addProc(mg.ListenerProcs, p)
			}
			for _, p := range g.ConnectorProcs {
				mg.ConnectorProcs = addProc(mg.ConnectorProcs, p)
			}
		}
	}
	r.mu.Unlock()
	for _, g := range merged {
		if as := f.AsUID; as != nil { // as redactFlow
			if g.Listener.UID != *as {
				g.ListenerProcs = nil
			}
			if g.Connector == nil || g.Connector.UID != *as {
				g.ConnectorProcs = nil
			}
		}
		a.Groups = append(a.Groups, *g)
	}
	SortAuditGroups(a.Groups)
	if len(a.Groups) > limit {
		a.Omitted = len(a.Groups) - limit
		a.Groups = a.Groups[:limit]
	}
	for maxBytes > 0 && len(a.Groups) > 0 {
		b, _ := json.Marshal(a)
		if len(b) <= maxBytes {
			break
		}
		drop := min(len(a.Groups), max(1, len(a.Groups)*(len(b)-maxBytes)/len(b)+1))
		a.Groups = a.Groups[:len(a.Groups)-drop]
		a.Omitted += drop
	}
	if a.Groups == nil {
		a.Groups = []AuditGroup{}
	}
	return a
}

// SortAuditGroups orders groups by count (largest first), then by listener,
// port and connector.
func SortAuditGroups(gs []AuditGroup) {
	sort.SliceStable(gs, func(i, j int) bool {
		a, b := &gs[i], &gs[j]
		if a.Count != b.Count {
			return a.Count > b.Count
		}
		if a.Listener.UID != b.Listener.UID {
			return a.Listener.UID < b.Listener.UID
		}
		if a.Port != b.Port {
			return a.Port < b.Port
		}
		return groupConnector(a) < groupConnector(b)
	})
}

func groupConnector(g *AuditGroup) string {
	if g.Connector != nil {
		return g.Connector.User
	}
	return g.Src
}

// MergeAuditGroups merges the groups of several nodes: the same listener
// user, port, protocol, connector (or source), rule and verdict add up.
func MergeAuditGroups(answers []AuditAnswer) []AuditGroup {
	type key struct {
		verdict, rule, proto, src string
		port                      uint16
		luid                      uint32
		cuid                      int64
	}
	m := map[key]*AuditGroup{}
	var order []key
	for _, a := range answers {
		for _, g := range a.Groups {
			k := key{g.Verdict, g.Rule, g.Proto, g.Src, g.Port, g.Listener.UID, -1}
			if g.Connector != nil {
				k.cuid = int64(g.Connector.UID)
			}
			mg := m[k]
			if mg == nil {
				c := g
				c.Nodes = nil
				m[k] = &c
				order = append(order, k)
				mg = &c
			} else {
				mg.Count += g.Count
				if g.First.Before(mg.First) {
					mg.First = g.First
				}
				if g.Last.After(mg.Last) {
					mg.Last = g.Last
				}
				for _, p := range g.ListenerProcs {
					mg.ListenerProcs = addProc(mg.ListenerProcs, p)
				}
				for _, p := range g.ConnectorProcs {
					mg.ConnectorProcs = addProc(mg.ConnectorProcs, p)
				}
			}
			for _, n := range g.Nodes {
				if !slices.Contains(mg.Nodes, n) {
					mg.Nodes = append(mg.Nodes, n)
				}
			}
		}
	}
	out := make([]AuditGroup, 0, len(order))
	for _, k := range order {
		g := m[k]
		slices.Sort(g.Nodes)
		out = append(out, *g)
	}
	SortAuditGroups(out)
	return out
}

// topRefusals are the n largest groups of the last hour (metrics).
func (r *flowRecorder) topRefusals(n int) []AuditGroup {
	a := r.Audit(AuditQuery{Filter: FlowFilter{Since: time.Now().Add(-time.Hour)}, Limit: n}, 0)
	return a.Groups
}

// answerData serves the ident service's data queries from other nodes.
func (r *flowRecorder) answerData(kind string, args json.RawMessage) (json.RawMessage, error) {
	switch kind {
	case ident.KindFlows:
		var q FlowQuery
		if err := json.Unmarshal(args, &q); err != nil {
			return nil, err
		}
		return json.Marshal(r.Flows(q, ident.MaxData))
	case ident.KindAudit:
		var q AuditQuery
		if err := json.Unmarshal(args, &q); err != nil {
			return nil, err
		}
		return json.Marshal(r.Audit(q, ident.MaxData))
	}
	return nil, errors.New("unknown data query " + strings.TrimSpace(kind))
}
