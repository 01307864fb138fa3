package identity

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const passwd = `root:x:0:0:root:/root:/bin/bash
# a comment

alice:x:2001:2001::/home/alice:/bin/bash
bob:x:2002:2002::/home/bob:/bin/bash
carol:x:2003:2003::/home/carol:/bin/bash
svc:x:2004:2004::/home/svc:/usr/sbin/nologin
+nisuser
alice:x:9999:9999:shadowed duplicate::
`

const group = `root:x:0:
alice:x:2001:
bob:x:2002:
carol:x:2003:
svc:x:2004:
proj1:x:2100:alice,bob
proj2:x:2200: bob , alice,bob
empty:x:2300:
`

func fixture(t *testing.T) *Table {
	t.Helper()
	tb, err := ParseTables([]byte(passwd), []byte(group))
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

// writeFiles puts the fixture in a temp dir as /etc-style files.
func writeFiles(t *testing.T) (string, string) {
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	if err := os.WriteFile(pw, []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(gr, []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	return pw, gr
}

// testResolver runs the Resolver contract against any implementation
// holding the fixture.
func testResolver(t *testing.T, r Resolver) {
	t.Helper()
	if uid, gid, err := r.LookupUser("alice"); err != nil || uid != 2001 || gid != 2001 {
		t.Errorf("LookupUser(alice) = %d %d %v", uid, gid, err)
	}
	if _, _, err := r.LookupUser("mallory"); err == nil || err.Error() != `unknown user "mallory"` || !IsUnknown(err) {
		t.Errorf("LookupUser(mallory) err = %v", err)
	}
	if n, err := r.LookupUID(2002); err != nil || n != "bob" {
		t.Errorf("LookupUID(2002) = %q %v", n, err)
	}
	if _, err := r.LookupUID(4242); !IsUnknown(err) {
		t.Errorf("LookupUID(4242) err = %v", err)
	}
	if g, err := r.LookupGroup("proj1"); err != nil || g != 2100 {
		t.Errorf("LookupGroup(proj1) = %d %v", g, err)
	}
	if _, err := r.LookupGroup("nogroup-xyz"); err == nil || err.Error() != `unknown group "nogroup-xyz"` {
		t.Errorf("LookupGroup(nogroup-xyz) err = %v", err)
	}
	if n, err := r.LookupGID(2200); err != nil || n != "proj2" {
		t.Errorf("LookupGID(2200) = %q %v", n, err)
	}
	for user, want := range map[string][]uint32{
		"alice": {2001, 2100, 2200}, "bob": {2002, 2100, 2200}, "carol": {2003}, "root": {0},
	} {
		got, err := r.GroupsOf(user)
		slices.Sort(got[1:]) // primary first; the rest in any order
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("GroupsOf(%s) = %v %v, want %v", user, got, err, want)
		}
	}
	if _, err := r.GroupsOf("mallory"); !IsUnknown(err) {
		t.Errorf("GroupsOf(mallory) err = %v", err)
	}
	m, err := r.Members()
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 5 || !m.Has(2002, 2100) || m.Has(2003, 2100) || !m.Has(2001, 2001) || !slices.Equal(m[2001], []uint32{2001, 2100, 2200}) {
		t.Errorf("Members = %v", m)
	}
}

func TestTable(t *testing.T) { testResolver(t, fixture(t)) }

func TestFiles(t *testing.T) {
	pw, gr := writeFiles(t)
	tb, err := ReadFiles(pw, gr)
	if err != nil {
		t.Fatal(err)
	}
	testResolver(t, tb)
	testResolver(t, &NSS{Passwd: pw, Group: gr}) // no getent: the files
	if _, err := ReadFiles(filepath.Join(t.TempDir(), "none"), gr); err == nil {
		t.Error("missing passwd file accepted")
	}
}

// TestFakeGetent drives the getent path with a script answering like glibc's
// getent backed by a directory service: keyed queries work, exit 2 means
// "not found".
func TestFakeGetent(t *testing.T) {
	pw, _ := writeFiles(t)
	script := filepath.Join(t.TempDir(), "getent")
	body := `#!/bin/sh
db=$1; key=$2
case $db in
passwd|group) f=` + "$(dirname " + pw + ")" + `/$db ;;
initgroups)
  [ "$key" = alice ] && { echo "alice 2100 2200"; exit 0; }
  [ "$key" = bob ] && { echo "bob 2100 2200"; exit 0; }
  echo "$key"; exit 0 ;;
*) exit 1 ;;
esac
[ -z "$key" ] && { grep -v -e '^#' -e '^+' -e '^$' "$f"; exit 0; }
grep -E "^$key:|^[^:]*:[^:]*:$key:" "$f" | head -1 | grep . || exit 2
`
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	testResolver(t, &NSS{Getent: script})
	broken := filepath.Join(t.TempDir(), "getent")
	if err := os.WriteFile(broken, []byte("#!/bin/sh\necho ldap down >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := (&NSS{Getent: broken}).LookupUser("alice"); err == nil || IsUnknown(err) || !strings.Contains(err.Error(), "ldap down") {
		t.Errorf("a failing getent must be an error, not unknown: %v", err)
	}
}

func TestSystem(t *testing.T) {
	r := System()
	if uid, gid, err := r.LookupUser("root"); err != nil || uid != 0 || gid != 0 {
		t.Fatalf("root: %d %d %v", uid, gid, err)
	}
	if n, err := r.LookupUID(0); err != nil || n != "root" {
		t.Errorf("LookupUID(0) = %q %v", n, err)
	}
	if g, err := r.GroupsOf("root"); err != nil || len(g) == 0 || g[0] != 0 {
		t.Errorf("GroupsOf(root) = %v %v", g, err)
	}
	if _, _, err := r.LookupUser("pal-no-such-user"); !IsUnknown(err) {
		t.Errorf("unknown user: %v", err)
	}
	m, err := Snapshot()
	if err != nil || !m.Has(0, 0) {
		t.Errorf("Snapshot: %v %v", m[0], err)
	}
}

func TestIDs(t *testing.T) {
	tb := fixture(t)
	for s, want := range map[string]uint32{"alice": 2001, "0": 0, "64030": 64030, "4294967294": 4294967294} {
		if got, err := UID(tb, s); err != nil || got != want {
			t.Errorf("UID(%q) = %d %v", s, got, err)
		}
	}
	for _, s := range []string{"mallory", "", "4294967295", "99999999999", "-1", "1e3"} {
		if got, err := UID(tb, s); err == nil {
			t.Errorf("UID(%q) = %d, want error", s, got)
		}
	}
	if g, err := GID(tb, "proj1"); err != nil || g != 2100 {
		t.Errorf("GID(proj1) = %d %v", g, err)
	}
	if g, err := GID(tb, "31337"); err != nil || g != 31337 {
		t.Errorf("GID(31337) = %d %v (numbers are not looked up)", g, err)
	}
	if UserName(tb, 2001) != "alice(2001)" || UserName(tb, 7) != "7" || UserName(nil, 2001) != "2001" || GroupName(tb, 2100) != "proj1(2100)" {
		t.Error("UserName/GroupName")
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct{ pw, gr, want string }{
		{"alice:x:2001\n", "", "passwd line 1: want 7"},
		{"root:x:0:0::/:/bin/sh\nalice:x:abc:1:::\n", "", "passwd line 2: uid: bad id"},
		{"", "proj:x:-5:\n", "group line 1: gid: bad id"},
		{"", ":x:5:\n", "group line 1"},
	} {
		if _, err := ParseTables([]byte(tc.pw), []byte(tc.gr)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseTables(%q, %q) err = %v, want %q", tc.pw, tc.gr, err, tc.want)
		}
	}
}

func TestMembershipEqual(t *testing.T) {
	a := Membership{1: {1, 2}, 2: {2}}
	if !a.Equal(Membership{2: {2}, 1: {1, 2}}) || a.Equal(Membership{1: {1, 2}}) || a.Equal(Membership{1: {2, 1}, 2: {2}}) || a.Equal(Membership{1: {1, 2}, 3: {2}}) {
		t.Error("Equal")
	}
}

func BenchmarkMembers(b *testing.B) {
	tb := &Table{}
	for i := range 10000 {
		name := "u" + strconv.Itoa(i)
		tb.Users = append(tb.Users, User{Name: name, UID: uint32(10000 + i), GID: uint32(10000 + i)})
	}
	for g := range 1000 {
		grp := Group{Name: "g" + strconv.Itoa(g), GID: uint32(50000 + g)}
		for j := range 50 {
			grp.Members = append(grp.Members, "u"+strconv.Itoa((g*37+j*101)%10000))
		}
		tb.Groups = append(tb.Groups, grp)
	}
	for b.Loop() {
		if _, err := tb.Members(); err != nil {
			b.Fatal(err)
		}
	}
}

// countingResolver names uid/gid 1 "one" and counts lookups.
type countingResolver struct {
	Resolver
	mu    sync.Mutex
	calls int
	known bool
}

func (r *countingResolver) LookupUID(uid uint32) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if uid == 1 && r.known {
		return "one", nil
	}
	return "", errors.New("unknown")
}

func (r *countingResolver) LookupGID(gid uint32) (string, error) { return r.LookupUID(gid) }

func TestNameCacheTTL(t *testing.T) {
	r := &countingResolver{known: true}
	c := NewNameCache(r, time.Minute)
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	first, second := c.User(1), c.User(1)
	if first != "one" || second != "one" || r.calls != 1 {
		t.Fatalf("hit not cached: %d lookups", r.calls)
	}
	// A miss is cached too, then expires: a user added later gets named.
	r.known = false
	first, second = c.Group(1), c.Group(1)
	if first != "" || second != "" || r.calls != 2 {
		t.Fatalf("miss not cached: %d lookups", r.calls)
	}
	r.known = true
	now = now.Add(59 * time.Second)
	if c.Group(1) != "" {
		t.Fatal("miss expired early")
	}
	now = now.Add(2 * time.Second)
	if c.Group(1) != "one" || r.calls != 3 {
		t.Fatalf("miss did not expire: %d lookups", r.calls)
	}
	// Hits expire as well (a renamed user).
	r.known = false
	if c.User(1) != "" || r.calls != 4 {
		t.Fatalf("hit did not expire: %d lookups", r.calls)
	}
	// Bounded.
	for id := uint32(10); id < 10+2*maxCachedNames; id++ {
		c.User(id)
	}
	if n := len(c.users); n > maxCachedNames {
		t.Fatalf("%d names cached, bound %d", n, maxCachedNames)
	}
}
