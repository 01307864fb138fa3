package testbed

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestEndToEnd is the administrator's path with the real binary:
// `palisade-lab testbed up`, `palisade-lab check --mode none` (the wide-open
// baseline: every case must connect and exchange data), `palisade-lab testbed
// down`, and nothing of the instance left in `ip netns list`, `ip link`,
// the process table, /etc/netns and /etc/passwd.
func TestEndToEnd(t *testing.T) {
	needRoot(t)
	name := e2eName
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	bin := palisadeBinary(t)
	pal := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append(os.Environ(), OwnerEnv+"="+strconv.Itoa(os.Getpid()))
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	pal("testbed", "down", "--name", name) // leftovers of an interrupted run
	netnsBefore := grepLines(mustRun(t, "ip", "netns", "list"), name)
	linksBefore := grepLines(mustRun(t, "ip", "-o", "link"), name)
	passwdBefore, _ := os.ReadFile("/etc/passwd")
	var othersBefore []string
	_ = withShared(func(s *shared) error { othersBefore = append(othersBefore, s.Instances...); return nil })

	out, err := pal("testbed", "up", "--name", name)
	if err != nil || !strings.Contains(out, "testbed "+name+" is up") {
		t.Fatalf("testbed up: %v\n%s", err, out)
	}
	defer pal("testbed", "down", "--name", name)
	if out, err := pal("testbed", "status", "--name", name); err != nil || strings.Count(out, " idle ") != 3 {
		t.Errorf("testbed status: %v\n%s", err, out)
	}

	start := time.Now()
	out, err = pal("check", "--name", name, "--mode", "none", "--quiet")
	t.Logf("check --mode none: %s", time.Since(start))
	m := regexp.MustCompile(`(?m)^(\d+) passed, (\d+) failed$`).FindStringSubmatch(out)
	if err != nil || m == nil || m[2] != "0" {
		t.Fatalf("check --mode none: %v\n%s", err, out)
	}
	if n, _ := strconv.Atoi(m[1]); n < 200 {
		t.Errorf("check ran only %d cases", n)
	}
	t.Logf("%s passed", m[1])

	if out, err := pal("testbed", "down", "--name", name); err != nil || !strings.Contains(out, "is down") {
		t.Fatalf("testbed down: %v\n%s", err, out)
	}
	if out, _ := pal("testbed", "down", "--name", name); !strings.Contains(out, "is not up") {
		t.Errorf("second down: %s", out)
	}
	if got := grepLines(mustRun(t, "ip", "netns", "list"), name); strings.Join(got, "\n") != strings.Join(netnsBefore, "\n") {
		t.Errorf("ip netns list: before %q after %q", netnsBefore, got)
	}
	if got := grepLines(mustRun(t, "ip", "-o", "link"), name); strings.Join(got, "\n") != strings.Join(linksBefore, "\n") {
		t.Errorf("ip link: before %q after %q", linksBefore, got)
	}
	if l := leftovers(InstanceDir(name), name); len(l) > 0 {
		t.Errorf("processes left: %v", l)
	}
	if ents, _ := filepath.Glob("/etc/netns/" + name + "-*"); len(ents) > 0 {
		t.Errorf("/etc/netns entries left: %v", ents)
	}
	if _, err := os.Stat(InstanceDir(name)); err == nil {
		t.Errorf("%s left", InstanceDir(name))
	}
	var othersAfter []string
	_ = withShared(func(s *shared) error { othersAfter = append(othersAfter, s.Instances...); return nil })
	// The testbed's own accounts only: the host may change others at any
	// time (lab/sidebyside does).
	if passwdAfter, _ := os.ReadFile("/etc/passwd"); len(othersBefore) == 0 && len(othersAfter) == 0 {
		if b, a := testbedAccounts(passwdBefore), testbedAccounts(passwdAfter); !slices.Equal(b, a) {
			t.Errorf("/etc/passwd: the testbed's accounts changed: before %q, after %q", b, a)
		}
	} else {
		t.Logf("other instances up (%v / %v): users stay, /etc/passwd not compared", othersBefore, othersAfter)
	}
}

// testbedAccounts are the lines of passwd that name the testbed's users.
func testbedAccounts(passwd []byte) []string {
	var out []string
	for l := range strings.Lines(string(passwd)) {
		name, _, _ := strings.Cut(l, ":")
		if slices.ContainsFunc(Users, func(u User) bool { return u.Name == name }) {
			out = append(out, strings.TrimSpace(l))
		}
	}
	return out
}
