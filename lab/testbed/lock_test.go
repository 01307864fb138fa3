package testbed

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLockFile: the per-instance lock file is gone once the instance has no
// state, and removing it never lets two lockers in at once (a waiter that
// wins the lock on the unlinked file must start over on the new one).
func TestLockFile(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (writes to " + BaseDir + ")")
	}
	name := RunName("tk")
	var holders, most atomic.Int32
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 40; j++ {
				unlock, err := lockInstance(name)
				if err != nil {
					t.Error(err)
					return
				}
				if n := holders.Add(1); n > most.Load() {
					most.Store(n)
				}
				time.Sleep(50 * time.Microsecond)
				holders.Add(-1)
				unlock() // no state: removes the file
			}
		}()
	}
	wg.Wait()
	if m := most.Load(); m != 1 {
		t.Errorf("%d holders of the lock at once", m)
	}
	if _, err := os.Stat(lockPath(name)); !os.IsNotExist(err) {
		t.Errorf("%s left behind (%v)", lockPath(name), err)
	}
	// Down of an instance that is not up leaves no lock file either.
	if err := Down(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(lockPath(name)); !os.IsNotExist(err) {
		t.Errorf("Down left %s (%v)", lockPath(name), err)
	}
}
