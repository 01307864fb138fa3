// Package kernels runs the userwall data plane on Debian's kernels in the
// VM testbed (qemu, TCG): the isolation matrix (a subset covering every
// rule, launcher, path, protocol and family, abstract Unix sockets
// included) and the attack suite, each relayed into the guest as
// `palisade-lab check` does; and, below the floor, the agent's refusal.
//
// PALISADE_TEST_KERNELS picks the kernels: `make test` sets "6.1", `make
// test-kernels` "6.1 6.12 5.10"; unset, the tests skip (a plain `go test
// ./...` does not boot VMs for 15+ minutes). Of the attack suite the VM
// runs the cases whose outcome can depend on the kernel
// (attack.KernelDependent), all of them with PALISADE_TEST_KERNEL_ATTACKS=all
// (make test-kernels). Needs root and qemu; -short skips them.
package kernels

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/check/vmcheck"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

func TestMain(m *testing.M) {
	// What cmd/palisade-lab wires, for the testbed this test brings up.
	testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{})
	testbed.RegisterVM(vm.Handler{})
	check.RegisterVMRelay(vm.RelayCheck)
	os.Exit(m.Run())
}

func kernels() []string { return strings.Fields(os.Getenv("PALISADE_TEST_KERNELS")) }

// floor is the kernel series below userwall's floor that the test proves
// the refusal on.
const floor = "5.10"

func needVM(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a VM")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
}

// CheckSubset is the matrix CI runs in the VM: bob and root connect; bob's
// own listener (same user), alice's (another user: denied), alice's under
// sg proj1 (shared group), svc's (exempt listener) and root's system port;
// root is the exempt connector, the outside host the off-cluster one. Every
// launcher, path, protocol and family; abstract Unix stream and datagram
// sockets where the agent reports them enforced.
var CheckSubset = []string{"--connectors=bob,root", "--listeners=bob,alice,alice+proj1,svc,root"}

func TestUserwallOnKernels(t *testing.T) {
	needVM(t)
	if len(kernels()) == 0 {
		t.Skip("PALISADE_TEST_KERNELS unset (make test sets 6.1)")
	}
	for _, series := range kernels() {
		if series == floor {
			continue // TestBelowFloor
		}
		t.Run(series, func(t *testing.T) { userwallOn(t, series) })
	}
}

func userwallOn(t *testing.T, series string) {
	ctx := context.Background()
	if _, err := vm.PrepareKernel(ctx, series); err != nil {
		t.Fatalf("guest kernel %s: %v", series, err)
	}
	name := testbed.RunName("k" + cmp.Or(map[string]string{"6.1": "a", "6.12": "b"}[series], "z"))
	t0 := time.Now()
	// Two nodes: every path of the matrix (a node and the other, loopback,
	// outside) and the attack suite's A and B; a third node under
	// emulation is one more agent through the verifier, slurmd and sshd
	// at TCG speed, and no other kernel path.
	tb, err := testbed.Up(ctx, testbed.Options{Name: name, Nodes: 2, Mode: userwalllab.ModeName, VM: true, Kernel: series})
	if err != nil {
		t.Fatalf("testbed up --vm --kernel %s --mode userwall: %v", series, err)
	}
	t.Logf("VM testbed %s (kernel %s) up in %v", name, series, time.Since(t0).Round(time.Second))
	t.Cleanup(func() {
		if err := testbed.Down(context.Background(), name); err != nil {
			t.Errorf("testbed down: %v", err)
		}
	})

	// The agent's own view: attach mode, Unix sockets, the probe.
	// status exits non-zero when it has warnings: the report says which.
	out, err := tb.Command(ctx, "node1", "", tb.Binary, "status", "--json").Output()
	var st control.Status
	if jerr := json.Unmarshal(out, &st); jerr != nil {
		t.Fatalf("status on node1: %v (%v)\n%s", jerr, err, out)
	}
	wantAttach := "tcx"
	if series == "6.1" {
		wantAttach = "tc"
	}
	if st.Kernel != nil && st.Kernel.Err() != nil {
		t.Errorf("probe on %s: %v", series, st.Kernel.Err())
	}
	if st.Mode != "userwall" || !st.Enabled || st.Attach != wantAttach || !st.UnixLSM || st.Kernel == nil || st.Kernel.Err() != nil {
		t.Errorf("status on %s: mode %s enabled %v attach %q (want %s) unix %v probe %v; warnings %v",
			series, st.Mode, st.Enabled, st.Attach, wantAttach, st.UnixLSM, st.Kernel != nil && st.Kernel.Err() == nil, st.Warnings)
	}

	t.Run("check-matrix", func(t *testing.T) { checkMatrix(t, ctx, tb) })
	t.Run("attacks", func(t *testing.T) { attacks(t, ctx, tb) })
}

