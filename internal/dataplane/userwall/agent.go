package userwall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/palisade-hpc/palisade/internal/ident"
	"github.com/palisade-hpc/palisade/internal/membership"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/cgroup2"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/internal/version"
	"github.com/vishvananda/netlink"
)

// AgentOptions configure one agent (one network namespace). Empty override
// fields take the value of the [agent] table.
type AgentOptions struct {
	ConfigPath     string
	PidFile        string
	EventLog       string
	MetricsAddress string
	IdentSocket    string
	Logger         *slog.Logger
}

// LoadConfig loads the configuration and applies the command-line overrides.
func (o *AgentOptions) LoadConfig() (*policy.Config, error) {
	cfg, err := policy.LoadOrDefault(o.ConfigPath)
	if err != nil {
		return nil, err
	}
	a := &cfg.Agent
	if o.PidFile != "" {
		a.PidFile = o.PidFile
	}
	if o.EventLog != "" {
		a.EventLog = o.EventLog
	}
	if o.MetricsAddress != "" {
		a.MetricsAddress = o.MetricsAddress
	}
	if o.IdentSocket != "" {
		a.IdentSocket = o.IdentSocket
	}
	return cfg, nil
}

type agent struct {
	opts     AgentOptions
	cfg      *policy.Config
	log      *slog.Logger
	dp       *Dataplane
	attached map[string]int // interface → ifindex
	cgroup   string
	sink     *eventSink
	ident    *ident.Server
	// keyErr says why the cluster key is not in use (nil: it is);
	// noKeyWarned keeps the log from repeating it.
	keyErr      error
	noKeyWarned string
	// nftRepairs counts restorations of the nft table (metrics).
	nftRepairs atomic.Int64

	// Owned by the main loop (RunAgent, reload): ctx of the services,
	// the metrics server, the ident service's stop, and problems of the
	// running agent for the state (notes).
	ctx       context.Context
	metrics   *http.Server
	stopIdent func()
	members   *membership.Tracker // fills the kernel's members map (internal/membership)
	exempt    groupExempts        // "@group" exemptions' members
	notes     []string
	pinDir    string

	// stateMu guards state, which the metrics goroutine reads.
	stateMu sync.Mutex
	state   AgentState
}

// ReadPid returns the pid in a pid file if that process is alive.
func ReadPid(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0
	}
	if !procfs.Alive(pid) {
		return 0
	}
	// A stale pid file may name a reused pid: only a palisade agent counts,
	// so that --uninstall never signals an unrelated process.
	args := procfs.Cmdline(pid)
	if len(args) < 2 || !strings.Contains(filepath.Base(args[0]), "palisade") || !slices.Contains(args[1:], "agent") {
		return 0
	}
	return pid
}

