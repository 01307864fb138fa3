package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// The import rules of docs/architecture.md, checked on what `go list` says
// (non-test imports), as Tailscale's deps tests do. A package of the module
// that no rule names fails the test: a new package's place is a decision,
// taken here and in docs/architecture.md's table.

// rule: packages matching pkg may import the module's packages matching
// allow and none matching deny (deny wins). Patterns are module-relative:
// "a/b" is that package, "a/b/..." it and everything below. The first rule
// whose pkg matches applies.
type rule struct {
	pkg         string
	allow, deny []string
}

// product is everything the shipped binary is built from.
var productDeny = []string{"lab/...", "cmd/..."}

var rules = []rule{
	// The product's foundations import nothing of the module.
	{pkg: "internal/identity"},
	// The Unix-socket server reads peers through the one peercred.
	{pkg: "internal/sys/unixserve", allow: []string{"internal/sys/peercred"}},
	// The cgroup2 root is found in the mount table, read by the one
	// reader of /proc.
	{pkg: "internal/sys/cgroup2", allow: []string{"internal/sys/procfs"}},
	{pkg: "internal/sys/..."},
	{pkg: "internal/slurmconf"},
	{pkg: "internal/version"},
	// The pure decision core.
	{pkg: "internal/policy", allow: []string{"internal/identity"}},
	{pkg: "internal/membership", allow: []string{"internal/identity", "internal/sys/..."}},
	{pkg: "internal/sockowner", allow: []string{"internal/identity", "internal/policy", "internal/sys/..."}},
	{pkg: "internal/portal/portalconfig", allow: []string{"internal/policy"}},
	{pkg: "internal/portal", allow: []string{"internal/identity", "internal/policy", "internal/portal/portalconfig", "internal/sys/..."}},
	// The configuration composes the planes' sections, never their data
	// paths.
	{pkg: "internal/config", allow: []string{"internal/policy", "internal/identity",
		"internal/dataplane/userwall/agentconfig", "internal/dataplane/egress", "internal/dataplane/uvn/uvnconfig", "internal/portal/portalconfig"}},
	// Data planes: each on its own, never another plane.
	{pkg: "internal/dataplane/userwall/agentconfig", allow: []string{"internal/policy"}},
	// userwall's kernel side knows no agent and no configuration file.
	{pkg: "internal/dataplane/userwall/kernel", allow: []string{"internal/policy", "internal/identity", "internal/sys/..."}},
	// Its read side (status, uninstall, signals, the cluster view) is
	// what the CLI uses without the agent: it never imports the agent.
	{pkg: "internal/dataplane/userwall/control", allow: []string{"internal/dataplane/userwall/kernel", "internal/config",
		"internal/sockowner", "internal/sys/..."}},
	{pkg: "internal/dataplane/userwall/...", allow: []string{"internal/dataplane/userwall/...", "internal/policy", "internal/config",
		"internal/identity", "internal/membership", "internal/sockowner", "internal/portal", "internal/sys/...", "internal/version"}},
	{pkg: "internal/dataplane/uvn/spank"},
	{pkg: "internal/dataplane/uvn/uvnconfig", allow: []string{"internal/policy"}},
	{pkg: "internal/dataplane/uvn/...", allow: []string{"internal/dataplane/uvn/...", "internal/policy", "internal/sys/...", "internal/slurmconf"}},
	{pkg: "internal/dataplane/egress", allow: []string{"internal/policy"}},
	{pkg: "internal/dataplane/egress/...", allow: []string{"internal/dataplane/egress/...", "internal/policy", "internal/sys/..."}},
	// The commands wire everything.
	{pkg: "internal/cli", allow: []string{"internal/..."}, deny: []string{"internal/cli"}},
	{pkg: "cmd/palisade", allow: []string{"internal/cli", "internal/version"}},

	// The lab: its foundations know no data plane and no mode.
	{pkg: "lab/testbed", allow: []string{"internal/sys/..."}},
	{pkg: "lab/probe", allow: []string{"internal/sys/..."}},
	// The lab's applications (an embedded script), for the bench and the
	// attack suite alike.
	{pkg: "lab/h3"},
	{pkg: "lab/check/craft"},
	{pkg: "lab/check", allow: []string{"internal/...", "lab/probe", "lab/testbed"}, deny: []string{"internal/cli"}},
	{pkg: "lab/check/attack", allow: []string{"internal/...", "lab/check/craft", "lab/h3", "lab/modes/userwall", "lab/testbed"}, deny: []string{"internal/cli"}},
	{pkg: "lab/check/...", allow: []string{"internal/...", "lab/check/...", "lab/testbed", "lab/vm"}, deny: []string{"internal/cli"}},
	{pkg: "lab/vm", allow: []string{"internal/...", "lab/testbed"}, deny: []string{"internal/cli"}},
	// A plane's lab adapter uses its own plane only.
	{pkg: "lab/modes/userwall/...", allow: []string{"internal/...", "lab/check", "lab/testbed", "lab/modes/userwall/...", "packaging/systemd"},
		deny: []string{"internal/cli", "internal/dataplane/uvn/...", "internal/dataplane/egress/..."}},
	{pkg: "lab/modes/uvn", allow: []string{"internal/...", "lab/check", "lab/testbed"},
		deny: []string{"internal/cli", "internal/dataplane/userwall/...", "internal/dataplane/egress/..."}},
	{pkg: "lab/modes/egress", allow: []string{"internal/...", "lab/testbed"},
		deny: []string{"internal/cli", "internal/dataplane/userwall/...", "internal/dataplane/uvn/..."}},
	{pkg: "lab/directory", allow: []string{"internal/...", "lab/modes/userwall", "lab/testbed"}, deny: []string{"internal/cli"}},
	{pkg: "lab/bench", allow: []string{"internal/...", "lab/..."}, deny: []string{"internal/cli", "lab/cli"}},
	// Tests only (no non-test imports).
	{pkg: "lab/kernels"},
	{pkg: "lab/sidebyside"},
	{pkg: "lab/portal/jupyterhub"},
	{pkg: "lab/portal/ondemand"},
	{pkg: "lab/cli", allow: []string{"internal/cli", "lab/..."}, deny: []string{"lab/cli"}},
	{pkg: "cmd/palisade-lab", allow: []string{"internal/cli", "lab/..."}},
	// The packages: the product's files, its unit, its man pages.
	{pkg: "packaging/...", allow: []string{"packaging/...", "internal/cli", "internal/version"}},
}

