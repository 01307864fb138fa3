package portal

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// ownerError: the kernel did not record the socket as the user's (the
// delegation refuses rather than hand over a socket of someone else).
type ownerError struct{ msg string }

func (e *ownerError) Error() string { return e.msg }

// socketAs creates (and binds, to an ephemeral port) a TCP socket whose
// creator, to the kernel, is uid/gid: userwall takes a socket's owner from
// the creating task's filesystem ids (task_owner's rule), as the kernel
// records sk_uid. A thread of its own takes
// those ids for the socket() call and then ends with its goroutine (locked,
// never unlocked), so no other goroutine ever runs with them.
func socketAs(family int, uid, gid uint32) (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		fd, err := func() (int, error) {
			// The group first: setfsgid needs CAP_SETGID, which a
			// non-zero fsuid leaves in place anyway.
			unix.SetfsgidRetGid(int(gid))
			if cur, _ := unix.SetfsgidRetGid(-1); cur != int(gid) {
				return -1, fmt.Errorf("setfsgid(%d) did not take (fsgid %d)", gid, cur)
			}
			unix.SetfsuidRetUid(int(uid))
			if cur, _ := unix.SetfsuidRetUid(-1); cur != int(uid) {
				return -1, fmt.Errorf("setfsuid(%d) did not take (fsuid %d)", uid, cur)
			}
			fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
			if err != nil {
				return -1, err
			}
			// Bound here, with the same ids: userwall keeps no record for
			// a TCP socket at socket() (it reads the ids its file keeps),
			// but makes one at bind (post_bind) by the same rule, which
			// connectAs checks.
			var sa unix.Sockaddr = &unix.SockaddrInet4{}
			if family == unix.AF_INET6 {
				sa = &unix.SockaddrInet6{}
			}
			if err := unix.Bind(fd, sa); err != nil {
				unix.Close(fd)
				return -1, fmt.Errorf("bind: %w", err)
			}
			return fd, nil
		}()
		ch <- result{fd, err}
	}()
	r := <-ch
	return r.fd, r.err
}

// connectAs makes a TCP connection to a:port as uid/gid and returns its
// descriptor (blocking mode, close-on-exec). The kernel's owner record is
// checked before anything is sent.
func connectAs(ctx context.Context, k Kernel, uid, gid uint32, a netip.Addr, port uint16) (int, error) {
	family := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(port), Addr: a.As16()}
	if a.Is4() {
		family = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(port), Addr: a.As4()}
	}
	fd, err := socketAs(family, uid, gid)
	if err != nil {
		return -1, err
	}
	ok := false
	defer func() {
		if !ok {
			unix.Close(fd)
		}
	}()
	ouid, ogid, err := k.SocketOwner(fd)
	if err != nil {
		return -1, &ownerError{fmt.Sprintf("the kernel has no owner record for the socket: %v", err)}
	}
	if ouid != uid || ogid != gid {
		return -1, &ownerError{fmt.Sprintf("the kernel recorded the socket as %d:%d, not %d:%d", ouid, ogid, uid, gid)}
	}
	if err := unix.Connect(fd, sa); err != nil && err != unix.EINPROGRESS && err != unix.EINTR {
		return -1, err
	}
	deadline, _ := ctx.Deadline()
	for {
		ms := 1000
		if !deadline.IsZero() {
			left := time.Until(deadline)
			if left <= 0 {
				return -1, fmt.Errorf("connect: timed out")
			}
			ms = int(min(left, time.Second) / time.Millisecond)
		}
		if ctx.Err() != nil {
			return -1, ctx.Err()
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(fds, max(ms, 1))
		if err == unix.EINTR || (err == nil && n == 0) {
			continue
		}
		if err != nil {
			return -1, err
		}
		break
	}
	soerr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return -1, err
	}
	if soerr != 0 {
		return -1, unix.Errno(soerr)
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		return -1, err
	}
	ok = true
	return fd, nil
}

func unixRights(fd int) []byte { return unix.UnixRights(fd) }

func closeFD(fd int) { unix.Close(fd) }