// RunAgent installs (or adopts) the data plane of the caller's network
// namespace and keeps it in step with the configuration and the node until
// ctx ends or SIGTERM/SIGINT. Leaving does not remove anything: the pinned
// programs go on enforcing (restart adopts them; --uninstall removes them).
func RunAgent(ctx context.Context, o AgentOptions) error {
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	v := version.Get()
	log.Info("palisade agent starting", "version", v.Version, "commit", v.Commit, "built", v.BuildDate,
		"go", v.GoVersion, "cilium_ebpf", v.EBPF)
	cfg, err := o.LoadConfig()
	if err != nil {
		return err
	}
	if cfg.Default {
		log.Warn("no configuration file; using the built-in default policy", "path", o.ConfigPath)
	}
	// Before anything changes: does this kernel have what the data plane
	// needs? If not, one clear message and nothing touched.
	probe, err := ProbeKernel()
	if err != nil {
		return fmt.Errorf("kernel feature probe: %w", err)
	}
	if err := probe.Err(); err != nil {
		return err
	}
	useTC, why, err := chooseTC(cfg.Agent.TCAttach, probe)
	if err != nil {
		return err
	}
	var noLSM error
	switch {
	case !cfg.Agent.UnixSockets:
		noLSM = errors.New("disabled by configuration (unix_sockets = false)")
	case !probe.Has(FeatLSMActive) && strings.HasPrefix(featureDetail(probe, FeatLSMActive), "/"):
		noLSM = fmt.Errorf("the bpf LSM is not enabled (%s); boot with lsm=...,bpf", featureDetail(probe, FeatLSMActive))
	case !probe.Has(FeatLSMAttach):
		noLSM = fmt.Errorf("BPF LSM programs cannot attach on this kernel: %s", featureDetail(probe, FeatLSMAttach))
	}
	a := &agent{opts: o, cfg: cfg, log: log, attached: map[string]int{}}
	// One agent per namespace: an exclusive lock next to the pid file
	// (held until exit; a stale pid file alone does not block a restart).
	if err := os.MkdirAll(filepath.Dir(cfg.Agent.PidFile), 0o755); err != nil {
		return err
	}
	lock, err := os.OpenFile(cfg.Agent.PidFile+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fmt.Errorf("an agent is already running (pid %d, %s)", ReadPid(cfg.Agent.PidFile), cfg.Agent.PidFile)
	}
	cookie, err := NetnsCookie()
	if err != nil {
		return err
	}
	fs, err := BPFFS(cfg.Agent.BPFFS)
	if err != nil {
		return err
	}
	cg, err := cgroup2.MountPoint()
	if err != nil {
		return err
	}
	pinDir := PinDir(fs, cookie)
	a.pinDir = pinDir
	if gone := CollectStale(fs); len(gone) > 0 {
		log.Info("removed the pins of deleted network namespaces", "cookies", gone)
	}
	_, statErr := os.Stat(filepath.Join(pinDir, "settings"))
	adopting := statErr == nil
	a.dp, err = Load(pinDir, cookie, noLSM)
	if err != nil {
		if !adopting {
			// The loader pins each map as it creates it and does not
			// unpin them when a later program fails to load.
			RemovePins(pinDir)
		}
		return err
	}
	defer a.dp.Close()
	a.dp.TC = useTC
	a.exempt.changed = make(chan struct{}, 1)
	a.exempt.setGroups(cfg.Policy)
	a.members = a.newMembers()
	log.Info("tc programs attach with "+attachName(useTC), "why", why, "kernel", probe.Kernel)
	if err := a.install(cg); err != nil {
		if !adopting {
			// A first install that failed half-way leaves nothing behind
			// (tc filters are not pinned: remove them by name).
			a.dp.Close()
			RemovePins(pinDir)
			removeTCFilters()
			RemoveNft()
		}
		return err
	}
	log.Info("userwall enforcing", "netns_cookie", cookie, "pins", pinDir, "adopted", adopting,
		"links", len(a.dp.Links()), "interfaces", a.dp.Interfaces(), "cgroup", cg)
	if a.dp.LSMErr != nil {
		log.Warn("abstract Unix sockets are NOT isolated", "reason", a.dp.LSMErr)
	}

	rd, err := ringbuf.NewReader(a.dp.Map("events"))
	if err != nil {
		return err
	}
	defer rd.Close()
	if a.sink, err = newEventSink(cfg.Agent.EventLog, cfg.Agent.Syslog, cfg.Agent.EventRate, log); err != nil {
		return err
	}
	defer a.sink.close()
	a.sink.seen = a.members.Seen
	go a.sink.run(rd)

	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	nftDone := make(chan struct{})
	go func() {
		defer close(nftDone)
		WatchNft(ctx, a.repairNft)
	}()
	defer func() { <-nftDone }()
	a.ctx = ctx
	a.startMetrics()
	defer a.stopMetrics()
	a.stopIdent = a.startIdent(ctx)
	defer func() { a.stopIdent() }()
	defer a.runMembers(ctx)()

	if err := os.WriteFile(cfg.Agent.PidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return err
	}
	defer func() {
		if ReadPid(cfg.Agent.PidFile) == os.Getpid() {
			os.Remove(cfg.Agent.PidFile)
		}
	}()
	a.initState()

	// Readiness for systemd (Type=notify): enforcement, metrics and ident
	// are in place, so units ordered after this one (slurmd, sshd) start
	// only on a node that already isolates users. A no-op without systemd.
	daemon.SdNotify(false, daemon.SdNotifyReady+"\nSTATUS=enforcing")
	defer daemon.SdNotify(false, daemon.SdNotifyStopping)

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	addrCh := make(chan netlink.AddrUpdate, 64)
	done := make(chan struct{})
	defer close(done)
	if err := netlink.AddrSubscribe(addrCh, done); err != nil {
		log.Warn("address updates unavailable; polling only", "err", err)
	}
	// New interfaces get the tc programs at once, not at the next poll.
	linkCh := make(chan netlink.LinkUpdate, 64)
	if err := netlink.LinkSubscribe(linkCh, done); err != nil {
		log.Warn("link updates unavailable; polling only", "err", err)
	}
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			log.Info("agent stopping; pinned programs stay in force")
			return nil
		case <-hup:
			daemon.SdNotify(false, daemon.SdNotifyReloading)
			a.reload()
			daemon.SdNotify(false, daemon.SdNotifyReady)
		case <-addrCh:
			// Drain a burst, then resync once.
			for len(addrCh) > 0 {
				<-addrCh
			}
			a.syncNode()
		case <-linkCh:
			for len(linkCh) > 0 {
				<-linkCh
			}
			a.syncNode()
		case <-a.exempt.changed:
			a.applyGroupExempts()
		case <-tick.C:
			a.syncNode()
			if err := a.dp.RefreshClock(); err != nil {
				a.log.Warn("clock offset not refreshed", "err", err)
			}
		}
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
	if err := a.dp.ApplyPolicy(a.exempt.withUIDs(a.cfg.Policy), a.cfg.Agent.Audit); err != nil {
		return err
	}
	if err := InstallNft(); err != nil {
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
	return policy.DefaultKeyFile
}

