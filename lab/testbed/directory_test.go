package testbed

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"
)

func TestDirectoryFiles(t *testing.T) {
	in := "root:x:0:0::/root:/bin/bash\nalice:x:2001:2001::/h:/bin/bash\nslurm:x:64030:64030::/:/bin/false\nproj1:x:2100:alice,bob\n"
	if got := filterEntries(in, testbedNames()); got != "root:x:0:0::/root:/bin/bash\nslurm:x:64030:64030::/:/bin/false\n" {
		t.Errorf("filterEntries = %q", got)
	}
	ns := nsswitch("# c\npasswd:         files systemd\ngroup: files\nshadow: files\ngshadow:        files systemd\nhosts: files dns\n")
	got := map[string]string{}
	for _, l := range strings.Split(ns, "\n") {
		if db, srcs, ok := strings.Cut(l, ":"); ok && !strings.HasPrefix(db, "#") {
			got[db] = strings.Join(strings.Fields(srcs), " ")
		}
	}
	for db, want := range map[string]string{"passwd": "files sss", "group": "files sss", "shadow": "files sss", "gshadow": "files systemd", "hosts": "files dns"} {
		if got[db] != want {
			t.Errorf("nsswitch %s: %q, want %q:\n%s", db, got[db], want, ns)
		}
	}
	small := DirectoryLDIF(0)
	for _, want := range []string{"dn: uid=alice,ou=people,dc=pal,dc=test\n", "uidNumber: 2004\n",
		"dn: cn=proj1,ou=groups,dc=pal,dc=test\nobjectClass: posixGroup\ncn: proj1\ngidNumber: 2100\nmemberUid: alice\nmemberUid: bob\n",
		"cn: hpc-portal\ngidNumber: 2300\nmemberUid: svc\n"} {
		if !strings.Contains(small, want) {
			t.Errorf("LDIF lacks %q", want)
		}
	}
	big := DirectoryLDIF(10000)
	if n := strings.Count(big, "objectClass: posixAccount"); n != 10004 {
		t.Errorf("%d users", n)
	}
	if n := strings.Count(big, "objectClass: posixGroup"); n != 10004+2+2000 {
		t.Errorf("%d groups", n)
	}
	if n := strings.Count(big, "memberUid: u"); n != 100000 {
		t.Errorf("%d synthetic memberships", n)
	}
}

func TestDirectoryBadInput(t *testing.T) {
	for _, o := range []Options{
		{Name: "palx", Directory: "nis"},
		{Name: "palx", DirectoryUsers: 5},
		{Name: "palx", Directory: "ldap", DirectoryUsers: -1},
	} {
		if err := validate(&o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

// TestDirectory brings up a directory instance: the test users come from
// SSSD (LDAP) on every node, never from the nodes' files and never by
// enumeration; logins, Slurm and sg work; the host's files are untouched;
// down leaves nothing.
func TestDirectory(t *testing.T) {
	needRoot(t)
	name := RunName("td")
	hostNS, _ := os.ReadFile("/etc/nsswitch.conf")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tb, err := Up(ctx, Options{Name: name, Nodes: 2, Directory: DirectoryLDAP, Binary: palisadeBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer Down(context.Background(), name)
	out := func(node, user string, argv ...string) string {
		t.Helper()
		o, err := tb.Output(ctx, node, user, argv...)
		if err != nil {
			t.Error(err)
		}
		return strings.TrimSpace(o)
	}
	for _, n := range tb.NodeNames() {
		if got := out(n, "", "getent", "-s", "sss", "passwd", "alice"); !strings.HasPrefix(got, "alice:*:2001:2001:") {
			t.Errorf("%s: alice from sss: %q", n, got)
		}
		// Not in the node's files, and not listed by enumeration.
		if o, err := tb.Output(ctx, n, "", "getent", "-s", "files", "passwd", "alice"); err == nil {
			t.Errorf("%s: alice in the node's files: %q", n, o)
		}
		for _, db := range []string{"passwd", "group"} {
			if got := out(n, "", "getent", db); strings.Contains(got, "alice") || strings.Contains(got, "proj1") || !strings.Contains(got, "root:") {
				t.Errorf("%s: getent %s enumerates the directory (or lost root):\n%s", n, db, got)
			}
		}
		// The view hangs on /etc itself (an overlay), never on per-file
		// mounts the host's next useradd would detach.
		if got := out(n, "", "sh", "-c", "stat -f -c %T /etc/passwd /etc/group /etc/nsswitch.conf; grep -c '^proj1:' /etc/group || true"); got != "overlayfs\noverlayfs\noverlayfs\n0" {
			t.Errorf("%s: /etc view: %q", n, got)
		}
		if got := out(n, "", "getent", "group", "proj1"); got != "proj1:*:2100:alice,bob" {
			t.Errorf("%s: proj1 = %q", n, got)
		}
	}
	if got := out("node1", "alice", "id"); got != "uid=2001(alice) gid=2001(alice) groups=2001(alice),2100(proj1)" {
		t.Errorf("alice: %q", got)
	}
	if got := out("node1", "bob", "srun", "-N2", "id", "-G"); got != "2002 2100\n2002 2100" {
		t.Errorf("srun id -G = %q", got)
	}
	if got := out("node1", "alice", "ssh", "node2", "sg", "proj1", "-c", "'id -g'"); got != "2100" {
		t.Errorf("ssh node2 sg proj1 = %q", got)
	}
	if o, err := tb.Output(ctx, "node2", "carol", "sg", "proj1", "-c", "id -g"); err == nil {
		t.Errorf("carol got proj1: %q", o)
	}
	// A change in the directory reaches the nodes within SSSD's cache time.
	if err := tb.LDAPModify(ctx, "dn: cn=proj1,ou=groups,"+LDAPBase+"\nchangetype: modify\nadd: memberUid\nmemberUid: carol\n"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(SSSDCacheTimeout + SSSDMemcacheTimeout + 5*time.Second)
	for {
		o, _ := tb.Output(ctx, "node2", "", "getent", "group", "proj1")
		if strings.Contains(o, "carol") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("carol not in proj1 on node2 after %v: %q", SSSDCacheTimeout+SSSDMemcacheTimeout, o)
		}
		time.Sleep(200 * time.Millisecond) // polling the node's view; nothing to wait on
	}
	if b, _ := os.ReadFile("/etc/nsswitch.conf"); string(b) != string(hostNS) {
		t.Error("the host's nsswitch.conf changed")
	}
	if _, err := os.Lstat("/var/lib/sss/pipes/nss"); err == nil {
		t.Error("an SSSD socket appeared in the host's /var/lib/sss")
	}
	if err := Down(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	if l := leftovers(tb.Dir, name); len(l) > 0 {
		t.Errorf("left behind: %v", l)
	}
}
