package userwall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/membership"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/portal"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
	"github.com/palisade-hpc/palisade/internal/sys/cgroup2"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/palisade-hpc/palisade/internal/version"
	"github.com/vishvananda/netlink"
)

// agent is one running agent. Its goroutines: the main loop (RunAgent's
// loop, reload), which alone writes the fields below unless a field says
// otherwise; and the services (startServices), which read only what is safe
// for them — dp (its own lock), sink (its own lock), members (its own lock),
// exempt (atomics and a channel to the loop),
// nftRepairs (atomic), state (stateMu) and what is set before they start
// and never written after (log, opts, pinDir). cfg, attached, keyErr,
// notes, metrics, ident and stopIdent belong to the main loop.
type agent struct {
	opts     control.Options
	cfg      *config.Config
	log      *slog.Logger
	dp       *kernel.Dataplane
	attached map[string]int // interface → ifindex
	cgroup   string
	sink     *eventSink
	flows    *flowRecorder
	ident    *ident.Server
	portal   *portal.Server // [portal] delegation (nil: off); its settings are atomic
	// flowCfg is what the flows socket's goroutines read of the running
	// configuration (set by the main loop); localAddrs are this node's
	// addresses as last synced (syncAddrs).
	flowCfg    atomic.Pointer[flowConfig]
	localAddrs atomic.Pointer[map[netip.Addr]bool]
	// keyErr says why the cluster key is not in use (nil: it is);
	// noKeyWarned keeps the log from repeating it.
	keyErr      error
	noKeyWarned string
	// nftRepairs counts restorations of the nft table (metrics).
	nftRepairs atomic.Int64
	// stateWriteErrors counts state files not written (metrics).
	stateWriteErrors atomic.Uint64

	// Set by newAgent, read-only after: the kernel's features and what
	// enforces on it (how the tc programs attach, whether the LSM ones do).
	probe *kernel.Probe
	enf   kernel.Enforcement

	// Owned by the main loop (RunAgent, reload): ctx of the services,
	// the metrics server, the ident service's stop, and problems of the
	// running agent for the state (notes).
	ctx       context.Context
	metrics   *metricsServer
	stopIdent func()
	members   *membership.Tracker // fills the kernel's members map (internal/membership)
	exempt    groupExempts        // "@group" exemptions' members
	// sitePolicy is the applied policy, for naming site rules in events
	// (the event sink's goroutine reads it).
	sitePolicy atomic.Pointer[policy.Policy]
	// grants are the users' grants (palisade share) held on this node.
	grants *grantStore
	notes  []string
	pinDir string
	// nodeAddrs are the node's addresses (syncAddrs), checked against
	// the cluster subnets; lastResolve is the last attempt to resolve the
	// configuration's unresolved names.
	nodeAddrs   []netip.Addr
	lastResolve time.Time
	usr1        chan os.Signal // SIGUSR1: reopen the event log
	hup         chan os.Signal // SIGHUP: reload

	// stateMu guards state, which the metrics goroutine reads.
	stateMu sync.Mutex
	state   control.AgentState
}

// RunAgent installs (or adopts) the data plane of the caller's network
// namespace and keeps it in step with the configuration and the node until
// ctx ends or SIGTERM/SIGINT. Leaving does not remove anything: the pinned
// programs go on enforcing (restart adopts them; --uninstall removes them).
func RunAgent(ctx context.Context, o control.Options) error {
	// SIGUSR1 reopens the event log only (logrotate's postrotate): no
	// reload of the policy every day. SIGHUP reloads. Both are caught from
	// the start: their default action would end an agent still loading, or
	// one whose pid file `agent --reload` has just read (ci5: a reload sent
	// right after a restart killed the agent). A SIGHUP that arrives before
	// the loop runs waits in the channel and is a reload then.
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	a, err := newAgent(o)
	if err != nil {
		return err
	}
	a.usr1, a.hup = usr1, hup
	unlock, err := a.lockNamespace()
	if err != nil {
		return err
	}
	defer unlock()
	if err := a.enforce(); err != nil {
		return err
	}
	defer a.dp.Close() // after every service has stopped reading it
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var svc services
	defer svc.stop()
	if err := a.startServices(ctx, &svc); err != nil {
		return err
	}
	// The state first: whoever sees this agent's pid in the pid file
	// (StartAgent, agent --reload) finds its state file already there.
	a.initState()
	pidFile := a.cfg.Agent.PidFile
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return err
	}
	// 0644 whatever the umask (the unit's is 0077): users' `palisade
	// status` reads it too.
	if err := os.Chmod(pidFile, 0o644); err != nil {
		return err
	}
	defer func() {
		if control.ReadPid(pidFile) == os.Getpid() {
			os.Remove(pidFile)
		}
	}()
	// Readiness for systemd (Type=notify): enforcement, metrics and ident
	// are in place, so units ordered after this one (slurmd, sshd) start
	// only on a node that already isolates users. A no-op without systemd.
	daemon.SdNotify(false, daemon.SdNotifyReady+"\nSTATUS=enforcing")
	defer daemon.SdNotify(false, daemon.SdNotifyStopping)
	return a.loop(ctx)
}

