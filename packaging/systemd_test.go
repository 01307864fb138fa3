package packaging

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// bootScript makes the namespaces' root a node booted by systemd: the
// kernel file systems (a cgroup2 of the cgroup namespace: the subtree the
// test made; a bpffs of its own), then systemd as PID 1 of the new PID
// namespace, told it runs in a container.
const bootScript = `set -e
R=$1
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount -t bpf bpf "$R/sys/fs/bpf"
mount -t securityfs securityfs "$R/sys/kernel/security" 2>/dev/null || true
mount -t tmpfs -o mode=755 run "$R/run"
mount -t tmpfs -o mode=1777 tmp "$R/tmp"
mount -t tmpfs -o mode=755 dev "$R/dev"
for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777 shm "$R/dev/shm"
cd "$R"
exec env -i container=palisade-test PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot . /lib/systemd/systemd --system --show-status=no
`

// capBits are the capabilities the agent's unit may name (linux/capability.h).
var capBits = map[string]uint{"CAP_CHOWN": 0, "CAP_DAC_READ_SEARCH": 2, "CAP_SETGID": 6, "CAP_SETUID": 7,
	"CAP_NET_BIND_SERVICE": 10, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
	"CAP_SYS_RESOURCE": 24, "CAP_MAC_ADMIN": 33, "CAP_PERFMON": 38, "CAP_BPF": 39}

