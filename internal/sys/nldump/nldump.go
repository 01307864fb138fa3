// Package nldump reads netlink tables consistently. The kernel marks a dump
// NLM_F_DUMP_INTR when the table changed while it was read (another user's
// uvn setup, an interface coming up); vishvananda/netlink then returns the
// partial listing with ErrDumpInterrupted, and deciding on it would miss
// links, addresses or routes. Retrying gives a consistent one.
package nldump

import (
	"errors"

	"github.com/vishvananda/netlink"
)

// attempts bounds the retries: a table that changes on every read for this
// long is reported as an error rather than read forever.
const attempts = 10

// Retry calls list until it returns a dump that was not interrupted.
func Retry[T any](list func() ([]T, error)) ([]T, error) {
	for i := 1; ; i++ {
		v, err := list()
		if !errors.Is(err, netlink.ErrDumpInterrupted) || i == attempts {
			return v, err
		}
	}
}
