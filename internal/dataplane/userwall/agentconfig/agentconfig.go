// Package agentconfig is the [agent] table of the configuration: the
// userwall agent's own settings (internal/config composes it). It is a
// package of its own because the agent loads the whole configuration.
package agentconfig

import (
	"errors"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Config is the [agent] table: settings of `palisade agent` (the
// userwall data plane; the agent also runs the ident service).
type Config struct {
	// Interfaces get the tc programs (cross-node checks). Empty: every
	// interface but lo (off-cluster traffic is checked wherever it arrives).
	Interfaces []string `toml:"interfaces"`
	// MetricsAddress is where Prometheus metrics are served ("" = off).
	// Keep it local: the metrics name users.
	MetricsAddress string `toml:"metrics_address"`
	// EventLog receives one JSON line per denial ("" = off).
	EventLog string `toml:"event_log"`
	// Syslog also sends denials to /dev/log (skipped quietly if absent).
	Syslog bool `toml:"syslog"`
	// EventRate bounds the denials logged per second; the rest are counted.
	EventRate int `toml:"event_rate"`
	// FlowSamples bounds the allowed verdicts each CPU records a second for
	// `palisade flows` (refusals are all recorded); 0: none.
	FlowSamples int `toml:"flow_samples"`
	// FlowHistory is how many recent verdicts the agent keeps.
	FlowHistory int `toml:"flow_history"`
	// BPFFS is the bpf filesystem the programs are pinned in.
	BPFFS string `toml:"bpffs"`
	// PidFile is written once enforcement is in place.
	PidFile string `toml:"pid_file"`
	// GroupRefresh is how often group membership is reloaded from NSS.
	GroupRefresh string `toml:"group_refresh"`
	// SocketStorage is accepted for compatibility and ignored: since data
	// plane v2 every socket's owner is always recorded (the check at delivery
	// needs it).
	SocketStorage bool `toml:"socket_storage"`
	// TCAttach is how the tc programs attach: "auto" (tcx links where the
	// kernel has them, ≥ 6.6; else clsact + cls_bpf), "tcx" or "tc" (refuse
	// to start without that one).
	TCAttach string `toml:"tc_attach"`
	// Audit decides and reports every connection but refuses none (a site
	// measuring what enforcement would refuse). Switched by reload.
	Audit bool `toml:"audit"`
	// UnixSockets enforces the rules on abstract Unix sockets (BPF LSM).
	UnixSockets bool `toml:"unix_sockets"`
	// IdentPort is the ident service's UDP port (privileged; 0 = off).
	IdentPort int `toml:"ident_port"`
	// IdentSocket is the ident service's Unix API socket ("" = off).
	IdentSocket string `toml:"ident_socket"`
	// IdentSocketGroup may use the Unix API ("" = root only).
	IdentSocketGroup string `toml:"ident_socket_group"`
}

// Agent defaults.
const (
	DefaultMetricsAddress = "127.0.0.1:9464"
	DefaultEventLog       = "/var/log/palisade/userwall-events.jsonl"
	DefaultAgentPidFile   = "/run/palisade/agent.pid"
	DefaultIdentSocket    = "/run/palisade/ident.sock"
)

// SetDefaults fills in defaults before the file's values are decoded.
func (a *Config) SetDefaults() {
	*a = Config{
		MetricsAddress: DefaultMetricsAddress,
		EventLog:       DefaultEventLog,
		Syslog:         true,
		EventRate:      20,
		FlowSamples:    20,
		FlowHistory:    10000,
		BPFFS:          "/sys/fs/bpf",
		PidFile:        DefaultAgentPidFile,
		GroupRefresh:   "60s",
		UnixSockets:    true,
		TCAttach:       "auto",
		IdentPort:      99,
		IdentSocket:    DefaultIdentSocket,
	}
}

// GroupRefreshInterval is GroupRefresh parsed (valid after Validate).
func (a *Config) GroupRefreshInterval() time.Duration {
	d, err := time.ParseDuration(a.GroupRefresh)
	if err != nil || d <= 0 {
		return time.Minute
	}
	return d
}

// Validate checks the table after decoding.
func (a *Config) Validate() error {
	var errs []error
	for _, i := range a.Interfaces {
		if i == "" || len(i) > 15 || strings.ContainsAny(i, "/ \t") {
			errs = append(errs, &policy.KeyError{Key: "interfaces", Value: i, Err: errors.New("not an interface name")})
		}
	}
	if a.MetricsAddress != "" {
		if _, _, err := net.SplitHostPort(a.MetricsAddress); err != nil {
			errs = append(errs, policy.KeyErrorf("metrics_address", "%q: want host:port: %v", a.MetricsAddress, err))
		}
	}
	for key, p := range map[string]string{"event_log": a.EventLog, "pid_file": a.PidFile, "ident_socket": a.IdentSocket} {
		if p != "" && !filepath.IsAbs(p) {
			errs = append(errs, policy.KeyErrorf(key, "%q: want an absolute path", p))
		}
	}
	if !filepath.IsAbs(a.BPFFS) {
		errs = append(errs, policy.KeyErrorf("bpffs", "%q: want an absolute path", a.BPFFS))
	}
	if a.EventRate < 0 || a.EventRate > 100000 {
		errs = append(errs, policy.KeyErrorf("event_rate", "%d: want 0..100000", a.EventRate))
	}
	if a.FlowSamples < 0 || a.FlowSamples > 100000 {
		errs = append(errs, policy.KeyErrorf("flow_samples", "%d: want 0..100000", a.FlowSamples))
	}
	if a.FlowHistory < 1 || a.FlowHistory > 1000000 {
		errs = append(errs, policy.KeyErrorf("flow_history", "%d: want 1..1000000", a.FlowHistory))
	}
	if d, err := time.ParseDuration(a.GroupRefresh); err != nil || d < time.Second {
		errs = append(errs, policy.KeyErrorf("group_refresh", "%q: want a duration of at least 1s (e.g. \"60s\")", a.GroupRefresh))
	}
	switch a.TCAttach {
	case "auto", "tcx", "tc":
	default:
		errs = append(errs, policy.KeyErrorf("tc_attach", "%q: want auto, tcx or tc", a.TCAttach))
	}
	if a.IdentPort < 0 || a.IdentPort > 1023 {
		errs = append(errs, policy.KeyErrorf("ident_port", "%d: want a privileged port 1..1023, or 0 for off", a.IdentPort))
	}
	return errors.Join(errs...)
}
