package config

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// siteUsers adds a database administrator and a monitoring group to the
// testbed's accounts.
var siteUsers = &identity.Table{
	Users: append(append([]identity.User{}, users.Users...),
		identity.User{Name: "dave", UID: 2005, GID: 2005}, identity.User{Name: "postgres", UID: 2006, GID: 2006}),
	Groups: append(append([]identity.Group{}, users.Groups...),
		identity.Group{Name: "dbadmins", GID: 2200, Members: []string{"dave"}},
		identity.Group{Name: "monitoring", GID: 2300, Members: []string{"carol"}},
		identity.Group{Name: "genomics", GID: 2400, Members: []string{"alice"}}),
}

// sitePolicy has a rule of every kind and tests covering each rule, positive
// and negative.
const sitePolicy = `[policy]
exempt_connectors = ["root", "svc"]
exempt_listeners  = ["root", "slurm"]

[cluster]
subnets = ["198.18.0.0/24", "198.19.0.0/24", "2001:2::/64"]
nodes   = ["node1=198.18.0.1,198.19.0.1", "node2=198.18.0.2,198.19.0.2,2001:2::2", "db1=198.18.0.11", "login1=198.18.0.21"]

[[rule]]
name = "db-admins-only"        # nobody but dbadmins reaches 5432 on the database nodes
action = "allow"
from = ["@dbadmins"]
on_nodes = ["db[1-2]"]
ports = [5432]
proto = "tcp"

[[rule]]
name = "db-others"
action = "deny"
on_nodes = ["db[1-2]"]
ports = ["5432"]

[[rule]]
name = "monitoring-exporters"  # the monitoring group reaches every user's 9100-9199
action = "allow"
from = ["@monitoring"]
ports = ["9100-9199"]

[[rule]]
name = "genomics-from-login"   # genomics listeners reachable from the login node
action = "allow"
from_nodes = ["login1"]
to = ["@genomics"]

[[rule]]
name = "portal-ports"          # the portal account reaches 8000-8999 only
action = "allow"
from = ["svc"]
ports = ["8000-8999"]

[[rule]]
name = "portal-nothing-else"
action = "deny"
from = ["svc"]

[[rule]]
name = "lab-net-udp"           # an off-cluster lab network may send UDP to 7000-7010
action = "allow"
from_subnets = ["203.0.113.0/24"]
ports = ["7000-7010"]
proto = "udp"

[[rule]]
name = "no-bob-on-node2-range"
action = "deny"
from = ["bob"]
on_nodes = ["node2"]
ports = ["6000-6099"]

[[rule]]
name = "own-debug-port-node1"
action = "allow"
relation = "same-user"
from_nodes = ["node1"]
ports = [7777]

[[rule]]
name = "project-udp-only"
action = "deny"
relation = "shared-group"
ports = ["12000-12999"]
proto = "tcp"

[[test]]
name = "dave reaches postgres on db1"
from = "dave"
from_node = "node1"
to = "postgres"
node = "db1"
port = 5432
expect = "allow"
rule = "db-admins-only"

[[test]]
from = "alice"
from_node = "node1"
to = "postgres"
node = "db1"
port = 5432
expect = "deny"
rule = "db-others"

[[test]]
from = "root"
from_node = "node1"
to = "postgres"
node = "db1"
port = 5432
expect = "deny"
rule = "db-others"

[[test]]
from = "alice"
from_node = "node1"
to = "alice"
node = "node2"
port = 5432
expect = "allow"
rule = "same-user"

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
node = "node2"
port = 9100
expect = "allow"
rule = "monitoring-exporters"

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
port = 9200
expect = "deny"
rule = "default-deny"

[[test]]
from = "bob"
from_node = "node1"
to = "alice"
port = 9150
expect = "deny"
rule = "default-deny"

[[test]]
from = "carol"
from_node = "login1"
to = "alice"
to_group = "genomics"
port = 8888
expect = "allow"
rule = "genomics-from-login"

[[test]]
from = "carol"
from_node = "node1"
to = "alice"
to_group = "genomics"
port = 8888
expect = "deny"
rule = "default-deny"

[[test]]
from = "svc"
from_node = "node1"
to = "carol"
port = 8080
expect = "allow"
rule = "portal-ports"

[[test]]
from = "svc"
from_node = "node1"
to = "carol"
port = 9000
expect = "deny"
rule = "portal-nothing-else"

[[test]]
from = "carol"
source = "203.0.113.9"
to = "alice"
port = 7005
proto = "udp"
expect = "allow"
rule = "lab-net-udp"

[[test]]
from = "carol"
source = "203.0.113.9"
to = "alice"
port = 7005
proto = "tcp"
expect = "deny"
rule = "off-cluster-denied"

[[test]]
from = "carol"
source = "198.51.100.1"
to = "alice"
port = 7005
proto = "udp"
expect = "deny"
rule = "off-cluster-denied"

[[test]]
from = "bob"
from_node = "node1"
to = "bob"
node = "node2"
port = 6050
expect = "deny"
rule = "no-bob-on-node2-range"

[[test]]
from = "bob"
from_node = "node1"
to = "bob"
node = "node1"
port = 6050
expect = "allow"
rule = "same-user"

[[test]]
from = "alice"
from_node = "node1"
to = "alice"
port = 7777
expect = "allow"
rule = "own-debug-port-node1"

[[test]]
from = "alice"
from_node = "node2"
to = "alice"
port = 7777
expect = "allow"
rule = "same-user"

[[test]]
from = "bob"
from_node = "node1"
to = "alice"
port = 7777
expect = "deny"
rule = "default-deny"

[[test]]
from = "bob"
from_node = "node2"
to = "alice"
to_group = "proj1"
port = 12345
expect = "deny"
rule = "project-udp-only"

[[test]]
from = "bob"
from_node = "node2"
to = "alice"
to_group = "proj1"
port = 12345
proto = "udp"
expect = "allow"
rule = "shared-group"

[[test]]
from = "alice"
to = "bob"
port = 22
expect = "allow"
rule = "system-port"
`

