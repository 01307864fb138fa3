package config

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// RuleConfig is one [[rule]] as written (docs/policy.md, "Site rules").
type RuleConfig struct {
	Name        string             `toml:"name"`
	Action      string             `toml:"action"`
	From        []policy.Principal `toml:"from,omitempty"`
	FromNodes   []string           `toml:"from_nodes,omitempty"`
	FromSubnets []string           `toml:"from_subnets,omitempty"`
	To          []policy.Principal `toml:"to,omitempty"`
	OnNodes     []string           `toml:"on_nodes,omitempty"`
	Ports       []policy.PortSpec  `toml:"ports,omitempty"`
	Proto       string             `toml:"proto,omitempty"`
	Relation    string             `toml:"relation,omitempty"`

	file string
	line int
}

// TestConfig is one [[test]]: a connection and the verdict the policy must
// give it. `palisade policy test`, `config check`, the agent's start and
// reload and the package's postinst refuse a policy whose tests fail.
type TestConfig struct {
	Name string `toml:"name,omitempty"`
	// From is the connector (user name or uid), Group its effective group
	// (as after sg; default its primary group). Its other groups are its
	// login groups (NSS).
	From  string `toml:"from"`
	Group string `toml:"group,omitempty"`
	// FromNode (a [cluster] nodes name) or Source (an address) is where the
	// connection comes from; neither: the listener's own node (local).
	FromNode string `toml:"from_node,omitempty"`
	Source   string `toml:"source,omitempty"`
	// To is the listener's user, ToGroup its socket's group (as after sg;
	// default its primary group), Node the listener's node (host name).
	To      string `toml:"to"`
	ToGroup string `toml:"to_group,omitempty"`
	Node    string `toml:"node,omitempty"`
	Port    int64  `toml:"port"`
	Proto   string `toml:"proto,omitempty"`
	// Expect is "allow" or "deny"; Rule, if set, the rule that must decide.
	Expect string `toml:"expect"`
	Rule   string `toml:"rule,omitempty"`

	file string
	line int
	src  netip.Addr
}

// ruleFile is what an included policy.d file may hold.
type ruleFile struct {
	Rule []RuleConfig `toml:"rule"`
	Test []TestConfig `toml:"test"`
}

var ruleName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// maxIncluded bounds an included file's size.
const maxIncluded = 4 << 20

// includedFile is one file [policy] include named, as read.
type includedFile struct {
	path string
	data []byte
}

// loadIncludes reads the files [policy] include names (globs relative to the
// main file's directory), in order, each file's matches sorted, and appends
// their rules and tests after the main file's. With c.included set (not
// nil), those files are used instead of the disk.
func (c *Config) loadIncludes(fail func(file string, line int, key, format string, args ...any)) []includedFile {
	if c.included != nil {
		for _, f := range c.included {
			c.addIncluded(f.path, f.data, fail)
		}
		return c.included
	}
	var files []includedFile
	dir := filepath.Dir(c.Path)
	seen := map[string]bool{}
	for _, pat := range c.Rules.Include {
		full := pat
		if !filepath.IsAbs(full) {
			full = filepath.Join(dir, full)
		}
		matches, err := filepath.Glob(full)
		if err != nil {
			fail(c.Path, c.KeyLineValue("policy.include", pat), "policy.include", "bad pattern %q: %v", pat, err)
			continue
		}
		slices.Sort(matches)
		for _, m := range matches {
			if seen[m] || m == c.Path {
				continue
			}
			seen[m] = true
			// A policy file, not whatever a glob meets (a device, a FIFO
			// or /proc would hang the agent's reload).
			if st, err := os.Stat(m); err == nil && (!st.Mode().IsRegular() || st.Size() > maxIncluded) {
				if st.Mode().IsDir() {
					continue
				}
				fail(c.Path, c.KeyLineValue("policy.include", pat), "policy.include", "%s: not a regular file of at most %d bytes", m, maxIncluded)
				continue
			}
			data, err := os.ReadFile(m)
			if err != nil {
				if errors.Is(err, fs.ErrPermission) || !errors.Is(err, fs.ErrNotExist) {
					fail(m, 0, "", "%v", err)
				}
				continue
			}
			files = append(files, includedFile{m, data})
			c.addIncluded(m, data, fail)
		}
	}
	c.included = files
	return files
}

