package attack

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// instance is this package's own testbed (other packages test in parallel).
const instance = "palatkt"

var tb *testbed.Testbed

// knownHoles are the cases that fail on userwall v1 (issue 9): each is
// logged, not failed, until the data plane v2 lands; remove a name once it
// passes (the test says so). PALISADE_ATTACKS_STRICT=1 fails them too.
var knownHoles = map[string]string{
	"udp-reply-stolen-port-local-v4":   "reply state keyed by port",
	"udp-reply-stolen-port-local-v6":   "reply state keyed by port",
	"udp-reply-stolen-port-cross-v4":   "reply state keyed by port",
	"udp-reply-stolen-port-cross-v6":   "reply state keyed by port",
	"udp-reply-self-made-local-v4":     "reply state without the local address",
	"udp-reply-self-made-local-v6":     "reply state without the local address",
	"udp-reply-self-made-cross-v4":     "reply state without the local address",
	"udp-reply-self-made-cross-v6":     "reply state without the local address",
	"mcast-allhosts-local-v4":          "multicast not checked",
	"mcast-allhosts-cross-v4":          "multicast not checked",
	"mcast-allnodes-local-v6":          "multicast not checked",
	"mcast-allnodes-cross-v6":          "multicast not checked",
	"mcast-joined-group-local-v4":      "multicast not checked",
	"mcast-joined-group-cross-v4":      "multicast not checked",
	"mcast-joined-group-cross-v6":      "multicast not checked",
	"bcast-subnet-local-v4":            "own broadcast refused (unstamped loopback copy)",
	"bcast-limited-local-v4":           "own broadcast refused (unstamped loopback copy)",
	"bcast-subnet-cross-v4":            "own broadcast refused (not stamped)",
	"bcast-reuseaddr-cobound-local-v4": "decision on a looked-up socket, not the receiving one",
	"bindtodevice-lo-tcp-local":        "lookup without the device misses",
	"linklocal-tcp-local-v6":           "link-local addresses not local",
	"linklocal-udp-local-v6":           "link-local addresses not local",
	"linklocal-tcp-cross-v6":           "link-local across nodes refused",
	"linklocal-udp-cross-v6":           "link-local across nodes refused",
	"proto-udplite-local-v4":           "UDP-Lite not checked",
	"proto-udplite-cross-v4":           "UDP-Lite not checked",
	"proto-udplite-cross-v6":           "UDP-Lite not checked",
	"spoof-outside-udp-v4":             "unauthenticated stamp",
	"spoof-outside-udp-v6":             "unauthenticated stamp",
	"spoof-outside-syn-v4":             "unauthenticated stamp",
	"spoof-outside-syn-v6":             "unauthenticated stamp",
	"nft-flush-tcp-cross":              "refusal depends on nft",
	"nft-flush-udp-cross":              "refusal depends on nft",
	"tcp-fastopen-cross":               "no room for the TCP stamp",
}

func strict() bool { return os.Getenv("PALISADE_ATTACKS_STRICT") == "1" }

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		fmt.Println("attack: integration tests need root (and no -short)")
		os.Exit(m.Run())
	}
	testbed.RegisterMode(uwlab.ModeName, uwlab.TestbedMode{}) // as cmd/palisade-lab wires it
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	_ = testbed.Down(ctx, instance)
	var err error
	tb, err = testbed.Up(ctx, testbed.Options{Name: instance, Nodes: 2, Mode: "userwall"})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testbed up:", err)
		_ = testbed.Down(context.Background(), instance)
		os.Exit(1)
	}
	code := m.Run()
	if err := testbed.Down(context.Background(), instance); err != nil {
		fmt.Fprintln(os.Stderr, "testbed down:", err)
		code = 1
	}
	os.Exit(code)
}

func needTestbed(t *testing.T) {
	t.Helper()
	if tb == nil {
		t.Skip("needs root and the " + instance + " testbed")
	}
}

// TestSuite runs every attack case with its control.
func TestSuite(t *testing.T) {
	needTestbed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	t0 := time.Now()
	res, err := RunSuite(ctx, tb, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	passed, failed, na := WriteReport(&out, res, false)
	t.Logf("attack suite in %v:\n%s", time.Since(t0).Round(time.Second), out.String())
	if len(res) < 30 || passed+failed+na != len(Cases()) {
		t.Errorf("%d cases ran (%d passed, %d failed, %d n/a) of %d", len(res), passed, failed, na, len(Cases()))
	}
	for _, r := range res {
		why, known := knownHoles[r.Case.Name]
		switch {
		case r.Status() == "FAIL" && known && !strict():
			t.Logf("known hole (issue 9, %s): %s", why, r.Line())
		case r.Status() == "FAIL":
			t.Errorf("%s", r.Line())
		case known:
			t.Logf("%s passes now: remove it from knownHoles", r.Case.Name)
		}
	}
	if d := time.Since(t0); d > 3*time.Minute {
		t.Errorf("suite took %v (target < 3 min)", d)
	}
}

// TestChurn runs a short churn: zero attacks may succeed.
func TestChurn(t *testing.T) {
	needTestbed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	opts := ChurnOptions{Duration: 30 * time.Second, Every: 2 * time.Second}
	if _, known := knownHoles["nft-flush-tcp-cross"]; known && !strict() {
		// Fail-open on `nft flush` is a known hole of v1: churn without it
		// (the attack suite still shows it).
		opts.Kinds = []string{"sigterm", "reload", "sigkill", "addr-add"}
		t.Log("known hole: nft-flush left out of the churn until data plane v2")
	}
	rep, err := Churn(ctx, tb, opts)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	failed := rep.Write(&out)
	t.Logf("%s", out.String())
	if failed > 0 {
		t.Errorf("churn: %d failures", failed)
	}
	ls, lok, as, _ := rep.Totals()
	if ls < 500 || as < 500 {
		t.Errorf("only %d legitimate and %d attack attempts", ls, as)
	}
	if float64(lok) < 0.95*float64(ls) {
		t.Errorf("legitimate success %d/%d below 95 %%", lok, ls)
	}
	if !strings.Contains(out.String(), "sigkill") {
		t.Errorf("no SIGKILL disruption ran")
	}
}
