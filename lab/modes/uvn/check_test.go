package uvn

import (
	"testing"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/check"
)

func TestExpectUVN(t *testing.T) {
	alice := check.Party{Name: "alice", User: "alice", UID: 2001, GID: 2001, Node: "node1"}
	aliceG := check.Party{Name: "alice+proj1", User: "alice", UID: 2001, GID: 2100, Node: "node2"}
	bob := check.Party{Name: "bob", User: "bob", UID: 2002, GID: 2002, Groups: []uint32{2100}, Node: "node1"}
	root := check.Party{Name: "root", User: "root", UID: 0, Node: "node2"}
	out := check.Party{Name: "carol", User: "carol", UID: 2003, GID: 2003, Node: check.OutsideHost}
	onNode := func(p check.Party, n string) check.Party { p.Node = n; return p }
	for _, c := range []struct {
		name  string
		conn  check.Party
		lis   check.Party
		path  check.Path
		proto policy.Proto
		fam   int
		allow bool
	}{
		{"same user across nodes", alice, onNode(alice, "node2"), check.Eth0, policy.TCP, 6, true},
		{"same user, listener under sg", alice, aliceG, check.IB, policy.UDP, 4, true},
		{"shared group does not share a VRF", bob, aliceG, check.Eth0, policy.TCP, 4, false},
		{"other user", bob, onNode(alice, "node2"), check.Loopback, policy.TCP, 4, false},
		{"user to system service", bob, root, check.Eth0, policy.TCP, 6, true},
		{"user to system service, udp4", bob, root, check.IB, policy.UDP, 4, true},
		{"user to system service, udp6", bob, root, check.Eth0, policy.UDP, 6, false},
		{"user to system service, udp loopback", onNode(bob, "node2"), root, check.Loopback, policy.UDP, 4, false},
		{"root to user", onNode(root, "node1"), onNode(alice, "node2"), check.Eth0, policy.TCP, 4, false},
		{"outside to user", out, onNode(alice, "node2"), check.OutsideIn, policy.TCP, 4, false},
		{"outside to system", out, root, check.OutsideIn, policy.TCP, 6, true},
		{"outside to system, udp6", out, root, check.OutsideIn, policy.UDP, 6, true},
		{"user to outside v4", alice, out, check.OutsideOut, policy.TCP, 4, true},
		{"user to outside v6", alice, out, check.OutsideOut, policy.TCP, 6, false},
		{"root to outside v6", onNode(root, "node1"), out, check.OutsideOut, policy.UDP, 6, true},
	} {
		v := ExpectUVN(&check.Case{Connector: c.conn, Listener: c.lis, Path: c.path, Proto: c.proto, Family: c.fam})
		if v.Allow != c.allow {
			t.Errorf("%s: got %+v, want allow=%v", c.name, v, c.allow)
		}
	}
}
