package userwall

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
)

// palisade runs the palisade CLI as user on node ("" root) with the node's
// configuration; it returns the combined output and whether it succeeded.
func palisade(t *testing.T, node, user string, args ...string) (string, bool) {
	t.Helper()
	argv := append([]string{tb.Binary}, args...)
	argv = append(argv, "--config", tb.ConfigPath(node))
	out, err := tb.Command(context.Background(), node, user, argv...).CombinedOutput()
	return string(out), err == nil
}

// grantList is `palisade share --list -o json` as user on node.
func grantList(t *testing.T, node, user string, args ...string) []uw.GrantInfo {
	t.Helper()
	out, ok := palisade(t, node, user, append([]string{"share", "--list", "-o", "json"}, args...)...)
	if !ok {
		t.Fatalf("share --list as %q on %s: %s", user, node, out)
	}
	var gs []uw.GrantInfo
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var g uw.GrantInfo
		if err := json.Unmarshal(sc.Bytes(), &g); err != nil {
			t.Fatalf("share --list: %v\n%s", err, out)
		}
		gs = append(gs, g)
	}
	return gs
}

func hasGrant(gs []uw.GrantInfo, owner string, port uint16, to string) bool {
	for _, g := range gs {
		name := g.GranteeName
		if g.Group {
			name = "@" + name
		}
		if g.OwnerName == owner && g.Port == port && name == to {
			return true
		}
	}
	return false
}

// listenUntil starts a listener like listen and returns what stops it
// (the listener's socket is closed once it returns).
func listenUntil(t *testing.T, node, user, proto, addr string, port int) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := tb.Command(ctx, node, user, "/usr/bin/python3", helper, "listen", proto, addr, strconv.Itoa(port))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := false
	stop = func() {
		if !done {
			done = true
			cancel()
			cmd.Wait()
		}
	}
	t.Cleanup(stop)
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || !strings.HasPrefix(line, "READY") {
		t.Fatalf("listener %s on %s:%d: %q %v", user, node, port, line, err)
	}
	return stop
}

