package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// requiredCommands must exist on the host before anything is created.
var requiredCommands = []string{"ip", "nsenter", "setpriv", "ssh-keygen", "useradd", "groupadd", "gpasswd",
	"userdel", "groupdel", "/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/sshd", "sinfo", "srun"}

// validate checks the options before anything is created.
func validate(opts *Options) error {
	opts.Name = ResolveName(opts.Name)
	if err := validateName(opts.Name); err != nil {
		return err
	}
	if opts.Nodes == 0 {
		opts.Nodes = DefaultNodes
	}
	if opts.Nodes < 1 || opts.Nodes > MaxNodes {
		return fmt.Errorf("invalid node count %d: want 1..%d", opts.Nodes, MaxNodes)
	}
	if opts.Mode == "" {
		opts.Mode = "none"
	}
	if _, ok := lookupMode(opts.Mode); !ok {
		return fmt.Errorf("unknown mode %q (known: %s)", opts.Mode, strings.Join(Modes(), ", "))
	}
	if opts.Egress {
		if _, ok := lookupExtension("egress"); !ok {
			return errors.New("--egress: no egress extension is registered in this binary")
		}
	}
	if (opts.Audit || len(opts.Agents) > 0) && opts.Mode == "none" {
		return errors.New("--audit and --agents need a data-plane mode (--mode userwall)")
	}
	for _, a := range opts.Agents {
		if n, err := strconv.Atoi(strings.TrimPrefix(a, "node")); err != nil || !strings.HasPrefix(a, "node") || n < 1 || n > opts.Nodes {
			return fmt.Errorf("--agents: %q is not a node of this testbed (node1..node%d)", a, opts.Nodes)
		}
	}
	if opts.Kernel != "" && !opts.VM {
		return errors.New("--kernel needs --vm (the host runs its own kernel)")
	}
	if err := validateDirectory(opts); err != nil {
		return err
	}
	if opts.VM && getVM() == nil {
		return errors.New("--vm: no VM handler is registered in this binary")
	}
	if os.Geteuid() != 0 {
		return errors.New("the testbed needs root")
	}
	for _, c := range requiredCommands {
		if _, err := exec.LookPath(c); err != nil {
			return fmt.Errorf("%s not found: install the packages listed in .ci/deps", c)
		}
	}
	return nil
}

// lockInstance serializes up/down of one instance name. Unlocking removes
// the lock file when the instance has no state left (after down or a failed
// up), so per-run instance names leave nothing behind. The file is unlinked
// only while locked, and a locker that wins the lock on a file that was
// unlinked (or replaced) meanwhile starts over on the current one; so two
// holders never exist at once.
func lockInstance(name string) (func(), error) {
	if err := os.MkdirAll(BaseDir, 0o755); err != nil {
		return nil, err
	}
	path := lockPath(name)
	for {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return nil, err
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, err
		}
		var held, cur unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &held); err != nil {
			f.Close()
			return nil, err
		}
		if unix.Stat(path, &cur) != nil || cur.Dev != held.Dev || cur.Ino != held.Ino {
			f.Close() // stale: its holder removed it; closing drops the lock
			continue
		}
		return func() {
			if _, err := os.Stat(statePath(name)); errors.Is(err, os.ErrNotExist) {
				os.Remove(path)
			}
			unix.Flock(int(f.Fd()), unix.LOCK_UN)
			f.Close()
		}, nil
	}
}

func lockPath(name string) string { return filepath.Join(BaseDir, "."+name+".lock") }

