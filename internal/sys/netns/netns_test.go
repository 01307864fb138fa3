package netns

import (
	"errors"
	"os"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"
)

func TestDo(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	// netns.New switches the calling thread: create it on a thread that is
	// then discarded, and keep only the handle.
	made := make(chan netns.NsHandle, 1)
	go lockAndNew(made)
	target := <-made
	if !target.IsOpen() {
		t.Fatal("no namespace made")
	}
	defer target.Close()

	var inside netns.NsHandle
	werr := errors.New("fn error")
	err = Do(target, func() error {
		inside, _ = netns.Get()
		return werr
	})
	defer inside.Close()
	if !errors.Is(err, werr) {
		t.Fatalf("Do returned %v, want fn's error", err)
	}
	if !inside.Equal(target) {
		t.Error("fn did not run in the target namespace")
	}
	after, _ := netns.Get()
	defer after.Close()
	if !after.Equal(orig) {
		t.Error("thread left in the target namespace")
	}
	if err := DoPath("/nonexistent/pal-netns", func() error { return nil }); err == nil {
		t.Error("DoPath on a missing file succeeded")
	}
}

// lockAndNew makes a namespace on a locked thread that is never unlocked,
// so the runtime discards it with its goroutine.
func lockAndNew(out chan<- netns.NsHandle) {
	runtime.LockOSThread()
	h, err := netns.New()
	if err != nil {
		out <- netns.None()
		return
	}
	out <- h
}

func TestDoNew(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	var first, second netns.NsHandle
	werr := errors.New("fn error")
	if err := DoNew(func() (err error) { first, err = netns.Get(); return err }); err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if err := DoNew(func() (err error) { second, _ = netns.Get(); return werr }); !errors.Is(err, werr) {
		t.Fatalf("DoNew returned %v, want fn's error", err)
	}
	defer second.Close()
	if first.Equal(orig) || second.Equal(orig) || first.Equal(second) {
		t.Error("fn did not run in a namespace of its own")
	}
	after, _ := netns.Get()
	defer after.Close()
	if !after.Equal(orig) {
		t.Error("thread left in the new namespace")
	}
}
