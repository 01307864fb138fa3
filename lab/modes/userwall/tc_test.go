package userwall

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

// TestTCAttach proves the classic-tc attachment (clsact + cls_bpf, used
// where tcx is missing) with the real agent in a scratch namespace forced to
// tc_attach = "tc": our filters run first (preference 1) ahead of a foreign
// filter, a restarted agent replaces them in place, a foreign filter that
// holds preference 1 is never displaced, uninstall removes exactly ours
// (the foreign filter and its clsact stay; the clsact we added on lo goes),
// and the pins of a namespace deleted without uninstall are collected.
func TestTCAttach(t *testing.T) {
	needTestbed(t)
	ns := "paluwt-tc"
	exec.Command("ip", "netns", "del", ns).Run()
	sh := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
		return string(out)
	}
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	sh("ip", "link", "add", "pal-tca", "type", "veth", "peer", "name", "pal-tcb")
	sh("ip", "link", "set", "pal-tca", "up")
	sh("ip", "link", "set", "pal-tcb", "up")
	sh("ip", "addr", "add", "198.18.200.1/30", "dev", "pal-tca")
	// A foreign filter (someone else's) at a later preference.
	sh("tc", "qdisc", "add", "dev", "pal-tca", "clsact")
	sh("tc", "filter", "add", "dev", "pal-tca", "ingress", "pref", "5", "protocol", "ip", "u32", "match", "u32", "0", "0", "classid", "1:1")

	dir := t.TempDir()
	cfg := filepath.Join(dir, "palisade.toml")
	pid := filepath.Join(dir, "agent.pid")
	os.WriteFile(cfg, []byte(fmt.Sprintf("[agent]\ntc_attach = \"tc\"\npid_file = %q\nevent_log = \"\"\nmetrics_address = \"\"\nident_port = 0\nident_socket = \"\"\nsyslog = false\n", pid)), 0o644)
	logPath := filepath.Join(dir, "agent.log")
	// A failing check must not leave an agent running (it would keep the
	// deleted namespace alive): stop the last one started.
	var last *exec.Cmd
	t.Cleanup(func() {
		if last != nil && last.ProcessState == nil {
			last.Process.Signal(syscall.SIGTERM)
			last.Wait()
		}
	})
	start := func() *exec.Cmd {
		t.Helper()
		lf, _ := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		defer lf.Close()
		cmd := exec.Command("nsenter", "--net=/run/netns/"+ns, "--", tb.Binary, "agent", "--config", cfg)
		cmd.Stdout, cmd.Stderr = lf, lf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		last = cmd
		for i := 0; i < 200 && control.ReadPid(pid) != cmd.Process.Pid; i++ {
			time.Sleep(50 * time.Millisecond)
		}
		if control.ReadPid(pid) != cmd.Process.Pid {
			cmd.Process.Kill()
			cmd.Wait()
			b, _ := os.ReadFile(logPath)
			t.Fatalf("agent not ready:\n%s", b)
		}
		return cmd
	}
	stop := func(cmd *exec.Cmd) {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}
	statusOf := func() control.Status {
		t.Helper()
		out, err := exec.Command("nsenter", "--net=/run/netns/"+ns, "--", tb.Binary, "status", "--json", "--config", cfg).Output()
		// status exits 1 with warnings and 2 when not enforcing; the
		// JSON is printed either way.
		var ee *exec.ExitError
		if errors.As(err, &ee) && (ee.ExitCode() == 1 || ee.ExitCode() == 2) {
			err = nil
		}
		var s control.Status
		if err != nil || json.Unmarshal(out, &s) != nil {
			t.Fatalf("status: %v %s", err, out)
		}
		return s
	}
	// pref → "kind name" of the ingress filters of dev.
	filters := func(dev, dir string) string {
		return sh("tc", "filter", "show", "dev", dev, dir)
	}
	ourIngress := regexp.MustCompile(`(?m)^filter protocol all pref 1 bpf chain 0 handle 0x5542 palisade:uw_tc_ingress direct-action.* id (\d+)`)

	// An interface whose preference 1 is held by a foreign filter of
	// another kind: the agent does not displace it; the first install
	// fails with a clear message and leaves nothing behind.
	sh("ip", "link", "add", "pal-tcc", "type", "veth", "peer", "name", "pal-tcd")
	sh("tc", "qdisc", "add", "dev", "pal-tcc", "clsact")
	sh("tc", "filter", "add", "dev", "pal-tcc", "ingress", "pref", "1", "protocol", "ip", "u32", "match", "u32", "0", "0", "classid", "1:1")
	out, err := exec.Command("nsenter", "--net=/run/netns/"+ns, "--", tb.Binary, "agent", "--config", cfg).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "preference 1 on pal-tcc is taken by another filter (u32)") {
		t.Fatalf("agent with pal-tcc's preference 1 taken: %v\n%s", err, out)
	}
	if in := filters("pal-tcc", "ingress"); strings.Contains(in, "palisade:") || !strings.Contains(in, "pref 1 u32") {
		t.Errorf("pal-tcc ingress:\n%s", in)
	}
	for _, dev := range []string{"pal-tca", "lo"} {
		if f := filters(dev, "egress") + filters(dev, "ingress"); strings.Contains(f, "palisade:") {
			t.Errorf("failed install left a filter on %s:\n%s", dev, f)
		}
	}
	if s := statusOf(); s.Mode != "none" {
		t.Errorf("failed install left pins: %+v", s)
	}
	sh("ip", "link", "del", "pal-tcc")

	agent := start()
	s := statusOf()
	if s.Attach != "tc" {
		t.Errorf("status attach = %q, want tc", s.Attach)
	}
	var names []string
	for _, l := range s.Links {
		if l.Type == "tc" {
			names = append(names, l.Name)
		}
	}
	for _, want := range []string{"tc_eg_lo", "tc_in_pal-tca", "tc_eg_pal-tca"} {
		if !strings.Contains(" "+strings.Join(names, " ")+" ", " "+want+" ") {
			t.Errorf("status tc links %v lack %s", names, want)
		}
	}
	in := filters("pal-tca", "ingress")
	m := ourIngress.FindStringSubmatch(in)
	if m == nil || !strings.Contains(in, "pref 5 u32") {
		t.Fatalf("pal-tca ingress: want ours at pref 1 and the foreign u32 at pref 5:\n%s", in)
	}
	// tc runs filters by preference: ours is listed (and runs) first.
	if strings.Index(in, "pref 1 bpf") > strings.Index(in, "pref 5 u32") {
		t.Errorf("our filter is not first:\n%s", in)
	}
	if b, _ := os.ReadFile(logPath); !strings.Contains(string(b), "tc programs attach with tc") {
		t.Errorf("the attach choice is not logged:\n%s", b)
	}

	// Restart: the same filter (handle, pref) now runs the new program.
	stop(agent)
	if m2 := ourIngress.FindStringSubmatch(filters("pal-tca", "ingress")); m2 == nil || m2[1] != m[1] {
		t.Fatalf("while the agent is stopped the filter must stay: %v", m2)
	}
	agent = start()
	in = filters("pal-tca", "ingress")
	m2 := ourIngress.FindStringSubmatch(in)
	if m2 == nil || m2[1] == m[1] || strings.Count(in, "palisade:") != 1 {
		t.Errorf("after restart want exactly one filter of ours with a new program (was id %s):\n%s", m[1], in)
	}

	// Uninstall removes exactly ours.
	stop(agent)
	out, err = exec.Command("nsenter", "--net=/run/netns/"+ns, "--", tb.Binary, "agent", "--uninstall", "--config", cfg).CombinedOutput()
	if err != nil {
		t.Fatalf("uninstall: %v: %s", err, out)
	}
	for _, dev := range []string{"pal-tca", "pal-tcb", "lo"} {
		for _, d := range []string{"ingress", "egress"} {
			if strings.Contains(sh("tc", "filter", "show", "dev", dev, d), "palisade:") {
				t.Errorf("%s %s: our filter left", dev, d)
			}
		}
	}
	if in := filters("pal-tca", "ingress"); !strings.Contains(in, "pref 5 u32") {
		t.Errorf("the foreign filter was removed:\n%s", in)
	}
	if q := sh("tc", "qdisc", "show", "dev", "lo"); strings.Contains(q, "clsact") {
		t.Errorf("our empty clsact on lo left: %s", q)
	}
	if q := sh("tc", "qdisc", "show", "dev", "pal-tca"); !strings.Contains(q, "clsact") {
		t.Errorf("the clsact holding a foreign filter was removed: %s", q)
	}
	if s := statusOf(); s.Mode != "none" {
		t.Errorf("after uninstall: %+v", s)
	}

	// Deleted without uninstall: the pins are recognised as stale by the
	// program ID of lo's filter, and collected.
	agent = start()
	cookie := strconv.FormatUint(statusOf().NetnsCookie, 10)
	stop(agent)
	pins := filepath.Join("/sys/fs/bpf/palisade", cookie)
	if kernel.NamespaceGone(pins) {
		t.Fatal("namespace reported gone while it exists")
	}
	exec.Command("ip", "netns", "del", ns).Run()
	for i := 0; i < 100 && !kernel.NamespaceGone(pins); i++ {
		time.Sleep(50 * time.Millisecond)
	}
	kernel.CollectStale("/sys/fs/bpf")
	if _, err := os.Stat(pins); !os.IsNotExist(err) {
		t.Fatalf("stale pins of the deleted tc-mode namespace %s left", cookie)
	}
}
