// Package netns runs code inside another network namespace: the one helper
// for "enter a netns on a locked thread". Namespace membership belongs to an
// OS thread, so the goroutine is locked to its thread while it is switched;
// if the thread cannot be switched back it stays locked, and the Go runtime
// discards it when the goroutine ends instead of running other goroutines
// in the wrong namespace.
package netns

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Do runs fn with the calling goroutine's thread in the network namespace
// target. Things that keep the namespace they were created in (sockets,
// netlink handles) may be used afterwards from any thread.
func Do(target netns.NsHandle, fn func() error) error {
	return in(func(cur netns.NsHandle) error {
		if cur.Equal(target) {
			return nil
		}
		if err := netns.Set(target); err != nil {
			return fmt.Errorf("enter netns: %w", err)
		}
		return nil
	}, fn)
}

// DoNew runs fn with the calling goroutine's thread in a new, empty network
// namespace (a scratch one: it disappears once nothing fn made in it, such as
// a socket, holds it any more).
func DoNew(fn func() error) error {
	return in(func(netns.NsHandle) error {
		ns, err := netns.New() // unshare: the thread is in it from here
		if err != nil {
			return fmt.Errorf("new netns: %w", err)
		}
		ns.Close() // the thread keeps the namespace
		return nil
	}, fn)
}

// in locks the calling goroutine to its thread, lets enter switch the
// thread's namespace, runs fn there and switches back. If enter fails the
// thread is switched back too (it may have left: unshare succeeded, the
// handle did not).
func in(enter func(cur netns.NsHandle) error, fn func() error) error {
	runtime.LockOSThread()
	cur, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("current netns: %w", err)
	}
	defer cur.Close()
	ferr := enter(cur)
	if ferr == nil {
		ferr = fn()
	}
	if err := netns.Set(cur); err != nil {
		return fmt.Errorf("return from netns: %w", err) // thread stays locked: discarded
	}
	runtime.UnlockOSThread()
	return ferr
}

// DoPath is Do with the namespace named by a file (e.g. /run/netns/NAME or
// /proc/PID/ns/net).
func DoPath(path string, fn func() error) error {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("netns %s: %w", path, err)
	}
	defer target.Close()
	return Do(target, fn)
}

// Cookie is the kernel's cookie of the calling thread's network namespace
// (what bpf_get_netns_cookie returns to programs running for its sockets).
func Cookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("SO_NETNS_COOKIE: %w (kernel ≥ 5.14 needed)", err)
	}
	return c, nil
}
