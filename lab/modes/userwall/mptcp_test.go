package userwall

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// mptcpPy listens or connects with IPPROTO_MPTCP (262), the default of Go's
// net.Listen since 1.24 (so also of `palisade-lab probe listen`). The kernel
// serves such a socket through an in-kernel TCP subflow socket: the
// listener that tc ingress and the connect hooks find is that subflow, not
// the socket the user created. Its identity holds because the first subflow
// is grafted onto the user's socket (mptcp_sock_graft: sk_uid and sk_socket,
// hence the socket file's creds, are the user's), and its connect runs the
// cgroup connect hook in the caller's context. The listener reports the
// protocol it really got (READY only for MPTCP), so a silent fallback to TCP
// cannot pass for MPTCP.
const mptcpPy = `import socket, sys, os, errno
mode, proto, addr, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fam = socket.AF_INET6 if ':' in addr else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM, 262 if proto == 'mptcp' else 0)
if mode == 'listen':
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(64)
    got = s.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL)
    print(('READY' if got == 262 else 'NOT-MPTCP') + ' proto=%d' % got, flush=True)
    while True:
        try:
            c, _ = s.accept(); c.settimeout(2); c.sendall(b'echo:' + c.recv(100)); c.close()
        except OSError: pass
s.settimeout(2)
try:
    s.connect((addr, port)); s.sendall(b'hi'); print('OK ' + s.recv(100).decode())
except socket.timeout: print('TIMEOUT')
except OSError as e: print('ERR ' + errno.errorcode.get(e.errno, str(e.errno)))
`

func TestMPTCP(t *testing.T) {
	needTestbed(t)
	py := filepath.Join(tb.Dir, "uwtest", "mptcp.py")
	if err := os.WriteFile(py, []byte(mptcpPy), 0o644); err != nil {
		t.Fatal(err)
	}
	mlisten := func(user string, port int) {
		t.Helper()
		argv := []string{"/usr/bin/python3", py, "listen", "mptcp", "::", strconv.Itoa(port)}
		if u, g, ok := strings.Cut(user, "+"); ok {
			user, argv = u, []string{"sg", g, "-c", strings.Join(argv, " ")}
		}
		listenArgv(t, "node1", user, argv...) // fails unless it printed READY: MPTCP
	}
	mlisten("alice", 5141)       // dual-stack, alice's private group
	mlisten("alice+proj1", 5142) // shared with bob through proj1
	n1 := tb.Nodes[0]
	type mcase struct {
		node, user, proto, addr string
		port                    int
		want                    string
	}
	cases := []mcase{
		// local: the connect hook, MPTCP or plain TCP connector
		{"node1", "alice", "mptcp", "127.0.0.1", 5141, "OK echo:hi"},
		{"node1", "alice", "tcp", "::1", 5141, "OK echo:hi"},
		{"node1", "bob", "mptcp", "127.0.0.1", 5141, refused},
		{"node1", "bob", "mptcp", "::1", 5141, refused},
		{"node1", "bob", "tcp", "127.0.0.1", 5141, refused},
		{"node1", "bob", "mptcp", n1.Eth0V4.String(), 5141, refused},
		{"node1", "bob", "mptcp", "::1", 5142, "OK echo:hi"},
		{"node1", "carol", "mptcp", "::1", 5142, refused},
	}
	// cross-node: tc ingress on node1 finds the subflow listener
	for _, a := range []string{n1.Eth0V4.String(), n1.Eth0V6.String(), n1.IBV4.String(), n1.IBV6.String()} {
		cases = append(cases,
			mcase{"node2", "alice", "mptcp", a, 5141, "OK echo:hi"},
			mcase{"node2", "bob", "mptcp", a, 5141, refused},
			mcase{"node2", "bob", "tcp", a, 5141, refused},
			mcase{"node2", "bob", "mptcp", a, 5142, "OK echo:hi"},
			mcase{"node2", "carol", "mptcp", a, 5142, refused},
		)
	}
	for _, c := range cases {
		out, err := tb.Command(context.Background(), c.node, c.user,
			"/usr/bin/python3", py, "connect", c.proto, c.addr, strconv.Itoa(c.port)).CombinedOutput()
		if err != nil {
			t.Fatalf("connector %s on %s: %v: %s", c.user, c.node, err, out)
		}
		if got := strings.TrimSpace(string(out)); got != c.want {
			t.Errorf("%s@%s → %s %s port %d: got %q, want %q", c.user, c.node, c.proto, c.addr, c.port, got, c.want)
		}
	}
}
