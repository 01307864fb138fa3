package userwall

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/ringbuf"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/vm"
)

// lsmList puts bpf in the LSM list of the guest kernel: Debian's 6.1 has
// CONFIG_BPF_LSM=y but leaves bpf out of its default list.
const lsmList = "lsm=lockdown,capability,landlock,yama,apparmor,bpf"

// TestLSMVM proves the abstract-Unix rules (BPF LSM hooks unix_stream_connect
// and unix_may_send) on a kernel where BPF LSM works: one bare qemu guest
// (package vm, Debian's 6.1 kernel booted with bpf in its LSM list, no
// testbed). This machine kind's own kernel refuses every LSM program, so this
// is the only place the hooks run. In the guest this test binary
// (TestLSMGuest) loads the object's two LSM programs with the agent's own
// loader and policy code, in a scratch network namespace (the full agent
// then runs there too and is uninstalled), and
// testdata/lsm_guest.py makes listeners and connectors as different users
// there and in a second namespace without programs. Needs root, qemu and a
// prepared kernel in the VM cache (`palisade-lab vm kernel`); ~1.5 min under TCG.
// Before that, the guest runs the full agent and replaces it by a build with
// another map layout (-tags palisade_layout_next): the migration of LSM links,
// which cannot be updated in place (checkLSMUpgrade).
func TestLSMVM(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("no qemu-system-x86_64")
	}
	if !vm.Prepared(vm.DefaultKernel) {
		t.Skipf("no prepared guest kernel in %s (run `palisade-lab vm kernel`)", vm.CacheDir())
	}
	// The VM queue (one guest per machine, other engineers' suites ahead)
	// counts against it; go test's -timeout bounds the whole run.
	ctx, cancel := context.WithTimeout(context.Background(), 80*time.Minute)
	defer cancel()
	// Not under /tmp: the guest mounts its own tmpfs there and sees the rest
	// of the host's root read-only at the same paths.
	dir, err := os.MkdirTemp("/var/tmp", "palulsm-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	// The product binary runs the agent in the guest; the lab binary is
	// the VM's hub and guest agent.
	bin, lab := filepath.Join(dir, "palisade"), filepath.Join(dir, "palisade-lab")
	next := filepath.Join(dir, "palisade-next") // another map layout: the upgrade with LSM links
	for out, pkg := range map[string]string{bin: "cmd/palisade", lab: "cmd/palisade-lab", next: "cmd/palisade"} {
		tags := ""
		if out == next {
			tags = "palisade_layout_next"
		}
		build := exec.CommandContext(ctx, "go", "build", "-tags", tags, "-o", out, "github.com/palisade-hpc/palisade/"+pkg)
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build: %v\n%s", err, out)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(self); err != nil || os.WriteFile(filepath.Join(dir, "userwall.test"), b, 0o755) != nil {
		t.Fatalf("copy the test binary: %v", err)
	}
	for _, f := range []string{"lsm_guest.py", "lsm_guest.sh"} {
		b, err := os.ReadFile(filepath.Join("testdata", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	vmDir := filepath.Join(dir, "vm")
	start := time.Now()
	if err := vm.Start(ctx, vmDir, lab, vm.AgentArgs{Name: "palulsm", Nodes: 0, KernelArgs: []string{lsmList}}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := vm.Stop(context.Background(), vmDir); err != nil {
			t.Errorf("stop VM: %v", err)
		}
	}()
	rd, err := vm.WaitReady(ctx, vmDir, 70*time.Minute) // another guest may hold the VM lock
	if err != nil {
		t.Fatalf("VM: %v", err)
	}
	if rd.Error != "" {
		t.Fatalf("VM: %s", rd.Error)
	}
	t.Logf("guest up in %.1f s", time.Since(start).Seconds())
	var out strings.Builder
	// The guest's own work is bounded apart from the queue: a hung guest
	// must not hold the machine's one VM.
	gctx, gcancel := context.WithTimeout(ctx, 15*time.Minute)
	defer gcancel()
	code, err := vm.Exec(gctx, vmDir, vm.Request{Op: "sh", Argv: []string{"bash", filepath.Join(dir, "lsm_guest.sh"), bin, dir, next}}, nil, &out, &out)
	t.Logf("guest script (exit %d, %.1f s since boot):\n%s", code, time.Since(start).Seconds(), out.String())
	if err != nil || code != 0 {
		t.Fatalf("guest script: exit %d, %v", code, err)
	}

	res := map[string]string{}
	got := map[string]bool{}
	upgrade := map[string]string{}
	var lsm string
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "RESULT "):
			f := strings.SplitN(l, " ", 3)
			if len(f) == 3 {
				res[f[1]] = f[2]
			}
		case strings.HasPrefix(l, "GOT "):
			if f := strings.Fields(l); len(f) == 3 {
				got[f[2]] = true
			}
		case strings.HasPrefix(l, "LSM "):
			lsm = strings.TrimPrefix(l, "LSM ")
		case strings.HasPrefix(l, "UPGRADE-"):
			k, v, _ := strings.Cut(l, " ")
			upgrade[k] = v
		}
	}
	checkLSMUpgrade(t, upgrade)
	if !strings.Contains(","+lsm+",", ",bpf,") {
		t.Fatalf("bpf not in the guest's LSM list %q", lsm)
	}
	if !strings.Contains(out.String(), "LSM-ATTACHED") {
		t.Fatal("the LSM programs were not loaded and attached in the guest")
	}

	// Allowed: the message reached the listener and its answer came back.
	// Refused: connect()/sendto() failed with EPERM and nothing arrived.
	type want struct {
		name, msg string
		allow     bool
	}
	var cases []want
	for _, k := range []string{"stream", "dgram"} {
		cases = append(cases,
			want{k + "-same-user", "m1", true},
			want{k + "-other-user", "m2", false},
			want{k + "-exempt-connector-svc", "m3", true},
			want{k + "-exempt-connector-root", "m4", true},
			want{k + "-shared-group", "m5", true},
			want{k + "-group-nonmember", "m6", false},
			want{k + "-group-not-listeners", "m7", false},
			want{k + "-exempt-listener-root", "m8", true})
	}
	cases = append(cases,
		want{"dgram-connect-other-user", "m9", false},
		want{"dgram-connect-same-user", "m10", true},
		// Pathname sockets are left to file permissions (here 0777).
		want{"pathname-other-user", "m11", true},
		// Netns scoping: no agent in palulB, the hooks there do nothing.
		want{"other-netns-stream-other-user", "n1", true},
		want{"other-netns-dgram-other-user", "n2", true})
	for _, c := range cases {
		r, ok := res[c.name]
		switch {
		case !ok:
			t.Errorf("%s: no result", c.name)
		case c.allow && r != "OK echo "+c.msg:
			t.Errorf("%s: want allowed (answer %q), got %q", c.name, "echo "+c.msg, r)
		case c.allow && !got[c.msg]:
			t.Errorf("%s: the listener did not get %q", c.name, c.msg)
		case !c.allow && r != "ERR EPERM":
			t.Errorf("%s: want EPERM, got %q", c.name, r)
		case !c.allow && got[c.msg]:
			t.Errorf("%s: refused, yet the listener got %q", c.name, c.msg)
		}
	}
	// The shared-group datagram's answer went through as a reply (the
	// server may not otherwise write to the client's socket).
	if !regexp.MustCompile(`Rule:unix-reply Allowed:true (Audit:false )?Count:1}`).MatchString(out.String()) {
		t.Errorf("no unix-reply counted for the shared-group datagram's answer")
	}
	// Every refusal is an event.
	for _, name := range []string{"palul.alice.s", "palul.proj.d"} {
		if !strings.Contains(out.String(), name) {
			t.Errorf("no denial event naming %s", name)
		}
	}
}

