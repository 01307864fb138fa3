package control

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

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

// GetStatus inspects the pins of the caller's namespace and what its
// running agent reports. probe runs the kernel feature probe (root only; it
// loads programs, so the agent's own status report leaves it out).
func GetStatus(o Options, probe bool) (*Status, error) {
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

// addAgentState completes a status with what the running agent reports:
// version, configuration identity, reloads, audit mode, findings. For a
// user who may not read the pinned objects (bpffs is root's), the agent's
// state file is the only source: without it the mode is "unknown", never
// "none" (which would tell a user on an enforcing node that it is open).
func (s *Status) addAgentState(cfg *config.Config, cfgOK bool) {
	st, err := ReadState(cfg.Agent.PidFile)
	live := err == nil && s.AgentPID != 0 && st.PID == s.AgentPID
	// A user may not read the pinned objects; root in another mount
	// namespace (`ip netns exec` mounts a fresh sysfs) does not see them.
	// Either way the running agent knows: never report "none" for it.
	if s.Mode != "userwall" && (os.Geteuid() != 0 || live) {
		s.Source, s.Mode, s.Nft, s.Counters, s.Warnings = "agent", "unknown", false, nil, nil
		if !cfgOK {
			s.Warnings = append(s.Warnings, "configuration "+cfg.Path+" invalid (a reload would be refused)")
		}
		if !live {
			s.Warnings = append(s.Warnings, "not root: the kernel's programs are not readable, and no running agent reports its state; run as root to know")
			return
		}
		s.Mode, s.Enabled, s.UnixLSM = "userwall", true, st.UnixLSM
		if !st.UnixLSM {
			s.Warnings = append(s.Warnings, "abstract Unix sockets are NOT isolated (the agent could not attach its BPF LSM programs)")
		}
	}
	if !live {
		return
	}
	s.Agent = st
	if s.Source == "agent" {
		s.Audit = st.Audit
		if s.Audit {
			s.Warnings = append(s.Warnings, "audit mode: refusals are reported, NOT enforced")
		}
	}
	if len(st.UnenforcedNodes) > 0 {
		s.Warnings = append(s.Warnings, fmt.Sprintf("staged rollout: identity-less traffic from %s is admitted (rule unverified)", strings.Join(st.UnenforcedNodes, ", ")))
	}
	if st.LastReloadError != "" {
		s.Warnings = append(s.Warnings, fmt.Sprintf("the last reload (%s) was refused: %s", st.LastReload.Format(time.RFC3339), st.LastReloadError))
	}
	if cfgOK && cfg.Path == st.Config && cfg.SHA256 != st.ConfigSHA {
		s.Warnings = append(s.Warnings, fmt.Sprintf("%s changed since the agent applied it (running sha256 %.12s, file %.12s): reload to apply", cfg.Path, st.ConfigSHA, cfg.SHA256))
	}
	for _, f := range st.Findings {
		if f.Level == config.Problem.String() {
			// The key finding says what root's status already says.
			if f.Key == "cluster.key_file" && slices.ContainsFunc(s.Errors, func(e string) bool { return strings.HasPrefix(e, "no usable cluster key") }) {
				continue
			}
			s.Errors = append(s.Errors, "configuration: "+f.String(st.Config))
			continue
		}
		s.Warnings = append(s.Warnings, "configuration warning: "+f.String(st.Config))
	}
	s.Warnings = append(s.Warnings, st.Notes...)
}
