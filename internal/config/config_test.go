package config

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// users is the testbed's account set as a fixture resolver.
var users = &identity.Table{
	Users: []identity.User{
		{Name: "root", UID: 0, GID: 0}, {Name: "slurm", UID: 64030, GID: 64030},
		{Name: "alice", UID: 2001, GID: 2001}, {Name: "bob", UID: 2002, GID: 2002},
		{Name: "carol", UID: 2003, GID: 2003}, {Name: "svc", UID: 2004, GID: 2004},
	},
	Groups: []identity.Group{
		{Name: "root", GID: 0}, {Name: "alice", GID: 2001}, {Name: "bob", GID: 2002},
		{Name: "proj1", GID: 2100, Members: []string{"alice", "bob"}},
	},
}

const goodConfig = `# Palisade policy for the test cluster
[policy]
system_port_max   = 1023
exempt_connectors = ["root", "svc"]
exempt_listeners  = ["root", "slurm", 2004]

[cluster]
subnets = ["198.18.0.0/24", "198.19.0.0/24", "2001:2::/64", "2001:2:0:1::/64"]
nodes   = ["node1=198.18.0.1", "node2=198.18.0.2"]

[offcluster]
allow_ports = ["8443", "9000-9100", 10000]

[agent]
[uvn]
[egress]
`

func TestParseGood(t *testing.T) {
	c, err := Parse("good.toml", []byte(goodConfig), users)
	if err != nil {
		t.Fatal(err)
	}
	p := c.Policy
	if p.SystemPortMax != 1023 {
		t.Errorf("SystemPortMax = %d", p.SystemPortMax)
	}
	if !slices.Equal(p.ExemptConnectors, []uint32{0, 2004}) || !slices.Equal(p.ExemptListeners, []uint32{0, 64030, 2004}) {
		t.Errorf("exempt = %v %v", p.ExemptConnectors, p.ExemptListeners)
	}
	if len(p.ClusterSubnets) != 4 || p.ClusterSubnets[3] != netip.MustParsePrefix("2001:2:0:1::/64") {
		t.Errorf("subnets = %v", p.ClusterSubnets)
	}
	if !slices.Equal(p.OffClusterPorts, []policy.PortRange{{First: 8443, Last: 8443}, {First: 9000, Last: 9100}, {First: 10000, Last: 10000}}) {
		t.Errorf("ports = %v", p.OffClusterPorts)
	}
	if len(c.Nodes) != 2 || c.Nodes[1].Name != "node2" || c.Nodes[1].Addr != netip.MustParseAddr("198.18.0.2") {
		t.Errorf("nodes = %v", c.Nodes)
	}
	// Describe's output is itself a valid configuration with the same policy.
	c2, err := Parse("described", []byte(c.Describe(users)), users)
	if err != nil {
		t.Fatalf("Describe output does not parse: %v\n%s", err, c.Describe(users))
	}
	if !equalPolicy(c.Policy, c2.Policy) || !reflect.DeepEqual(c.Nodes, c2.Nodes) {
		t.Errorf("Describe round trip: %+v != %+v", c2.Policy, c.Policy)
	}
}

func equalPolicy(a, b *policy.Policy) bool {
	return a.SystemPortMax == b.SystemPortMax && slices.Equal(a.ExemptConnectors, b.ExemptConnectors) &&
		slices.Equal(a.ExemptListeners, b.ExemptListeners) && slices.Equal(a.ClusterSubnets, b.ClusterSubnets) &&
		slices.Equal(a.OffClusterPorts, b.OffClusterPorts)
}

func TestParseDefaults(t *testing.T) {
	for _, data := range []string{"", "# nothing\n", "[policy]\n[cluster]\n[offcluster]\n"} {
		c, err := Parse("empty.toml", []byte(data), users)
		if err != nil {
			t.Fatal(err)
		}
		if !equalPolicy(c.Policy, policy.Default()) {
			t.Errorf("%q: policy %+v, want policy.Default() %+v", data, c.Policy, policy.Default())
		}
	}
	// An explicit empty list removes the default root exemption.
	c, err := Parse("x", []byte("[policy]\nexempt_connectors = []\n"), users)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Policy.ExemptConnectors) != 0 || !slices.Equal(c.Policy.ExemptListeners, []uint32{0}) {
		t.Errorf("exempt = %v %v", c.Policy.ExemptConnectors, c.Policy.ExemptListeners)
	}
}

