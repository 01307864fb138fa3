package control

import (
	"context"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// SignalReload asks the namespace's running agent to reload (SIGHUP) and
// waits for its answer in the state file: nil once the new configuration is
// applied, the agent's reason when it refused it. The file is checked here
// first, so that a bad file is refused with its errors before any signal.
func SignalReload(o Options) error {
	cfg, err := o.LoadTestedConfig()
	if err != nil {
		return fmt.Errorf("configuration refused, agent not signalled: %w", err)
	}
	return signalAcked(cfg.Agent.PidFile, unix.SIGHUP, "the reload", func(before, now *AgentState) (bool, error) {
		if now.Reloads <= before.Reloads {
			return false, nil
		}
		if now.LastReloadError != "" {
			return true, fmt.Errorf("the agent refused the configuration: %s", now.LastReloadError)
		}
		return true, nil
	})
}

// SignalReopen asks the running agent to reopen its event log (SIGUSR1:
// after logrotate moved it) and waits for its acknowledgement. Nothing else
// is reloaded.
func SignalReopen(o Options) error {
	cfg, err := o.LoadConfig()
	if err != nil {
		return err
	}
	return signalAcked(cfg.Agent.PidFile, unix.SIGUSR1, "the log reopen", func(before, now *AgentState) (bool, error) {
		return now.LogReopens > before.LogReopens, nil
	})
}

// signalAcked sends sig to the agent of pidFile and waits (30 s at most)
// until its state file acknowledges it (acked: done, and the agent's
// answer). An agent that writes no state file is only signalled.
func signalAcked(pidFile string, sig unix.Signal, what string, acked func(before, now *AgentState) (bool, error)) error {
	pid := ReadPid(pidFile)
	if pid == 0 {
		return fmt.Errorf("no running agent (%s)", pidFile)
	}
	before, serr := ReadState(pidFile)
	if err := unix.Kill(pid, sig); err != nil {
		return err
	}
	if serr != nil || before.PID != pid {
		return nil // an agent that does not report acknowledgements
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond) // polling the acknowledgement: the file is all the agent writes
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the agent did not acknowledge %s within 30 s", what)
		case <-tick.C:
		}
		if now, err := ReadState(pidFile); err == nil {
			if done, err := acked(before, now); done {
				return err
			}
		}
	}
}
