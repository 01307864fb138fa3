package gateway

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	sysnetns "github.com/palisade-hpc/palisade/internal/sys/netns"
)

// TestNATAndForwarding, in a scratch network namespace: the NAT table
// says what the gateway needs (pool out of any device but the tun,
// masqueraded), a second install replaces it (one rule, not two), removal
// leaves nothing; forwarding is restored to the value from before, also
// by a gateway started after one that died without restoring (journal).
func TestNATAndForwarding(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed (the test reads the table back with it)")
	}
	err := sysnetns.DoNew(func() error {
		list := func() string {
			out, _ := exec.Command("nft", "list", "table", "ip", "palisade_egress_palgw_t").CombinedOutput()
			return string(out)
		}
		pool := netip.MustParsePrefix("100.64.3.1/16")
		for range 2 {
			if err := installNAT("palgw-t", pool); err != nil {
				t.Fatal(err)
			}
		}
		got := list()
		if strings.Count(got, "masquerade") != 1 || !strings.Contains(got, `ip saddr 100.64.0.0/16 oifname != "palgw-t" masquerade`) ||
			!strings.Contains(got, "type nat hook postrouting priority srcnat; policy accept;") {
			t.Errorf("NAT table:\n%s", got)
		}
		if err := removeNAT("palgw-t"); err != nil {
			t.Error(err)
		}
		if got := list(); !strings.Contains(got, "No such file") {
			t.Errorf("after removal: %s", got)
		}
		if err := removeNAT("palgw-t"); err != nil {
			t.Errorf("removing a missing table: %v", err)
		}

		fwd := func() string { b, _ := os.ReadFile(ipForward); return strings.TrimSpace(string(b)) }
		if err := os.WriteFile(ipForward, []byte("0"), 0); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		restore, err := enableForwarding(dir)
		if err != nil || fwd() != "1" {
			t.Fatalf("enable: %v, ip_forward %s", err, fwd())
		}
		// A gateway that died: the next one finds forwarding on and the
		// journal of the host's value.
		restore2, err := enableForwarding(dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := restore2(); err != nil || fwd() != "0" {
			t.Errorf("restore after a crash: %v, ip_forward %s, want 0", err, fwd())
		}
		if _, err := os.Stat(filepath.Join(dir, "ip_forward.orig")); !os.IsNotExist(err) {
			t.Errorf("journal left after restore: %v", err)
		}
		_ = restore
		// Control: a host that forwards already keeps forwarding.
		os.WriteFile(ipForward, []byte("1"), 0)
		restore, err = enableForwarding(dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := restore(); err != nil || fwd() != "1" {
			t.Errorf("restore of a forwarding host: %v, ip_forward %s, want 1", err, fwd())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
