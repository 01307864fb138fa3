package userwall

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A policy larger than the maps (exempt lists hold 1024 uids) passes the
// config loader, which does not know the data plane's bounds: the agent
// must refuse it on reload before writing anything, not enforce a mix of
// the old and the new lists.
func TestPolicyTooLargeRefused(t *testing.T) {
	needTestbed(t)
	listen(t, "node1", "alice", "tcp", "0.0.0.0", 5171)
	p := tb.ConfigPath("node1")
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		os.WriteFile(p, orig, 0o644)
		reload(t, "node1")
	}()
	run(t, []tcase{{"node1", "carol", "tcp", "127.0.0.1", 5171, eperm, nil}})

	uids := []string{`"carol"`}
	for i := range 1100 {
		uids = append(uids, fmt.Sprintf(`"%d"`, 3900000+i))
	}
	big := strings.Replace(string(orig), `exempt_connectors = [`, `exempt_connectors = [`+strings.Join(uids, ", ")+", ", 1)
	if big == string(orig) {
		t.Fatal("no exempt_connectors line in the node's config")
	}
	if err := os.WriteFile(p, []byte(big), 0o644); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(tb.LogDir(), "node1-agent.log")
	before, _ := os.ReadFile(logPath)
	reloadRefused(t, "node1")
	after, _ := os.ReadFile(logPath)
	if msg := string(after[len(before):]); !strings.Contains(msg, "configuration refused") ||
		!strings.Contains(msg, "policy.exempt_connectors: ") || !strings.Contains(msg, "the data plane holds at most 1024") {
		t.Errorf("agent log after the reload: %q", msg)
	}
	// Nothing of the refused policy is enforced: carol is not exempt, svc
	// (exempt in the running policy) still is.
	run(t, []tcase{
		{"node1", "carol", "tcp", "127.0.0.1", 5171, eperm, nil},
		{"node1", "svc", "tcp", "127.0.0.1", 5171, "OK", nil},
	})
}
