package control

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"
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
	pid := ReadPid(cfg.Agent.PidFile)
	if pid == 0 {
		return fmt.Errorf("no running agent (%s)", cfg.Agent.PidFile)
	}
	before, serr := ReadState(cfg.Agent.PidFile)
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return err
	}
	if serr != nil || before.PID != pid {
		return nil // an agent that does not report reloads
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return errors.New("the agent did not acknowledge the reload within 30 s")
		case <-tick.C:
		}
		s, err := ReadState(cfg.Agent.PidFile)
		if err != nil || s.Reloads <= before.Reloads {
			continue
		}
		if s.LastReloadError != "" {
			return fmt.Errorf("the agent refused the configuration: %s", s.LastReloadError)
		}
		return nil
	}
}

// SignalReopen asks the running agent to reopen its event log (SIGUSR1:
// after logrotate moved it) and waits for its acknowledgement. Nothing else
// is reloaded.
func SignalReopen(o Options) error {
	cfg, err := o.LoadConfig()
	if err != nil {
		return err
	}
	pid := ReadPid(cfg.Agent.PidFile)
	if pid == 0 {
		return fmt.Errorf("no running agent (%s)", cfg.Agent.PidFile)
	}
	before, serr := ReadState(cfg.Agent.PidFile)
	if err := syscall.Kill(pid, syscall.SIGUSR1); err != nil {
		return err
	}
	if serr != nil || before.PID != pid {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if s, err := ReadState(cfg.Agent.PidFile); err == nil && s.LogReopens > before.LogReopens {
			return nil
		}
		time.Sleep(20 * time.Millisecond) // polling the acknowledgement
	}
	return errors.New("the agent did not acknowledge within 30 s")
}
