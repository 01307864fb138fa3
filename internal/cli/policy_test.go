package cli

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

// TestPolicyTest runs `palisade policy test` offline with passwd/group files
// (a site's CI), and `config check` on the same files: a failing test is an
// ERROR there, an untested rule a warning.
func TestPolicyTest(t *testing.T) {
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	writeConfigFile(t, pw, "alice:x:2001:2001::/home/alice:/bin/sh\nbob:x:2002:2002::/home/bob:/bin/sh\ncarol:x:2003:2003::/home/carol:/bin/sh\n")
	writeConfigFile(t, gr, "alice:x:2001:\nbob:x:2002:\ncarol:x:2003:\nmonitoring:x:2300:carol\n")
	key := writeKey(t, dir)
	pol := filepath.Join(dir, "palisade.toml")
	base := "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nnodes = [\"node1=198.18.0.1\"]\nkey_file = \"" + key + "\"\n" +
		"[[rule]]\nname = \"monitoring\"\naction = \"allow\"\nfrom = [\"@monitoring\"]\nports = [\"9100-9199\"]\n" +
		"[[rule]]\nname = \"untested\"\naction = \"deny\"\nports = [6000]\n" +
		"[[test]]\nfrom = \"carol\"\nfrom_node = \"node1\"\nto = \"alice\"\nport = 9100\nexpect = \"allow\"\nrule = \"monitoring\"\n" +
		"[[test]]\nfrom = \"bob\"\nfrom_node = \"node1\"\nto = \"alice\"\nport = %d\nexpect = \"deny\"\nrule = \"default-deny\"\n"
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		root := New()
		root.SetOut(&out)
		root.SetArgs(args)
		err := root.Execute()
		return out.String(), err
	}
	writeConfigFile(t, pol, strings.Replace(base, "%d", "9200", 1))
	out, err := run("policy", "test", pol, "--passwd", pw, "--group", gr)
	if err != nil || !strings.Contains(out, "PASS  "+pol+":14: carol → alice:9100  allow by rule monitoring") ||
		!strings.Contains(out, "# WARNING: "+pol+":10: rule \"untested\": no test expects this rule to decide") ||
		!strings.Contains(out, "2 site rule(s), 2 test(s), 0 failed, 1 rule(s) untested") {
		t.Errorf("passing policy: %v\n%s", err, out)
	}
	if _, err := run("policy", "test", pol, "--passwd", pw, "--group", gr, "--strict"); err == nil {
		t.Error("--strict passed with an untested rule")
	}
	// Port 9150 is in the monitoring range, but bob is not in the group: the
	// test still passes; port 9150 from carol would not be default-deny.
	writeConfigFile(t, pol, strings.Replace(strings.Replace(base, "%d", "9150", 1), `from = "bob"`, `from = "carol"`, 1))
	out, err = run("policy", "test", pol, "--passwd", pw, "--group", gr)
	want := pol + `:21: test[2]: "carol → alice:9150": expected deny by rule default-deny, got allow by rule monitoring`
	if err == nil || err.Error() != want || !strings.Contains(out, "FAIL  "+pol+":21:") {
		t.Errorf("failing test: %v\nwant %s\n%s", err, want, out)
	}
	// config check (with NSS) reports a failing test as an ERROR, exit 1.
	writeConfigFile(t, pol, "[cluster]\nsubnets = [\"198.18.0.0/24\"]\nkey_file = \""+key+"\"\n"+
		"[[rule]]\nname = \"no-root-5000\"\naction = \"deny\"\nto = [\"root\"]\nports = [5000]\n"+
		"[[test]]\nname = \"root's own\"\nfrom = \"root\"\nto = \"root\"\nport = 5000\nexpect = \"allow\"\n")
	out, err = runConfigCheck(t, pol)
	if ee, ok := err.(*ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(out, "# ERROR: "+pol+":9: test \"root's own\": failed (") {
		t.Errorf("config check: %v\n%s", err, out)
	}
}
