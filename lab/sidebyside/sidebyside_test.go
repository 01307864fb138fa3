// Package sidebyside proves that testbeds share a machine: two host
// testbeds and a VM testbed come up at the same time and each works while
// users are added and removed on the host (issue 26, item 6).
package sidebyside

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
	"github.com/palisade-hpc/palisade/lab/vm"
)

func TestMain(m *testing.M) {
	// As cmd/palisade-lab wires them.
	testbed.RegisterMode(userwalllab.ModeName, userwalllab.TestbedMode{})
	testbed.RegisterVM(vm.Handler{})
	os.Exit(m.Run())
}

// churn adds and removes a group and a user on the host, one account tool
// after another (each takes the account databases' lock and rewrites
// passwd, group, shadow and gshadow), until stop. Its accounts are named
// pal<pid>..., and removed at the end whatever happened.
type churn struct {
	prefix string
	stop   chan struct{}
	done   chan struct{}
	mu     sync.Mutex
	ops    int
	errs   []string
}

// The churn's accounts take ids the account tools choose, from a range of
// their own: left to login.defs (1000-60000) groupadd and useradd take the
// next id above the highest in use, which is a testbed's bob (2002) whenever
// only alice exists, and a testbed that comes up next refuses (ci4: "UID
// 2002 is not unique", and every lab/testbed test running beside it
// failed). The testbed's fixed ids are its own, as a site's ids are.
var (
	churnUIDs = [2]string{"UID_MIN=47000", "UID_MAX=47999"}
	churnGIDs = [2]string{"GID_MIN=47000", "GID_MAX=47999"}
)

