package vm

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// TestMain lets the test binary act as a hub, as `palisade-lab vm hub`
// would (PAL_VM_TEST_HUB_DIR, PAL_VM_TEST_HUB_OWNER).
func TestMain(m *testing.M) {
	if dir := os.Getenv("PAL_VM_TEST_HUB_DIR"); dir != "" {
		owner, _ := strconv.Atoi(os.Getenv("PAL_VM_TEST_HUB_OWNER"))
		if err := RunHub(dir, owner); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestHubGoesWithOwner: a hub whose owner (the test that started the VM)
// dies stops its guest and exits, whether it holds the machine's VM lock or
// still waits for it, so a killed test never leaves a guest blocking every
// later VM test. The "guest" is a sleep; the control: without an owner the
// hub outlives the process that started it.
func TestHubGoesWithOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (the VM lock lives in the system cache directory)")
	}
	if err := os.MkdirAll(CacheDir(), 0o755); err != nil {
		t.Fatal(err)
	}
	// start runs a hub whose "guest" is a sleep; done closes when the hub
	// has exited (one waiter per process).
	start := func(withOwner bool) (done chan struct{}, guest func() int, ownerProc *exec.Cmd) {
		dir := t.TempDir()
		// The hub appends the /etc snapshot to -initrd's file (etc.go).
		initrd := filepath.Join(dir, "base.img")
		if err := os.WriteFile(initrd, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal([]string{"sh", "-c", "exec sleep 600", "-initrd", initrd})
		if err := os.WriteFile(filepath.Join(dir, fileQemuArgs), b, 0o644); err != nil {
			t.Fatal(err)
		}
		ownerProc = exec.Command("sleep", "600")
		if err := ownerProc.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ownerProc.Process.Kill(); ownerProc.Wait() })
		owner := 0
		if withOwner {
			owner = ownerProc.Process.Pid
		}
		hub := exec.Command(os.Args[0])
		hub.Env = append(os.Environ(), "PAL_VM_TEST_HUB_DIR="+dir, "PAL_VM_TEST_HUB_OWNER="+strconv.Itoa(owner))
		if err := hub.Start(); err != nil {
			t.Fatal(err)
		}
		done = make(chan struct{})
		go func() { hub.Wait(); close(done) }()
		t.Cleanup(func() { hub.Process.Kill(); <-done })
		guest = func() int {
			b, err := os.ReadFile(filepath.Join(dir, fileQemuPID))
			if err != nil {
				return 0
			}
			pid, _ := strconv.Atoi(string(b))
			return pid
		}
		return done, guest, ownerProc
	}
	exited := func(done chan struct{}, within time.Duration) bool {
		select {
		case <-done:
			return true
		case <-time.After(within):
			return false
		}
	}

	hub, guest, owner := start(true)
	// With the lock (another guest may hold it: then the hub waits, which
	// is the other case this test is about).
	deadline := time.Now().Add(5 * time.Second)
	for guest() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // polling a file the hub writes; no acknowledgement to wait on
	}
	g := guest()
	owner.Process.Kill()
	owner.Wait()
	if !exited(hub, 10*time.Second) {
		t.Fatalf("hub still running 10 s after its owner died (guest pid %d)", g)
	}
	if g != 0 {
		// Killed, it may linger as a zombie until init reaps it.
		if gone := func() bool {
			for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
				if !procfs.Alive(g) {
					return true
				}
			}
			return false
		}(); !gone {
			syscall.Kill(g, syscall.SIGKILL)
			t.Errorf("guest %d outlived its hub", g)
		}
	} else {
		t.Logf("the hub was waiting for the VM lock (another guest up): it left while waiting")
	}

	// Control: no owner, the starter's death changes nothing.
	hub, _, owner = start(false)
	owner.Process.Kill()
	owner.Wait()
	if exited(hub, 2*time.Second) {
		t.Errorf("a hub without an owner exited when an unrelated process did")
	}
}