func TestSiteRules(t *testing.T) {
	c, err := Parse("site.toml", []byte(sitePolicy), siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Policy.Rules) != 10 || len(c.Tests) != 22 {
		t.Fatalf("%d rules, %d tests", len(c.Policy.Rules), len(c.Tests))
	}
	res, err := c.RunTests(siteUsers)
	if err != nil {
		t.Fatalf("tests failed:\n%v", err)
	}
	if len(res) != 22 {
		t.Fatalf("%d results", len(res))
	}
	if u := c.Uncovered(); len(u) != 0 {
		t.Errorf("rules without a test: %v", u)
	}
	r := c.Policy.SiteRule("monitoring-exporters")
	if r == nil || r.Line != 23 || r.File != "site.toml" {
		t.Errorf("monitoring-exporters at %+v", r)
	}
	// node1's two addresses, node2's three.
	if r := c.Policy.SiteRule("own-debug-port-node1"); r == nil || len(r.Sources) != 2 {
		t.Errorf("own-debug-port-node1 sources %+v", r)
	}
	// Describe keeps the rules and tests: its output passes the same tests.
	c2, err := Parse("described", []byte(c.Describe(siteUsers)), siteUsers)
	if err != nil {
		t.Fatalf("Describe: %v\n%s", err, c.Describe(siteUsers))
	}
	if _, err := c2.RunTests(siteUsers); err != nil || len(c2.Policy.Rules) != 10 {
		t.Errorf("described policy: %d rules, tests: %v", len(c2.Policy.Rules), err)
	}
}

