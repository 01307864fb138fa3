package userwall

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/vishvananda/netlink"
)

// Uninstall stops the namespace's running agent (if any) and removes every
// program, link, map and nft table it made.
func Uninstall(o AgentOptions) error {
	cfg, err := o.LoadConfig()
	bpffsDir, pidFile := "/sys/fs/bpf", ""
	if err == nil {
		bpffsDir, pidFile = cfg.Agent.BPFFS, cfg.Agent.PidFile
	} else if o.PidFile != "" {
		pidFile = o.PidFile
	}
	fs, fsOK := kernel.FindBPFFS(bpffsDir, 0)
	if pidFile != "" {
		if pid := ReadPid(pidFile); pid != 0 && pid != os.Getpid() {
			if !fsOK {
				fs, fsOK = kernel.FindBPFFS(bpffsDir, pid)
			}
			syscall.Kill(pid, syscall.SIGTERM)
			for i := 0; i < 100 && ReadPid(pidFile) == pid; i++ {
				time.Sleep(50 * time.Millisecond)
			}
			if ReadPid(pidFile) == pid {
				syscall.Kill(pid, syscall.SIGKILL)
				time.Sleep(100 * time.Millisecond)
			}
			os.Remove(pidFile)
		}
		os.Remove(pidFile + ".lock")
		removeState(pidFile)
	}
	cookie, err := kernel.NetnsCookie()
	if err != nil {
		return err
	}
	var errs []error
	if fsOK {
		errs = append(errs, kernel.RemovePins(kernel.PinDir(fs, cookie)))
		kernel.CollectStale(fs)
	}
	errs = append(errs, kernel.RemoveTCFilters())
	errs = append(errs, kernel.RemoveNft())
	if cfg != nil {
		errs = append(errs, restoreRouteMTU(cfg.Policy.ClusterSubnets))
	}
	return errors.Join(errs...)
}

// restoreRouteMTU removes the MTU the agent gave the routes to stamped
// destinations (SyncRouteMTU), on every device it could have managed.
func restoreRouteMTU(cluster []netip.Prefix) error {
	links, err := nldump.Retry(netlink.LinkList)
	if err != nil {
		return err
	}
	l2 := map[int]int{}
	for _, l := range links {
		if n, ok := l2HeaderLen(l.Attrs().EncapType); ok {
			l2[l.Attrs().Index] = n
		}
	}
	_, err = kernel.SyncRouteMTU(cluster, l2, true)
	return err
}

// Status is what `palisade status` reports for this network namespace.
type Status struct {
	// Mode is "userwall", "none", or "unknown" (a user who may not read the
	// kernel objects, with no agent to ask).
	Mode string `json:"mode"`
	// Source says where the facts come from: "kernel" (the pinned objects,
	// root) or "agent" (the running agent's state file, for other users).
	Source string      `json:"source"`
	Agent  *AgentState `json:"agent,omitempty"`
	// Attach is how the tc programs are attached: "tcx" links, or "tc"
	// (clsact + cls_bpf filters, kernels before 6.6).
	Attach      string              `json:"attach,omitempty"`
	NetnsCookie uint64              `json:"netns_cookie"`
	PinDir      string              `json:"pin_dir"`
	AgentPID    int                 `json:"agent_pid"`
	Links       []kernel.LinkStatus `json:"links"`
	Nft         bool                `json:"nft_table"`
	Enabled     bool                `json:"enabled"`
	UnixLSM     bool                `json:"unix_enforced"`
	// Audit: decisions are reported, nothing is refused.
	Audit bool `json:"audit"`
	// Keys are the ids of the cluster keys in force (the first seals);
	// KeyError says why the configured key file is not usable.
	Keys     []uint8  `json:"key_ids,omitempty"`
	KeyError string   `json:"key_error,omitempty"`
	Warnings []string `json:"warnings,omitempty"`
	// Errors are what breaks users' or Slurm's traffic while the node
	// enforces: no usable cluster key, config check's ERRORs for the
	// running configuration. Status exits 1 with them, as with warnings.
	Errors   []string         `json:"errors,omitempty"`
	Counters []kernel.Counter `json:"counters"`
	// Kernel is the feature probe of this node's kernel.
	Kernel *kernel.Probe `json:"kernel,omitempty"`
	// Headline is Summary(): status's first line.
	Headline string `json:"summary"`
}

// GetStatus inspects the pins of the caller's namespace.
func GetStatus(o AgentOptions) (*Status, error) { return getStatus(o, true) }