// Up brings an instance up (or returns the running one, with AlreadyUp set,
// if its node count and mode match). A failure rolls everything back.
func Up(ctx context.Context, opts Options) (*Testbed, error) {
	// What the caller asked for explicitly must match a running instance;
	// the rest (zero values) is "whatever it runs with".
	explicitMode, explicitNodes := opts.Mode != "", opts.Nodes != 0
	if err := validate(&opts); err != nil {
		return nil, err
	}
	unlock, err := lockInstance(opts.Name)
	if err != nil {
		return nil, err
	}
	defer unlock()

	if s, err := readState(opts.Name); err == nil {
		old := build(s)
		if s.Phase == "up" && old.alive() {
			if (explicitNodes && opts.Nodes != s.Nodes) || (explicitMode && opts.Mode != old.Mode) || (opts.VM && !s.VM) || (opts.Kernel != "" && opts.Kernel != s.Kernel) ||
				(opts.Egress && !slices.Contains(s.Extensions, "egress")) ||
				(opts.Directory != "" && (opts.Directory != s.Directory || opts.DirectoryUsers != s.DirUsers)) ||
				(opts.Audit && !s.Audit) || (len(opts.Agents) > 0 && !slices.Equal(opts.Agents, s.Agents)) {
				return nil, fmt.Errorf("testbed %s is already up with %d nodes, mode %s: run `palisade-lab testbed down --name %s` first",
					s.Name, s.Nodes, old.Mode, s.Name)
			}
			old.AlreadyUp = true
			return old, nil
		}
		// Leftovers of an interrupted or crashed run.
		if err := teardown(ctx, old); err != nil {
			return nil, fmt.Errorf("cleaning up the previous run of %s: %w", opts.Name, err)
		}
	}
	if !opts.VM {
		if err := checkUsers(); err != nil {
			return nil, err
		}
		// Never adopt (and later delete) objects this instance did not make.
		probe := build(&state{Name: opts.Name, Nodes: opts.Nodes})
		for _, ns := range probe.netnsNames() {
			if _, err := os.Lstat("/run/netns/" + ns); err == nil {
				return nil, fmt.Errorf("network namespace %s exists but testbed %s has no state: remove it or use another --name", ns, opts.Name)
			}
			if _, err := os.Lstat("/etc/netns/" + ns); err == nil {
				return nil, fmt.Errorf("/etc/netns/%s exists but testbed %s has no state: remove it or use another --name", ns, opts.Name)
			}
		}
		for _, l := range probe.hostLinks() {
			if _, err := os.Lstat("/sys/class/net/" + l); err == nil {
				return nil, fmt.Errorf("link %s exists but testbed %s has no state: remove it or use another --name", l, opts.Name)
			}
		}
	}

	s := &state{Name: opts.Name, Nodes: opts.Nodes, Mode: opts.Mode, VM: opts.VM, Kernel: opts.Kernel, Phase: "starting",
		Directory: opts.Directory, DirUsers: opts.DirectoryUsers, Audit: opts.Audit, Agents: opts.Agents}
	s.Owner, s.OwnerStart = owner()
	if opts.Egress {
		s.Extensions = append(s.Extensions, "egress")
	}
	if err := os.MkdirAll(InstanceDir(s.Name), 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(InstanceDir(s.Name), 0o755); err != nil {
		return nil, err
	}
	if err := writeState(s); err != nil {
		os.RemoveAll(InstanceDir(s.Name))
		return nil, err
	}
	tb := build(s)
	if err := tb.bringUp(ctx, opts, s); err != nil {
		if os.Getenv("PALISADE_TESTBED_KEEP") != "" {
			return nil, fmt.Errorf("%w (PALISADE_TESTBED_KEEP set: left as is for debugging)", err)
		}
		if derr := teardown(context.WithoutCancel(ctx), tb); derr != nil {
			err = fmt.Errorf("%w (rollback: %v)", err, derr)
		}
		return nil, err
	}
	return tb, nil
}

func (tb *Testbed) bringUp(ctx context.Context, opts Options, s *state) error {
	if err := os.MkdirAll(filepath.Join(tb.Dir, "bin"), 0o755); err != nil {
		return err
	}
	if err := installBinaries(ctx, opts, tb); err != nil {
		return err
	}
	if opts.VM {
		// The guest runs a native testbed with the mode and extensions
		// (opts carries them): nothing more to do on the host.
		if err := getVM().Up(ctx, tb, opts); err != nil {
			return err
		}
		s.Phase = "up"
		return writeState(s)
	}
	if err := tb.bringUpNative(ctx, s); err != nil {
		return err
	}
	t0 := time.Now()
	m, _ := lookupMode(tb.Mode)
	if err := m.Up(ctx, tb); err != nil {
		return fmt.Errorf("mode %s: %w", tb.Mode, err)
	}
	t0 = vmPhase("mode "+tb.Mode+" up", t0)
	for _, e := range tb.Extensions {
		x, _ := lookupExtension(e)
		if err := x.Up(ctx, tb); err != nil {
			return fmt.Errorf("extension %s: %w", e, err)
		}
	}
	vmPhase("extensions up", t0)
	s.Phase = "up"
	return writeState(s)
}

// vmPhase reports how long a step of bringing the testbed up took, inside a
// VM guest only (PALISADE_VM=1: the guest's console keeps it): there every
// step is slow under emulation and where the time goes is seen nowhere else.
func vmPhase(step string, t0 time.Time) time.Time {
	if os.Getenv("PALISADE_VM") == "1" {
		fmt.Fprintf(os.Stderr, "testbed: %s in %.1f s\n", step, time.Since(t0).Seconds())
	}
	return time.Now()
}

func (tb *Testbed) bringUpNative(ctx context.Context, s *state) error {
	t0 := time.Now()
	if err := acquireShared(ctx, tb.Name); err != nil {
		return err
	}
	if err := tb.writeConfig(); err != nil {
		return err
	}
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		if err := os.Symlink(tb.NodeEtc(n.Name), filepath.Join("/etc/netns", n.NetNS)); err != nil {
			return err
		}
	}
	// Keys (ssh-keygen) run while the kernel objects are made.
	keys := make(chan error, 1)
	go func() { keys <- tb.genKeys(ctx) }()
	nerr := tb.upNetwork(ctx)
	if kerr := <-keys; kerr != nil {
		return kerr
	}
	if nerr != nil {
		return nerr
	}
	t0 = vmPhase("users, network and keys", t0)
	if err := tb.makeUTS(); err != nil {
		return err
	}
	if tb.Directory != "" {
		if err := tb.startDirectory(ctx, tb.DirectoryUsers); err != nil {
			return fmt.Errorf("directory: %w", err)
		}
	}
	if err := tb.startDaemons(ctx); err != nil {
		return err
	}
	t0 = vmPhase("daemons started", t0)
	// The MPI program compiles while the nodes register.
	mpi := make(chan error, 1)
	go func() {
		out := filepath.Join(tb.Dir, "bin", "mpi-hello")
		_, err := run(ctx, "", "mpicc", "-O2", "-o", out, filepath.Join(tb.Dir, "src", "mpi-hello.c"))
		if err == nil {
			s.MPIHello, tb.MPIHello = out, out
		}
		mpi <- err
	}()
	werr := tb.waitIdle(ctx, 45*time.Second)
	t0 = vmPhase("Slurm nodes idle", t0)
	err := <-mpi
	vmPhase("MPI program built", t0)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testbed %s: building the MPI test program failed (mpirun checks will fail): %v\n", tb.Name, err)
	}
	return werr
}

