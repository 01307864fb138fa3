// Package unixserve is the one accept loop of the local Unix-socket APIs
// (the agent's flows socket, the portal's delegation socket, the portal
// forwarder): the socket is made under a temporary name, given its mode
// (and group) and only then renamed into place, so it is never reachable
// with a wider mode than asked; every connection is served with its
// peer's credentials (SO_PEERCRED, the kernel's record of who connected),
// within a bound on connections served at once; a handler that panics
// fails its own connection, never the process.
package unixserve

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/peercred"
)

// Listener is a Unix socket made by Listen.
type Listener struct {
	*net.UnixListener
	path string
	file os.FileInfo
}

// Listen creates the socket at path with mode (and group gid, unless
// gid < 0). A stale socket at path is replaced; anything else there is
// refused. The directory is created (0755) if missing.
func Listen(path string, mode os.FileMode, gid int) (*Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket == 0 {
		return nil, fmt.Errorf("%s exists and is not a socket", path)
	}
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	os.Remove(tmp)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	err = os.Chmod(tmp, mode)
	if err == nil && gid >= 0 {
		err = os.Chown(tmp, -1, gid)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, err
	}
	fi, _ := os.Lstat(path)
	return &Listener{UnixListener: l, path: path, file: fi}, nil
}

// Close stops accepting and removes the socket, unless another listener
// has replaced it since (a restarted agent's).
func (l *Listener) Close() error {
	err := l.UnixListener.Close()
	if fi, e := os.Lstat(l.path); e == nil && l.file != nil && os.SameFile(fi, l.file) {
		os.Remove(l.path)
	}
	return err
}

// Handler serves one connection; peer is who connected. release ends the
// connection's claim on the bound early (a connection that stays open
// after its request, such as a held session); it is called again, to no
// effect, when the handler returns. The connection is closed after.
type Handler func(c *net.UnixConn, peer *unix.Ucred, release func())

// Options bound and name a server.
type Options struct {
	// Max is the number of connections served at once; more are closed
	// at once.
	Max int
	// Admit, if set, is asked first for every connection: false closes
	// it at once; done is called when its claim ends (per-peer bounds).
	Admit func(peer *unix.Ucred) (done func(), ok bool)
	// Name and Log report a handler's panic.
	Name string
	Log  *slog.Logger
}

// Serve accepts on l until it is closed (nil) or accepting fails (that
// error), then waits for every handler.
func Serve(l *Listener, o Options, h Handler) error {
	sem := make(chan struct{}, o.Max)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.AcceptUnix()
		if errors.Is(err, net.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		peer, err := peercred.Of(c)
		if err != nil {
			c.Close()
			continue
		}
		done := func() {}
		if o.Admit != nil {
			var ok bool
			if done, ok = o.Admit(peer); !ok {
				c.Close()
				continue
			}
		}
		select {
		case sem <- struct{}{}:
		default:
			done()
			c.Close()
			continue
		}
		wg.Go(func() {
			var once sync.Once
			release := func() { once.Do(func() { <-sem; done() }) }
			// The claim ends before the peer sees the connection close.
			defer c.Close()
			defer release()
			defer func() {
				if p := recover(); p != nil {
					log := o.Log
					if log == nil {
						log = slog.Default()
					}
					log.Error(o.Name+" request failed", "panic", p, "stack", string(debug.Stack()))
				}
			}()
			h(c, peer, release)
		})
	}
}