// addIncluded appends the rules and tests of the included file m.
func (c *Config) addIncluded(m string, data []byte, fail func(file string, line int, key, format string, args ...any)) {
	var rf ruleFile
	md, err := toml.Decode(string(data), &rf)
	if err != nil {
		ce := decodeError(m, err).(*ConfigError)
		fail(ce.File, ce.Line, ce.Key, "%s", ce.Msg)
		return
	}
	loc := newLocator(data)
	for _, k := range md.Undecoded() {
		fail(m, loc.line(k.String(), ""), k.String(), "unknown key (an included file holds only [[rule]] and [[test]])")
	}
	for i := range rf.Rule {
		rf.Rule[i].file, rf.Rule[i].line = m, loc.arrayLine("rule", i, "", "")
	}
	for i := range rf.Test {
		rf.Test[i].file, rf.Test[i].line = m, loc.arrayLine("test", i, "", "")
	}
	c.SiteRules = append(c.SiteRules, rf.Rule...)
	c.Tests = append(c.Tests, rf.Test...)
}

// buildRules validates the [[rule]] entries into c.Policy.Rules and the
// [[test]] entries' syntax (tests run with RunTests: they need NSS).
func (c *Config) buildRules(res identity.Resolver, fail func(file string, line int, key, format string, args ...any)) {
	p := c.Policy
	names := map[string]string{}
	if len(c.SiteRules) > policy.MaxSiteRules {
		r := c.SiteRules[policy.MaxSiteRules]
		fail(r.file, r.line, "rule", "%d rules: at most %d", len(c.SiteRules), policy.MaxSiteRules)
		return
	}
	nodeAddrs := map[string][]netip.Addr{}
	for _, n := range c.Nodes {
		nodeAddrs[n.Name] = n.Addrs
	}
	idx := map[string]int{}
	for _, rc := range c.SiteRules {
		idx[rc.file]++
		key := fmt.Sprintf("rule[%d]", idx[rc.file])
		loc := c.locatorFor(rc.file)
		n := idx[rc.file] - 1
		bad := func(k, value string, format string, args ...any) {
			fail(rc.file, loc.arrayLine("rule", n, k, value), key+"."+k, format, args...)
		}
		r := policy.SiteRule{Name: rc.Name, File: rc.file, Line: rc.line}
		ok := true
		badf := func(k, value string, format string, args ...any) { ok = false; bad(k, value, format, args...) }
		switch {
		case rc.Name == "":
			badf("name", "", "missing: every rule has a name (verdicts and explain report it)")
		case !ruleName.MatchString(rc.Name):
			badf("name", rc.Name, "bad name %q: letters, digits, '-', '_', '.' (at most 63)", rc.Name)
		case slices.Contains(policy.BuiltinRules, policy.Rule(rc.Name)):
			badf("name", rc.Name, "%q is a built-in rule's name", rc.Name)
		case names[rc.Name] != "":
			badf("name", rc.Name, "duplicate rule name %q (also %s)", rc.Name, names[rc.Name])
		default:
			names[rc.Name] = fmt.Sprintf("%s:%d", rc.file, rc.line)
		}
		switch rc.Action {
		case "allow":
			r.Allow = true
		case "deny":
		case "":
			badf("action", "", `missing: "allow" or "deny"`)
		default:
			badf("action", rc.Action, `bad action %q: want "allow" or "deny"`, rc.Action)
		}
		r.From, r.FromGroups = principals(res, rc.From, func(v string, err error) { badf("from", v, "%v", err) })
		r.To, r.ToGroups = principals(res, rc.To, func(v string, err error) { badf("to", v, "%v", err) })
		for _, s := range rc.FromSubnets {
			pfx, err := parseSubnet(s)
			if err != nil {
				badf("from_subnets", s, "%v", err)
				continue
			}
			r.Sources = append(r.Sources, pfx)
		}
		for _, h := range rc.FromNodes {
			hosts, err := policy.ExpandHostlist(h)
			if err != nil {
				badf("from_nodes", h, "%v", err)
				continue
			}
			for _, name := range hosts {
				addrs, known := nodeAddrs[name]
				if !known && slices.ContainsFunc(c.PendingNodes, func(p PendingNode) bool { return p.Name == name }) {
					badf("from_nodes", h, "node %q is in [cluster] nodes by name only (a hostlist): from_nodes needs its addresses there (name=address)", name)
					break
				}
				if !known {
					badf("from_nodes", h, "node %q is not in [cluster] nodes (its addresses come from there)", name)
					break
				}
				for _, a := range addrs {
					r.Sources = append(r.Sources, netip.PrefixFrom(a, a.BitLen()))
				}
			}
		}
		for _, h := range rc.OnNodes {
			hosts, err := policy.ExpandHostlist(h)
			if err != nil {
				badf("on_nodes", h, "%v", err)
				continue
			}
			r.Nodes = append(r.Nodes, hosts...)
		}
		for _, s := range rc.Ports {
			pr, err := policy.ParsePortRange(string(s))
			if err != nil {
				badf("ports", string(s), "%v", err)
				continue
			}
			if pr.Last <= p.SystemPortMax {
				badf("ports", string(s), "%s is within the system ports (<= %d), which every user reaches from anywhere: no rule decides them", pr, p.SystemPortMax)
				continue
			}
			r.Ports = append(r.Ports, pr)
		}
		switch rc.Proto {
		case "", "any":
		case "tcp":
			r.Proto = policy.TCP
		case "udp":
			r.Proto = policy.UDP
		default:
			badf("proto", rc.Proto, `bad protocol %q: want "tcp", "udp" or "any"`, rc.Proto)
		}
		switch rc.Relation {
		case "":
		case "same-user":
			r.Relation = policy.SameUser
		case "shared-group":
			r.Relation = policy.SharedGroup
		default:
			badf("relation", rc.Relation, `bad relation %q: want "same-user" or "shared-group"`, rc.Relation)
		}
		if ok {
			p.Rules = append(p.Rules, r)
		}
	}

	tidx := map[string]int{}
	for i := range c.Tests {
		t := &c.Tests[i]
		tidx[t.file]++
		key := fmt.Sprintf("test[%d]", tidx[t.file])
		loc := c.locatorFor(t.file)
		n := tidx[t.file] - 1
		bad := func(k, value string, format string, args ...any) {
			fail(t.file, loc.arrayLine("test", n, k, value), key+"."+k, format, args...)
		}
		if t.From == "" {
			bad("from", "", "missing: the connecting user")
		}
		if t.To == "" {
			bad("to", "", "missing: the listener's user")
		}
		if t.Port < 1 || t.Port > 65535 {
			bad("port", "", "port %d out of range (1-65535)", t.Port)
		}
		switch t.Proto {
		case "", "tcp", "udp":
		default:
			bad("proto", t.Proto, `bad protocol %q: want "tcp" or "udp"`, t.Proto)
		}
		switch t.Expect {
		case "allow", "deny":
		default:
			bad("expect", t.Expect, `want "allow" or "deny", got %q`, t.Expect)
		}
		if t.Rule != "" && !slices.Contains(policy.BuiltinRules, policy.Rule(t.Rule)) && names[t.Rule] == "" {
			bad("rule", t.Rule, "no rule is named %q", t.Rule)
		}
		switch {
		case t.FromNode != "" && t.Source != "":
			bad("source", t.Source, "give from_node or source, not both")
		case t.FromNode != "":
			addrs, known := nodeAddrs[t.FromNode]
			switch {
			case known:
				t.src = addrs[0]
			case slices.ContainsFunc(c.PendingNodes, func(p PendingNode) bool { return p.Name == t.FromNode }):
				// Known by name only (a hostlist): resolved when the test runs.
			default:
				bad("from_node", t.FromNode, "node %q is not in [cluster] nodes", t.FromNode)
			}
		case t.Source != "":
			a, err := netip.ParseAddr(t.Source)
			if err != nil || a.Zone() != "" {
				bad("source", t.Source, "bad address %q", t.Source)
			} else {
				t.src = a
			}
		}
	}
}

