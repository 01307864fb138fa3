package procfs

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

func TestAliveAndCmdline(t *testing.T) {
	if !Alive(os.Getpid()) {
		t.Fatal("this process is not alive")
	}
	if s, ok := Read(os.Getpid()); !ok || s.PPID != os.Getppid() {
		t.Fatalf("Read(self) ppid = %d, %v; want %d", s.PPID, ok, os.Getppid())
	}
	// A command name (comm in /proc/PID/stat) with a space and a ')'.
	bin, err := os.ReadFile("/bin/sleep")
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(t.TempDir(), "x) y")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	want := []string{exe, "30"}
	cmd := exec.Command(exe, "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	defer cmd.Process.Kill()
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Equal(Cmdline(pid), want) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := Cmdline(pid); !slices.Equal(got, want) {
		t.Fatalf("Cmdline = %q", got)
	}
	if s, ok := Read(pid); !ok || s.PPID != os.Getpid() || s.Zombie() || s.Comm != "x) y" {
		t.Fatalf("Read(child) = %+v %v", s, ok)
	}
	if !Alive(pid) {
		t.Fatal("running child not alive")
	}
	// Exited but not reaped: a zombie counts as dead.
	cmd.Process.Signal(syscall.SIGKILL)
	for {
		if s, _ := Read(pid); s.State == 'Z' || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if Alive(pid) {
		t.Fatal("zombie child counted as alive")
	}
	cmd.Wait()
	if Alive(pid) || Cmdline(pid) != nil {
		t.Fatal("reaped child still seen")
	}
	if Alive(0) || Alive(-1) {
		t.Fatal("pid <= 0 counted as alive")
	}
}

func TestDescendantsMemoryStart(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	d := Descendants(os.Getpid())
	if !d[os.Getpid()] || !d[cmd.Process.Pid] || d[os.Getppid()] {
		t.Fatalf("Descendants(self) = %v (child %d, parent %d)", d, cmd.Process.Pid, os.Getppid())
	}
	rss, hwm, ok := Memory(os.Getpid())
	if !ok || rss == 0 || hwm < rss {
		t.Fatalf("Memory(self) = %d, %d, %v", rss, hwm, ok)
	}
	self, _ := Read(os.Getpid())
	child, _ := Read(cmd.Process.Pid)
	if self.Start == 0 || child.Start < self.Start {
		t.Fatalf("start times: self %d, child %d", self.Start, child.Start)
	}
	if _, _, ok := Memory(-1); ok {
		t.Fatal("Memory(-1) ok")
	}
}

func TestEffectiveUID(t *testing.T) {
	if uid, ok := EffectiveUID(os.Getpid()); !ok || uid != uint64(os.Geteuid()) {
		t.Errorf("EffectiveUID(self) = %d, %v; want %d", uid, ok, os.Geteuid())
	}
	if _, ok := EffectiveUID(1 << 30); ok {
		t.Errorf("EffectiveUID of a pid that cannot exist succeeded")
	}
}

func TestParseCreds(t *testing.T) {
	status := "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t17793\nPid:\t17793\n" +
		"Uid:\t2001\t2002\t2002\t2002\nGid:\t2001\t2100\t2100\t2100\nFDSize:\t64\nGroups:\t2001 2100 \n"
	c, err := parseCreds([]byte(status))
	if err != nil {
		t.Fatal(err)
	}
	if c.EUID() != 2002 || c.EGID() != 2100 || !slices.Equal(c.GIDs, []uint32{2001, 2100, 2100, 2100}) || !slices.Equal(c.Groups, []uint32{2001, 2100}) || c.Command != "python3" || c.Zombie {
		t.Errorf("parsed %+v", c)
	}
	c, err = parseCreds([]byte("Name:\tx\nState:\tZ (zombie)\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\n"))
	if err != nil || !c.Zombie || len(c.Groups) != 0 {
		t.Errorf("zombie: %+v %v", c, err)
	}
	for _, bad := range []string{"Name:\tx\n", "Uid:\t1\nGid:\t1\t1\n", "Uid:\t1\t1\nGid:\t1\t1\nGroups:\tx\n"} {
		if _, err := parseCreds([]byte(bad)); err == nil {
			t.Errorf("parseCreds(%q) accepted", bad)
		}
	}
}

func TestCredsAndCgroup2OfThisProcess(t *testing.T) {
	c, err := ReadCreds(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	groups, _ := os.Getgroups()
	var want []uint32
	for _, g := range groups {
		want = append(want, uint32(g))
	}
	if int(c.EUID()) != os.Geteuid() || int(c.EGID()) != os.Getegid() || !slices.Equal(c.Groups, want) || c.Zombie {
		t.Errorf("ReadCreds(self) = %+v, want euid %d egid %d groups %v", c, os.Geteuid(), os.Getegid(), want)
	}
	cg, err := Cgroup2(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile("/proc/self/cgroup")
	if !strings.Contains(string(b), "0::"+cg+"\n") && !(cg == "/" && strings.Contains(string(b), "0::/\n")) {
		t.Errorf("Cgroup2(self) = %q; /proc/self/cgroup:\n%s", cg, b)
	}
	if _, err := ReadCreds(1 << 30); err == nil {
		t.Error("ReadCreds of a pid that cannot exist succeeded")
	}
	if _, err := Cgroup2(1 << 30); err == nil {
		t.Error("Cgroup2 of a pid that cannot exist succeeded")
	}
}

func TestFdinfoIDs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a BPF map)")
	}
	before := FdinfoIDs(os.Getpid(), "map_id")
	m, err := ebpf.NewMap(&ebpf.MapSpec{Name: "pal_fdinfo", Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	got := FdinfoIDs(os.Getpid(), "map_id")
	if slices.Contains(before, uint32(id)) || !slices.Contains(got, uint32(id)) || len(got) != len(before)+1 {
		t.Errorf("map_id: before %v, with map %d open %v", before, id, got)
	}
	if ids := FdinfoIDs(os.Getpid(), "prog_id"); len(ids) != 0 {
		t.Errorf("prog_id of a process holding no program: %v", ids)
	}
}

func TestThreadsCPU(t *testing.T) {
	// Spend 20 ms of CPU time of our own (by the kernel's count, whatever
	// the machine's load); threads that exited are in rusage, not in
	// /proc/PID/task: half of it must show.
	for {
		var ru syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		if time.Duration(ru.Utime.Nano()+ru.Stime.Nano()) >= 20*time.Millisecond {
			break
		}
	}
	ns, err := ThreadsCPU(os.Getpid())
	if err != nil {
		t.Skipf("no schedstat here: %v", err)
	}
	if ns < 10e6 {
		t.Errorf("ThreadsCPU(self) = %.0f ns after 20 ms of CPU time", ns)
	}
	if ns, err := ThreadsCPU(1 << 30); ns != 0 || err != nil {
		t.Errorf("ThreadsCPU of a pid that cannot exist = %v, %v", ns, err)
	}
}

// TestPIDsNetNSSocketInodes: this process is listed, its network namespace
// is the caller's, and a socket it opens is among its socket inodes.
func TestPIDsNetNSSocketInodes(t *testing.T) {
	if !slices.Contains(PIDs(), os.Getpid()) {
		t.Fatal("PIDs: this process missing")
	}
	self, err := Namespace(0, "net")
	if err != nil || !strings.HasPrefix(self, "net:[") {
		t.Fatalf("Namespace(0, net) = %q, %v", self, err)
	}
	if ns, err := Namespace(os.Getpid(), "net"); err != nil || ns != self {
		t.Errorf("Namespace(self pid, net) = %q, %v; want %q", ns, err, self)
	}
	l, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var st syscall.Stat_t
	f, err := l.(*net.UDPConn).File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if got := SocketInodes(os.Getpid()); !slices.Contains(got, uint32(st.Ino)) {
		t.Errorf("SocketInodes: %v lacks the socket's inode %d", got, st.Ino)
	}
	t.Setenv("PAL_PROCFS_TEST", "x")
	if cmd := exec.Command("sleep", "60"); cmd.Start() == nil {
		defer func() { cmd.Process.Kill(); cmd.Wait() }()
		// Until the child has called execve its environ is this process's
		// initial one (os.Setenv does not write it): wait for the exec —
		// its command line becomes sleep's — before reading (ci2 read it
		// between fork and exec).
		cmdline := fmt.Sprintf("/proc/%d/cmdline", cmd.Process.Pid)
		for deadline := time.Now().Add(10 * time.Second); ; {
			if b, _ := os.ReadFile(cmdline); strings.HasPrefix(string(b), "sleep\x00") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the child did not exec sleep within 10 s")
			}
			time.Sleep(time.Millisecond)
		}
		if !slices.Contains(Environ(cmd.Process.Pid), "PAL_PROCFS_TEST=x") {
			t.Errorf("Environ of a child: %v lacks PAL_PROCFS_TEST=x", Environ(cmd.Process.Pid))
		}
	}
	if got := SocketInodes(-1); got != nil {
		t.Errorf("SocketInodes of no process: %v", got)
	}
}

// TestMountPoints: this process's mount table has /proc, a proc
// filesystem; no filesystem type "palnone".
func TestMountPoints(t *testing.T) {
	ps, err := MountPoints(0, "proc")
	if err != nil || !slices.Contains(ps, "/proc") {
		t.Fatalf("proc mounts %q %v, want /proc among them", ps, err)
	}
	if ps, err := MountPoints(os.Getpid(), "palnone"); err != nil || len(ps) != 0 {
		t.Errorf("palnone mounts %q %v, want none", ps, err)
	}
}
