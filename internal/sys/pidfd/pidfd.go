// Package pidfd signals a process and waits for its exit through a pidfd:
// the one way the product and the lab stop a process they did not start
// (an agent, a listener behind sg). A pidfd never reaches a process that
// took the pid since it was opened, and its readiness is the exit itself,
// so nothing polls a pid file or /proc.
package pidfd

import (
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

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
