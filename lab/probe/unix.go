package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// Abstract Unix sockets (Linux): a listener with Unix set also serves the
// stream socket "@palprobe-<port>" and the datagram socket
// "@palprobe-<port>-dg" for each of its ports. Abstract names live in the
// network namespace, so every node has its own.
const (
	ProtoUnixStream = "unix"     // Target.Proto of a stream case
	ProtoUnixDgram  = "unixgram" // Target.Proto of a datagram case
)

// UnixName is the abstract name (with Go's leading '@') a listener serves
// for port and proto (ProtoUnixStream or ProtoUnixDgram).
func UnixName(port uint16, proto string) string {
	if proto == ProtoUnixDgram {
		return fmt.Sprintf("@palprobe-%d-dg", port)
	}
	return fmt.Sprintf("@palprobe-%d", port)
}

func portOfUnixName(name string) uint16 {
	var p uint16
	fmt.Sscanf(strings.TrimPrefix(name, "@palprobe-"), "%d", &p)
	return p
}

func (l *Listener) listenUnix(ports []uint16) error {
	for _, p := range ports {
		tl, err := net.Listen("unix", UnixName(p, ProtoUnixStream))
		if err != nil {
			return fmt.Errorf("probe listen: %w", err)
		}
		l.unix = append(l.unix, tl)
		uc, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: UnixName(p, ProtoUnixDgram), Net: "unixgram"})
		if err != nil {
			return fmt.Errorf("probe listen: %w", err)
		}
		l.unixgram = append(l.unixgram, uc)
	}
	return nil
}

func (l *Listener) serveUnixgram(uc *net.UnixConn) {
	defer l.wg.Done()
	port := portOfUnixName(uc.LocalAddr().String())
	buf := make([]byte, maxMsg)
	for {
		n, src, err := uc.ReadFromUnix(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		nonce, err := parseRequest(buf[:n])
		if err != nil || src == nil || src.Name == "" {
			continue // an unbound sender cannot be answered
		}
		uc.WriteToUnix(formatReply(Reply{Nonce: nonce, Identity: l.self, Port: port, Proto: ProtoUnixDgram}), src)
	}
}

// unixDgram sends from a socket bound to its own abstract name (the
// listener answers to it) and connected to the listener, retrying like UDP.
func (c *Connector) unixDgram(ctx context.Context, t Target, nonce string) (Reply, error) {
	laddr := &net.UnixAddr{Name: fmt.Sprintf("@palprobe-c-%d-%s", os.Getpid(), nonce), Net: "unixgram"}
	conn, err := net.DialUnix("unixgram", laddr, &net.UnixAddr{Name: t.Addr, Net: "unixgram"})
	if err != nil {
		return Reply{}, err
	}
	defer conn.Close()
	return c.exchange(ctx, conn, t, nonce)
}
