package userwall

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestAgentUnitParses: the lab reads the shipped unit's sandbox (no root
// needed), and refuses a setting it would not emulate, so that the testbed
// never silently runs agents differently from the unit.
func TestAgentUnitParses(t *testing.T) {
	u, err := AgentUnit()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"bpf", "net_admin", "sys_admin", "sys_ptrace", "dac_read_search", "chown"} {
		if !slices.Contains(u.Caps, c) {
			t.Errorf("unit caps %v lack %s", u.Caps, c)
		}
	}
	if !u.NoNewPrivs || !slices.Contains(u.ReadOnly, "/etc") || !slices.Contains(u.ReadOnly, "/home") {
		t.Errorf("sandbox %+v", u)
	}
	if u.Umask != "0077" || !slices.Contains(u.Syscalls, "@system-service") || !slices.Contains(u.Syscalls, "bpf") || u.SysErrno != int(syscall.EPERM) || !u.NativeArch {
		t.Errorf("sandbox %+v: want UMask=0077, SystemCallFilter=@system-service bpf …, SystemCallErrorNumber=EPERM, native", u)
	}
	prefix, err := u.Prefix("/lab")
	if err != nil {
		t.Fatal(err)
	}
	p := strings.Join(prefix, " ")
	if !strings.Contains(p, "--bounding-set=-all,+") || !strings.Contains(p, "--no-new-privs") || !strings.Contains(p, "unshare --mount --propagation slave") ||
		!strings.Contains(p, "umask 0077;") || !strings.Contains(p, "/lab "+UnitExecCommand+" --allow ") {
		t.Errorf("prefix %s", p)
	}
	for _, bad := range []string{"User=palisade", "ProtectSystem=strict", "CapabilityBoundingSet=~CAP_SYS_BOOT", "PrivateTmp=yes",
		"SystemCallFilter=~@mount", "SystemCallArchitectures=native", "SystemCallErrorNumber=NOSUCH", "UMask=08"} {
		if _, err := parseUnit("[Service]\nCapabilityBoundingSet=CAP_BPF\n" + bad + "\n"); err == nil {
			t.Errorf("%s: accepted, but the lab does not emulate it", bad)
		}
	}
}

// unitExecEnv makes the test binary run as `palisade-lab __unit-exec`.
const unitExecEnv = "PALISADE_TEST_UNIT_EXEC"

// TestUnitExec: the filter the testbed applies is the unit's. Under it a
// call of @system-service (getpid) and bpf(2) work, one outside the set
// (chroot, in @privileged only) fails with EPERM; the same chroot without
// the filter works (the control). Needs root (chroot) and
// systemd-analyze.
func TestUnitExec(t *testing.T) {
	if os.Geteuid() != 0 || testing.Short() {
		t.Skip("needs root")
	}
	u, err := AgentUnit()
	if err != nil {
		t.Fatal(err)
	}
	lab, err := os.Executable() // this test binary runs UnitExec (TestMain)
	if err != nil {
		t.Fatal(err)
	}
	allow, err := resolveSyscalls(u.Syscalls)
	if err != nil {
		t.Fatal(err)
	}
	if len(allow) < 250 {
		t.Fatalf("@system-service and the rest resolved to %d calls", len(allow))
	}
	script := `chroot / true 2>&1 && echo chroot-ok; bpftool prog show >/dev/null 2>&1 && echo bpf-ok; echo pid $$`
	run := func(filtered bool) string {
		argv := []string{"sh", "-c", script}
		if filtered {
			nums := make([]string, len(allow))
			for i, n := range allow {
				nums[i] = strconv.FormatUint(uint64(n), 10)
			}
			argv = append([]string{lab, UnitExecCommand, "--allow", strings.Join(nums, ","), "--errno", strconv.Itoa(u.SysErrno), "--"}, argv...)
		}
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = append(os.Environ(), unitExecEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("%v: %v\n%s", argv[:2], err, out)
		}
		return string(out)
	}
	if out := run(false); !strings.Contains(out, "chroot-ok") || !strings.Contains(out, "bpf-ok") {
		t.Errorf("without the filter (control): %s", out)
	}
	out := run(true)
	if strings.Contains(out, "chroot-ok") || !strings.Contains(out, "Operation not permitted") {
		t.Errorf("chroot under the unit's filter: %s (want EPERM)", out)
	}
	if !strings.Contains(out, "bpf-ok") || !strings.Contains(out, "pid ") {
		t.Errorf("bpf and a service's calls under the unit's filter: %s", out)
	}
}