// newAgent loads the configuration and checks, before anything changes,
// that the kernel has what the data plane needs (if not: one clear message
// and nothing touched).
func newAgent(o control.Options) (*agent, error) {
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	v := version.Get()
	log.Info("palisade agent starting", "version", v.Version, "commit", v.Commit, "built", v.BuildDate,
		"go", v.GoVersion, "cilium_ebpf", v.EBPF)
	cfg, err := o.LoadConfig()
	if err != nil {
		return nil, err
	}
	// A policy whose tests fail is refused by reloads (the running one
	// stays), but at start there is none to keep: refusing would leave a
	// rebooted node unprotected. It is enforced and reported loudly.
	var testErr error
	if _, testErr = cfg.RunTests(nil); testErr != nil {
		log.Error("policy tests fail; enforcing this configuration anyway (no running policy to keep): fix it and reload", "err", testErr)
	}
	if cfg.Default {
		log.Warn("no configuration file; using the built-in default policy", "path", o.ConfigPath)
	}
	cfg.ResolveNodes(nil) // hostlist node names (flows); findings if not
	probe, err := kernel.ProbeKernel()
	if err != nil {
		return nil, fmt.Errorf("kernel feature probe: %w", err)
	}
	if err := probe.Err(); err != nil {
		return nil, err
	}
	a := &agent{opts: o, cfg: cfg, log: log, attached: map[string]int{}, probe: probe}
	if testErr != nil {
		a.notes = append(a.notes, "policy tests fail (enforced anyway at start; a reload is refused until they pass): "+testErr.Error())
	}
	if a.enf, err = kernel.Plan(probe, cfg.Agent.TCAttach, cfg.Agent.UnixSockets); err != nil {
		return nil, err
	}
	return a, nil
}

// lockNamespace makes this the namespace's only agent: an exclusive lock
// next to the pid file, held until unlock (a stale pid file alone does not
// block a restart).
func (a *agent) lockNamespace() (unlock func(), err error) {
	pidFile := a.cfg.Agent.PidFile
	if err := os.MkdirAll(filepath.Dir(pidFile), 0o755); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(pidFile+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	// An agent that is stopping has removed its pid file but still holds
	// the lock while it joins its services: a restart waits for it (up to
	// 10 s) instead of failing.
	for deadline := time.Now().Add(10 * time.Second); err != nil && control.ReadPid(pidFile) == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("an agent is already running (pid %d, %s)", control.ReadPid(pidFile), pidFile)
	}
	return func() { lock.Close() }, nil
}