// TestParseErrors checks that each kind of bad input is refused with the
// file, the line and the key in the message.
func TestParseErrors(t *testing.T) {
	const f = "/etc/palisade/palisade.toml"
	tests := []struct {
		name, data string
		want       []string // each a substring of the error, in order
	}{
		{"duplicate exempt by name and uid", "[policy]\nexempt_connectors = [\"svc\", 2004]\n",
			[]string{f + `:2: policy.exempt_connectors: duplicate: "2004" is uid 2004, already listed as "svc"`}},
		{"uid out of range", "[policy]\nexempt_listeners = [4294967296]\n",
			[]string{f + `:2: policy.exempt_listeners: id 4294967296 out of range`}},
		{"wrong element type", "[policy]\nexempt_connectors = [\"root\", 1.5]\n",
			[]string{f + `:2: policy.exempt_connectors: want a user name or uid, got a float`}},
		{"unknown key", "[policy]\nsystem_port_max = 1023\nexempt_conectors = [\"root\"]\n",
			[]string{f + `:3: policy.exempt_conectors: unknown key`}},
		{"unknown section", "[polcy]\nsystem_port_max = 1\n",
			[]string{f + `:1: polcy: unknown section`}},
		{"unknown top-level key", "\nfoo = 1\n",
			[]string{f + `:2: foo: unknown section`}},
		{"unknown nested table", "[cluster]\nsubnets = []\n[cluster.extra]\na = 1\n",
			[]string{f + `:3: cluster.extra: unknown key`}},
		{"unknown nested table reported once", "[agent.x]\na = 1\nb = 2\n",
			[]string{f + `:1: agent.x: unknown key`}},
		{"unknown key in data plane section", "[agent]\nbogus = true\n",
			[]string{f + `:2: agent.bogus: unknown key`}},
		{"dotted unknown key", "[uvn]\na.b = 1\n",
			[]string{f + `:2: uvn.a.b: unknown key`}},
		{"system port out of range", "[policy]\nsystem_port_max = 65536\n",
			[]string{f + `:2: policy.system_port_max: port 65536 out of range (0-65535)`}},
		{"system port negative", "[policy]\nsystem_port_max = -1\n",
			[]string{f + `:2: policy.system_port_max: port -1 out of range`}},
		{"system port wrong type", "[policy]\nsystem_port_max = \"1023\"\n",
			[]string{f + `:2: policy.system_port_max: wrong type: got a string, want an integer`}},
		{"section wrong type", "policy = 3\n",
			[]string{f + `:1: policy: wrong type: got an integer, want a table`}},
		{"subnets wrong type", "[cluster]\nsubnets = \"198.18.0.0/24\"\n",
			[]string{f + `:2: cluster.subnets: wrong type: got a string, want an array`}},
		{"bad subnet", "[cluster]\nsubnets = [\"198.18.0.0/33\"]\n",
			[]string{f + `:2: cluster.subnets: bad subnet "198.18.0.0/33"`}},
		{"subnet without length", "[cluster]\nsubnets = [\"198.18.0.0\"]\n",
			[]string{f + `:2: cluster.subnets: bad subnet "198.18.0.0"`}},
		{"subnet host bits", "[cluster]\nsubnets = [\n\"198.18.0.0/24\",\n\"2001:2::1/64\"]\n",
			[]string{f + `:4: cluster.subnets: bad subnet "2001:2::1/64": host bits set (did you mean 2001:2::/64?)`}},
		{"subnet v4-mapped", "[cluster]\nsubnets = [\"::ffff:198.18.0.0/120\"]\n",
			[]string{f + `:2: cluster.subnets: bad subnet "::ffff:198.18.0.0/120": write IPv4-mapped networks as IPv4`}},
		{"duplicate subnet", "[cluster]\nsubnets = [\"198.18.0.0/24\", \"198.18.0.0/24\"]\n",
			[]string{f + `:2: cluster.subnets: duplicate subnet 198.18.0.0/24`}},
		{"bad node", "[cluster]\nnodes = [\"node1 198.18.0.1\"]\n",
			[]string{f + `:2: cluster.nodes: bad hostlist "node1 198.18.0.1"`, `want name=address[,address...] or a hostlist`}},
		{"bad node address", "[cluster]\nnodes = [\"node1=198.18.0.300\"]\n",
			[]string{f + `:2: cluster.nodes: bad node "node1=198.18.0.300"`}},
		{"duplicate node", "[cluster]\nnodes = [\"node1=198.18.0.1\", \"node1=198.18.0.2\"]\n",
			[]string{f + `:2: cluster.nodes: duplicate node name "node1"`}},
		{"duplicate node address", "[cluster]\nnodes = [\"node1=198.18.0.1\", \"node2=198.18.0.1\"]\n",
			[]string{f + `:2: cluster.nodes: duplicate address 198.18.0.1 (also node1)`}},
		{"node outside cluster", "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nnodes = [\"node1=198.19.0.1\"]\n",
			[]string{f + `:3: cluster.nodes: node node1 address 198.19.0.1 is outside cluster.subnets`}},
		{"port out of range", "[offcluster]\nallow_ports = [\"70000\"]\n",
			[]string{f + `:2: offcluster.allow_ports: port 70000 out of range (1-65535)`}},
		{"port zero", "[offcluster]\nallow_ports = [0]\n",
			[]string{f + `:2: offcluster.allow_ports: port 0 out of range`}},
		{"port not a number", "[offcluster]\nallow_ports = [\"https\"]\n",
			[]string{f + `:2: offcluster.allow_ports: bad port "https"`}},
		{"inverted range", "[offcluster]\nallow_ports = [\"9100-9000\"]\n",
			[]string{f + `:2: offcluster.allow_ports: inverted range "9100-9000"`}},
		{"overlapping ranges", "[offcluster]\nallow_ports = [\"9000-9100\",\n \"9100\"]\n",
			[]string{f + `:3: offcluster.allow_ports: duplicate: 9100 overlaps 9000-9100`}},
		{"port wrong type", "[offcluster]\nallow_ports = [true]\n",
			[]string{f + `:2: offcluster.allow_ports: want a port or "first-last" range, got a boolean`}},
		{"syntax error", "[policy]\nsystem_port_max = \n",
			[]string{f + `:2: policy.system_port_max:`}},
		{"duplicate key", "[policy]\nsystem_port_max = 1\nsystem_port_max = 2\n",
			[]string{f + `:3:`, "system_port_max"}},
		{"several errors, in file order", "[offcluster]\nallow_ports = [\"0\"]\n[policy]\nexempt_connectors = [\"@\"]\nextra = 1\n",
			[]string{f + `:2: offcluster.allow_ports`, f + `:4: policy.exempt_connectors`, f + `:5: policy.extra: unknown key`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse(f, []byte(tt.data), users)
			if err == nil {
				t.Fatalf("no error; policy %+v", c.Policy)
			}
			if c != nil {
				t.Error("a config returned with an error")
			}
			msg := err.Error()
			at := 0
			for _, w := range tt.want {
				i := strings.Index(msg[at:], w)
				if i < 0 {
					t.Fatalf("error %q\n  does not contain (after offset %d) %q", msg, at, w)
				}
				at += i + len(w)
			}
			if n := strings.Count(msg, "\n") + 1; n > len(tt.want) {
				t.Errorf("%d errors reported, want %d: %s", n, len(tt.want), msg)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.File != f {
				t.Errorf("not a *ConfigError naming the file: %#v", err)
			}
		})
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "palisade.toml")
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), path+": configuration file does not exist") {
		t.Errorf("missing file: %v", err)
	}
	c, err := LoadOrDefault(path)
	if err != nil || !c.Default || !equalPolicy(c.Policy, policy.Default()) || c.Path != path {
		t.Errorf("LoadOrDefault(missing) = %+v, %v", c, err)
	}
	if err := os.WriteFile(path, []byte("[policy]\nsystem_port_max = 2047\nexempt_connectors = [0]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, load := range []func(string) (*Config, error){Load, LoadOrDefault} {
		c, err := load(path)
		if err != nil || c.Default || c.Policy.SystemPortMax != 2047 {
			t.Errorf("load = %+v, %v", c, err)
		}
	}
	if err := os.WriteFile(path, []byte("[policy]\nsystem_port_max = 99999\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A present but invalid file is never replaced by defaults.
	if _, err := LoadOrDefault(path); err == nil || !strings.Contains(err.Error(), path+":2: policy.system_port_max") {
		t.Errorf("LoadOrDefault(invalid) = %v", err)
	}
	if _, err := Load(dir); err == nil {
		t.Error("Load(directory) succeeded")
	}
}

// sectionWithKeys stands in for a data plane's table to test the loader's
// contract with section owners (defaults, strict decoding, KeyError lines).
func TestKeyErrorLines(t *testing.T) {
	loc := newLocator([]byte("[agent]\nmetrics = \"x\"\nlist = [\n  \"a\",\n  \"b\", # comment\n]\n[uvn]\n  vni_base = 7 # c\n"))
	for _, tc := range []struct {
		key, value string
		want       int
	}{
		{"agent", "", 1}, {"agent.metrics", "", 2}, {"agent.list", "", 3}, {"agent.list", "b", 5},
		{"agent.list", "zzz", 3}, {"agent.missing", "", 1}, {"uvn.vni_base", "", 8}, {"egress.x", "", 0},
	} {
		if got := loc.line(tc.key, tc.value); got != tc.want {
			t.Errorf("line(%q, %q) = %d, want %d", tc.key, tc.value, got, tc.want)
		}
	}
	e := &ConfigError{File: "f", Line: 3, Key: "agent.x", Msg: "bad"}
	if e.Error() != "f:3: agent.x: bad" || (&ConfigError{File: "f", Msg: "m"}).Error() != "f: m" {
		t.Error(e.Error())
	}
}

// The effective configuration that `config check` prints is valid input and
// means the same, nested tables ([[uvn.underlay]]) included.
func TestDescribeRoundTrip(t *testing.T) {
	const file = `[uvn]
enable = true
underlay_ports = ["22", "6817-6819"]
[[uvn.underlay]]
prefixes = ["198.18.0.0/24", "2001:2::/64"]
port = 4789
group = "239.192.0.0/16"
[[uvn.underlay]]
prefixes = ["198.19.0.0/24"]
port = 4790
peers = ["198.19.0.1"]
[egress]
deny = ["198.18.0.0/15"]
`
	c, err := Parse("uvn.toml", []byte(file), users)
	if err != nil {
		t.Fatal(err)
	}
	d := c.Describe(users)
	c2, err := Parse("described", []byte(d), users)
	if err != nil {
		t.Fatalf("Describe output does not parse: %v\n%s", err, d)
	}
	if !reflect.DeepEqual(c.UVN, c2.UVN) || !reflect.DeepEqual(c.Egress, c2.Egress) || !reflect.DeepEqual(c.Agent, c2.Agent) {
		t.Errorf("round trip changed the sections:\n%+v\n%+v\n%s", c.UVN, c2.UVN, d)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(goodConfig))
	f.Add([]byte("[policy]\nexempt_connectors = [\"mallory\", 1, -1]\n"))
	f.Add([]byte("[offcluster]\nallow_ports = [\"9-1\", 0, \"65535\"]\n[x.y]\nz=1"))
	f.Add([]byte("[cluster]\nnodes = [\"a=::ffff:1.2.3.4\"]\nsubnets = [\"::/0\"]"))
	f.Add([]byte("[[uvn.underlay]]\nprefixes = [\"198.18.0.0/24\"]\nport = 4789"))
	f.Add([]byte(sitePolicy))
	f.Add([]byte("[[rule]]\nname=\"a\"\naction=\"deny\"\nfrom_nodes=[\"n[01-10]x[1-2],m\"]\non_nodes=[\"a[1-2,5]\"]\nfrom=[\"@proj1\",2001]\n[[test]]\nfrom=\"bob\"\nto=\"alice\"\nport=5000\nexpect=\"deny\"\nrule=\"a\"\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.toml", data, users)
		if (c == nil) == (err == nil) {
			t.Fatalf("Parse returned config %v and error %v", c, err)
		}
		if err == nil {
			// Tests run or fail with an error, never panic; rule order holds.
			if _, terr := c.RunTests(users); terr != nil && !strings.Contains(terr.Error(), "test[") {
				t.Fatalf("RunTests: %v", terr)
			}
		}
		if err == nil {
			// A valid config describes itself as a valid config.
			if _, err := Parse("described", []byte(c.Describe(users)), users); err != nil {
				t.Fatalf("Describe output invalid: %v\n%s", err, c.Describe(users))
			}
		}
	})
}

// TestUnresolvedNames: an exempt name NSS cannot resolve does not make the
// file invalid (a daemon must not refuse to start over it): it is left out
// of the policy (fewer exemptions, nothing opened) and reported as an ERROR
// finding with its line — a WARNING with Elsewhere (a configuration
// management host without the site's directory); Resolve picks it up once
// it resolves.
func TestUnresolvedNames(t *testing.T) {
	const f = "/etc/palisade/palisade.toml"
	data := "[policy]\n\n\n\n\n\nexempt_connectors = [\"root\", \"mallory\"]\nexempt_listeners = [\n  \"root\",\n  \"eve\",\n  \"@nogroup\",\n  -1,\n]\n"
	c, err := Parse(f, []byte(data), users)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Policy.ExemptConnectors, []uint32{0}) || !slices.Equal(c.Policy.ExemptListeners, []uint32{0}) {
		t.Errorf("policy %+v", c.Policy)
	}
	var got []string
	for _, fd := range c.Findings(CheckOptions{}) {
		got = append(got, fd.Level+" "+fd.String(f))
	}
	for _, w := range []string{
		`ERROR ` + f + `:7: policy.exempt_connectors: unknown user "mallory": not exempt until it resolves`,
		`ERROR ` + f + `:10: policy.exempt_listeners: unknown user "eve"`,
		`ERROR ` + f + `:11: policy.exempt_listeners: unknown group "nogroup"`,
		`ERROR ` + f + `:12: policy.exempt_listeners: unknown user "-1"`,
	} {
		if !slices.ContainsFunc(got, func(g string) bool { return strings.HasPrefix(g, w) }) {
			t.Errorf("findings lack %q:\n%s", w, strings.Join(got, "\n"))
		}
	}
	for _, fd := range c.Findings(CheckOptions{Elsewhere: true}) {
		if fd.Key == "cluster.subnets" {
			continue
		}
		if fd.Level != "WARNING" || !strings.Contains(fd.Msg, "not resolvable on this host") {
			t.Errorf("elsewhere: %s %s", fd.Level, fd.String(f))
		}
	}
	more := &identity.Table{Users: append(slices.Clone(users.Users), identity.User{Name: "eve", UID: 2010, GID: 2010}), Groups: users.Groups}
	pol, still, err := c.Resolve(more)
	if err != nil || !slices.Equal(pol.ExemptListeners, []uint32{0, 2010}) || len(still) != 3 {
		t.Errorf("Resolve: %v %v %d", err, pol, len(still))
	}
}