// waitUntil polls cond until it holds or the deadline passes.
func waitUntil(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestUserGrants: palisade share on real nodes under the real agents.
// alice shares her listener on node2 with bob: bob reaches it from node1,
// carol does not; a @group grant admits the group's members only; bob
// cannot grant (nor revoke) alice's port; a grant never reaches another
// user's socket on the port; grants expire and die with their listener;
// --node makes the grant on another node; explain and flows name the
// grant; the site switch removes every grant and refuses new ones.
func TestUserGrants(t *testing.T) {
	needTestbed(t)
	e2 := tb.Nodes[1].Eth0V4.String()
	e2v6 := tb.Nodes[1].Eth0V6.String()
	t.Cleanup(func() { palisade(t, "node2", "", "unshare", "8888"); palisade(t, "node2", "", "unshare", "8890") })

	listen(t, "node2", "alice", "tcp", "::", 8888)
	run(t, []tcase{
		{"node1", "bob", "tcp", e2, 8888, refused, nil},
		{"node1", "carol", "tcp", e2, 8888, refused, nil},
	})

	// Forgery: bob grants (himself, carol) alice's port — refused by the
	// agent, nothing in the kernel changes (bob still refused).
	for _, with := range []string{"bob", "carol"} {
		out, ok := palisade(t, "node2", "bob", "share", "8888", "--with", with)
		if ok || !strings.Contains(out, "you hold no TCP listener on port 8888") {
			t.Errorf("bob sharing alice's 8888 with %s: ok=%v %s", with, ok, out)
		}
	}
	if gs := grantList(t, "node2", ""); len(gs) != 0 {
		t.Errorf("grants after refused forgeries: %+v", gs)
	}
	run(t, []tcase{{"node1", "bob", "tcp", e2, 8888, refused, nil}})

	// alice shares with bob: bob reaches it from node1 (v4 and v6), carol
	// does not; bob cannot revoke it.
	if out, ok := palisade(t, "node2", "alice", "share", "8888", "--with", "bob", "--for", "10m"); !ok || !strings.Contains(out, "bob") {
		t.Fatalf("alice shares 8888 with bob: %s", out)
	}
	run(t, []tcase{
		{"node1", "bob", "tcp", e2, 8888, "OK", nil},
		{"node1", "bob", "tcp", e2v6, 8888, "OK", nil},
		{"node1", "carol", "tcp", e2, 8888, refused, nil},
		{"node2", "carol", "tcp", "127.0.0.1", 8888, eperm, nil},
	})
	if out, ok := palisade(t, "node2", "bob", "unshare", "8888"); ok {
		t.Errorf("bob revoked alice's grant: %s", out)
	}
	if !hasGrant(grantList(t, "node2", "bob"), "alice", 8888, "bob") || len(grantList(t, "node2", "carol")) != 0 {
		t.Errorf("share --list: bob sees the grant made to him, carol none")
	}
	// explain (as root) and flows name the grant.
	out, _ := palisade(t, "node1", "", "explain", "--from", "bob", "--to", e2+":8888")
	if !strings.Contains(out, "ALLOW (rule user-grant)") || !strings.Contains(out, "alice's grant on 8888/tcp to bob, expires") {
		t.Errorf("explain of bob → alice's 8888:\n%s", out)
	}
	if f := findFlow(t, "node2", "", func(f uw.Flow) bool {
		return f.Rule == "user-grant" && strings.Contains(f.Grant, "alice's grant on 8888/tcp to bob")
	}, "--node", "node2", "--port", "8888"); f == nil {
		t.Error("palisade flows shows no user-grant flow naming alice's grant")
	}
	if m, err := metrics("node2", "127.0.0.1:9464"); err != nil || !strings.Contains(m, "palisade_user_grants_active 1") {
		t.Errorf("metric palisade_user_grants_active: %v\n%s", err, grepLines(m, "grants"))
	}
	if b, _ := os.ReadFile(tb.LogDir() + "/node2-userwall.jsonl"); !strings.Contains(string(b), `"grant":"created","owner":"alice","owner_uid":2001,"port":8888`) {
		t.Error("the event log has no grant creation")
	}

	// A @group grant: proj1's members (bob) in, carol not.
	listen(t, "node2", "alice", "tcp", "::", 8890)
	if out, ok := palisade(t, "node2", "alice", "share", "8890", "--with", "@proj1"); !ok {
		t.Fatalf("share with @proj1: %s", out)
	}
	run(t, []tcase{
		{"node1", "bob", "tcp", e2, 8890, "OK", nil},
		{"node1", "carol", "tcp", e2, 8890, refused, nil},
	})

	// The grant must not survive its owner's socket: alice shares 8891
	// with carol (positive control: carol reaches it), closes the
	// listener carol reached while keeping one on ::1 (so the agent keeps
	// the grant), and bob binds 0.0.0.0:8891: carol must not reach bob.
	stopA := listenUntil(t, "node2", "alice", "tcp", "0.0.0.0", 8891)
	listenUntil(t, "node2", "alice", "tcp", "::1", 8891)
	if out, ok := palisade(t, "node2", "alice", "share", "8891", "--with", "carol"); !ok {
		t.Fatalf("share 8891: %s", out)
	}
	run(t, []tcase{{"node1", "carol", "tcp", e2, 8891, "OK", nil}})
	stopA()
	listen(t, "node2", "bob", "tcp", "0.0.0.0", 8891)
	if !hasGrant(grantList(t, "node2", ""), "alice", 8891, "carol") {
		t.Fatal("alice's grant on 8891 is gone: the kernel's keying is not what is tested")
	}
	run(t, []tcase{
		{"node1", "carol", "tcp", e2, 8891, refused, nil},
		{"node1", "bob", "tcp", e2, 8891, "OK", nil}, // bob's own socket (same user)
	})

	// Expiry: a grant for 15 s admits bob, then goes (the agent's state
	// says when), and bob is refused again.
	listen(t, "node2", "alice", "tcp", "0.0.0.0", 8892)
	if out, ok := palisade(t, "node2", "alice", "share", "8892", "--with", "bob", "--for", "15s"); !ok {
		t.Fatalf("share 8892 --for 15s: %s", out)
	}
	run(t, []tcase{{"node1", "bob", "tcp", e2, 8892, "OK", nil}})
	waitUntil(t, "the 15-s grant to expire", 20*time.Second, func() bool {
		return !hasGrant(grantList(t, "node2", ""), "alice", 8892, "bob")
	})
	run(t, []tcase{{"node1", "bob", "tcp", e2, 8892, refused, nil}})

	// --node: alice, on node1, shares her listener on node2.
	listen(t, "node2", "alice", "tcp", "0.0.0.0", 8893)
	if out, ok := palisade(t, "node1", "alice", "share", "8893", "--with", "carol", "--node", "node2"); !ok {
		t.Fatalf("share --node node2 from node1: %s", out)
	}
	run(t, []tcase{{"node1", "carol", "tcp", e2, 8893, "OK", nil}})
	// ... and bob, on node1, cannot do it for her.
	if out, ok := palisade(t, "node1", "bob", "share", "8893", "--with", "bob", "--node", "node2"); ok || !strings.Contains(out, "you hold no TCP listener") {
		t.Errorf("bob sharing alice's 8893 through --node: %s", out)
	}

	// The site switch: every grant goes at the reload, new ones are refused.
	p := tb.ConfigPath("node2")
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		if s, err := signalReload("node2"); err != nil || s.LastReloadError != "" {
			t.Errorf("restoring node2's configuration: %v %+v", err, s)
		}
	})
	off := strings.Replace(string(orig), "[policy]\n", "[policy]\nuser_grants = false\n", 1)
	if err := os.WriteFile(p, []byte(off), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := reloadNode(t, "node2"); err != nil {
		t.Fatalf("reload with user_grants = false: %v\n%s", err, out)
	}
	if gs := grantList(t, "node2", ""); len(gs) != 0 {
		t.Errorf("grants left with user_grants = false: %+v", gs)
	}
	run(t, []tcase{
		{"node1", "bob", "tcp", e2, 8888, refused, nil},
		{"node1", "bob", "tcp", e2, 8890, refused, nil},
		{"node1", "carol", "tcp", e2, 8893, refused, nil},
	})
	if out, ok := palisade(t, "node2", "alice", "share", "8888", "--with", "bob"); ok || !strings.Contains(out, "disabled") {
		t.Errorf("share with user_grants = false: %s", out)
	}
}
