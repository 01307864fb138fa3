package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/spank"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Handler runs `palisade-lab testbed up --vm`: the whole testbed inside a qemu
// guest; Command relays through the control channel.
type Handler struct{}

// Dir is the host-side directory of tb's VM.
func Dir(tb *testbed.Testbed) string { return filepath.Join(tb.Dir, "vm") }

// Accel picks the accelerator: KVM only if /dev/kvm is writable and the CPU
// really offers vmx/svm (this machine kind's kvm_pvm runs a stock kernel
// ~100x slower than TCG), else TCG.
func Accel() []string {
	if os.Getenv("PALISADE_VM_ACCEL") == "tcg" {
		return tcgAccel
	}
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
			for _, l := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(l, "flags") && (strings.Contains(l, " vmx") || strings.Contains(l, " svm")) {
					return []string{"-accel", "kvm", "-cpu", "host,-arch-capabilities"}
				}
			}
		}
	}
	return tcgAccel
}

var tcgAccel = []string{"-accel", "tcg,thread=multi", "-cpu", "max"}

// LSMList enables the bpf LSM (abstract Unix sockets): Debian's 6.1 has
// CONFIG_BPF_LSM=y but leaves bpf out of its default list.
const LSMList = "lsm=lockdown,capability,landlock,yama,apparmor,bpf"

// QemuArgs is the qemu command line for a guest running the agent.
func QemuArgs(k *Kernel, dir, agentBin string, a AgentArgs, memMB int) []string {
	cmdline := []string{"console=ttyS0", "panic=-1", "quiet", "loglevel=3",
		"pal.moddir=" + filepath.Dir(filepath.Join(k.Modules, "x")),
		"pal.modules=" + strings.Join(GuestModules, ","),
		"pal.agent=" + agentBin, "pal.name=" + a.Name, "pal.nodes=" + strconv.Itoa(a.Nodes), "pal.mode=" + a.Mode}
	if a.Spank != "" {
		cmdline = append(cmdline, "pal.spank="+a.Spank)
	}
	cmdline = append(cmdline, a.KernelArgs...)
	args := []string{"qemu-system-x86_64"}
	args = append(args, Accel()...)
	args = append(args, "-smp", "2", "-m", strconv.Itoa(memMB),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-serial", "file:"+filepath.Join(dir, fileConsole),
		"-nic", "none",
		"-kernel", k.image(), "-initrd", k.Initrd,
		"-append", strings.Join(cmdline, " "),
		"-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
		"-chardev", "socket,id=ctl,path="+filepath.Join(dir, fileCtl)+",server=on,wait=off",
		"-device", "virtio-serial-pci", "-device", "virtserialport,chardev=ctl,name=pal.ctl")
	return args
}

