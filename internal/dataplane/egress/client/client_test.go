package client

import (
	"runtime"
	"testing"
)

// TestSerialTunnel: the tun path runs on one P unless GOMAXPROCS says
// otherwise (a site's explicit setting wins).
func TestSerialTunnel(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(2)
	t.Setenv("GOMAXPROCS", "")
	serialTunnel()
	if n := runtime.GOMAXPROCS(0); n != 1 {
		t.Fatalf("GOMAXPROCS unset: %d Ps, want 1", n)
	}
	runtime.GOMAXPROCS(2)
	t.Setenv("GOMAXPROCS", "2")
	serialTunnel()
	if n := runtime.GOMAXPROCS(0); n != 2 {
		t.Fatalf("GOMAXPROCS=2 in the environment: %d Ps, want 2 kept", n)
	}
}