func checkMatrix(t *testing.T, ctx context.Context, tb *testbed.Testbed) {
	rep := vmcheck.Matrix(t, ctx, tb, 1000, append([]string{"--mode=userwall"}, CheckSubset...)...)
	paths := map[string]int{}
	for _, c := range rep.Cases {
		paths[string(c.Path)]++
	}
	t.Logf("cases by path %v", paths)
	if paths[string(check.Unix)] == 0 {
		t.Errorf("no abstract Unix socket cases ran (the agent must enforce them on this kernel)")
	}
}

// attacks runs the attack cases whose outcome can depend on the kernel
// version (attack.KernelDependent: the rule and its reasons are there); the
// host's kernel runs all of them (lab/check/attack). With
// PALISADE_TEST_KERNEL_ATTACKS=all (make test-kernels) the whole suite.
func attacks(t *testing.T, ctx context.Context, tb *testbed.Testbed) {
	t0 := time.Now()
	args := []string{"check", "--attacks", "--kernel-dependent"}
	if os.Getenv("PALISADE_TEST_KERNEL_ATTACKS") == "all" {
		args = args[:2]
	}
	var stdout, stderr bytes.Buffer
	code, err := vm.RelayCheck(ctx, tb, args, &stdout, &stderr)
	if err != nil {
		t.Fatalf("relay: %v\n%s", err, stderr.String())
	}
	tail := strings.TrimSpace(stdout.String())
	if i := strings.LastIndex(tail, "\n"); i >= 0 {
		tail = tail[i+1:]
	}
	t.Logf("%v in %v (exit %d): %s", args[1:], time.Since(t0).Round(time.Second), code, tail)
	if code != 0 {
		t.Errorf("check --attacks exited %d:\n%s\n%s", code, stdout.String(), stderr.String())
	}
}

// TestBelowFloor boots Debian 11's 5.10 (below the floor: no SO_NETNS_COOKIE,
// no bpf_check_mtu for tc programs) without a testbed and starts the real
// agent: it must refuse with the one clear message and leave the kernel's
// BPF objects, bpffs, nftables, qdiscs, cgroup attachments and /run as they
// were.
func TestBelowFloor(t *testing.T) {
	needVM(t)
	if !slices.Contains(kernels(), floor) {
		t.Skipf("PALISADE_TEST_KERNELS does not name %s", floor)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("/var/tmp", "palkfloor-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	for _, b := range []string{"palisade", "palisade-lab"} {
		cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, b), "github.com/palisade-hpc/palisade/cmd/"+b)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", b, err, out)
		}
	}
	script := `B=` + filepath.Join(dir, "palisade") + `
snap() { { ls -R /sys/fs/bpf; nft list ruleset; tc qdisc show; bpftool prog show | grep -c '^[0-9]'; bpftool cgroup tree /sys/fs/cgroup; ls /run/palisade; } > $1 2>&1; }
echo "KERNEL $(uname -r)"
snap /tmp/before
$B --config /nonexistent.toml agent --pid-file /run/palisade/agent.pid; echo "AGENT-EXIT $?"
$B doctor >/dev/null 2>&1; echo "DOCTOR-EXIT $?"
snap /tmp/after
diff /tmp/before /tmp/after && echo UNCHANGED
`
	vmDir := filepath.Join(dir, "vm")
	if err := vm.Start(ctx, vmDir, filepath.Join(dir, "palisade-lab"), vm.AgentArgs{Name: testbed.RunName("kf"), Nodes: 0, Kernel: floor, KernelArgs: []string{vm.LSMList}}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := vm.Stop(context.Background(), vmDir); err != nil {
			t.Errorf("stop VM: %v", err)
		}
	}()
	// Another guest may hold the VM lock first.
	if rd, err := vm.WaitReady(ctx, vmDir, 20*time.Minute); err != nil || rd.Error != "" {
		t.Fatalf("VM: %v %v", err, rd)
	}
	var out strings.Builder
	if _, err := vm.Exec(ctx, vmDir, vm.Request{Op: "sh", Argv: []string{"bash", "-c", script}}, nil, &out, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	t.Logf("guest:\n%s", s)
	for _, want := range []string{
		"KERNEL 5.10.",
		"this kernel (Linux 5.10.", "lacks what userwall needs: SO_NETNS_COOKIE (Linux 5.14)",
		"userwall needs Linux >= 6.1", "nothing was changed",
		"AGENT-EXIT 1", "DOCTOR-EXIT 1", "UNCHANGED",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("guest output lacks %q", want)
		}
	}
	if strings.Count(s, "lacks what userwall needs") != 1 {
		t.Errorf("want exactly one refusal message")
	}
}
