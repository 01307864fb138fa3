package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// account is what Command needs to know of a user.
type account struct {
	name      string
	uid, gid  uint32
	home      string
	shell     string
	homeReady bool
}

func lookupAccount(name string) (*account, error) {
	if name == "" {
		name = "root"
	}
	u, err := user.Lookup(name)
	if err != nil {
		if _, nerr := strconv.Atoi(name); nerr == nil {
			u, err = user.LookupId(name)
		}
		if err != nil {
			return nil, fmt.Errorf("unknown user %q", name)
		}
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	a := &account{name: u.Username, uid: uint32(uid), gid: uint32(gid), home: u.HomeDir, shell: "/bin/bash"}
	if sh := loginShell(u.Username); sh != "" {
		a.shell = sh
	}
	if st, err := os.Stat(a.home); err == nil && st.IsDir() {
		a.homeReady = true
	}
	return a, nil
}

// loginShell reads the shell field, which os/user does not expose.
func loginShell(name string) string {
	b, err := os.ReadFile("/etc/passwd")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Split(l, ":")
		if len(f) == 7 && f[0] == name {
			return f[6]
		}
	}
	return ""
}

func (tb *Testbed) account(name string) (*account, error) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if a, ok := tb.users[name]; ok {
		return a, nil
	}
	a, err := lookupAccount(name)
	if err != nil {
		return nil, err
	}
	if tb.users == nil {
		tb.users = map[string]*account{}
	}
	tb.users[name] = a
	return a, nil
}

var (
	ipPathOnce sync.Once
	ipPath     = "ip"
)

// LoginWrapper is optionally implemented by a Mode whose users must be set
// up at login, as PAM would do on a real node (e.g. moved into their VRF).
// For every non-root Command on a compute node, the returned argv runs as
// root right before the privilege drop and must exec the rest of its
// arguments.
type LoginWrapper interface {
	LoginPrefix(tb *Testbed, node, user string) []string
}

// SlurmConfer is optionally implemented by a Mode that needs settings in
// slurm.conf (written before the daemons start): one "Key=Value" per line.
type SlurmConfer interface {
	SlurmConf(tb *Testbed) []string
}

// PAMSessioner is optionally implemented by a Mode that must see ssh
// logins, as pam_exec would on a real node (uvn: into the user's VRF). Its
// lines (e.g. "session required pam_exec.so /path/to/helper") end sshd's
// PAM stack on node; sshd then runs with UsePAM yes and the node gets its
// own /etc/pam.d. Called while the configuration is written, before the
// mode's Up.
type PAMSessioner interface {
	PAMSession(tb *Testbed, node string) []string
}

// Command prepares argv as user ("" = root) on node ("node1".., "outside"):
// in the node's network namespace with its /etc overlay (ip netns exec) and
// UTS namespace (nsenter), with the user's uid, gid and full group list
// (setpriv --init-groups) and a login-like environment (HOME, USER, LOGNAME,
// SHELL, PATH with the testbed's bin first), starting in the home directory.
// No argv: the user's login shell. Each step execs the next, so the
// returned Cmd's process is argv itself (signals and exit status pass
// straight through). Errors (unknown node or user) surface from Start/Run.
func (tb *Testbed) Command(ctx context.Context, node, user string, argv ...string) *exec.Cmd {
	if tb.VM {
		if h := getVM(); h != nil {
			return h.Command(ctx, tb, node, user, argv...)
		}
	}
	ipPathOnce.Do(func() {
		if p, err := exec.LookPath("ip"); err == nil {
			ipPath = p
		}
	})
	cmd := exec.CommandContext(ctx, ipPath)
	n, ok := tb.Node(node)
	if !ok {
		cmd.Err = fmt.Errorf("testbed %s has no node %q", tb.Name, node)
		return cmd
	}
	a, err := tb.account(user)
	if err != nil {
		cmd.Err = err
		return cmd
	}
	if len(argv) == 0 {
		argv = []string{a.shell, "-l"}
	}
	args := append([]string{ipPath}, n.enter()...)
	if a.uid != 0 && node != "outside" {
		if m, ok := lookupMode(tb.Mode); ok {
			if w, ok := m.(LoginWrapper); ok {
				args = append(args, w.LoginPrefix(tb, node, a.name)...)
			}
		}
	}
	if a.uid != 0 {
		args = append(args, "setpriv", "--reuid="+strconv.Itoa(int(a.uid)), "--regid="+strconv.Itoa(int(a.gid)), "--init-groups", "--")
	}
	cmd.Args = append(args, argv...)
	cmd.Env = []string{
		"HOME=" + a.home, "USER=" + a.name, "LOGNAME=" + a.name, "SHELL=" + a.shell,
		"PATH=" + tb.pathEnv(), "LANG=C.UTF-8", "PALISADE_TESTBED=" + tb.Name,
	}
	if t := os.Getenv("TERM"); t != "" {
		cmd.Env = append(cmd.Env, "TERM="+t)
	}
	if a.homeReady {
		cmd.Dir = a.home
	}
	// Own process group, killed as a whole when ctx ends: a listener and
	// whatever it spawned go away with the caller's context. (Pdeathsig
	// would not survive setpriv's uid change.) Interactive callers that
	// need the terminal's foreground group reset SysProcAttr and Cancel.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	return cmd
}

// Output runs argv as user on node and returns its combined output.
func (tb *Testbed) Output(ctx context.Context, node, user string, argv ...string) (string, error) {
	out, err := tb.Command(ctx, node, user, argv...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s as %q on %s: %w: %s", argv, user, node, err, out)
	}
	return string(out), nil
}

// Parallel runs f for every item concurrently (one per node, typically)
// and returns every failure.
func Parallel[T any](items []T, f func(T) error) error {
	errs := make([]error, len(items))
	var wg sync.WaitGroup
	for i, it := range items {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(it)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