// Start boots a VM in dir running the agent (binary bin) and returns once
// the hub is running; WaitReady then waits for the guest.
func Start(ctx context.Context, dir, bin string, a AgentArgs) error {
	k, err := PrepareKernel(ctx, a.Kernel)
	if err != nil {
		return err
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return errors.New("qemu-system-x86_64 not found: install qemu-system-x86 (.ci/deps)")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	mem := 2048
	if v, err := strconv.Atoi(os.Getenv("PALISADE_VM_MEM")); err == nil && v >= 256 {
		mem = v
	}
	b, _ := json.Marshal(QemuArgs(k, dir, bin, a, mem))
	if err := os.WriteFile(filepath.Join(dir, fileQemuArgs), b, 0o644); err != nil {
		return err
	}
	os.Remove(filepath.Join(dir, fileReady))
	// A test's VM goes with the test process: one killed or timed out
	// (no cleanup runs then) must not leave a guest holding the machine's
	// VM lock. From the CLI the VM lives until `testbed down`.
	owner := 0
	if testing.Testing() {
		owner = os.Getpid()
	}
	hub := exec.Command(bin, "vm", "hub", "--dir", dir, "--owner", strconv.Itoa(owner))
	devnull, _ := os.Open(os.DevNull)
	hl, err := os.OpenFile(filepath.Join(dir, fileHubLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	hub.Stdin, hub.Stdout, hub.Stderr = devnull, hl, hl
	hub.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := hub.Start(); err != nil {
		return fmt.Errorf("start VM hub: %w", err)
	}
	os.WriteFile(filepath.Join(dir, fileHubPID), []byte(strconv.Itoa(hub.Process.Pid)), 0o644)
	hub.Process.Release()
	devnull.Close()
	hl.Close()
	return nil
}

// Up boots the VM and waits for the guest's testbed.
func (Handler) Up(ctx context.Context, tb *testbed.Testbed, opts testbed.Options) error {
	dir := Dir(tb)
	a := AgentArgs{Name: tb.Name, Nodes: len(tb.Nodes), Mode: tb.Mode, Kernel: opts.Kernel,
		KernelArgs: []string{LSMList}}
	if a.Nodes == 0 {
		a.Nodes = opts.Nodes
	}
	if tb.Mode == "uvn" {
		so := filepath.Join(dir, spank.PluginName)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := spank.Build(ctx, so); err != nil {
			return err
		}
		a.Spank = so
	}
	if err := Start(ctx, dir, tb.LabBinary, a); err != nil {
		return err
	}
	// Boot and guest testbed, after other guests' runs (the VM lock): the
	// timeout counts from when the hub takes the lock (WaitReady), so time
	// queued behind other guests is not counted; ctx bounds the whole wait.
	timeout := 30 * time.Minute
	rd, err := WaitReady(ctx, dir, timeout)
	if err != nil {
		return err
	}
	if rd.Error != "" {
		return fmt.Errorf("guest testbed: %s (console: %s)", rd.Error, filepath.Join(dir, fileConsole))
	}
	return nil
}

// Stop asks the guest to take its testbed down and power off, then makes
// sure qemu and the hub are gone (by their PIDs).
func Stop(ctx context.Context, dir string) error {
	var errs []error
	if _, err := os.Stat(filepath.Join(dir, fileHub)); err == nil {
		sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		var out strings.Builder
		code, err := Exec(sctx, dir, Request{Op: "shutdown"}, nil, &out, &out)
		cancel()
		if err == nil && code != 0 {
			errs = append(errs, fmt.Errorf("guest testbed down: %s", strings.TrimSpace(out.String())))
		}
	}
	for _, f := range []string{fileQemuPID, fileHubPID} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 1 {
			continue
		}
		waitGone(pid, 30*time.Second, f == fileQemuPID)
	}
	return errors.Join(errs...)
}

// waitGone waits for pid to end (zombies count as ended), killing it after
// timeout. Only our own qemu/hub PIDs come here, checked by command name.
func waitGone(pid int, timeout time.Duration, isQemu bool) {
	want := "palisade"
	if isQemu {
		want = "qemu-system"
	}
	deadline := time.Now().Add(timeout)
	for {
		s, ok := procfs.Read(pid)
		if !ok || s.Zombie() || !strings.HasPrefix(s.Comm, want[:min(len(want), 15)]) {
			return
		}
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			deadline = time.Now().Add(5 * time.Second)
			timeout = 0
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Down stops the VM; the testbed removes tb.Dir afterwards.
func (Handler) Down(ctx context.Context, tb *testbed.Testbed) error {
	return Stop(ctx, Dir(tb))
}

// Command relays argv on node as user into the guest.
func (Handler) Command(ctx context.Context, tb *testbed.Testbed, node, user string, argv ...string) *exec.Cmd {
	args := []string{"vm", "exec", "--dir", Dir(tb), "--node", node}
	if user != "" {
		args = append(args, "--user", user)
	}
	args = append(args, "--")
	return exec.CommandContext(ctx, tb.LabBinary, append(args, argv...)...)
}
