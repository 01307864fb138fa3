package control

import (
	"context"
	"errors"
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

// Signal sends sig to pid through a pidfd (never to a process that took
// the pid since it was read) and waits up to within for the process to
// exit, on the pidfd: exited is true once it has, or if it was gone
// already.
func Signal(pid int, sig unix.Signal, within time.Duration) (exited bool, err error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("pid %d: %w", pid, err)
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, sig, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return true, nil
		}
		return false, fmt.Errorf("%v to pid %d: %w", sig, pid, err)
	}
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(within)
	for {
		n, err := unix.Poll(fds, int(max(time.Until(deadline), 0).Milliseconds()))
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return false, fmt.Errorf("waiting for pid %d: %w", pid, err)
		}
		return n > 0, nil // readable: the process has exited
	}
}
