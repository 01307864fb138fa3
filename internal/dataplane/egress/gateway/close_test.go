package gateway

import (
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// TestCloseJoins: Close returns once the gateway's goroutines (joins,
// housekeeping, DNS over UDP and TCP) have ended, and leaves none behind.
// Netstack mode in a scratch network namespace (this test's thread, which
// is discarded at the end).
func TestCloseJoins(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	runtime.LockOSThread()
	if _, err := netns.New(); err != nil {
		t.Fatal(err)
	}
	if lo, err := netlink.LinkByName("lo"); err != nil || netlink.LinkSetUp(lo) != nil {
		t.Fatal("lo:", err)
	}
	before := runtime.NumGoroutine()
	g, err := Start(Config{StateDir: t.TempDir(), ListenPort: 29400, Mode: "netstack", Logf: t.Logf})
	if err != nil {
		if g != nil {
			g.Close()
		}
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); g.Close() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return")
	}
	// Ours have ended when Close returns.
	buf := make([]byte, 1<<20)
	stacks := string(buf[:runtime.Stack(buf, true)])
	for _, fn := range []string{"(*Gateway).serveJoins", "(*Gateway).housekeeping", "(*Responder).Serve"} {
		if strings.Contains(stacks, fn) {
			t.Errorf("%s still running after Close", fn)
		}
	}
	// wireguard-go and gVisor end some goroutines of their own
	// asynchronously after Close: allow them a moment, then compare.
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		runtime.Gosched()
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Errorf("%d goroutines after Close, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}