// TestAddressFindings: a node none of whose addresses is in the cluster
// subnets (the 198.81.0.0/24 typo) is an ERROR; one in them is not.
func TestAddressFindings(t *testing.T) {
	c, err := Parse("c.toml", []byte("[cluster]\nsubnets = [\"198.81.0.0/24\"]\n"), users)
	if err != nil {
		t.Fatal(err)
	}
	local := []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("fe80::1")}
	fs := c.Findings(CheckOptions{LocalAddrs: local})
	if len(fs) != 1 || fs[0].Level != "ERROR" || fs[0].Line != 2 || !strings.Contains(fs[0].Msg, "none of this node's addresses (198.18.0.1) is in the cluster subnets (198.81.0.0/24)") {
		t.Errorf("typo: %+v", fs)
	}
	c, _ = Parse("c.toml", []byte("[cluster]\nsubnets = [\"198.18.0.0/24\"]\nnodes = [\"node2=198.18.0.2\"]\n"), users)
	fs = c.Findings(CheckOptions{LocalAddrs: local})
	if len(fs) != 1 || fs[0].Level != "WARNING" || fs[0].Key != "cluster.nodes" {
		t.Errorf("in the subnets, not in the node list: %+v", fs)
	}
	if fs := c.Findings(CheckOptions{LocalAddrs: local, Elsewhere: true}); len(fs) != 0 {
		t.Errorf("elsewhere: %+v", fs)
	}
}