// enforce loads (or adopts) the programs and maps and installs them. A first
// install that fails half-way leaves nothing behind; an adopted data plane
// keeps enforcing what it did.
func (a *agent) enforce() error {
	cookie, err := kernel.NetnsCookie()
	if err != nil {
		return err
	}
	fs, err := kernel.BPFFS(a.cfg.Agent.BPFFS)
	if err != nil {
		return err
	}
	cg, err := cgroup2.MountPoint()
	if err != nil {
		return err
	}
	pinDir := kernel.PinDir(fs, cookie)
	a.pinDir = pinDir
	if gone := kernel.CollectStale(fs); len(gone) > 0 {
		a.log.Info("removed the pins of deleted network namespaces", "cookies", gone)
	}
	_, statErr := os.Stat(filepath.Join(pinDir, "settings"))
	adopting := statErr == nil
	if a.dp, err = kernel.Load(pinDir, cookie, a.enf); err != nil {
		if !adopting {
			// The loader pins each map as it creates it and does not
			// unpin them when a later program fails to load.
			kernel.RemovePins(pinDir)
		}
		return err
	}
	if changed := a.dp.Migrating(); changed != nil {
		a.log.Info("pinned maps have another layout: migrating (new maps staged, links switched in place)", "maps", changed)
	}
	a.exempt.changed = make(chan struct{}, 1)
	a.exempt.setGroups(a.cfg.Policy)
	a.members = a.newMembers()
	a.log.Info("tc programs attach with "+kernel.AttachName(a.enf.TC), "why", a.enf.TCWhy, "kernel", a.probe.Kernel)
	err = a.install(cg)
	if err == nil && a.dp.Migrating() != nil {
		err = a.dp.Fault("commit")
	}
	if err == nil && a.dp.Migrating() != nil {
		err = a.dp.Commit()
		if err == nil {
			a.log.Info("migration committed: the new maps replaced the old pins")
		}
	}
	if err != nil {
		if a.dp.Migrating() != nil {
			if rerr := a.dp.Rollback(); rerr != nil {
				a.log.Error("rolling back the migration", "err", rerr)
			} else {
				a.log.Warn("migration rolled back: the previous programs and maps keep enforcing", "err", err)
			}
		}
		a.dp.Close()
		if !adopting {
			// tc filters are not pinned: remove them by name.
			kernel.RemovePins(pinDir)
			kernel.RemoveTCFilters()
			kernel.RemoveNft()
		}
		return err
	}
	if gone := a.dp.PruneMaps(); len(gone) > 0 {
		a.log.Info("removed the pins of maps this version no longer has", "maps", gone)
	}
	a.log.Info("userwall enforcing", "netns_cookie", cookie, "pins", pinDir, "adopted", adopting,
		"links", len(a.dp.Links()), "interfaces", a.dp.Interfaces(), "cgroup", cg)
	if err := a.dp.LSMErr(); err != nil {
		a.log.Warn("abstract Unix sockets are NOT isolated", "reason", err)
	}
	return nil
}

// services are the agent's goroutines beside its main loop. stop ends them
// in the reverse order of their start and waits for each.
type services struct{ stops []func() }

func (s *services) add(stop func()) { s.stops = append(s.stops, stop) }

func (s *services) stop() {
	for i := len(s.stops) - 1; i >= 0; i-- {
		s.stops[i]()
	}
	s.stops = nil
}

// startServices starts the event sink, the nft watcher, the metrics server,
// the ident service and the membership tracker; what started is in svc
// (also on error).
func (a *agent) startServices(ctx context.Context, svc *services) error {
	rd, err := ringbuf.NewReader(a.dp.Map("events"))
	if err != nil {
		return err
	}
	if a.sink, err = newEventSink(a.cfg.Agent.EventLog, a.cfg.Agent.Syslog, a.cfg.Agent.EventRate, a.log); err != nil {
		rd.Close()
		return err
	}
	a.sink.seen = a.members.Seen
	a.sink.site = a.siteVerdict
	a.flows = a.newFlows()
	a.sink.flows = a.flows
	a.newGrants()
	a.sink.grant = a.grantFor
	svc.add(a.runGrants())
	flowCtx, stopFlows := context.WithCancel(ctx)
	svc.add(goJoined(func() { a.flows.run(flowCtx) }, stopFlows, a.flows.close))
	svc.add(goJoined(func() { a.sink.run(rd) }, func() { rd.Close() }, a.sink.close))
	if stop, err := a.serveFlows(ctx); err != nil {
		a.log.Warn("flows socket not served (palisade flows, audit report)", "err", err)
		a.notes = append(a.notes, "flows socket not served: "+err.Error())
	} else {
		svc.add(stop)
	}

	if stop, err := a.servePortal(ctx); err != nil {
		a.log.Warn("portal delegation not served", "err", err)
		a.notes = append(a.notes, "portal delegation not served: "+err.Error())
	} else {
		svc.add(stop)
	}

	nftCtx, cancel := context.WithCancel(ctx)
	svc.add(goJoined(func() { kernel.WatchNft(nftCtx, a.repairNft) }, cancel, nil))

	a.ctx = ctx
	a.startMetrics()
	svc.add(a.stopMetrics)
	a.stopIdent = a.startIdent(ctx)
	svc.add(func() { a.stopIdent() }) // reload may replace it
	svc.add(a.runMembers(ctx))
	return nil
}

// goJoined runs fn in a goroutine; the returned stop calls end (which makes
// fn return), waits for fn, then calls after (either may be nil).
func goJoined(fn, end, after func()) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	return func() {
		if end != nil {
			end()
		}
		<-done
		if after != nil {
			after()
		}
	}
}

