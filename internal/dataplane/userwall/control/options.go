package control

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// Options configure one agent (one network namespace). Empty override
// fields take the value of the [agent] table.
type Options struct {
	ConfigPath     string
	PidFile        string
	EventLog       string
	MetricsAddress string
	IdentSocket    string
	Logger         *slog.Logger
}

// LoadConfig loads the configuration and applies the command-line overrides.
func (o *Options) LoadConfig() (*config.Config, error) {
	cfg, err := config.LoadOrDefault(o.ConfigPath)
	if err != nil {
		return nil, err
	}
	o.applyOverrides(cfg)
	return cfg, nil
}

// LoadTestedConfig is LoadConfig, refusing a policy whose [[test]] entries
// fail: what the agent reloads with (and `agent --reload` checks before
// signalling), so a change that breaks a site's tests never replaces the
// running policy.
func (o *Options) LoadTestedConfig() (*config.Config, error) {
	cfg, err := o.LoadConfig()
	if err != nil {
		return nil, err
	}
	if _, err := cfg.RunTests(nil); err != nil {
		return nil, fmt.Errorf("policy tests failed:\n%w", err)
	}
	return cfg, nil
}

func (o *Options) applyOverrides(cfg *config.Config) {
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
	// Nor a user's process dressed as one (named "palisade ... agent"),
	// which could take a crashed agent's pid: the agent runs as root.
	if uid, ok := procfs.EffectiveUID(pid); !ok || uid != 0 {
		return 0
	}
	return pid
}
