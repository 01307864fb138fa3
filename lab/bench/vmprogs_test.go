package bench

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
)

// TestVMProgs: the host side of the guest accounting reads every node,
// attributes each program to the node that reported it, switches the
// guest's statistics on through the first node and restores them.
func TestVMProgs(t *testing.T) {
	var mu sync.Mutex
	var calls []string
	runs := map[string]uint64{"node1": 0, "node2": 0}
	env := &Env{Nodes: []Node{{Name: "node1"}, {Name: "node2"}}, LabBinary: "palisade-lab"}
	env.Command = func(_ context.Context, node, _ string, argv ...string) *exec.Cmd {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, node+" "+strings.Join(argv[1:], " "))
		runs[node] += 10
		id := map[string]uint32{"node1": 7, "node2": 9}[node]
		b, _ := json.Marshal(GuestProgs{Stats: "0", Programs: []GuestProg{{ID: id, Name: "pal_uvn_out", Type: "CGroupSKB", RunNS: runs[node] * 100, RunCnt: runs[node]}}})
		return exec.Command("echo", string(b))
	}
	v := newVMProgs(context.Background(), env)
	if _, err := v.begin(); err != nil {
		t.Fatal(err)
	}
	a := v.snap()
	b := v.snap()
	d := v.delta(a, b, []string{"node1"})
	v.end()
	if len(d) != 2 || d[0].Node != "node1" || !d[0].Work || d[0].RunCnt != 10 || d[0].RunNS != 1000 || d[1].Node != "node2" || d[1].Work {
		t.Errorf("delta: %+v", d)
	}
	if !slices.Contains(calls, "node1 bench progstats --set-stats 1") || !slices.Contains(calls, "node1 bench progstats --set-stats 0") {
		t.Errorf("statistics not switched on and restored through node1: %q", calls)
	}
}

// TestUVNStateProgs: every program id a node's uvn state records.
func TestUVNStateProgs(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, v any) {
		b, _ := json.Marshal(v)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("node.json", uvn.NodeState{GuardProgs: []uint32{1, 2, 3, 4}, SrunRelease: 5, Undo: []uvn.Undo{{Kind: "guard-root", Prog: 1}}})
	write("user-2001.json", uvn.UserState{UID: 2001, Attach: []uvn.Attachment{{ProgID: 6, ConnectID: 7, SendmsgID: 8, Bind4ID: 9, Bind6ID: 10, ReleaseID: 11, LinkLocalID: 12}}})
	ids, err := uvnStateProgs(dir)
	if err != nil {
		t.Fatal(err)
	}
	for want := uint32(1); want <= 12; want++ {
		if !slices.Contains(ids, want) {
			t.Errorf("program %d missing from %v", want, ids)
		}
	}
	if _, err := uvnStateProgs(filepath.Join(dir, "none")); err != nil {
		t.Errorf("a node without uvn state: %v", err)
	}
}
