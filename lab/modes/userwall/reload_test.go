package userwall

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
)

// signalReload sends SIGHUP to node's agent and waits for its answer: the
// reload count in the agent's state file (written last, once the reload is
// applied or refused). It returns the state that answers.
func signalReload(node string) (*control.AgentState, error) {
	pidFile := AgentPidFile(tb, node)
	pid := control.ReadPid(pidFile)
	if pid == 0 {
		return nil, fmt.Errorf("%s: no agent running", node)
	}
	before, err := control.ReadState(pidFile)
	if err != nil || before.PID != pid {
		return nil, fmt.Errorf("%s: no state of agent %d: %v", node, pid, err)
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if s, err := control.ReadState(pidFile); err == nil && s.PID == pid && s.Reloads > before.Reloads {
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
func reload(t *testing.T, node string) *control.AgentState {
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
	before, err := control.ReadState(AgentPidFile(tb, node))
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

// TestHUPWhileStarting: SIGHUPs that reach the agent while it loads, or
// right after it wrote its pid file (where `agent --reload` finds it), are
// reloads once its loop runs, never its end: SIGHUP's default action
// terminates the process (ci5: node2's agent, restarted by a test's
// cleanup, got the next cleanup's reload before its loop had asked for
// SIGHUP, died, and the test waited 30 s for an answer). The signals start
// once the agent has logged its start, where RunAgent has them caught: one
// while it loads, one as soon as its pid file is there.
func TestHUPWhileStarting(t *testing.T) {
	needTestbed(t)
	n := tb.Nodes[len(tb.Nodes)-1]
	pidFile := AgentPidFile(tb, n.Name)
	// Its programs stay pinned: the next agent adopts them.
	if err := TermAgent(tb, n.Name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := StartAgent(context.Background(), tb, n); err != nil {
			t.Error(err)
		}
	})
	logPath := filepath.Join(t.TempDir(), "agent.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := nodeCommand(context.Background(), tb, n, "agent")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// nsenter execs the agent: same pid.
	pid := cmd.Process.Pid
	hups := 0
	for t0 := time.Now(); control.ReadPid(pidFile) == 0; {
		if time.Since(t0) > 2*time.Minute {
			b, _ := os.ReadFile(logPath)
			cmd.Process.Kill()
			t.Fatalf("the agent did not start in 2 minutes (%d SIGHUPs):\n%s", hups, b)
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("the agent ended while starting (%v) after %d SIGHUPs:\n%s", err, hups, b)
		case <-time.After(2 * time.Millisecond):
		}
		// One while it loads (not a stream: a signal pending during
		// BPF_PROG_LOAD makes the verifier start over, and a stream faster
		// than a verification would never let it finish).
		if b, _ := os.ReadFile(logPath); hups == 0 && strings.Contains(string(b), "palisade agent starting") {
			syscall.Kill(pid, syscall.SIGHUP)
			hups++
		}
	}
	if got := control.ReadPid(pidFile); got != pid {
		t.Fatalf("the pid file names %d, not the process started (%d): the signals went elsewhere", got, pid)
	}
	// And right after the pid file, as `agent --reload` would.
	syscall.Kill(pid, syscall.SIGHUP)
	hups++
	if hups < 2 {
		t.Fatal("the agent wrote its pid file before the test saw it start: no SIGHUP reached it while loading")
	}
	for i := 0; ; i++ {
		s, err := control.ReadState(pidFile)
		if err == nil && s.PID == pid && s.Reloads >= 1 && s.LastReloadError == "" {
			t.Logf("%d SIGHUPs while starting: agent %d alive, %d reload(s)", hups, pid, s.Reloads)
			break
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("the agent ended after %d SIGHUPs (%v):\n%s", hups, err, b)
		case <-time.After(20 * time.Millisecond): // polling its acknowledgement, the state file
		}
		if i == 3000 {
			t.Fatalf("agent %d: no reload answered after %d SIGHUPs (%+v, %v)", pid, hups, s, err)
		}
	}
	// The agent keeps running as the node's (StartAgent in the cleanup finds it).
}