// TestAgentUnderSystemd boots a clean Debian root with the .deb installed
// under Debian's systemd as PID 1 (PID, mount, network, cgroup namespaces of
// its own; nothing of the host's is touched), with palisade-agent.service
// enabled as the package ships it, and checks what the unit promises:
//   - the agent is started by systemd, is ready (Type=notify) only once it
//     enforces, and runs with exactly the unit's capability bounding set and
//     no_new_privs;
//   - it enforces for processes systemd starts: alice's listener answers
//     alice and root, refuses bob (positive and negative);
//   - the optional slurmd drop-in: `systemctl start slurmd` on a node whose
//     programs were removed starts the agent first and runs slurmd's gate
//     after the agent is ready; with an agent that cannot start (a broken
//     configuration) slurmd never runs (its gate fails, it retries), and once
//     the file is fixed the agent recovers and slurmd starts by itself.
func TestAgentUnderSystemd(t *testing.T) {
	p := build(t)
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox not installed (Debian package busybox-static, .ci/deps)")
	}
	cg2 := cgroup2Mount(t)
	root := cleanRoot(t, "systemd", "slurmd", "procps")
	os.WriteFile(filepath.Join(root, "tmp", filepath.Base(p.deb)), must(os.ReadFile(p.deb)), 0o644)
	if out, err := inRoot(root, "dpkg", "-i", "/tmp/"+filepath.Base(p.deb)); err != nil {
		t.Fatalf("dpkg -i: %v\n%s", err, out)
	}
	if out, err := inRoot(root, "palisade", "key", "generate", "/etc/palisade/cluster.key"); err != nil {
		t.Fatalf("key generate: %v\n%s", err, out)
	}
	// As an administrator deploys it (docs/deploy.md): the agent enabled,
	// slurmd coupled by the drop-in. slurmd and munge start only when asked.
	wants := filepath.Join(root, "etc/systemd/system/multi-user.target.wants")
	os.Remove(filepath.Join(wants, "slurmd.service"))
	os.Remove(filepath.Join(wants, "munge.service"))
	if err := os.Symlink("/usr/lib/systemd/system/palisade-agent.service", filepath.Join(wants, "palisade-agent.service")); err != nil {
		t.Fatal(err)
	}
	dropin := filepath.Join(root, "etc/systemd/system/slurmd.service.d")
	os.MkdirAll(dropin, 0o755)
	os.WriteFile(filepath.Join(dropin, "palisade.conf"), must(os.ReadFile(filepath.Join(root, "usr/share/palisade/systemd/slurmd-palisade.conf"))), 0o644)
	os.MkdirAll(filepath.Join(root, "etc/slurm"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/slurm/slurm.conf"), nil, 0o644) // slurmd's ConditionPathExists
	appendFile(t, filepath.Join(root, "etc/passwd"), "alice:x:2001:2001::/tmp:/bin/sh\nbob:x:2002:2002::/tmp:/bin/sh\n")
	appendFile(t, filepath.Join(root, "etc/group"), "alice:x:2001:\nbob:x:2002:\n")
	os.WriteFile(filepath.Join(root, "usr/local/bin/busybox"), must(os.ReadFile(busybox)), 0o755)
	script := filepath.Join(t.TempDir(), "boot.sh")
	os.WriteFile(script, []byte(bootScript), 0o755)

	// The node's cgroup: a subtree of the host's, the root of the node's
	// cgroup namespace (the agent attaches its cgroup programs there).
	cg := filepath.Join(cg2, fmt.Sprintf("palpkg-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	boot := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec unshare --cgroup --pid --fork --mount --net --uts --ipc --propagation private -- sh "$2" "$3"`,
		"sh", cg, script, root)
	boot.Stdout, boot.Stderr = os.Stderr, os.Stderr
	if err := boot.Start(); err != nil {
		t.Fatal(err)
	}
	var pid1 int
	t.Cleanup(func() {
		if pid1 > 0 {
			// The data plane goes with the node's namespaces; uninstall
			// first all the same, then end PID 1 and so every process.
			exec.Command("nsenter", "-t", strconv.Itoa(pid1), "-a", "-r", "-w", "palisade", "agent", "--uninstall").Run()
			syscall.Kill(pid1, syscall.SIGKILL)
		}
		boot.Process.Kill()
		boot.Wait()
		removeCgroup(t, cg)
	})
	waitFor(t, "systemd as the node's PID 1", 30*time.Second, func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", boot.Process.Pid, boot.Process.Pid))
		f := strings.Fields(string(b))
		if len(f) == 1 {
			comm, _ := os.ReadFile("/proc/" + f[0] + "/comm")
			if strings.TrimSpace(string(comm)) == "systemd" {
				pid1, _ = strconv.Atoi(f[0])
			}
		}
		return pid1 > 0
	})
	in := func(args ...string) (string, error) {
		out, err := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(pid1), "-a", "-r", "-w"}, args...)...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	show := func(unit, prop string) string {
		out, _ := in("systemctl", "show", "-p", prop, "--value", unit)
		return out
	}
	waitFor(t, "the node's boot", 90*time.Second, func() bool {
		s, _ := in("systemctl", "is-system-running")
		return s == "running" || s == "degraded"
	})
	if s := show("palisade-agent", "ActiveState") + " " + show("palisade-agent", "StatusText"); s != "active enforcing" {
		j, _ := in("journalctl", "--no-pager", "-u", "palisade-agent")
		t.Fatalf("palisade-agent.service after boot: %q\n%s", s, j)
	}
	// The unit's sandbox, as the kernel holds it for the running agent.
	status, err := in("cat", "/proc/"+show("palisade-agent", "MainPID")+"/status")
	if err != nil {
		t.Fatal(err)
	}
	var want uint64
	for _, c := range strings.Fields(unitValue(t, filepath.Join(root, "usr/lib/systemd/system/palisade-agent.service"), "CapabilityBoundingSet")) {
		bit, ok := capBits[c]
		if !ok {
			t.Fatalf("unit names %s: add it to capBits", c)
		}
		want |= 1 << bit
	}
	// ... within what this machine grants at all (a sandbox may drop some:
	// CAP_SYS_RESOURCE here).
	want &= ownCapBnd(t)
	if !strings.Contains(status, fmt.Sprintf("CapBnd:\t%016x\n", want)) || !strings.Contains(status, "NoNewPrivs:\t1\n") {
		t.Errorf("agent's capabilities (want bounding set %016x, no_new_privs):\n%s", want, status)
	}

	// Enforcing for processes systemd runs: alice's listener.
	if out, err := in("systemd-run", "--quiet", "--unit=pal-listen", "-p", "User=alice", "/usr/local/bin/busybox", "nc", "-ll", "-p", "5555", "-e", "/bin/echo", "ok"); err != nil {
		t.Fatalf("listener: %v\n%s", err, out)
	}
	waitFor(t, "alice's listener", 10*time.Second, func() bool {
		out, _ := in("sh", "-c", "grep -c ':15B3 .* 0A ' /proc/net/tcp /proc/net/tcp6 | grep -v ':0$'")
		return out != ""
	})
	for _, c := range []struct {
		user string
		ok   bool
	}{{"alice", true}, {"root", true}, {"bob", false}} {
		unit := "pal-conn-" + c.user
		if out, err := in("systemd-run", "--quiet", "--unit="+unit, "-p", "User="+c.user, "-p", "StandardOutput=file:/tmp/"+unit,
			"-p", "StandardError=file:/tmp/"+unit+".err", "/usr/local/bin/busybox", "nc", "-w", "5", "127.0.0.1", "5555"); err != nil {
			t.Fatalf("%s: %v\n%s", unit, err, out)
		}
		waitFor(t, unit+" to end", 20*time.Second, func() bool {
			s := show(unit, "ActiveState")
			return s == "inactive" || s == "failed"
		})
		got, _ := in("cat", "/tmp/"+unit)
		errs, _ := in("cat", "/tmp/"+unit+".err")
		if (got == "ok") != c.ok {
			t.Errorf("%s connecting to alice's listener: got %q (%s), want allowed=%v", c.user, got, errs, c.ok)
		}
	}

	// The slurmd drop-in. A node whose programs are gone: starting slurmd
	// starts the agent first, and slurmd's gate runs once it is ready.
	for _, args := range [][]string{{"systemctl", "stop", "palisade-agent"}, {"palisade", "agent", "--uninstall"}} {
		if out, err := in(args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	if out, err := in("systemctl", "start", "slurmd"); err != nil {
		t.Fatalf("systemctl start slurmd: %v\n%s", err, out)
	}
	agentUp, _ := strconv.ParseUint(show("palisade-agent", "ActiveEnterTimestampMonotonic"), 10, 64)
	gate := show("slurmd", "ExecStartPre")
	slurmdUp, _ := strconv.ParseUint(show("slurmd", "ExecMainStartTimestampMonotonic"), 10, 64)
	if show("palisade-agent", "ActiveState") != "active" || !strings.Contains(gate, "status=0 }") || agentUp == 0 || slurmdUp < agentUp {
		t.Errorf("slurmd started with the agent: agent %s at %d, slurmd main at %d, gate %s", show("palisade-agent", "ActiveState"), agentUp, slurmdUp, gate)
	}
	// An agent that cannot start: slurmd never runs, and retries.
	in("systemctl", "stop", "slurmd", "palisade-agent")
	in("palisade", "agent", "--uninstall")
	conf := filepath.Join(root, "etc/palisade/palisade.toml")
	good := must(os.ReadFile(conf))
	os.WriteFile(conf, []byte(strings.Replace(string(good), "#system_port_max = 1023", "system_port_max = 70000", 1)), 0o644)
	if out, err := in("systemctl", "start", "slurmd"); err == nil {
		t.Errorf("systemctl start slurmd with an agent that cannot start succeeded:\n%s", out)
	}
	if s, g := show("slurmd", "ActiveState"), show("slurmd", "ExecStartPre"); s == "active" || !strings.Contains(g, "status=2 }") {
		t.Errorf("slurmd on a node without enforcement: %s, gate %s", s, g)
	}
	// Fixed: the agent recovers (Restart=always, no start limit) and
	// slurmd joins by itself (its own retry).
	// (slurmd's main process starting again is the acknowledgement: only
	// a passed gate starts it. With this test's empty slurm.conf it may
	// exit again later; that is Slurm's business.)
	os.WriteFile(conf, good, 0o644)
	waitFor(t, "slurmd to start by itself once the agent enforces", 120*time.Second, func() bool {
		n, _ := strconv.ParseUint(show("slurmd", "ExecMainStartTimestampMonotonic"), 10, 64)
		return n > slurmdUp
	})
	if s := show("palisade-agent", "ActiveState") + " " + show("palisade-agent", "StatusText"); s != "active enforcing" {
		t.Errorf("palisade-agent after the fix: %q", s)
	}
}

func ownCapBnd(t *testing.T) uint64 {
	t.Helper()
	for _, line := range strings.Split(string(must(os.ReadFile("/proc/self/status"))), "\n") {
		if v, ok := strings.CutPrefix(line, "CapBnd:\t"); ok {
			n, err := strconv.ParseUint(v, 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no CapBnd in /proc/self/status")
	return 0
}

func cgroup2Mount(t *testing.T) string {
	t.Helper()
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fl := strings.Fields(sc.Text()); len(fl) > 2 && fl[2] == "cgroup2" {
			return fl[1]
		}
	}
	t.Fatal("no cgroup2 mount")
	return ""
}

// removeCgroup removes the node's cgroup subtree, deepest first, once its
// processes are gone.
func removeCgroup(t *testing.T, dir string) {
	var dirs []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	deadline := time.Now().Add(30 * time.Second)
	for i := len(dirs) - 1; i >= 0; i-- {
		for {
			err := os.Remove(dirs[i])
			if err == nil || os.IsNotExist(err) {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("cgroup %s: %v", dirs[i], err)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// waitFor polls cond until it holds or the deadline passes (a bound, not
// a timing assertion: each condition is an acknowledgement systemd gives).
func waitFor(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func appendFile(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

// unitValue is the value of key in a unit file.
func unitValue(t *testing.T, unit, key string) string {
	t.Helper()
	for _, line := range strings.Split(string(must(os.ReadFile(unit))), "\n") {
		if v, ok := strings.CutPrefix(line, key+"="); ok {
			return v
		}
	}
	t.Fatalf("%s: no %s", unit, key)
	return ""
}
