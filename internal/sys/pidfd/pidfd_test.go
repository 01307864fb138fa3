package pidfd

import (
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestSignalWaitsForExit: Signal returns exited once the process has
// exited, and not for one that ignores the signal.
func TestSignalWaitsForExit(t *testing.T) {
	start := func(script string) *exec.Cmd {
		cmd := exec.Command("sh", "-c", script)
		out, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// The shell says when its trap is set.
		buf := make([]byte, 6)
		if _, err := out.Read(buf); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	stubborn := start(`trap "" TERM; echo ready; exec sleep 60`)
	if exited, err := Signal(stubborn.Process.Pid, unix.SIGTERM, 200*time.Millisecond); err != nil || exited {
		t.Fatalf("SIGTERM to a process ignoring it: exited %v, %v", exited, err)
	}
	if exited, err := Signal(stubborn.Process.Pid, unix.SIGKILL, time.Minute); err != nil || !exited {
		t.Fatalf("SIGKILL: exited %v, %v", exited, err)
	}
	polite := start(`echo ready; exec sleep 60`)
	if exited, err := Signal(polite.Process.Pid, unix.SIGTERM, time.Minute); err != nil || !exited {
		t.Fatalf("SIGTERM: exited %v, %v", exited, err)
	}
}