// loop keeps the data plane in step with the node until ctx ends: SIGHUP
// reloads, address and link changes (netlink) and a 5 s poll resync.
func (a *agent) loop(ctx context.Context) error {
	addrs := newSubscription("address", subscriptionGap, func(ch chan netlink.AddrUpdate, done chan struct{}) error {
		return netlink.AddrSubscribe(ch, done)
	})
	defer addrs.stop()
	// New interfaces get the tc programs at once, not at the next poll.
	links := newSubscription("link", subscriptionGap, func(ch chan netlink.LinkUpdate, done chan struct{}) error {
		return netlink.LinkSubscribe(ch, done)
	})
	defer links.stop()
	for _, s := range []renewable{addrs, links} {
		if err := s.start(time.Now()); err != nil {
			a.log.Warn(s.label()+" updates unavailable; polling only", "err", err)
		}
	}
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			a.log.Info("agent stopping; pinned programs stay in force")
			return nil
		case <-a.hup:
			daemon.SdNotify(false, daemon.SdNotifyReloading)
			a.reload()
			daemon.SdNotify(false, daemon.SdNotifyReady)
		case <-a.usr1:
			a.reopenEvents(a.cfg)
			a.log.Info("event log reopened", "path", a.cfg.Agent.EventLog)
			a.setState(func(s *control.AgentState) { s.LogReopens++; s.Notes = a.notes })
		case _, ok := <-addrs.C():
			a.nodeChanged(addrs, ok && drain(addrs.C()))
		case _, ok := <-links.C():
			a.nodeChanged(links, ok && drain(links.C()))
		case <-addrs.Retry():
			a.renew(addrs, addrs.due)
		case <-links.Retry():
			a.renew(links, links.due)
		case <-a.exempt.changed:
			a.applyGroupExempts()
		case <-tick.C:
			a.syncNode()
			if len(a.cfg.Unresolved) > 0 && time.Since(a.lastResolve) >= a.cfg.Agent.GroupRefreshInterval() {
				a.resolveAgain()
			}
			if err := a.dp.RefreshClock(); err != nil {
				a.log.Warn("clock offset not refreshed", "err", err)
			}
		}
	}
}

// subscriptionGap is the least time between two netlink subscriptions of
// one kind (the 5 s poll covers the gap).
const subscriptionGap = 5 * time.Second

// renewable is what the loop needs of a subscription of either kind.
type renewable interface {
	label() string
	start(time.Time) error
	lost(time.Time) error
}

// nodeChanged resyncs after a burst of updates (drained: one resync); when
// the subscription ended (ok false: updates were lost) it is renewed first,
// so nothing after the resync is missed.
func (a *agent) nodeChanged(s renewable, ok bool) {
	if !ok {
		a.log.Warn(s.label() + " updates lost (netlink subscription ended); resubscribing and resyncing")
		a.renew(s, s.lost)
	}
	a.syncNode()
}

func (a *agent) renew(s renewable, how func(time.Time) error) {
	if err := how(time.Now()); err != nil {
		a.log.Warn(s.label()+" updates unavailable; polling until the next attempt", "err", err)
	}
}

// install fills the maps, then the nft table, then attaches: on a first
// install the programs only start deciding once everything is in place.
func (a *agent) install(cgroupRoot string) error {
	a.cgroup = cgroupRoot
	if err := a.syncAddrs(); err != nil {
		return err
	}
	a.members.Load(context.Background())
	if err := a.loadKeys(); err != nil {
		return err
	}
	a.dp.AllowSamples = uint32(a.cfg.Agent.FlowSamples)
	if err := a.dp.ApplyPolicy(a.exempt.withUIDs(a.cfg.Policy), a.cfg.Agent.Audit); err != nil {
		return err
	}
	a.sitePolicy.Store(a.cfg.Policy)
	if err := kernel.InstallNft(); err != nil {
		return err
	}
	if err := a.dp.PrepareMigration(cgroupRoot); err != nil {
		return err
	}
	// Stamping first: the check at delivery refuses identity-less user
	// traffic, so the stamps must flow before it is attached.
	if err := a.syncInterfaces(); err != nil {
		return err
	}
	return a.dp.AttachCgroup(cgroupRoot)
}

// keyFile is the configured cluster key file.
func (a *agent) keyFile() string {
	if f := a.cfg.Cluster.KeyFile; f != "" {
		return f
	}
	return config.DefaultKeyFile
}

