// Package relay joins two byte streams: the one relay of the paths that
// terminate a connection on one side and re-open it on the other (egress's
// SOCKS5 server and gVisor stacks, the portal's delegated connections).
package relay

import (
	"io"
	"net"
	"sync"
)

// Splice copies both ways and half-closes, so request/response protocols
// that shut down their write side keep working; it closes both ends when
// both directions are done.
func Splice(a, b net.Conn) {
	var wg sync.WaitGroup
	cp := func(dst, src net.Conn) {
		defer wg.Done()
		io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		} else {
			dst.Close()
		}
	}
	wg.Add(2)
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
	a.Close()
	b.Close()
}
