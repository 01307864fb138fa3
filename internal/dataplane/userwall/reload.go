package userwall

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/agentconfig"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/version"
)

// setState updates the agent's state under its lock and writes the file
// (atomically: readers never see half of it).
func (a *agent) setState(update func(*control.AgentState)) {
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	update(&a.state)
	b, _ := json.MarshalIndent(&a.state, "", "  ")
	path := control.StatePath(a.cfg.Agent.PidFile)
	tmp := path + ".tmp"
	err := os.WriteFile(tmp, append(b, '\n'), 0o644)
	if err == nil {
		// 0644 whatever the umask (the unit's is 0077): users' `palisade
		// status` reads it.
		err = os.Chmod(tmp, 0o644)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		// status, reload acknowledgements and monitoring read this file.
		n := a.stateWriteErrors.Add(1)
		a.log.Error("agent state not written", "path", path, "err", err, "write_errors_total", n)
	}
}

// stateSnapshot is a copy of the state (metrics goroutine).
func (a *agent) stateSnapshot() control.AgentState {
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	return a.state
}

// findings are config check's findings for cfg on this node: its
// addresses, its Slurm, its key file, its directory.
func (a *agent) findings(cfg *config.Config) []config.Finding {
	fs := cfg.Findings(config.CheckOptions{SlurmConf: config.SlurmConfPath(), LocalAddrs: a.nodeAddrs})
	if f, ok := KeyFinding(cfg); ok {
		fs = append(fs, f)
	}
	return fs
}

// problems are the ERROR findings among fs.
func problems(fs []config.Finding) []config.Finding {
	var out []config.Finding
	for _, f := range fs {
		if f.Severity == config.Problem {
			out = append(out, f)
		}
	}
	return out
}

// logFindings logs each finding, ERRORs at level error.
func (a *agent) logFindings(cfg *config.Config, fs []config.Finding) {
	for _, f := range fs {
		if f.Severity == config.Problem {
			a.log.Error("configuration: " + f.String(cfg.Path))
		} else {
			a.log.Warn("configuration: " + f.String(cfg.Path))
		}
	}
}

func (a *agent) initState() {
	v := version.Get()
	cfg := a.cfg
	a.setState(func(s *control.AgentState) {
		*s = control.AgentState{PID: os.Getpid(), Version: v.Version, Commit: v.Commit, Started: time.Now().UTC(),
			Config: cfg.Path, ConfigSHA: cfg.SHA256, SharedSHA: cfg.SharedSHA256(), Generation: 1, Audit: cfg.Agent.Audit,
			UnenforcedNodes: cfg.Cluster.UnenforcedNodes, UnixLSM: a.dp.LSMErr() == nil, PinDir: a.pinDir, Findings: a.findings(cfg),
			Notes: a.notes, KeyLoaded: a.keyErr == nil, Unresolved: len(cfg.Unresolved)}
	})
	a.logFindings(cfg, a.stateSnapshot().Findings)
}

// needsRestart names the settings a reload cannot apply: where the
// programs are pinned and which are loaded are fixed for an agent's life.
func needsRestart(old, cfg *agentconfig.Config) []string {
	var keys []string
	if old.BPFFS != cfg.BPFFS {
		keys = append(keys, fmt.Sprintf("agent.bpffs (%q → %q)", old.BPFFS, cfg.BPFFS))
	}
	if old.PidFile != cfg.PidFile {
		keys = append(keys, fmt.Sprintf("agent.pid_file (%q → %q)", old.PidFile, cfg.PidFile))
	}
	if old.UnixSockets != cfg.UnixSockets {
		keys = append(keys, fmt.Sprintf("agent.unix_sockets (%v → %v)", old.UnixSockets, cfg.UnixSockets))
	}
	return keys
}

// reload re-reads the configuration and applies every setting, or refuses
// the whole file (the running configuration stays) when it is invalid, does
// not fit the maps, or changes a setting that needs a restart. Maps are
// updated in place (add, then delete): no gap. The event log is reopened
// in every case (logrotate sends SIGHUP after moving it).
func (a *agent) reload() {
	err := a.applyReload()
	var fs []config.Finding
	if err != nil {
		a.log.Error("configuration refused; the running configuration stays", "err", err)
	} else {
		fs = a.findings(a.cfg)
		a.logFindings(a.cfg, fs)
		a.log.Info("configuration reloaded", "path", a.cfg.Path, "sha256", a.cfg.SHA256,
			"generation", a.stateSnapshot().Generation+1, "audit", a.cfg.Agent.Audit)
	}
	// Last, once everything is applied and logged: the state file is the
	// acknowledgement that `agent --reload` and the tests wait on.
	a.setState(func(s *control.AgentState) {
		s.Reloads++
		s.LastReload = time.Now().UTC()
		s.LastReloadError = ""
		if err != nil {
			s.LastReloadError = err.Error()
			return
		}
		s.Generation++
		s.Config, s.ConfigSHA, s.SharedSHA, s.Audit = a.cfg.Path, a.cfg.SHA256, a.cfg.SharedSHA256(), a.cfg.Agent.Audit
		s.UnenforcedNodes, s.Findings, s.Notes = a.cfg.Cluster.UnenforcedNodes, fs, a.notes
		s.KeyLoaded, s.Unresolved = a.keyErr == nil, len(a.cfg.Unresolved)
	})
}

