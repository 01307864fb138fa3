package uvn

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

// Issue 21: a user's network is a boundary enforced where packets flow.
// The attack set is lab/check/attack's uvn cases (one implementation with
// `palisade-lab check --attacks --mode uvn`), run inside the guest through
// the relay as that command runs it: every case must pass with its control.

var suiteTotal = regexp.MustCompile(`(?m)^(\d+) passed, (\d+) failed$`)

func attacks(t *testing.T, ctx context.Context, tb *testbed.Testbed) {
	t0 := time.Now()
	var stdout, stderr bytes.Buffer
	code, err := vm.RelayCheck(ctx, tb, []string{"check", "--attacks", "--mode=uvn", "--actors", "--quiet"}, &stdout, &stderr)
	if err != nil {
		t.Fatalf("relay: %v\n%s", err, stderr.String())
	}
	out := stdout.String()
	t.Logf("check --attacks --mode uvn in %v (exit %d):\n%s", time.Since(t0).Round(time.Second), code, out)
	m := suiteTotal.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no summary line in the output; stderr:\n%s", stderr.String())
	}
	passed, _ := strconv.Atoi(m[1])
	failed, _ := strconv.Atoi(m[2])
	if want := len(attack.UVNCases()); code != 0 || failed != 0 || passed != want {
		t.Errorf("want all %d cases passed and exit 0: %d passed, %d failed, exit %d; stderr:\n%s", want, passed, failed, code, stderr.String())
	}
	if strings.Contains(out, "not applicable") {
		t.Errorf("a uvn case was not applicable in the VM")
	}
}

// srunBudget: a user who holds every SrunPortRange claim his budget allows
// is named, with the budget, by `palisade uvn status` (exit 1) and by his
// next login's warning; below the budget neither says anything.
func srunBudget(t *testing.T, e *vmEnv) {
	tb := e.tb
	// A process of bob's keeps his network on node3 throughout (the
	// control below must see his VRF with its claims given back, not gone).
	e.bg(t, "node3", "bob", "exec sleep 3600")
	// bob binds ports of the range until the claim program refuses one
	// (EPERM: his budget), holds them until stdin closes.
	hold := e.bg(t, "node3", "bob", `exec python3 -c '
import socket, sys
held = []
for p in range(61000, 63000):
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
    except OSError as e:
        if e.errno == 1:
            break
        continue
    held.append(s)
print("holding %d" % len(held), flush=True)
sys.stdin.read()
'`)
	if !waitOut(t, hold, "holding", 3*time.Minute) {
		return
	}
	st := e.run(t, "node3", "", tb.Binary+" uvn status; echo rc=$?")
	if !strings.Contains(st, "WARNING: user bob(2002) holds 500 SrunPortRange claims (61000-62999)") || !strings.Contains(st, "rc=1") {
		t.Errorf("status with bob's budget used up (%s): want a warning naming bob and the budget, exit 1:\n%s", strings.TrimSpace(hold.String()), st)
	}
	login := e.run(t, "node3", "bob", "true")
	if !strings.Contains(login, "palisade: WARNING: user bob(2002) holds 500") {
		t.Errorf("bob's login with his budget used up did not warn him:\n%s", login)
	}
	// Control: once his sockets close, nothing is said.
	hold.in.Close()
	hold.cmd.Wait()
	st = e.run(t, "node3", "", tb.Binary+" uvn status; echo rc=$?")
	if strings.Contains(st, "WARNING") || !strings.Contains(st, "rc=0") {
		t.Errorf("status after bob's claims were given back: want no warning, exit 0:\n%s", st)
	}
	if login := e.run(t, "node3", "bob", "true"); strings.Contains(login, "WARNING") {
		t.Errorf("bob's login below the budget warned:\n%s", login)
	}
}
