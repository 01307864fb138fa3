package portal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Dial asks the agent behind the delegation socket at socketPath for a TCP
// connection to address (host:port) on user's behalf. The caller must be a
// [portal] proxy and user must have a session with it; the connection's
// owner, to the kernel and to every node's policy, is user. A refusal or a
// failed connection is an *Error (Code CodeForbidden, CodeUnreachable, ...).
//
// A host name is resolved here, as the caller sees names (the agent then
// gets an address; each is tried in turn).
func Dial(ctx context.Context, socketPath, user, address string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return nil, &Error{Code: CodeBadRequest, Msg: err.Error()}
	}
	addrs := []string{address}
	if _, err := netip.ParseAddr(host); err != nil {
		ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil, &Error{Code: CodeUnreachable, Msg: err.Error()}
		}
		addrs = addrs[:0]
		for _, ip := range ips {
			addrs = append(addrs, net.JoinHostPort(ip.Unmap().String(), port))
		}
	}
	var resp *Response
	fd := -1
	for _, a := range addrs {
		resp, fd, err = roundTrip(ctx, socketPath, Request{Op: OpConnect, User: user, Address: a})
		var pe *Error
		if err == nil || !errors.As(err, &pe) || pe.Code != CodeUnreachable {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	if fd < 0 {
		return nil, errors.New("portal: the agent answered without a socket")
	}
	f := os.NewFile(uintptr(fd), "portal:"+resp.Address)
	defer f.Close() // FileConn dups it
	return net.FileConn(f)
}

// Register records a session: the calling user allows proxy to open
// connections as her until ttl (0: [portal] max_session) or EndSessions.
// group ("": her primary group) is the group those connections carry.
func Register(ctx context.Context, socketPath, proxy, group string, ttl time.Duration) (*Response, error) {
	req := Request{Op: OpSession, Proxy: proxy, Group: group}
	if ttl > 0 {
		req.TTL = ttl.String()
	}
	resp, _, err := roundTrip(ctx, socketPath, req)
	return resp, err
}

// Hold records a session like Register that also ends when ctx ends (or
// the agent stops: then Hold returns an error). ready is called once the
// session is in place.
func Hold(ctx context.Context, socketPath, proxy, group string, ttl time.Duration, ready func(*Response)) error {
	req := Request{Op: OpSession, Proxy: proxy, Group: group, Hold: true}
	if ttl > 0 {
		req.TTL = ttl.String()
	}
	c, err := dial(ctx, socketPath)
	if err != nil {
		return err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	resp, _, err := exchange(c, req, time.Now().Add(10*time.Second))
	if err != nil {
		return err
	}
	if ready != nil {
		ready(resp)
	}
	c.SetDeadline(time.Time{})
	var b [1]byte
	_, err = c.Read(b[:]) // the agent never writes again: EOF = it ended the session
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("portal: the agent ended the held session: %v", err)
}

// EndSessions ends the caller's sessions with proxy ("" = every proxy).
func EndSessions(ctx context.Context, socketPath, proxy string) (int, error) {
	resp, _, err := roundTrip(ctx, socketPath, Request{Op: OpEnd, Proxy: proxy})
	if err != nil {
		return 0, err
	}
	return resp.Ended, nil
}

// Sessions lists the sessions the caller may see.
func Sessions(ctx context.Context, socketPath string) ([]Session, error) {
	resp, _, err := roundTrip(ctx, socketPath, Request{Op: OpSessions})
	if err != nil {
		return nil, err
	}
	return resp.Sessions, nil
}

func dial(ctx context.Context, socketPath string) (*net.UnixConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socketPath)
	if err != nil {
		return nil, fmt.Errorf("portal: no agent answers on %s: %w", socketPath, err)
	}
	return c.(*net.UnixConn), nil
}

// roundTrip sends req and returns the answer and the descriptor it carried
// (-1: none). An answer that is not OK is returned as its *Error.
func roundTrip(ctx context.Context, socketPath string, req Request) (*Response, int, error) {
	c, err := dial(ctx, socketPath)
	if err != nil {
		return nil, -1, err
	}
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	return exchange(c, req, deadline)
}

func exchange(c *net.UnixConn, req Request, deadline time.Time) (*Response, int, error) {
	c.SetDeadline(deadline)
	b, _ := json.Marshal(req)
	if _, err := c.Write(append(b, '\n')); err != nil {
		return nil, -1, fmt.Errorf("portal: %w", err)
	}
	var line []byte
	fd := -1
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for !bytes.Contains(line, []byte{'\n'}) {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			for _, x := range takeFDs(oob[:oobn]) {
				if fd < 0 {
					fd = x
				} else {
					unix.Close(x) // one socket per answer; more is a bug
				}
			}
		}
		line = append(line, buf[:n]...)
		if err != nil || n == 0 {
			if bytes.Contains(line, []byte{'\n'}) {
				break
			}
			if fd >= 0 {
				unix.Close(fd)
			}
			if err == nil {
				err = errors.New("connection closed")
			}
			return nil, -1, fmt.Errorf("portal: no answer from the agent: %w", err)
		}
		if len(line) > 16<<20 {
			break
		}
	}
	var resp Response
	if err := json.Unmarshal(bytes.TrimSpace(line), &resp); err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, -1, fmt.Errorf("portal: malformed answer: %w", err)
	}
	if err := resp.err(); err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return &resp, -1, err
	}
	return &resp, fd, nil
}

func takeFDs(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var out []int
	for _, m := range msgs {
		if fds, err := unix.ParseUnixRights(&m); err == nil {
			out = append(out, fds...)
		}
	}
	return out
}
