package uvnconfig_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/uvnconfig"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// parseUVN runs the whole loader: [uvn] is one section of the file.
func parseUVN(t *testing.T, body string) (*config.Config, error) {
	t.Helper()
	return config.Parse("test.toml", []byte(body), nil)
}

func TestUVNConfigValid(t *testing.T) {
	c, err := parseUVN(t, `
[uvn]
enable = true
underlay_ports = ["22", "6817-6819"]
[[uvn.underlay]]
prefixes = ["198.18.0.0/24", "2001:2::/64"]
port = 4789
group = "239.192.0.0/16"
[[uvn.underlay]]
prefixes = ["198.19.0.0/24"]
port = 4790
peers = ["198.19.0.1", "198.19.0.2"]
`)
	if err != nil {
		t.Fatal(err)
	}
	u := c.UVN
	if u.MinUID != 1000 || u.UIDMax != 1<<24-1 || u.NATPrefix.String() != "100.64.0.0/10" || u.PortSpan() != 1 {
		t.Errorf("defaults: %+v", u)
	}
	if len(u.Underlays) != 2 || !u.Underlays[0].GroupNet.IsValid() || len(u.Underlays[1].PeerAddrs) != 2 ||
		len(u.Underlays[0].Nets) != 2 || len(u.UnderlayRanges) != 2 {
		t.Errorf("parsed: %+v", u.Underlays)
	}
	// Defaults alone validate (config check re-encodes them).
	if _, err := parseUVN(t, ""); err != nil {
		t.Fatal(err)
	}
}

func TestUVNConfigRejects(t *testing.T) {
	for _, c := range []struct{ body, want string }{
		{"[uvn]\nmin_uid = 100", "min_uid"},
		{"[uvn]\nenable = true", "no [[uvn.underlay]]"},
		{"[uvn]\nsrc_port_max = 1024", "src_port_max"},
		{"[uvn]\nsrc_port_min = 2000", "privileged"},
		{"[uvn]\nnat_pool = \"2001:2::/64\"", "nat_pool"},
		{"[uvn]\nunderlay_ports = [\"70000\"]", "underlay_ports"},
		{"[uvn]\nstate_dir = \"rel\"", "state_dir"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\n[[uvn.underlay]]\nprefixes = [\"198.19.0.0/24\"]\nport = 4789", "overlap"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\n[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4790", "already in underlay"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\ngroup = \"ff05::1\"", "family"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\ngroup = \"198.18.0.1\"", "not multicast"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\npeers = [\"198.19.0.1\"]", "not in the tunnel prefix"},
		{"[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 800", "source ports"},
		// uid_max above 2^24: each underlay needs a block of ports.
		{"[uvn]\nuid_max = 4294967294\n[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\n[[uvn.underlay]]\nprefixes = [\"198.19.0.0/24\"]\nport = 4790", "overlap"},
		{"[uvn]\nbogus = 1", "unknown key"},
		{"[uvn]\nsrun_ports = \"30000-62768\"", "at most 32768"},
		// More than the session programs (bpf/vrf.c) hold.
		{"[uvn]\nunderlay_ports = [\"1\", \"2\", \"3\", \"4\", \"5\", \"6\", \"7\", \"8\", \"9\"]", "at most 8 ranges"},
		{"[[uvn.underlay]]\nport = 4789\nprefixes = [" + prefixes(65) + "]", "65 IPv4 prefixes in all; at most 64"},
	} {
		_, err := parseUVN(t, c.body)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: want error containing %q, got %v", c.body, c.want, err)
		}
	}
	// Port blocks that do not overlap are fine; so are the programs' limits.
	if _, err := parseUVN(t, "[uvn]\nunderlay_ports = [\"1\", \"2\", \"3\", \"4\", \"5\", \"6\", \"7\", \"8\"]\n[[uvn.underlay]]\nport = 4789\nprefixes = ["+prefixes(64)+"]"); err != nil {
		t.Fatal(err)
	}
	if _, err := parseUVN(t, "[uvn]\nsrun_ports = \"30000-62767\""); err != nil {
		t.Fatal(err)
	}
	if _, err := parseUVN(t, "[uvn]\nuid_max = 4294967294\n[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789\n[[uvn.underlay]]\nprefixes = [\"198.19.0.0/24\"]\nport = 5045"); err != nil {
		t.Fatal(err)
	}
}

// prefixes is n distinct IPv4 /24s as TOML strings.
func prefixes(n int) string {
	var ps []string
	for i := range n {
		ps = append(ps, fmt.Sprintf("%q", fmt.Sprintf("198.18.%d.0/24", i)))
	}
	return strings.Join(ps, ", ")
}

// TestSiteNotesCallers: a deny rule from one of Slurm's accounts or an
// exempt account above min_uid on SrunPortRange is warned about (uvn
// cannot see who calls back), as one from root is; a user's is not.
func TestSiteNotesCallers(t *testing.T) {
	srun := policy.PortRange{First: 62900, Last: 62999}
	rule := func(uid uint32) *policy.Policy {
		return &policy.Policy{SystemPortMax: 1023, Rules: []policy.SiteRule{{Name: "r", From: []uint32{uid}, Ports: []policy.PortRange{{First: 62990, Last: 62999}}}}}
	}
	for _, c := range []struct {
		uid     uint32
		callers []uint32
		warned  bool
	}{
		{0, nil, true},                 // root: below min_uid
		{64030, []uint32{64030}, true}, // Debian's slurm, above min_uid
		{64030, nil, false},            // not a caller
		{2001, []uint32{64030}, false}, // a user
	} {
		warned := false
		for _, n := range uvnconfig.SiteNotes(rule(c.uid), 1000, srun, c.callers) {
			warned = warned || strings.Contains(n.Msg, "Slurm's callbacks")
		}
		if warned != c.warned {
			t.Errorf("from uid %d, callers %v: warned %v, want %v", c.uid, c.callers, warned, c.warned)
		}
	}
}