// The two binaries, as named in bin/ and in a testbed's bin directory.
const (
	ProductName = "palisade"
	LabName     = "palisade-lab"
)

// installBinaries copies the product and the lab binary into the testbed.
// A Go test binary is neither: build both from the module instead.
func installBinaries(ctx context.Context, opts Options, tb *Testbed) error {
	lab, product := opts.LabBinary, opts.Binary
	if lab == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		if strings.HasSuffix(exe, ".test") {
			if err := goBuild(ctx, tb.LabBinary, "cmd/palisade-lab"); err != nil {
				return err
			}
			if product == "" {
				return goBuild(ctx, tb.Binary, "cmd/palisade")
			}
			return installBinary(product, tb.Binary)
		}
		lab = exe
	}
	if product == "" {
		product = filepath.Join(filepath.Dir(lab), ProductName)
		if _, err := os.Stat(product); err != nil {
			return fmt.Errorf("the product binary %s is missing next to %s (make build builds both): %w", ProductName, lab, err)
		}
	}
	if err := installBinary(lab, tb.LabBinary); err != nil {
		return err
	}
	return installBinary(product, tb.Binary)
}

// goBuild builds a command of this module into dst.
func goBuild(ctx context.Context, dst, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dst, "github.com/palisade-hpc/palisade/"+pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s for the testbed: %w: %s", pkg, err, out)
	}
	return os.Chmod(dst, 0o755)
}

// installBinary copies src to dst atomically.
func installBinary(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst+".tmp", os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	if err := os.Chmod(dst+".tmp", 0o755); err != nil {
		return err
	}
	return os.Rename(dst+".tmp", dst)
}

// alive reports whether the instance's namespaces exist.
func (tb *Testbed) alive() bool {
	if tb.VM {
		return true
	}
	for _, ns := range tb.netnsNames() {
		if _, err := os.Stat("/run/netns/" + ns); err != nil {
			return false
		}
	}
	return true
}

// Exists reports whether instance name has any state on this machine.
func Exists(name string) bool {
	_, err := os.Stat(statePath(ResolveName(name)))
	return err == nil
}

// Down takes instance name down, removing everything it created. Taking
// down an instance that is not up is not an error.
func Down(ctx context.Context, name string) error {
	name = ResolveName(name)
	if err := validateName(name); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("the testbed needs root")
	}
	unlock, err := lockInstance(name)
	if err != nil {
		return err
	}
	defer unlock()
	s, err := readState(name)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return teardown(ctx, build(s))
}

// teardown removes everything of an instance, tolerating what is missing.
// Mode and extension Down hooks run first (they must tolerate a partial
// bring-up).
func teardown(ctx context.Context, tb *Testbed) error {
	var errs []error
	if tb.VM {
		// The guest's own testbed runs the mode's and extensions' Down.
		if h := getVM(); h != nil {
			if err := h.Down(ctx, tb); err != nil {
				errs = append(errs, err)
			}
		} else {
			errs = append(errs, errors.New("no VM handler registered: the VM was not stopped"))
		}
		if err := os.RemoveAll(tb.Dir); err != nil {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	for _, e := range slices.Backward(tb.Extensions) {
		if x, ok := lookupExtension(e); ok {
			if err := x.Down(ctx, tb); err != nil {
				errs = append(errs, fmt.Errorf("extension %s down: %w", e, err))
			}
		}
	}
	if m, ok := lookupMode(tb.Mode); ok {
		if err := m.Down(ctx, tb); err != nil {
			errs = append(errs, fmt.Errorf("mode %s down: %w", tb.Mode, err))
		}
	} else {
		errs = append(errs, fmt.Errorf("mode %s is not registered in this binary: its Down hook did not run", tb.Mode))
	}
	tb.killAll()
	tb.unmountUTS()
	if err := tb.downNetwork(ctx); err != nil {
		errs = append(errs, err)
	}
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		l := filepath.Join("/etc/netns", n.NetNS)
		if t, err := os.Readlink(l); err == nil && strings.HasPrefix(t, tb.Dir+"/") {
			os.Remove(l)
		}
	}
	if err := releaseShared(ctx, tb.Name); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(tb.Dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
