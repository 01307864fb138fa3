package sockowner_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// TestWhoAcrossNodes runs `palisade ident serve` on every node of a
// testbed (its own instance, no data plane) and asks, from node1, who owns
// a listener alice runs on node2 under `sg proj1`: as root (UDP from a
// privileged port), as bob through node1's Unix API (group proj1 may use
// it), and not as carol (not in the group). The outside host, off-cluster,
// gets no answer. explain gives the policy's verdicts for the same listener.
func TestWhoAcrossNodes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the testbed needs root")
	}
	if testing.Short() {
		t.Skip("-short: no testbed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	name := testbed.RunName("id") // per run: other runs may test at the same time
	testbed.DownOrphans(ctx)
	tb, err := testbed.Up(ctx, testbed.Options{Name: name, Nodes: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := testbed.Down(context.Background(), name); err != nil {
			t.Errorf("testbed down: %v", err)
		}
	})
	bin := tb.Binary
	sockDir := filepath.Join(tb.RunDir(), "palid-ident")
	if err := os.MkdirAll(sockDir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := func(node string) string { return filepath.Join(sockDir, node+".sock") }

	// start runs argv on node as user until the test ends; it waits for a
	// first output line (the listener's "ready"), or for the socket file.
	start := func(node, user string, ready func(string) bool, argv ...string) {
		t.Helper()
		cmd := tb.Command(ctx, node, user, argv...)
		stdin, _ := cmd.StdinPipe()
		stdout, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			stdin.Close()
			cmd.Process.Signal(os.Interrupt) // ours, by pid
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		})
		lines := make(chan string, 1)
		go func() {
			r := bufio.NewReader(stdout)
			l, _ := r.ReadString('\n')
			lines <- l
			io.Copy(io.Discard, r)
		}()
		deadline := time.After(20 * time.Second)
		for {
			select {
			case l := <-lines:
				if ready(l) {
					return
				}
				t.Fatalf("%v on %s: %q", argv, node, l)
			case <-time.After(50 * time.Millisecond):
				if ready("") {
					return
				}
			case <-deadline:
				t.Fatalf("%v on %s: not ready", argv, node)
			}
		}
	}
	for _, n := range []string{"node1", "node2"} {
		start(n, "", func(string) bool { _, err := os.Stat(sock(n)); return err == nil },
			bin, "ident", "serve", "--socket", sock(n), "--socket-group", "proj1")
	}
	// alice's listener on node2, TCP and UDP on port 29501, v4 and v6,
	// started under sg proj1 so that its effective group is proj1.
	listener := `import socket,sys
t=socket.socket(socket.AF_INET6); t.bind(("::",29501)); t.listen()
u=socket.socket(socket.AF_INET6,socket.SOCK_DGRAM); u.bind(("::",29501))
print("ready",flush=True); sys.stdin.read()`
	start("node2", "alice", func(l string) bool { return strings.HasPrefix(l, "ready") },
		"sg", "proj1", "-c", "exec /usr/bin/python3 -c '"+listener+"'")

	run := func(node, user string, args ...string) (string, error) {
		out, err := tb.Command(ctx, node, user, append([]string{bin}, args...)...).CombinedOutput()
		return string(out), err
	}
	expect := func(out string, err error, okWant bool, wants ...string) {
		t.Helper()
		if (err == nil) != okWant {
			t.Errorf("exit: %v (want success=%v)\n%s", err, okWant, out)
		}
		for _, w := range wants {
			if !strings.Contains(out, w) {
				t.Errorf("output lacks %q:\n%s", w, out)
			}
		}
	}

	// Root on node1 asks node2 directly, over IPv4 and IPv6, TCP and UDP.
	out, err := run("node1", "", "who", "198.18.0.2:29501")
	expect(out, err, true, "on node 198.18.0.2", "alice (2001)", "proj1 (2100)", "python3")
	for _, target := range []string{"[2001:2::2]:29501/udp", "198.19.0.2:29501/udp", "[2001:2:0:1::2]:29501"} {
		out, err = run("node1", "", "who", "--json", target)
		var j struct {
			Owner struct {
				UID, GID uint32
				Groups   []uint32
				PID      int
				Command  string
			}
		}
		if err != nil || json.Unmarshal([]byte(out), &j) != nil || j.Owner.UID != 2001 || j.Owner.GID != 2100 || j.Owner.PID == 0 || j.Owner.Command != "python3" {
			t.Errorf("who --json %s: %v %s", target, err, out)
		}
	}
	// Nothing on the next port: a definite no.
	out, err = run("node1", "", "who", "198.18.0.2:29502")
	expect(out, err, false, "no socket at 198.18.0.2:29502/tcp on node 198.18.0.2")

	// bob (in proj1) through node1's Unix API; carol (not) is refused.
	out, err = run("node1", "bob", "who", "--socket", sock("node1"), "198.18.0.2:29501")
	expect(out, err, true, "alice (2001)", "proj1 (2100)", "python3")
	out, err = run("node1", "carol", "who", "--socket", sock("node1"), "198.18.0.2:29501")
	expect(out, err, false, "permission denied")
	if strings.Contains(out, "alice") {
		t.Errorf("carol learnt the owner: %s", out)
	}

	// The outside host is not in a cluster subnet: node2 does not answer.
	out, err = run("outside", "", "who", "--timeout", "500ms", "198.18.0.2:29501")
	expect(out, err, false, "no answer")

	// explain applies the node's policy to the real owner.
	out, err = run("node1", "", "explain", "--from", "bob", "--to", "198.18.0.2:29501")
	expect(out, err, true, "ALLOW (rule shared-group)", "on node 198.18.0.2")
	out, err = run("node1", "", "explain", "--from", "carol", "--to", "198.18.0.2:29501/udp")
	expect(out, err, true, "DENY (rule default-deny)")
	out, err = run("node1", "", "explain", "--quiet", "--from", "carol", "--to", "198.18.0.2:29501")
	expect(out, err, false)
	out, err = run("node2", "", "explain", "--from", "alice", "--node", "node2", "--to", "198.18.0.2:29501")
	expect(out, err, true, "ALLOW (rule same-user)", "local connection")
	out, err = run("node1", "", "explain", "--from", "carol", "--node", "198.18.200.1", "--to", "198.18.0.2:29501")
	expect(out, err, true, "DENY (rule off-cluster-denied)")
}