// checkLSMUpgrade: in the guest, a build with another map layout replaced
// the agent (migration) with both LSM links attached before and after, on
// new programs, committed, nothing left staged.
func checkLSMUpgrade(t *testing.T, u map[string]string) {
	t.Helper()
	progs := func(k string) map[string]string {
		m := map[string]string{}
		for _, f := range strings.Fields(u[k]) {
			name, id, _ := strings.Cut(f, "=")
			m[name] = id
		}
		return m
	}
	before, after := progs("UPGRADE-BEFORE"), progs("UPGRADE-AFTER")
	for _, l := range []string{"lsm_unix_may_send", "lsm_unix_stream_connect"} {
		if before[l] == "" || after[l] == "" || before[l] == after[l] {
			t.Errorf("upgrade in the guest: LSM link %s on program %q before, %q after", l, before[l], after[l])
		}
	}
	if before["unix_enforced"] != "True" || after["unix_enforced"] != "True" {
		t.Errorf("upgrade in the guest: unix_enforced %q before, %q after", before["unix_enforced"], after["unix_enforced"])
	}
	if u["UPGRADE-COMMITTED"] != "1" || u["UPGRADE-STAGED"] != "0" {
		t.Errorf("upgrade in the guest: committed %q, staged dirs left %q", u["UPGRADE-COMMITTED"], u["UPGRADE-STAGED"])
	}
}

// TestLSMGuest is the guest side of TestLSMVM (it runs only there, with
// $PALISADE_LSM_GUEST set to the test's directory, as root in the scratch
// namespace palulA): load the LSM programs for this namespace, apply the
// policy with the agent's code, run the cases, print the denial events.
func TestLSMGuest(t *testing.T) {
	dir := os.Getenv("PALISADE_LSM_GUEST")
	if dir == "" {
		t.Skip("guest side of TestLSMVM")
	}
	cookie, err := kernel.NetnsCookie()
	if err != nil {
		t.Fatal(err)
	}
	pol := &policy.Policy{SystemPortMax: 1023, ExemptConnectors: []uint32{0, 2004}, ExemptListeners: []uint32{0, 2004}}
	d, err := kernel.LoadUnixOnly(cookie, pol)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	fmt.Printf("LSM-ATTACHED netns cookie %d\n", cookie)
	events := filepath.Join(t.TempDir(), "events.jsonl")
	sink, err := newEventSink(events, false, 1000, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	rd, err := ringbuf.NewReader(d.Map("events"))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { sink.run(rd); close(done) }()
	for _, argv := range [][]string{
		{"python3", filepath.Join(dir, "lsm_guest.py"), "enforced"},
		{"nsenter", "--net=/run/netns/palulB", "--", "python3", filepath.Join(dir, "lsm_guest.py"), "other"},
	} {
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stdout
		if err := cmd.Run(); err != nil {
			t.Errorf("%v: %v", argv, err)
		}
	}
	// Every refusal is in the ring buffer now: close the reader once the
	// sink has read all of it (a fixed 200 ms pause lost the datagram
	// refusals' events in a loaded CI guest).
	for end := time.Now().Add(30 * time.Second); rd.AvailableBytes() > 0 && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond)
	}
	rd.Close()
	<-done
	sink.close()
	b, _ := os.ReadFile(events)
	fmt.Printf("EVENTS-BEGIN\n%sEVENTS-END\n", b)
	if c, err := d.ReadCounters(); err == nil {
		for _, x := range c {
			fmt.Printf("COUNTER %+v\n", x)
		}
	}
}