// TestHostlistNodes: [cluster] nodes takes Slurm hostlists of names,
// resolved lazily (ResolveNodes): a name that does not resolve is a
// warning naming it, one outside the cluster subnets an ERROR; the others
// become nodes. unenforced_nodes takes hostlists of those nodes: listed
// ones give their addresses, hostlist ones are looked up, and one that
// does not resolve is unresolved (its traffic refused, retried).
func TestHostlistNodes(t *testing.T) {
	fake := map[string][]netip.Addr{
		"node01": {netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("2001:2::1")},
		"node03": {netip.MustParseAddr("10.0.0.3")},
	}
	lookup := func(n string) ([]netip.Addr, error) {
		if a, ok := fake[n]; ok {
			return a, nil
		}
		return nil, errors.New("no such host")
	}
	defer func(old func(string) ([]netip.Addr, error)) { lookupNode = old }(lookupNode)
	lookupNode = lookup
	const f = "c.toml"
	data := "[cluster]\nsubnets = [\"198.18.0.0/24\", \"2001:2::/64\"]\nnodes = [\"login1=198.18.0.100\",\n  \"node[01-03]\"]\nunenforced_nodes = [\"login1\", \"node[01-02]\"]\n"
	c, err := Parse(f, []byte(data), users)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Nodes) != 1 || len(c.PendingNodes) != 3 || c.PendingNodes[1].Name != "node02" || c.PendingNodes[1].Line != 4 {
		t.Fatalf("nodes %+v pending %+v", c.Nodes, c.PendingNodes)
	}
	var un []string
	for _, p := range c.Policy.UnenforcedNodes {
		un = append(un, p.String())
	}
	if !slices.Equal(un, []string{"198.18.0.100/32", "198.18.0.1/32", "2001:2::1/128"}) {
		t.Errorf("unenforced %v", un)
	}
	if len(c.Unresolved) != 1 || c.Unresolved[0].Key != "cluster.unenforced_nodes" || !strings.Contains(c.Unresolved[0].Msg, "node node02: not resolvable") {
		t.Errorf("unresolved %+v", c.Unresolved)
	}
	fs := c.ResolveNodes(lookup)
	if len(c.Nodes) != 2 || c.Nodes[1].Name != "node01" || len(c.Nodes[1].Addrs) != 2 || len(c.PendingNodes) != 2 {
		t.Errorf("after resolving: nodes %+v pending %+v", c.Nodes, c.PendingNodes)
	}
	if len(fs) != 2 || fs[0].Level != "WARNING" || fs[0].Line != 4 || !strings.Contains(fs[0].Msg, "node node02: not resolvable") ||
		fs[1].Level != "ERROR" || !strings.Contains(fs[1].Msg, "node node03 resolves to 10.0.0.3, outside cluster.subnets") {
		t.Errorf("findings %+v", fs)
	}
	if got := c.Findings(CheckOptions{}); !slices.ContainsFunc(got, func(x Finding) bool { return strings.Contains(x.Msg, "node03") }) {
		t.Errorf("Findings lack ResolveNodes' findings: %+v", got)
	}
	for _, bad := range []struct{ data, want string }{
		{"[cluster]\nnodes = [\"node[01-\"]\n", "c.toml:2: cluster.nodes: bad hostlist"},
		{"[cluster]\nnodes = [\"node1=198.18.0.1\", \"node[1-2]\"]\n", `duplicate node name "node1"`},
		{"[cluster]\nunenforced_nodes = [\"node7\"]\n", `node "node7" is not in [cluster] nodes`},
	} {
		if _, err := Parse(f, []byte(bad.data), users); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want %q", bad.data, err, bad.want)
		}
	}
}
