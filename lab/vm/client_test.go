package vm

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestWaitReadyQueued: WaitReady's timeout counts from when the hub took
// the machine's VM lock. A hub still queued for it is waited for (bounded by
// ctx); once it holds the lock the timeout applies; a hub that is gone ends
// the wait at once.
func TestWaitReadyQueued(t *testing.T) {
	dir := t.TempDir()
	hub := exec.Command("sleep", "600") // a live hub that never opens hub.sock
	if err := hub.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { hub.Process.Kill(); hub.Wait() }()
	os.WriteFile(filepath.Join(dir, fileHubPID), []byte(strconv.Itoa(hub.Process.Pid)), 0o644)

	// Queued: 50 ms of timeout, still waiting after 500 ms; ctx ends it.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := WaitReady(ctx, dir, 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("queued hub: %v, want the context's deadline", err)
	}
	// Lock taken 1 s ago, timeout 50 ms: no VM, without waiting for ctx.
	p := filepath.Join(dir, fileLocked)
	os.WriteFile(p, nil, 0o644)
	old := time.Now().Add(-time.Second)
	os.Chtimes(p, old, old)
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	if _, err := WaitReady(ctx2, dir, 50*time.Millisecond); !errors.Is(err, ErrNoVM) {
		t.Fatalf("hub holding the lock past its timeout: %v, want ErrNoVM (not the context's end)", err)
	}
	// Gone hub, never locked: no VM at once.
	os.Remove(p)
	hub.Process.Kill()
	hub.Wait()
	if _, err := WaitReady(ctx2, dir, time.Hour); !errors.Is(err, ErrNoVM) {
		t.Fatalf("gone hub: %v, want ErrNoVM", err)
	}
}