// binaryDeny are packages the product binary must not link at all
// (anywhere in its dependency graph): the lab, plotting, the testing
// framework (whose flags and hooks a test-only import would bring).
var binaryDeny = []string{"lab/", "cmd/palisade-lab", "gonum.org/", "testing", "testing/"}

func match(pattern, pkg string) bool {
	if p, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == p || strings.HasPrefix(pkg, p+"/")
	}
	return pkg == pattern
}

func matchAny(patterns []string, pkg string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return match(p, pkg) })
}

func goList(t *testing.T, args ...string) []string {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list"}, args...)...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go list %v: %v\n%s", args, err, stderr)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

// TestImportRules checks every package's direct imports of the module
// against the rules, and the product binary's whole dependency graph.
func TestImportRules(t *testing.T) {
	mod := goList(t, "-m")[0] + "/"
	for _, line := range goList(t, "-f", "{{.ImportPath}} {{join .Imports \" \"}}", mod+"...") {
		f := strings.Fields(line)
		pkg, ok := strings.CutPrefix(f[0], mod)
		if !ok {
			continue // the module root (tools pin)
		}
		i := slices.IndexFunc(rules, func(r rule) bool { return match(r.pkg, pkg) })
		if i < 0 {
			t.Errorf("%s: no import rule: add one to cmd/palisade/deps_test.go and its row to docs/architecture.md", pkg)
			continue
		}
		r := rules[i]
		product := match("internal/...", pkg) || pkg == "cmd/palisade"
		for _, imp := range f[1:] {
			imp, ok := strings.CutPrefix(imp, mod)
			if !ok {
				continue
			}
			switch {
			case product && matchAny(productDeny, imp):
				t.Errorf("%s imports %s: the product never imports the lab or a command", pkg, imp)
			case matchAny(r.deny, imp) || !matchAny(r.allow, imp):
				t.Errorf("%s imports %s: not allowed (rule %q: allow %v, deny %v; docs/architecture.md)", pkg, imp, r.pkg, r.allow, r.deny)
			}
		}
	}
	deps := goList(t, "-deps", mod+"cmd/palisade")
	if len(deps) < 100 {
		t.Fatalf("go list -deps cmd/palisade: only %d packages", len(deps))
	}
	for _, d := range deps {
		d = strings.TrimPrefix(d, mod)
		for _, bad := range binaryDeny {
			if d == bad || (strings.HasSuffix(bad, "/") && strings.HasPrefix(d, bad)) {
				t.Errorf("the product binary links %s", d)
			}
		}
	}
}

// TestImportRulesCatch is the rules' positive control: imports that break
// them are reported.
func TestImportRulesCatch(t *testing.T) {
	for _, c := range []struct {
		pkg, imp string
		ok       bool
	}{
		{"internal/policy", "internal/identity", true},
		{"internal/sys/cgroup2", "internal/sys/procfs", true},
		{"internal/sys/procfs", "internal/sys/cgroup2", false},
		{"internal/sys/relay", "internal/sys/procfs", false},
		{"internal/policy", "internal/config", false},
		{"internal/config", "internal/dataplane/userwall", false},
		{"internal/config", "internal/dataplane/egress/gateway", false},
		{"internal/config", "internal/dataplane/uvn", false},
		{"internal/config", "internal/portal", false},
		{"internal/config", "internal/dataplane/uvn/uvnconfig", true},
		{"internal/dataplane/uvn", "internal/dataplane/userwall", false},
		{"internal/dataplane/userwall/kernel", "internal/dataplane/userwall", false},
		{"internal/dataplane/userwall/kernel", "internal/config", false},
		{"internal/dataplane/userwall", "internal/dataplane/userwall/kernel", true},
		{"internal/dataplane/userwall", "internal/dataplane/userwall/control", true},
		{"internal/dataplane/userwall/control", "internal/dataplane/userwall", false},
		{"internal/dataplane/userwall/control", "internal/dataplane/userwall/kernel", true},
		{"internal/dataplane/userwall/kernel", "internal/dataplane/userwall/control", false},
		{"internal/dataplane/egress/gateway", "internal/dataplane/egress/join", true},
		{"lab/testbed", "lab/modes/userwall", false},
		{"lab/modes/egress", "internal/dataplane/userwall", false},
		{"lab/check", "lab/modes/uvn", false},
		{"lab/cli", "lab/testbed", true},
	} {
		i := slices.IndexFunc(rules, func(r rule) bool { return match(r.pkg, c.pkg) })
		if i < 0 {
			t.Fatalf("%s: no rule", c.pkg)
		}
		r := rules[i]
		if ok := !matchAny(r.deny, c.imp) && matchAny(r.allow, c.imp); ok != c.ok {
			t.Errorf("%s importing %s: allowed %v, want %v", c.pkg, c.imp, ok, c.ok)
		}
	}
}
