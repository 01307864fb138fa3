package procfs

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"
)

func TestAliveAndCmdline(t *testing.T) {
	if !Alive(os.Getpid()) {
		t.Fatal("this process is not alive")
	}
	if _, pp, ok := Stat(os.Getpid()); !ok || pp != os.Getppid() {
		t.Fatalf("Stat(self) ppid = %d, %v; want %d", pp, ok, os.Getppid())
	}
	// A command name (comm in /proc/PID/stat) with a space and a ')'.
	bin, err := os.ReadFile("/bin/sleep")
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(t.TempDir(), "x) y")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	want := []string{exe, "30"}
	cmd := exec.Command(exe, "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	defer cmd.Process.Kill()
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Equal(Cmdline(pid), want) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := Cmdline(pid); !slices.Equal(got, want) {
		t.Fatalf("Cmdline = %q", got)
	}
	if s, pp, ok := Stat(pid); !ok || pp != os.Getpid() || s == 'Z' {
		t.Fatalf("Stat(child) = %c %d %v", s, pp, ok)
	}
	if !Alive(pid) {
		t.Fatal("running child not alive")
	}
	// Exited but not reaped: a zombie counts as dead.
	cmd.Process.Signal(syscall.SIGKILL)
	for {
		if s, _, _ := Stat(pid); s == 'Z' || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if Alive(pid) {
		t.Fatal("zombie child counted as alive")
	}
	cmd.Wait()
	if Alive(pid) || Cmdline(pid) != nil {
		t.Fatal("reaped child still seen")
	}
	if Alive(0) || Alive(-1) {
		t.Fatal("pid <= 0 counted as alive")
	}
}