func (a *agent) applyReload() error {
	cfg, err := a.opts.LoadTestedConfig()
	if err != nil {
		a.reopenEvents(a.cfg)
		return err
	}
	cfg.ResolveNodes(nil) // hostlist node names; findings if not
	if keys := needsRestart(&a.cfg.Agent, &cfg.Agent); len(keys) > 0 {
		a.reopenEvents(a.cfg)
		return fmt.Errorf("%s changed: needs a restart (systemctl restart palisade-agent); nothing applied", strings.Join(keys, ", "))
	}
	// What config check calls an ERROR (no usable key, an exempt name that
	// does not resolve, Slurm's accounts not exempt, this node outside the
	// cluster subnets) would break users' or Slurm's traffic: the running
	// configuration stays. (At start the agent enforces it anyway.)
	if errs := problems(a.findings(cfg)); len(errs) > 0 {
		a.reopenEvents(a.cfg)
		msgs := make([]string, len(errs))
		for i, f := range errs {
			msgs[i] = f.String(cfg.Path)
		}
		return fmt.Errorf("config check reports %d ERROR(s), nothing applied: %s", len(errs), strings.Join(msgs, "; "))
	}
	// "@group" exemptions: the members known now (a group new to the
	// policy gets its members at the tracker's next round, Refresh below).
	if err := a.dp.Fits(a.exempt.withUIDs(cfg.Policy)); err != nil {
		a.reopenEvents(a.cfg)
		return err
	}
	a.dp.AllowSamples = uint32(cfg.Agent.FlowSamples)
	if err := a.dp.ApplyPolicy(a.exempt.withUIDs(cfg.Policy), cfg.Agent.Audit); err != nil {
		// Half-applied maps: put the running policy back.
		a.dp.AllowSamples = uint32(a.cfg.Agent.FlowSamples)
		if rerr := a.dp.ApplyPolicy(a.exempt.withUIDs(a.cfg.Policy), a.cfg.Agent.Audit); rerr != nil {
			a.log.Error("running policy not restored", "err", rerr)
		}
		a.reopenEvents(a.cfg)
		return fmt.Errorf("policy not applied: %w", err)
	}
	old := a.cfg
	a.cfg = cfg
	a.sitePolicy.Store(cfg.Policy)
	a.notes = nil
	a.setFlowConfig()
	if err := a.loadKeys(); err != nil {
		a.log.Error("cluster keys not loaded", "err", err)
	}
	a.reopenEvents(cfg)
	if old.Agent.MetricsAddress != cfg.Agent.MetricsAddress {
		a.restartMetrics(old.Agent.MetricsAddress)
	}
	if identChanged(&old.Agent, &cfg.Agent) {
		a.stopIdent()
		a.stopIdent = a.startIdent(a.ctx)
		a.log.Info("ident service restarted", "port", cfg.Agent.IdentPort, "socket", cfg.Agent.IdentSocket)
	} else if a.ident != nil {
		a.ident.SetPolicy(cfg.Policy)
	}
	if d := cfg.Agent.GroupRefreshInterval(); d != old.Agent.GroupRefreshInterval() {
		a.members.SetRefresh(d)
	}
	a.reloadPortal(old, cfg)
	a.exempt.setGroups(cfg.Policy)
	a.members.Refresh()
	a.syncNode()
	if a.grants != nil {
		a.grants.sweep() // grants disabled by the site go now
	}
	return nil
}

func identChanged(old, cfg *agentconfig.Config) bool {
	return old.IdentPort != cfg.IdentPort || old.IdentSocket != cfg.IdentSocket || old.IdentSocketGroup != cfg.IdentSocketGroup
}

// reopenEvents reopens the event log (and syslog, the rate) as cfg says.
func (a *agent) reopenEvents(cfg *config.Config) {
	if a.sink == nil {
		return
	}
	c := cfg.Agent
	if err := a.sink.reopen(c.EventLog, c.Syslog, c.EventRate); err != nil {
		a.log.Error("event log not reopened; still writing to the old one", "err", err)
		a.notes = append(a.notes, "event log not reopened: "+err.Error())
	}
}

// startMetrics serves the metrics on [agent] metrics_address.
func (a *agent) startMetrics() {
	addr := a.cfg.Agent.MetricsAddress
	if addr == "" {
		return
	}
	srv, err := a.serveMetrics(addr)
	if err != nil {
		a.log.Warn("metrics not served", "addr", addr, "err", err)
		a.notes = append(a.notes, fmt.Sprintf("metrics not served on %s: %v", addr, err))
		return
	}
	a.metrics = srv
}

func (a *agent) serveMetrics(addr string) (*metricsServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	m := &metricsServer{srv: &http.Server{Handler: a.metricsHandler(), ReadHeaderTimeout: 5 * time.Second}, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		m.srv.Serve(ln)
	}()
	return m, nil
}

// metricsServer is the HTTP server of the metrics and its goroutine.
type metricsServer struct {
	srv  *http.Server
	done chan struct{}
}

// stop closes the listener, lets scrapes in flight finish (they read the
// data plane, which is closed after) and waits for the server.
func (m *metricsServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if m.srv.Shutdown(ctx) != nil {
		m.srv.Close()
	}
	<-m.done
}

// restartMetrics moves the metrics to the new address: bound first, so a
// failure keeps them where they were.
func (a *agent) restartMetrics(oldAddr string) {
	addr := a.cfg.Agent.MetricsAddress
	var srv *metricsServer
	if addr != "" {
		var err error
		if srv, err = a.serveMetrics(addr); err != nil {
			a.log.Error("metrics address not bound; still serving on the old one", "addr", addr, "old", oldAddr, "err", err)
			a.notes = append(a.notes, fmt.Sprintf("metrics not moved to %s (%v): still on %s", addr, err, oldAddr))
			return
		}
	}
	if a.metrics != nil {
		a.metrics.stop()
	}
	a.metrics = srv
	a.log.Info("metrics address changed", "addr", addr, "old", oldAddr)
}

func (a *agent) stopMetrics() {
	if a.metrics != nil {
		a.metrics.stop()
		a.metrics = nil
	}
}