// loadKeys loads the cluster keys into the data plane. Without a readable
// key file the node seals with a random key of its own: its users keep
// their local traffic, and no identity from another node is trusted (fail
// closed for users, loudly).
func (a *agent) loadKeys() error {
	keys, err := kernel.LoadKeys(a.keyFile())
	if err != nil {
		if a.noKeyWarned == "" || a.noKeyWarned != err.Error() {
			a.log.Error("no cluster key: identity from other nodes is NOT trusted (cross-node user traffic is refused)", "err", err)
			a.noKeyWarned = err.Error()
		}
		var k kernel.Key
		copy(k[:], kernel.GenerateKeyBytes())
		keys = []kernel.Key{k}
		a.keyErr = err
	} else {
		a.noKeyWarned, a.keyErr = "", nil
	}
	return a.dp.SetKeys(keys)
}

func (a *agent) syncAddrs() error {
	list, err := nldump.Retry(func() ([]netlink.Addr, error) { return netlink.AddrList(nil, netlink.FAMILY_ALL) })
	if err != nil {
		return err
	}
	// Unicast addresses only: broadcast and multicast datagrams go to many
	// sockets and are decided at each of them, never early.
	var addrs, bcast []netip.Addr
	set := map[netip.Addr]bool{}
	for _, x := range list {
		if ip, ok := netip.AddrFromSlice(x.IP); ok {
			addrs = append(addrs, ip)
			set[ip.Unmap()] = true
		}
		// The broadcast address given (brd), and the subnet's last
		// address, for which the kernel makes a broadcast route itself
		// (prefixes up to /30).
		if b, ok := netip.AddrFromSlice(x.Broadcast); ok && b.Unmap().Is4() && !b.IsUnspecified() {
			bcast = append(bcast, b.Unmap())
		}
		if x.IPNet != nil {
			if ip4 := x.IPNet.IP.To4(); ip4 != nil {
				if ones, bits := x.IPNet.Mask.Size(); bits == 32 && ones < 31 {
					var b [4]byte
					for i := range b {
						b[i] = ip4[i] | ^x.IPNet.Mask[i]
					}
					bcast = append(bcast, netip.AddrFrom4(b))
				}
			}
		}
	}
	a.localAddrs.Store(&set)
	if err := a.dp.SetLocalAddrs(addrs); err != nil {
		return err
	}
	if err := a.dp.SetNodeAddrs(addrs); err != nil {
		// Fails closed for users only (their wildcard binds that share
		// a port): never a reason to stop the agent.
		a.log.Warn("node address list for the bind check incomplete", "err", err)
	}
	if err := a.dp.SetBroadcasts(bcast); err != nil {
		return err
	}
	a.nodeAddrs = addrs
	return nil
}

// repairNft restores the reject table if anything of it is gone.
func (a *agent) repairNft() {
	if kernel.NftComplete() {
		return
	}
	if err := kernel.InstallNft(); err != nil {
		a.log.Error("nft reject table not restored (refusals are silent drops until it is)", "err", err)
		return
	}
	a.nftRepairs.Add(1)
	a.log.Warn("nft reject table was removed or changed; restored")
}

func (a *agent) syncNode() {
	if err := a.syncAddrs(); err != nil {
		a.log.Warn("local addresses not refreshed", "err", err)
	}
	if err := a.syncInterfaces(); err != nil {
		a.log.Warn("interfaces not refreshed", "err", err)
	}
}

// wantInterfaces: lo and the configured list, or every interface. Each gets
// the stamping (egress) and early-refusal (ingress) programs; l2 is the L2
// header length by which they find the IP header.
func (a *agent) wantInterfaces() (want map[string]int, l2, mtu map[int]int, err error) {
	links, err := nldump.Retry(netlink.LinkList)
	if err != nil {
		return nil, nil, nil, err
	}
	want, l2, mtu = map[string]int{}, map[int]int{}, map[int]int{}
	for _, l := range links {
		at := l.Attrs()
		if at.Name == "lo" || len(a.cfg.Agent.Interfaces) == 0 || slices.Contains(a.cfg.Agent.Interfaces, at.Name) {
			n, ok := kernel.L2HeaderLen(at.EncapType)
			if !ok {
				if a.cfg.Agent.Interfaces != nil {
					a.log.Warn("interface type not supported; its traffic carries no identity", "interface", at.Name, "type", at.EncapType)
				}
				continue
			}
			want[at.Name] = at.Index
			l2[at.Index] = n
			mtu[at.Index] = at.MTU
		}
	}
	return want, l2, mtu, nil
}

