package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os/exec"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Node is what the bench needs to know about a testbed host.
type Node struct {
	Name string
	Eth0 netip.Addr // eth0 IPv4 (the "Ethernet" underlay)
	// Eth0V6 is eth0's IPv6 address (zero if the testbed has none).
	Eth0V6 netip.Addr
	IB     netip.Addr // ib0 IPv4 (the IPoIB stand-in), zero if absent
}

// Env is the cluster the bench drives: a testbed on this machine, or the
// same testbed inside the uvn VM. Nodes share the host's file system, so
// Dir and Binary are valid paths on every node.
type Env struct {
	Name   string
	Dir    string // scratch space readable on every node (bench writes <Dir>/bench)
	Binary string // the product binary (palisade) as seen on the nodes
	// LabBinary is the lab binary (palisade-lab: bench serve, rr, conn, hold).
	LabBinary string
	Nodes     []Node
	Outside   *Node
	VM        bool
	Mode      string // the data plane the testbed was brought up with
	// TB is the testbed itself (nil for a synthetic Env): drivers that
	// call another package's testbed hooks need it.
	TB *testbed.Testbed
	// Command runs argv on node as user ("" = root) the way a login would;
	// the caller owns Stdin/Stdout/Stderr.
	Command func(ctx context.Context, node, user string, argv ...string) *exec.Cmd
}

// node returns node i (0-based) or an error naming what is missing.
func (e *Env) node(i int) (Node, error) {
	if i >= len(e.Nodes) {
		return Node{}, fmt.Errorf("testbed %s has %d nodes, this test needs %d", e.Name, len(e.Nodes), i+1)
	}
	return e.Nodes[i], nil
}

// run executes argv on node as user and returns its stdout; a failure
// carries the tail of stderr so the reason is visible in the report.
func (e *Env) run(ctx context.Context, node, user string, argv ...string) (string, error) {
	cmd := e.Command(ctx, node, user, argv...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s on %s as %s: %w: %s", argv[0], node, userName(user), err, tail(errb.String(), 400))
	}
	return out.String(), nil
}

func userName(u string) string {
	if u == "" {
		return "root"
	}
	return u
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		s = "…" + s[len(s)-n:]
	}
	return s
}

// server is a long-running helper on a node that stops when its stdin
// closes (all bench servers do: `palisade-lab bench serve`, `hold`).
type server struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	errb  *bytes.Buffer
	done  chan error
	// lines carries what the helper prints after "ready" (stats answers).
	lines chan string
}

// startServer starts argv and waits for its "ready" line.
func (e *Env) startServer(ctx context.Context, node, user string, argv ...string) (*server, error) {
	cmd := e.Command(ctx, node, user, argv...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	errb := &bytes.Buffer{}
	cmd.Stderr = errb
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s on %s: %w", argv[0], node, err)
	}
	s := &server{cmd: cmd, stdin: stdin, errb: errb, done: make(chan error, 1), lines: make(chan string, 16)}
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		ok := false
		for sc.Scan() {
			switch {
			case !ok && strings.TrimSpace(sc.Text()) == "ready":
				ok = true
				ready <- true
			case ok:
				select {
				case s.lines <- sc.Text():
				default: // nobody asked: drop
				}
			}
		}
		if !ok {
			ready <- false
		}
		s.done <- cmd.Wait()
	}()
	select {
	case ok := <-ready:
		if ok {
			return s, nil
		}
		err := <-s.done
		return nil, fmt.Errorf("%s on %s as %s exited before ready: %v: %s", strings.Join(argv, " "), node, userName(user), err, tail(errb.String(), 400))
	case <-time.After(30 * time.Second):
		s.stop()
		return nil, fmt.Errorf("%s on %s: not ready after 30s: %s", argv[0], node, tail(errb.String(), 400))
	case <-ctx.Done():
		s.stop()
		return nil, ctx.Err()
	}
}

// stats asks a `palisade bench serve` for its ServeStats.
func (s *server) stats() (ServeStats, error) {
	// Drop an answer that came after an earlier query gave up.
	select {
	case <-s.lines:
	default:
	}
	if _, err := io.WriteString(s.stdin, "stats\n"); err != nil {
		return ServeStats{}, err
	}
	select {
	case l := <-s.lines:
		var st ServeStats
		if err := json.Unmarshal([]byte(l), &st); err != nil {
			return st, fmt.Errorf("server stats %q: %w", l, err)
		}
		return st, nil
	case <-time.After(10 * time.Second):
		return ServeStats{}, errors.New("server stats: no answer in 10 s")
	}
}

// stop closes stdin and waits; a helper that ignores it is killed by the
// PID we started.
func (s *server) stop() error {
	if s == nil {
		return nil
	}
	s.stdin.Close()
	select {
	case err := <-s.done:
		return err
	case <-time.After(10 * time.Second):
		if s.cmd.Process != nil {
			_ = s.cmd.Process.Kill()
		}
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
		}
		return errors.New("server did not stop on stdin EOF; killed")
	}
}