func TestSiteRuleTestFails(t *testing.T) {
	// The same policy with the monitoring rule widened by mistake.
	data := strings.Replace(sitePolicy, `ports = ["9100-9199"]`, `ports = ["9100-9299"]`, 1)
	c, err := Parse("site.toml", []byte(data), siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.RunTests(siteUsers)
	want := `site.toml:120: test[6]: "carol → alice:9200": expected deny by rule default-deny, got allow by rule monitoring-exporters`
	if err == nil || err.Error() != want {
		t.Errorf("got %v\nwant %s", err, want)
	}
	var ce *ConfigError
	if !errors.As(err, &ce) {
		t.Errorf("not a ConfigError: %T", err)
	}
}

func TestSiteRuleErrors(t *testing.T) {
	head := "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nnodes = [\"node1=198.18.0.1\"]\n"
	tests := []struct{ body, want string }{
		{"[[rule]]\naction = \"allow\"\n", "x.toml:4: rule[1].name: missing: every rule has a name (verdicts and explain report it)"},
		{"[[rule]]\nname = \"same-user\"\naction = \"allow\"\n", `x.toml:5: rule[1].name: "same-user" is a built-in rule's name`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\n[[rule]]\nname = \"a\"\naction = \"deny\"\n", `x.toml:8: rule[2].name: duplicate rule name "a" (also x.toml:4)`},
		{"[[rule]]\nname = \"a b\"\naction = \"allow\"\n", `x.toml:5: rule[1].name: bad name "a b": letters, digits, '-', '_', '.' (at most 63)`},
		{"[[rule]]\nname = \"a\"\naction = \"permit\"\n", `x.toml:6: rule[1].action: bad action "permit": want "allow" or "deny"`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nfrom = [\"alice\",\n  \"mallory\"]\n", `x.toml:8: rule[1].from: unknown user "mallory"`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nto = [\"@nogroup\"]\n", `x.toml:7: rule[1].to: unknown group "nogroup"`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nports = [\"9000-8000\"]\n", `x.toml:7: rule[1].ports: inverted range "9000-8000": first port above last`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nports = [22]\n", `x.toml:7: rule[1].ports: 22 is within the system ports (<= 1023), which every user reaches from anywhere: no rule decides them`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nproto = \"sctp\"\n", `x.toml:7: rule[1].proto: bad protocol "sctp": want "tcp", "udp" or "any"`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nfrom_nodes = [\"node[1-3]\"]\n", `x.toml:7: rule[1].from_nodes: node "node2" is not in [cluster] nodes (its addresses come from there)`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\non_nodes = [\"node[1-\"]\n", `x.toml:7: rule[1].on_nodes: bad hostlist "node[1-": '[' not closed`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nfrom_subnets = [\"10.0.0.1/8\"]\n", `x.toml:7: rule[1].from_subnets: bad subnet "10.0.0.1/8": host bits set (did you mean 10.0.0.0/8?)`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nrelation = \"friends\"\n", `x.toml:7: rule[1].relation: bad relation "friends": want "same-user" or "shared-group"`},
		{"[[rule]]\nname = \"a\"\naction = \"allow\"\nfrm = [\"alice\"]\n", `x.toml:7: rule.frm: unknown key`},
		{"[[test]]\nfrom = \"alice\"\nto = \"bob\"\nport = 5000\nexpect = \"maybe\"\n", `x.toml:8: test[1].expect: want "allow" or "deny", got "maybe"`},
		{"[[test]]\nfrom = \"alice\"\nto = \"bob\"\nport = 5000\nexpect = \"deny\"\nrule = \"nope\"\n", `x.toml:9: test[1].rule: no rule is named "nope"`},
		{"[[test]]\nfrom = \"alice\"\nto = \"bob\"\nport = 0\nexpect = \"deny\"\n", `x.toml:7: test[1].port: port 0 out of range (1-65535)`},
		{"[[test]]\nfrom = \"alice\"\nto = \"bob\"\nport = 5000\nexpect = \"deny\"\nfrom_node = \"node9\"\n", `x.toml:9: test[1].from_node: node "node9" is not in [cluster] nodes`},
	}
	for _, tt := range tests {
		c, err := Parse("x.toml", []byte(head+tt.body), siteUsers)
		if err == nil || err.Error() != tt.want {
			t.Errorf("%q:\n got %v\nwant %s", tt.body, err, tt.want)
		}
		if c != nil {
			t.Errorf("%q: a config came back with the error", tt.body)
		}
	}
}

func TestSiteRuleIncludes(t *testing.T) {
	dir := t.TempDir()
	main := filepath.Join(dir, "palisade.toml")
	write := func(p, s string) {
		t.Helper()
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.Mkdir(filepath.Join(dir, "policy.d"), 0o755)
	write(main, "[policy]\ninclude = [\"policy.d/*.toml\"]\n[cluster]\nsubnets = [\"198.18.0.0/24\"]\n"+
		"[[rule]]\nname = \"first\"\naction = \"deny\"\nports = [5000]\n")
	write(filepath.Join(dir, "policy.d", "20-b.toml"), "[[rule]]\nname = \"third\"\naction = \"allow\"\nports = [5000, 5001]\n")
	write(filepath.Join(dir, "policy.d", "10-a.toml"), "# a\n[[rule]]\nname = \"second\"\naction = \"allow\"\nports = [5001]\n\n"+
		"[[test]]\nfrom = \"bob\"\nto = \"alice\"\nport = 5001\nexpect = \"allow\"\nrule = \"second\"\n")
	data, _ := os.ReadFile(main)
	c, err := Parse(main, data, siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range c.Policy.Rules {
		names = append(names, r.Name+"@"+filepath.Base(r.File))
	}
	if got := strings.Join(names, " "); got != "first@palisade.toml second@10-a.toml third@20-b.toml" {
		t.Errorf("rules %s", got)
	}
	if r := c.Policy.SiteRule("second"); r.Line != 2 {
		t.Errorf("second at line %d", r.Line)
	}
	if _, err := c.RunTests(siteUsers); err != nil {
		t.Error(err)
	}
	// Resolve (names again, the agent's retry) uses the files as read,
	// not a change made since, which no test has passed.
	write(filepath.Join(dir, "policy.d", "20-b.toml"), "[[rule]]\nname = \"changed\"\naction = \"allow\"\nports = [6000]\n")
	if pol, _, err := c.Resolve(siteUsers); err != nil || len(pol.Rules) != 3 || pol.SiteRule("third") == nil {
		t.Errorf("Resolve read the changed file: %v %+v", err, pol)
	}
	// An error in an included file names that file and line.
	write(filepath.Join(dir, "policy.d", "20-b.toml"), "[[rule]]\nname = \"third\"\naction = \"allow\"\nports = [5000, 70000]\n")
	_, err = Parse(main, data, siteUsers)
	want := filepath.Join(dir, "policy.d", "20-b.toml") + ":4: rule[1].ports: port 70000 out of range (1-65535)"
	if err == nil || err.Error() != want {
		t.Errorf("got %v\nwant %s", err, want)
	}
	// Not a regular file: refused, not read.
	c2 := strings.Replace(string(data), `include = ["policy.d/*.toml"]`, `include = ["policy.d/*.toml", "/dev/zero"]`, 1)
	if _, err := Parse(main, []byte(c2), siteUsers); err == nil || !strings.Contains(err.Error(), "policy.include: /dev/zero: not a regular file") {
		t.Errorf("/dev/zero included: %v", err)
	}
	write(filepath.Join(dir, "policy.d", "20-b.toml"), "[policy]\nsystem_port_max = 1\n")
	if _, err = Parse(main, data, siteUsers); err == nil || !strings.Contains(err.Error(), "20-b.toml:2: policy.system_port_max: unknown key (an included file holds only [[rule]] and [[test]])") {
		t.Errorf("got %v", err)
	}
}

func TestDecideSiteRuleOrder(t *testing.T) {
	c, err := Parse("site.toml", []byte(sitePolicy), siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	// A rule matches an off-cluster source only when it names its subnet and
	// asks nothing of the (untrusted) identity: svc from outside is not svc.
	v := c.Policy.Decide(policy.Conn{Source: mustAddr("203.0.113.9"), Connector: policy.Identity{UID: 2004, GID: 2004},
		Listener: policy.Identity{UID: 2003, GID: 2003}, Port: 8080, Proto: policy.TCP})
	if v.Allow || v.Rule != policy.RuleOffClusterDenied {
		t.Errorf("svc from outside: %+v", v)
	}
	// A local connection matches no source constraint.
	v = c.Policy.Decide(policy.Conn{Connector: policy.Identity{UID: 2001, GID: 2001}, Listener: policy.Identity{UID: 2001, GID: 2001}, Port: 7777, Proto: policy.TCP})
	if v.Rule != policy.RuleSameUser {
		t.Errorf("local: %+v", v)
	}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestExplainSiteRule(t *testing.T) {
	c, err := Parse("site.toml", []byte(sitePolicy), siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	conn := policy.Conn{Source: mustAddr("198.18.0.1"), Connector: policy.Identity{UID: 2003, GID: 2003, Groups: []uint32{2003, 2300}},
		Listener: policy.Identity{UID: 2001, GID: 2001}, Port: 9100, Proto: policy.TCP}
	got := c.Policy.ExplainWith(conn, siteUsers)
	want := `Allowed by rule monitoring-exporters: site rule "monitoring-exporters" (site.toml:23), the first that matches port 9100/tcp, allows it: from @monitoring(2300), ports 9100-9199 (2 site rule(s) before it did not match); port 9100/tcp is above the system ports (<= 1023) and the source 198.18.0.1 is in cluster subnet 198.18.0.0/24, so its identity is trusted.`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
	conn.Port = 9300
	if got := c.Policy.ExplainWith(conn, siteUsers); !strings.Contains(got, "none of the 10 site rules matched") {
		t.Errorf("default deny: %s", got)
	}
}

// A test's from_node known by name only (a [cluster] nodes hostlist) is
// resolved when the test runs, not when the file loads.
func TestTestFromHostlistNode(t *testing.T) {
	data := "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nnodes = [\"palnosuchnode[1-2]\"]\n" +
		"[[test]]\nfrom = \"alice\"\nfrom_node = \"palnosuchnode1\"\nto = \"alice\"\nport = 5000\nexpect = \"allow\"\n"
	c, err := Parse("h.toml", []byte(data), siteUsers)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunTests(siteUsers); err == nil || !strings.Contains(err.Error(), `from_node "palnosuchnode1" (a [cluster] nodes hostlist name) does not resolve`) {
		t.Errorf("RunTests: %v", err)
	}
}