// getStatus is GetStatus; probe runs the kernel feature probe (root only;
// it loads programs, so the agent's status report leaves it out).
func getStatus(o AgentOptions, probe bool) (*Status, error) {
	cfg, cfgErr := o.LoadConfig()
	if cfgErr != nil {
		// Still report what is in force, from the default locations.
		cfg = &config.Config{}
		cfg.Agent.SetDefaults()
		if o.PidFile != "" {
			cfg.Agent.PidFile = o.PidFile
		}
	}
	cookie, err := kernel.NetnsCookie()
	if err != nil {
		return nil, err
	}
	s := &Status{Mode: "none", Source: "kernel", NetnsCookie: cookie, AgentPID: ReadPid(cfg.Agent.PidFile), Nft: kernel.NftInstalled()}
	if cfgErr != nil {
		s.Warnings = append(s.Warnings, "configuration invalid (a reload would be refused): "+cfgErr.Error())
	}
	fs, _ := kernel.FindBPFFS(cfg.Agent.BPFFS, s.AgentPID)
	s.PinDir = kernel.PinDir(fs, cookie)
	// The running agent's pins, whatever bpffs the file names now.
	pins := s.PinDir
	if st := liveState(cfg.Agent.PidFile, s.AgentPID); st != nil && st.PinDir != "" {
		s.PinDir, pins = st.PinDir, st.PinDir
		// The agent names its pins in its own mount namespace; `ip netns
		// exec` mounts a fresh /sys without that bpffs. Read them through
		// the agent's root then.
		if _, err := os.Stat(pins); err != nil && s.AgentPID > 0 {
			if p := filepath.Join(fmt.Sprintf("/proc/%d/root", s.AgentPID), pins); kernel.IsBPFFS(p) {
				pins = p
			}
		}
	}
	pv := kernel.ReadPins(pins)
	s.Links, s.Attach, s.UnixLSM = pv.Links, pv.Attach, pv.UnixLSM
	s.Enabled, s.Audit, s.Keys, s.Counters = pv.Enabled, pv.Audit, pv.Keys, pv.Counters
	s.Warnings = append(s.Warnings, pv.Warnings...)
	// The probe loads programs: only root can run it (as a user every
	// answer would be EPERM).
	if probe && os.Geteuid() == 0 {
		if p, err := kernel.ProbeKernel(); err == nil {
			s.Kernel = p
		} else {
			s.Warnings = append(s.Warnings, "kernel feature probe failed: "+err.Error())
		}
	}
	keyFile := cfg.Cluster.KeyFile
	if keyFile == "" {
		keyFile = config.DefaultKeyFile
	}
	if _, err := kernel.LoadKeys(keyFile); err != nil {
		s.KeyError = err.Error()
	}
	if pv.Attached {
		s.Mode = "userwall"
		if s.AgentPID == 0 {
			s.Warnings = append(s.Warnings, "agent not running: pinned programs enforce the last policy, but addresses, groups and events are not kept up to date")
		}
		if !s.Nft {
			s.Warnings = append(s.Warnings, "nft table "+kernel.NftTable+" missing: refusals are silent drops instead of resets (the agent restores it)")
		}
		if s.Audit {
			s.Warnings = append(s.Warnings, "audit mode: refusals are reported, NOT enforced")
		}
		if s.KeyError != "" {
			s.Errors = append(s.Errors, "no usable cluster key ("+s.KeyError+"): identity from other nodes is not trusted, cross-node user traffic is refused")
		}
	}
	s.addAgentState(cfg, cfgErr == nil)
	// Last: on a kernel without the bpf LSM it is always there, and the
	// summary line names the first warning.
	if s.Mode == "userwall" && s.Source == "kernel" && !s.UnixLSM {
		why := "BPF LSM programs could not be loaded or attached"
		if ok, how := kernel.LSMActive(); !ok && how != "" && how[0] == '/' {
			why = "the bpf LSM is not enabled (" + how + "); boot with lsm=...,bpf"
		}
		s.Warnings = append(s.Warnings, "abstract Unix sockets are NOT isolated: "+why)
	}
	s.Headline = s.Summary()
	return s, nil
}

// Summary is status's first line: whether the node enforces and the worst
// of what is wrong, so that a glance (or `head -1`) tells.
func (s *Status) Summary() string {
	more := func(n int) string {
		if n <= 0 {
			return ""
		}
		return fmt.Sprintf(" (+%d more below)", n)
	}
	var state string
	switch {
	case s.Mode == "none":
		return "NOT ENFORCING: no userwall programs in force on this node"
	case s.Mode != "userwall":
		state = "UNKNOWN"
	case s.Audit:
		state = "AUDIT (nothing is refused)"
	case !s.Enabled && s.Source == "kernel":
		state = "NOT ENFORCING (programs disabled)"
	default:
		state = "enforcing"
	}
	switch {
	case len(s.Errors) > 0:
		return fmt.Sprintf("%s, ERROR: %s%s", state, s.Errors[0], more(len(s.Errors)-1+len(s.Warnings)))
	case len(s.Warnings) > 0:
		return fmt.Sprintf("%s, WARNING: %s%s", state, s.Warnings[0], more(len(s.Warnings)-1))
	}
	return state + ", no warnings"
}
