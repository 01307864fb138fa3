package cli

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// TestUVNExplain: explain's uvn line says what uvn does — a user's own
// connection decided by the site rules, another user's never carried, the
// callback path by source, a default-VRF service — and agrees with
// policy.Decide where uvn carries the connection.
func TestUVNExplain(t *testing.T) {
	res := &identity.Table{
		Users: []identity.User{{Name: "root"}, {Name: "alice", UID: 2001, GID: 2001}, {Name: "bob", UID: 2002, GID: 2002}},
		Groups: []identity.Group{{Name: "root"}, {Name: "alice", GID: 2001}, {Name: "bob", GID: 2002},
			{Name: "proj1", GID: 2100, Members: []string{"alice"}}},
	}
	data := `[policy]
exempt_connectors = ["root"]
[cluster]
subnets = ["198.18.0.0/24"]
nodes = ["node1=198.18.0.1", "node2=198.18.0.2"]
[uvn]
enable = true
slurm_conf = ""
srun_ports = "62900-62999"
[[uvn.underlay]]
prefixes = ["198.18.0.0/24"]
port = 4789
group = "239.192.0.0/16"
[[rule]]
name = "proj1-9302"
action = "deny"
from = ["@proj1"]
ports = [9302]
[[rule]]
name = "srun-node1"
action = "deny"
from_nodes = ["node1"]
ports = ["62990-62999"]
`
	cfg, err := config.Parse("palisade.toml", []byte(data), res)
	if err != nil {
		t.Fatal(err)
	}
	id := func(uid uint32, groups ...uint32) policy.Identity {
		return policy.Identity{UID: uid, GID: uid, Groups: append([]uint32{uid}, groups...)}
	}
	n1, n3, out := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.3"), netip.MustParseAddr("203.0.113.9")
	nat := netip.MustParseAddr("100.64.0.9")
	for _, c := range []struct {
		conn policy.Conn
		want string
	}{
		{policy.Conn{Source: n1, Connector: id(2001, 2100), Listener: id(2001), Port: 9302, Node: "node2", Proto: policy.TCP}, "DENY (site rule proj1-9302; the user's own VRF)"},
		{policy.Conn{Source: n1, Connector: id(2002), Listener: id(2002), Port: 9302, Node: "node2", Proto: policy.TCP}, "ALLOW (the user's own VRF; no site rule decides it)"},
		{policy.Conn{Source: n1, Connector: id(2002), Listener: id(2001), Port: 9303, Node: "node2", Proto: policy.TCP}, "DENY (bob's connections never reach alice's VRF"},
		{policy.Conn{Source: out, Connector: id(2001), Listener: id(2001), Port: 9303, Node: "node2", Proto: policy.TCP}, "DENY (off-cluster hosts never reach a user's VRF)"},
		{policy.Conn{Source: n1, Connector: id(0), Listener: id(2001), Port: 62995, Node: "node2", Proto: policy.TCP}, "DENY (site rule srun-node1; Slurm's callback path"},
		{policy.Conn{Source: n3, Connector: id(0), Listener: id(2001), Port: 62995, Node: "node2", Proto: policy.TCP}, "ALLOW (Slurm's callback path"},
		{policy.Conn{Source: n3, Connector: id(0), Listener: id(2001), Port: 9303, Node: "node2", Proto: policy.TCP}, "DENY (the default VRF reaches alice's listeners only on SrunPortRange"},
		{policy.Conn{Source: n1, Connector: id(2001, 2100), Listener: id(0), Port: 9302, Node: "node2", Proto: policy.TCP}, "DENY (site rule proj1-9302; a default-VRF service, reached from alice's VRF"},
		{policy.Conn{Source: n1, Connector: id(2002), Listener: id(0), Port: 9302, Node: "node2", Proto: policy.TCP}, "ALLOW (a default-VRF service, reached from bob's VRF"},
		// From her own NAT address (review finding: uvn let it pass
		// while explain said off-cluster): her VRF's deny rules apply.
		{policy.Conn{Source: nat, Connector: id(2001, 2100), Listener: id(2001), Port: 9302, Node: "node2", Proto: policy.TCP}, "DENY (site rule proj1-9302; the user's own VRF)"},
		{policy.Conn{Source: nat, Connector: id(2001, 2100), Listener: id(2001), Port: 9303, Node: "node2", Proto: policy.TCP}, "ALLOW (the user's own VRF; no site rule decides it)"},
		{policy.Conn{Source: nat, Connector: id(2002), Listener: id(2001), Port: 9303, Node: "node2", Proto: policy.TCP}, "DENY (bob's connections never reach alice's VRF"},
		{policy.Conn{Source: n1, Connector: id(2002), Listener: id(2001), Port: 22, Node: "node2", Proto: policy.TCP}, "ALLOW (system port"},
	} {
		if got := uvnExplain(cfg, res, c.conn); !strings.HasPrefix(got, c.want) {
			t.Errorf("%+v:\n got %s\nwant %s...", c.conn, got, c.want)
		}
	}
}