// principals resolves user names / uids and "@group" names / gids.
func principals(res identity.Resolver, list []policy.Principal, bad func(value string, err error)) (uids, gids []uint32) {
	for _, pr := range list {
		if g, ok := strings.CutPrefix(string(pr), "@"); ok {
			gid, err := identity.GID(res, g)
			if err != nil {
				bad(string(pr), err)
				continue
			}
			if slices.Contains(gids, gid) {
				bad(string(pr), fmt.Errorf("duplicate: %q is gid %d, listed twice", pr, gid))
				continue
			}
			gids = append(gids, gid)
			continue
		}
		uid, err := identity.UID(res, string(pr))
		if err != nil {
			bad(string(pr), err)
			continue
		}
		if slices.Contains(uids, uid) {
			bad(string(pr), fmt.Errorf("duplicate: %q is uid %d, listed twice", pr, uid))
			continue
		}
		uids = append(uids, uid)
	}
	return uids, gids
}

// locatorFor is the locator of the main file or of an included one.
func (c *Config) locatorFor(file string) *locator {
	for _, f := range c.included {
		if f.path == file && file != c.Path {
			return newLocator(f.data)
		}
	}
	return newLocator(c.data)
}

// KeyLineValue is the line of an element of a key's array (0 if absent).
func (c *Config) KeyLineValue(key, value string) int { return newLocator(c.data).line(key, value) }

// TestResult is the outcome of one [[test]].
type TestResult struct {
	Name string
	File string
	Line int
	Conn policy.Conn
	Got  policy.Verdict
	// Err is why the test failed (nil: passed).
	Err error
}

// Where is "FILE:LINE".
func (t TestResult) Where() string { return fmt.Sprintf("%s:%d", t.File, t.Line) }

