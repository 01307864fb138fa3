// Package peercred is the one reader of a Unix socket peer's credentials
// (SO_PEERCRED): the kernel's record of the process that connected, which
// the peer cannot forge.
package peercred

import (
	"net"

	"golang.org/x/sys/unix"
)

// Of returns the credentials of c's peer as of its connect().
func Of(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cr *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		cr, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cr, gerr
}
