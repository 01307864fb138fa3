package userwall

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

// waitKeys reloads node's agent and checks that its status shows exactly
// the key ids want.
func waitKeys(t *testing.T, node string, want []uint8) {
	t.Helper()
	// The reload's acknowledgement (the state file, written last), then
	// the keys: a reload loads them before it acknowledges. Polling the
	// keys instead returned while the reload was still running when they
	// were already the wanted ones (the restore), and its acknowledgement
	// then answered the next test's reload (TestPolicyTooLargeRefused:
	// "reload applied (generation 6 → 7), want refused").
	if _, err := signalReload(node); err != nil {
		t.Fatal(err)
	}
	if got := status(t, node).Keys; !slices.Equal(got, want) {
		t.Fatalf("%s: key ids %v after reload, want %v", node, got, want)
	}
}

func newKey(t *testing.T) (kernel.Key, string) {
	t.Helper()
	keys, err := kernel.ParseKeys(kernel.GenerateKey())
	if err != nil {
		t.Fatal(err)
	}
	return keys[0], hex.EncodeToString(keys[0][:])
}

func ids(keys ...kernel.Key) []uint8 {
	var out []uint8
	for _, k := range keys {
		out = append(out, k.ID())
	}
	return out
}

// TestKeyRotation rotates the cluster key on every node, as docs/userwall.md
// says, while connections flow: the rightful user's never fail, another
// user's never get through. Then a node with a key the others do not hold:
// its stamps are not believed (negative control of the MAC).
func TestKeyRotation(t *testing.T) {
	needTestbed(t)
	listen(t, "node1", "alice", "tcp", "::", 5301)
	listen(t, "node1", "alice", "udp", "::", 5302)
	path := tb.ClusterKeyPath()
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	k1s, err := kernel.ParseKeys(orig)
	if err != nil {
		t.Fatal(err)
	}
	k1 := k1s[0]
	k2, h2 := newKey(t)
	for k2.ID() == k1.ID() {
		k2, h2 = newKey(t)
	}
	h1 := hex.EncodeToString(k1[:])
	restore := func() {
		os.WriteFile(path, orig, 0o600)
		for _, n := range tb.Nodes {
			waitKeys(t, n.Name, ids(k1))
		}
	}
	defer restore()

	n1 := tb.Nodes[0]
	ctx := context.Background()
	d := 6 * time.Second
	probes := []struct {
		name, want string
		out        strings.Builder
	}{
		{name: "alice tcp node2→node1", want: "OK echo="},
		{name: "alice udp node2→node1", want: "OK="},
		{name: "bob tcp node2→node1", want: "ERR ECONNREFUSED="},
	}
	cmds := []*struct{ c interface{ Wait() error } }{}
	loops := []*strings.Builder{&probes[0].out, &probes[1].out, &probes[2].out}
	for i, spec := range []struct{ user, proto string }{{"alice", "tcp"}, {"alice", "udp"}, {"bob", "tcp"}} {
		port := 5301
		if spec.proto == "udp" {
			port = 5302
		}
		c := loop(ctx, "node2", spec.user, spec.proto, n1.Eth0V4.String(), port, d)
		c.Stdout = loops[i]
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, &struct{ c interface{ Wait() error } }{c})
	}
	steps := []struct {
		body string
		want []uint8
	}{
		{h1 + "\n" + h2 + "\n", ids(k1, k2)}, // 1. add the new key second
		{h2 + "\n" + h1 + "\n", ids(k2, k1)}, // 2. seal with the new key
		{h2 + "\n", ids(k2)},                 // 3. drop the old key
	}
	for _, s := range steps {
		if err := os.WriteFile(path, []byte(s.body), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, n := range tb.Nodes {
			waitKeys(t, n.Name, s.want)
		}
		time.Sleep(time.Second) // traffic under this step
	}
	for i, c := range cmds {
		c.c.Wait()
		got := strings.TrimSpace(probes[i].out.String())
		if !regexp.MustCompile(`^` + regexp.QuoteMeta(probes[i].want) + `\d+$`).MatchString(got) {
			t.Errorf("%s during the rotation: outcomes %q, want only %s…", probes[i].name, got, probes[i].want)
		}
	}

	// Negative control: node2 alone seals with a key node1 does not hold.
	k3, h3 := newKey(t)
	other := filepath.Join(tb.Dir, "palisade-other.key")
	if err := os.WriteFile(other, []byte(h3+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp := tb.ConfigPath("node2")
	cfg, _ := os.ReadFile(cp)
	defer func() {
		os.WriteFile(cp, cfg, 0o644)
		waitKeys(t, "node2", ids(k2)) // the shared file holds k2 until restore()
	}()
	os.WriteFile(cp, []byte(strings.Replace(string(cfg), path, other, 1)), 0o644)
	waitKeys(t, "node2", ids(k3))
	a := n1.Eth0V4.String()
	notDelivered(t, "node2", "alice", "tcp", a, 5301)
	notDelivered(t, "node2", "alice", "udp", a, 5302, "connected")
	run(t, []tcase{{"node2", "alice", "tcp", "127.0.0.1", 22, "OK*", nil}}) // system ports need no identity
	if !waitEvent(t, "node1", func(e uw.Event) bool {
		return e.Dst == a+":5301" && (e.Stamp == "unknown-key" || e.Stamp == "bad-mac")
	}) {
		t.Error(`no event with "stamp":"unknown-key"/"bad-mac" on node1 for node2's foreign key`)
	}
}

// notDelivered: the attempt got no answer from the listener. A stamp under a
// key the receiver does not hold is refused early when its 4-bit key id is
// unknown there (reset / ICMP) and dropped at the socket when the id happens
// to match one of the receiver's keys (bad MAC): both deliver nothing.
func notDelivered(t *testing.T, node, user, proto, addr string, port int, extra ...string) {
	t.Helper()
	got := try(t, node, user, proto, addr, port, extra...)
	if strings.HasPrefix(got, "OK") {
		t.Errorf("%s@%s → %s %s port %d %v: delivered (%q)", user, node, proto, addr, port, extra, got)
	}
}

func n1addr() string { return fmt.Sprint(tb.Nodes[0].Eth0V4) }