// RunTests decides every [[test]] with the policy, resolving its users and
// groups through res (nil: NSS). It returns each result and, if any failed,
// an error joining one *ConfigError per failure (FILE:LINE: test[N]: ...).
func (c *Config) RunTests(res identity.Resolver) ([]TestResult, error) {
	if res == nil {
		res = identity.System()
	}
	var out []TestResult
	var errs []error
	idx := map[string]int{}
	for _, t := range c.Tests {
		idx[t.file]++
		r := TestResult{Name: t.Name, File: t.file, Line: t.line}
		if r.Name == "" {
			r.Name = fmt.Sprintf("%s → %s:%d", t.From, t.To, t.Port)
		}
		r.Err = c.runTest(res, &t, &r)
		if r.Err != nil {
			errs = append(errs, &ConfigError{File: t.file, Line: t.line, Key: fmt.Sprintf("test[%d]", idx[t.file]),
				Msg: strconv.Quote(r.Name) + ": " + r.Err.Error()})
		}
		out = append(out, r)
	}
	return out, errors.Join(errs...)
}

func (c *Config) runTest(res identity.Resolver, t *TestConfig, r *TestResult) error {
	conn, err := testIdentity(res, t.From, t.Group, true)
	if err != nil {
		return fmt.Errorf("from: %w", err)
	}
	lis, err := testIdentity(res, t.To, t.ToGroup, false)
	if err != nil {
		return fmt.Errorf("to: %w", err)
	}
	proto := policy.TCP
	if t.Proto == "udp" {
		proto = policy.UDP
	}
	src := t.src
	if t.FromNode != "" && !src.IsValid() {
		addrs, err := LookupHost(t.FromNode)
		if err != nil || len(addrs) == 0 {
			return fmt.Errorf("from_node %q (a [cluster] nodes hostlist name) does not resolve: %v", t.FromNode, err)
		}
		src = addrs[0]
	}
	r.Conn = policy.Conn{Source: src, Connector: conn, Listener: lis, Port: uint16(t.Port), Proto: proto, Node: t.Node}
	r.Got = c.Policy.Decide(r.Conn)
	verdict := func(allow bool) string {
		if allow {
			return "allow"
		}
		return "deny"
	}
	want := t.Expect
	if t.Rule != "" {
		want += " by rule " + t.Rule
	}
	if verdict(r.Got.Allow) != t.Expect || (t.Rule != "" && string(r.Got.Rule) != t.Rule) {
		return fmt.Errorf("expected %s, got %s by rule %s", want, verdict(r.Got.Allow), r.Got.Rule)
	}
	return nil
}

// testIdentity resolves a test's user: uid, effective gid (group, which the
// user need not hold for a listener: a socket's gid is what it was created
// with) and, as listener's and connector's groups, the user's login groups.
func testIdentity(res identity.Resolver, user, group string, connector bool) (policy.Identity, error) {
	uid, err := identity.UID(res, user)
	if err != nil {
		return policy.Identity{}, err
	}
	id := policy.Identity{UID: uid, GID: uid}
	if name, err := res.LookupUID(uid); err == nil {
		if _, gid, err := res.LookupUser(name); err == nil {
			id.GID = gid
		}
		id.Groups, _ = res.GroupsOf(name)
	}
	if group != "" {
		g, err := identity.GID(res, group)
		if err != nil {
			return policy.Identity{}, err
		}
		if connector && !id.HasGroup(g) {
			return policy.Identity{}, fmt.Errorf("%s is not a member of group %s (sg would refuse)", user, group)
		}
		id.GID = g
	}
	return id, nil
}

// Uncovered lists the site rules that no [[test]] names as its deciding rule.
func (c *Config) Uncovered() []policy.SiteRule {
	var out []policy.SiteRule
	for _, r := range c.Policy.Rules {
		if !slices.ContainsFunc(c.Tests, func(t TestConfig) bool { return t.Rule == r.Name }) {
			out = append(out, r)
		}
	}
	return out
}

// arrayLine is the line of key (with value, the line of that element) in
// the n-th (0-based) [[table]] entry; the entry's header line when key is
// "" or not written; 0 if there is no such entry.
func (l *locator) arrayLine(table string, n int, key, value string) int {
	header := regexp.MustCompile(`^\s*\[\[\s*` + regexp.QuoteMeta(table) + `\s*\]\]`)
	start, count := 0, 0
	for i, line := range l.lines {
		if header.MatchString(line) {
			if count == n {
				start = i + 1
				break
			}
			count++
		}
	}
	if start == 0 || key == "" {
		return start
	}
	end := len(l.lines)
	for i := start; i < len(l.lines); i++ {
		if headerRe.MatchString(l.lines[i]) {
			end = i
			break
		}
	}
	sub := &locator{lines: l.lines[start:end], keys: map[string]int{}}
	for i, line := range sub.lines {
		if m := keyRe.FindStringSubmatch(line); m != nil {
			sub.add(normKey(m[1]), i+1)
		}
	}
	if ln := sub.line(key, value); ln > 0 {
		return start + ln
	}
	return start
}