func startChurn(t *testing.T) *churn {
	c := &churn{prefix: "palch" + strconv.FormatInt(int64(os.Getpid()), 36), stop: make(chan struct{}), done: make(chan struct{})}
	steps := func(i int) [][]string {
		g, u := fmt.Sprintf("%sg%d", c.prefix, i%3), fmt.Sprintf("%su%d", c.prefix, i%3)
		return [][]string{{"groupadd", "-K", churnGIDs[0], "-K", churnGIDs[1], g},
			{"useradd", "-K", churnUIDs[0], "-K", churnUIDs[1], "-M", "-N", "-g", g, "-s", "/usr/sbin/nologin", u},
			{"gpasswd", "-a", u, g}, {"userdel", u}, {"groupdel", g}}
	}
	go func() {
		defer close(c.done)
		// Paced, not back to back: the testbeds' own useradd must get the
		// databases' lock too (glibc's lckpwdf gives up after 15 s).
		tick := time.NewTicker(30 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			for _, argv := range steps(i) {
				select {
				case <-c.stop:
					return
				case <-tick.C:
				}
				out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
				c.mu.Lock()
				c.ops++
				if err != nil {
					c.errs = append(c.errs, fmt.Sprintf("%v: %v: %s", argv, err, out))
				}
				c.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		c.halt()
		for i := range 3 {
			exec.Command("userdel", fmt.Sprintf("%su%d", c.prefix, i)).Run()
			exec.Command("groupdel", fmt.Sprintf("%sg%d", c.prefix, i)).Run()
		}
		if b, _ := os.ReadFile("/etc/passwd"); strings.Contains(string(b), c.prefix) {
			t.Errorf("churn accounts left in /etc/passwd")
		}
		if b, _ := os.ReadFile("/etc/group"); strings.Contains(string(b), c.prefix) {
			t.Errorf("churn groups left in /etc/group")
		}
	})
	return c
}

func (c *churn) halt() {
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	<-c.done
}

func (c *churn) count() (int, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ops, append([]string(nil), c.errs...)
}

// TestSideBySide: a host testbed without a data plane, one with userwall
// and a VM testbed come up at once while the host's accounts churn; every
// one runs its users' commands, ssh and Slurm across nodes; the guest's
// accounts are its own (a user added on the host later does not appear
// in it); the churn itself never failed.
func TestSideBySide(t *testing.T) {
	if testing.Short() {
		t.Skip("brings up three testbeds, one in a VM")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
	// The VM may be another suite's for most of make test (the go test
	// timeout is 45 minutes): the guest waits its turn within this bound.
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	testbed.DownOrphans(ctx)
	if _, err := vm.PrepareKernel(ctx, ""); err != nil {
		t.Fatalf("guest kernel: %v", err)
	}
	bin := t.TempDir()
	for name, pkg := range map[string]string{testbed.ProductName: "cmd/palisade", testbed.LabName: "cmd/palisade-lab"} {
		cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(bin, name), "github.com/palisade-hpc/palisade/"+pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, out)
		}
	}
	opts := []testbed.Options{
		{Name: testbed.RunName("sa"), Nodes: 2, Mode: "none"},
		{Name: testbed.RunName("sb"), Nodes: 2, Mode: userwalllab.ModeName},
		{Name: testbed.RunName("sv"), Nodes: 2, Mode: "none", VM: true},
	}
	for _, o := range opts {
		t.Cleanup(func() {
			if err := testbed.Down(context.Background(), o.Name); err != nil {
				t.Errorf("testbed %s down: %v", o.Name, err)
			}
		})
	}
	tbs := make([]*testbed.Testbed, len(opts))
	var started atomic.Pointer[churn] // the churn, once it runs
	up := func(i int) error {
		o := opts[i]
		o.Binary, o.LabBinary = filepath.Join(bin, testbed.ProductName), filepath.Join(bin, testbed.LabName)
		t0 := time.Now()
		tb, err := testbed.Up(ctx, o)
		if err != nil {
			return fmt.Errorf("testbed %s (vm %v) up: %w", o.Name, o.VM, err)
		}
		ops := 0
		if c := started.Load(); c != nil {
			ops, _ = c.count()
		}
		t.Logf("testbed %s (mode %s, vm %v) up in %v; %d account changes on the host so far", o.Name, o.Mode, o.VM, time.Since(t0).Round(time.Second), ops)
		tbs[i] = tb
		return nil
	}
	// The VM testbed first: its guest waits for the machine's one VM
	// (other packages' VM suites hold it for minutes in make test). The
	// host testbeds and the churn start once it has the VM, so that all
	// three come up at the same time (ci: the host testbeds and the churn
	// had run 11 minutes, 22,451 account changes, before the guest came up,
	// loading the machine under the VM suites for nothing).
	vmUp := make(chan error, 1)
	t0 := time.Now()
	go func() { vmUp <- up(2) }()
	vmDir := filepath.Join(testbed.InstanceDir(opts[2].Name), "vm")
	for !vm.Running(vmDir) {
		select {
		case err := <-vmUp: // failed before its guest started (or up already)
			vmUp <- err
		case <-ctx.Done():
			t.Fatalf("the VM testbed's guest did not start: %v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
			continue
		}
		break
	}
	t.Logf("VM testbed %s has the machine's VM after %v", opts[2].Name, time.Since(t0).Round(time.Second))
	ch := startChurn(t)
	started.Store(ch)
	err := errors.Join(testbed.Parallel([]int{0, 1}, up), <-vmUp)
	if err != nil {
		t.Fatal(err)
	}

	// Each testbed works while the churn goes on.
	err = testbed.Parallel(tbs, func(tb *testbed.Testbed) error {
		var errs []string
		want := func(node, user, expect string, argv ...string) {
			out, err := tb.Output(ctx, node, user, argv...)
			if err != nil || out != expect {
				errs = append(errs, fmt.Sprintf("%s: %v as %s on %s: got %q, want %q (%v)", tb.Name, argv, user, node, out, expect, err))
			}
		}
		want("node1", "alice", "alice\n", "id", "-un")
		want("node2", "bob", "bob proj1\n", "id", "-Gn")
		want("node1", "carol", "node2\ncarol\n", "ssh", "node2", "hostname; id -un")
		want("node2", "alice", "node1\nnode2\n", "sh", "-c", "srun -N2 hostname | sort")
		if len(errs) > 0 {
			return fmt.Errorf("%s", strings.Join(errs, "\n"))
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}

	// The guest's accounts are its own: one added on the host now is not in
	// the guest (control: the host sees it).
	late := ch.prefix + "late"
	if out, err := exec.Command("useradd", "-K", churnUIDs[0], "-K", churnUIDs[1], "-M", "-N", "-s", "/usr/sbin/nologin", late).CombinedOutput(); err != nil {
		t.Fatalf("useradd %s: %v %s", late, err, out)
	}
	defer exec.Command("userdel", late).Run()
	if out, err := exec.Command("getent", "passwd", late).Output(); err != nil || !strings.HasPrefix(string(out), late+":") {
		t.Errorf("host: getent passwd %s: %q %v", late, out, err)
	}
	guest := tbs[2]
	if out, err := guest.Output(ctx, "node1", "", "sh", "-c", "getent passwd "+late+"; echo rc=$?"); !strings.HasSuffix(out, "rc=2\n") || err != nil {
		t.Errorf("guest: getent passwd %s: %q %v (want rc=2: the host's later accounts are not the guest's)", late, out, err)
	}
	if out, err := guest.Output(ctx, "node1", "", "getent", "passwd", "alice"); err != nil || !strings.HasPrefix(out, "alice:x:2001:") {
		t.Errorf("guest: getent passwd alice: %q %v", out, err)
	}
	// Nor does any file the host's /etc gains after the boot (as a lock
	// file of the host's account tools would): the guest's /etc is not a
	// view of the host's.
	probe := "/etc/" + ch.prefix + ".probe"
	if err := os.WriteFile(probe, []byte("host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(probe)
	if out, err := guest.Output(ctx, "node1", "", "sh", "-c", "test -e "+probe+"; echo rc=$?"); out != "rc=1\n" || err != nil {
		t.Errorf("guest: test -e %s: %q %v (want rc=1: the host's /etc is not the guest's)", probe, out, err)
	}
	if out, err := guest.Output(ctx, "node1", "", "sh", "-c", "test -e /etc/passwd; echo rc=$?"); out != "rc=0\n" || err != nil {
		t.Errorf("guest: test -e /etc/passwd: %q %v (control)", out, err)
	}

	ch.halt()
	ops, errs := ch.count()
	t.Logf("%d account changes on the host during the run", ops)
	if len(errs) > 0 {
		t.Errorf("host account changes failed (%d of %d):\n%s", len(errs), ops, strings.Join(errs, "\n"))
	}
	if ops < 50 {
		t.Errorf("only %d account changes on the host: the testbeds did not come up under churn", ops)
	}
}
