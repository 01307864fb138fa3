package control

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
)

// AgentState is what a running agent tells everyone about itself, in a
// world-readable file next to its pid file (StatePath): status for users
// who may not read the pinned kernel objects, reload acknowledgements for
// `palisade agent --reload`, and the configuration identity for monitoring.
type AgentState struct {
	PID       int       `json:"pid"`
	Version   string    `json:"version"`
	Commit    string    `json:"commit"`
	Started   time.Time `json:"started"`
	Config    string    `json:"config"`
	ConfigSHA string    `json:"config_sha256"`
	// SharedSHA is the hash of the cluster-wide tables of the running
	// configuration (config.Config.SharedSHA256): equal on every node.
	SharedSHA string `json:"shared_sha256"`
	// Generation counts configurations applied since the agent started
	// (1 = the one it started with); Reloads counts SIGHUPs handled,
	// applied or refused.
	Generation uint64 `json:"generation"`
	Reloads    uint64 `json:"reloads"`
	// LogReopens counts SIGUSR1s handled: event log reopened (logrotate).
	LogReopens      uint64    `json:"log_reopens"`
	LastReload      time.Time `json:"last_reload"`
	LastReloadError string    `json:"last_reload_error,omitempty"`
	Audit           bool      `json:"audit"`
	UnenforcedNodes []string  `json:"unenforced_nodes,omitempty"`
	UnixLSM         bool      `json:"unix_enforced"`
	// PinDir is where the agent's programs are pinned (status follows the
	// running agent, not a bpffs the file may name since).
	PinDir string `json:"pin_dir"`
	// Findings are config check's warnings and errors for the running
	// configuration (Slurm's accounts, risky settings).
	Findings []config.Finding `json:"findings,omitempty"`
	// Notes are problems of the running agent (a metrics address not bound).
	Notes []string `json:"notes,omitempty"`
	// KeyLoaded: the configured cluster key is in force (else the node
	// seals with a random key and trusts no other node's identity).
	KeyLoaded bool `json:"key_loaded"`
	// Unresolved counts exempt names NSS could not resolve (retried at
	// every group refresh).
	Unresolved int `json:"unresolved_names,omitempty"`
}

// StatePath is the agent state file that belongs to a pid file.
func StatePath(pidFile string) string {
	return strings.TrimSuffix(pidFile, ".pid") + ".state.json"
}

// ReadState reads an agent state file.
func ReadState(pidFile string) (*AgentState, error) {
	b, err := os.ReadFile(StatePath(pidFile))
	if err != nil {
		return nil, err
	}
	var s AgentState
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: %w", StatePath(pidFile), err)
	}
	return &s, nil
}

// removeState removes the state file of an uninstalled node.
func removeState(pidFile string) { os.Remove(StatePath(pidFile)) }

// liveState is the state of the running agent of pidFile (nil if none).
func liveState(pidFile string, pid int) *AgentState {
	st, err := ReadState(pidFile)
	if err != nil || pid == 0 || st.PID != pid {
		return nil
	}
	return st
}
