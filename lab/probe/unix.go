package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"
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

func (l *Listener) serveUnix(tl net.Listener) {
	defer l.wg.Done()
	port := portOfUnixName(tl.Addr().String())
	for {
		c, err := tl.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			line, err := readLine(c)
			if err != nil {
				return
			}
			nonce, err := parseRequest(line)
			if err != nil {
				return
			}
			c.Write(formatReply(Reply{Nonce: nonce, Identity: l.self, Port: port, Proto: ProtoUnixStream}))
		}()
	}
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

func (c *Connector) unixStream(ctx context.Context, t Target, nonce string) (Reply, error) {
	d := net.Dialer{Timeout: c.TCPTimeout}
	conn, err := d.DialContext(ctx, "unix", t.Addr)
	if err != nil {
		return Reply{}, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(c.ReplyTimeout))
	if _, err := conn.Write(formatRequest(nonce, t.ID)); err != nil {
		return Reply{}, err
	}
	line, err := readLine(conn)
	if err != nil {
		return Reply{}, err
	}
	rep, err := parseReply(line)
	if err != nil {
		return Reply{}, badReply{err.Error()}
	}
	return rep, nil
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
	req := formatRequest(nonce, t.ID)
	buf := make([]byte, maxMsg)
	var last error = os.ErrDeadlineExceeded
	wait := c.UDPWait
	for try := 0; try < c.UDPTries; try, wait = try+1, wait*2 {
		if err := ctx.Err(); err != nil {
			return Reply{}, err
		}
		if _, err := conn.Write(req); err != nil {
			return Reply{}, err
		}
		conn.SetReadDeadline(time.Now().Add(wait))
		for {
			n, err := conn.Read(buf)
			if err != nil {
				if Classify(err) == KindTimeout {
					last = err
					break
				}
				return Reply{}, err
			}
			rep, perr := parseReply(buf[:n])
			if perr == nil && rep.Nonce == nonce {
				return rep, nil
			}
			last = badReply{"unexpected datagram"}
		}
	}
	return Reply{}, last
}