// loadKeys loads the cluster keys into the data plane. Without a readable
// key file the node seals with a random key of its own: its users keep
// their local traffic, and no identity from another node is trusted (fail
// closed for users, loudly).
func (a *agent) loadKeys() error {
	keys, err := LoadKeys(a.keyFile())
	if err != nil {
		if a.noKeyWarned == "" || a.noKeyWarned != err.Error() {
			a.log.Error("no cluster key: identity from other nodes is NOT trusted (cross-node user traffic is refused)", "err", err)
			a.noKeyWarned = err.Error()
		}
		var k Key
		copy(k[:], GenerateKeyBytes())
		keys = []Key{k}
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
	var addrs []netip.Addr
	for _, x := range list {
		if ip, ok := netip.AddrFromSlice(x.IP); ok {
			addrs = append(addrs, ip)
		}
	}
	return a.dp.SetLocalAddrs(addrs)
}

// repairNft restores the reject table if anything of it is gone.
func (a *agent) repairNft() {
	if NftComplete() {
		return
	}
	if err := InstallNft(); err != nil {
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
func (a *agent) wantInterfaces() (want map[string]int, l2 map[int]int, err error) {
	links, err := nldump.Retry(netlink.LinkList)
	if err != nil {
		return nil, nil, err
	}
	want, l2 = map[string]int{}, map[int]int{}
	for _, l := range links {
		at := l.Attrs()
		if at.Name == "lo" || len(a.cfg.Agent.Interfaces) == 0 || slices.Contains(a.cfg.Agent.Interfaces, at.Name) {
			n, ok := l2HeaderLen(at.EncapType)
			if !ok {
				if a.cfg.Agent.Interfaces != nil {
					a.log.Warn("interface type not supported; its traffic carries no identity", "interface", at.Name, "type", at.EncapType)
				}
				continue
			}
			want[at.Name] = at.Index
			l2[at.Index] = n
		}
	}
	return want, l2, nil
}

// l2HeaderLen is the length of the link-layer header the tc programs see.
func l2HeaderLen(encap string) (int, bool) {
	switch encap {
	case "ether", "loopback":
		return 14, true
	case "none": // tun, wireguard: the IP header comes first
		return 0, true
	case "infiniband": // IPoIB: a 4-byte header (protocol, reserved)
		return 4, true
	}
	return 0, false
}

func (a *agent) syncInterfaces() error {
	want, l2, err := a.wantInterfaces()
	if err != nil {
		return err
	}
	var errs []error
	// The header lengths first: a program attached before would not find
	// the IP header and stamp nothing.
	if err := a.dp.SetInterfaces(l2); err != nil {
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
		Policy: a.cfg.Policy, Logger: a.log,
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
