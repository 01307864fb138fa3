package userwall

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
)

// signalReload sends SIGHUP to node's agent and waits for its answer: the
// reload count in the agent's state file (written last, once the reload is
// applied or refused). It returns the state that answers.
func signalReload(node string) (*uw.AgentState, error) {
	pidFile := AgentPidFile(tb, node)
	pid := uw.ReadPid(pidFile)
	if pid == 0 {
		return nil, fmt.Errorf("%s: no agent running", node)
	}
	before, err := uw.ReadState(pidFile)
	if err != nil || before.PID != pid {
		return nil, fmt.Errorf("%s: no state of agent %d: %v", node, pid, err)
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if s, err := uw.ReadState(pidFile); err == nil && s.PID == pid && s.Reloads > before.Reloads {
			return s, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s: agent %d did not answer the reload within 30 s", node, pid)
		}
		time.Sleep(20 * time.Millisecond) // polling the acknowledgement
	}
}

// reload reloads node's agent and fails the test unless the configuration
// was applied (a new generation).
func reload(t *testing.T, node string) *uw.AgentState {
	t.Helper()
	s, err := signalReload(node)
	if err != nil {
		t.Fatal(err)
	}
	if s.LastReloadError != "" {
		t.Fatalf("%s: reload refused: %s", node, s.LastReloadError)
	}
	return s
}

// reloadRefused reloads node's agent and fails the test unless the agent
// refused the configuration (same generation); it returns the reason.
func reloadRefused(t *testing.T, node string) string {
	t.Helper()
	before, err := uw.ReadState(AgentPidFile(tb, node))
	if err != nil {
		t.Fatal(err)
	}
	s, err := signalReload(node)
	if err != nil {
		t.Fatal(err)
	}
	if s.LastReloadError == "" || s.Generation != before.Generation {
		t.Fatalf("%s: reload applied (generation %d → %d), want refused", node, before.Generation, s.Generation)
	}
	return s.LastReloadError
}