func (a *agent) syncInterfaces() error {
	want, l2, mtu, err := a.wantInterfaces()
	if err != nil {
		return err
	}
	var errs []error
	// The header lengths first: a program attached before would not find
	// the IP header and stamp nothing.
	if err := a.dp.SetInterfaces(l2); err != nil {
		errs = append(errs, err)
	}
	if err := a.dp.SetInterfaceMTUs(mtu); err != nil {
		errs = append(errs, err)
	}
	for name, idx := range want {
		if a.attached[name] == idx {
			continue
		}
		if err := a.dp.AttachInterface(name, idx); err != nil {
			errs = append(errs, err)
			continue
		}
		a.attached[name] = idx
		a.log.Info("tc programs attached", "interface", name)
	}
	for _, name := range a.dp.Interfaces() {
		if _, ok := want[name]; !ok {
			a.dp.DetachInterface(name)
			delete(a.attached, name)
			a.log.Info("tc programs detached", "interface", name)
		}
	}
	// The stamp's room, reserved in what the stack computes (routemtu.go).
	changed, err := kernel.SyncRouteMTU(a.cfg.Policy.ClusterSubnets, l2, false)
	for _, ch := range changed {
		a.log.Info("route MTU lowered to leave room for the identity stamp", "route", ch.Dst, "dev", ch.Dev,
			"mtu", ch.To, "was", ch.From)
	}
	if err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// startIdent starts the ident service; the returned func stops it and waits
// (bounded) until it has closed its sockets and removed its Unix socket,
// which it would not get to if the agent exited right after its ctx ended.
func (a *agent) startIdent(ctx context.Context) (stop func()) {
	c := a.cfg.Agent
	if c.IdentPort == 0 && c.IdentSocket == "" {
		return func() {}
	}
	srv, err := ident.NewServer(ident.ServerConfig{
		UDPPort: uint16(c.IdentPort), DisableUDP: c.IdentPort == 0,
		SocketPath: c.IdentSocket, DisableUnix: c.IdentSocket == "", SocketGroup: c.IdentSocketGroup,
		Policy: a.cfg.Policy, Logger: a.log, Report: a.report, Data: a.answerData,
	})
	if err != nil {
		a.log.Warn("ident service not started", "err", err)
		return func() {}
	}
	a.ident = srv
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Run(ctx); err != nil {
			a.log.Error("ident service stopped", "err", err)
		}
	}()
	return func() {
		cancel()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
		}
	}
}

// siteVerdict decides an event's facts with the running policy and the
// membership the kernel has (the event sink names site rules with it).
func (a *agent) siteVerdict(c policy.Conn, trusted bool) policy.Verdict {
	p := a.sitePolicy.Load()
	if p == nil {
		return policy.Verdict{Rule: policy.RuleDenied}
	}
	c.Connector.Groups, c.Listener.Groups = a.dp.SiteMembers(c.Connector.UID), a.dp.SiteMembers(c.Listener.UID)
	c.Node = a.dp.SiteNode()
	return p.DecideTrusted(c, trusted)
}

// resolveAgain resolves the exempt names that did not resolve (a directory
// outage at boot, an account created later) and applies those that do now;
// until then the node enforces without them (fewer exemptions: nothing is
// opened) and reports them.
func (a *agent) resolveAgain() {
	a.lastResolve = time.Now()
	pol, unresolved, err := a.cfg.Resolve(nil)
	if err != nil {
		a.log.Warn("exempt names not resolved again", "err", err)
		return
	}
	if len(unresolved) == len(a.cfg.Unresolved) {
		return
	}
	if err := a.dp.Fits(a.exempt.withUIDs(pol)); err != nil {
		a.log.Error("exempt names resolved, but the policy does not fit", "err", err)
		return
	}
	if err := a.dp.ApplyPolicy(a.exempt.withUIDs(pol), a.cfg.Agent.Audit); err != nil {
		a.log.Error("exempt names resolved, but the policy was not applied", "err", err)
		if rerr := a.dp.ApplyPolicy(a.exempt.withUIDs(a.cfg.Policy), a.cfg.Agent.Audit); rerr != nil {
			a.log.Error("running policy not restored", "err", rerr)
		}
		return
	}
	a.cfg.Policy, a.cfg.Unresolved = pol, unresolved
	if a.ident != nil {
		a.ident.SetPolicy(pol)
	}
	a.exempt.setGroups(pol)
	a.members.Refresh()
	fs := a.findings(a.cfg)
	a.log.Info("exempt names resolved and applied", "still_unresolved", len(unresolved))
	a.setState(func(s *control.AgentState) { s.Findings, s.Unresolved = fs, len(unresolved) })
}
