package nldump

import (
	"errors"
	"fmt"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestRetry(t *testing.T) {
	calls := 0
	v, err := Retry(func() ([]int, error) {
		calls++
		if calls < 3 {
			return []int{1}, fmt.Errorf("list: %w", netlink.ErrDumpInterrupted)
		}
		return []int{1, 2}, nil
	})
	if err != nil || len(v) != 2 || calls != 3 {
		t.Fatalf("got %v, %v after %d calls; want the full list after 3", v, err, calls)
	}

	calls = 0
	_, err = Retry(func() ([]int, error) { calls++; return nil, netlink.ErrDumpInterrupted })
	if !errors.Is(err, netlink.ErrDumpInterrupted) || calls != attempts {
		t.Fatalf("always interrupted: %v after %d calls, want the error after %d", err, calls, attempts)
	}

	other := errors.New("permission denied")
	calls = 0
	if _, err = Retry(func() ([]int, error) { calls++; return nil, other }); err != other || calls != 1 {
		t.Fatalf("other error: %v after %d calls, want it at once", err, calls)
	}
}
