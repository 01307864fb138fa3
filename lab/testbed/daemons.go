package testbed

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// enter is the `ip` argv that runs what follows on node n: in its network
// namespace with its /etc overlay (ip netns exec) and in its UTS namespace.
func (n Node) enter() []string {
	return append([]string{"netns", "exec", n.NetNS, "nsenter", "--uts=" + n.UTS, "--"}, nodeView(n.Etc, n.SSS)...)
}

// onNode runs a command as root on node n and returns its output.
func (tb *Testbed) onNode(ctx context.Context, n Node, argv ...string) (string, error) {
	return run(ctx, "", "ip", append(n.enter(), argv...)...)
}

// makeUTS creates the persistent UTS namespace of every node: unshare on a
// locked thread, set the hostname, bind the namespace onto its file.
func (tb *Testbed) makeUTS() error {
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		if err := newUTS(n.UTS, n.Name); err != nil {
			return fmt.Errorf("uts namespace for %s: %w", n.Name, err)
		}
	}
	return nil
}

func newUTS(file, hostname string) error {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/uts", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(orig)
	if err := unix.Unshare(unix.CLONE_NEWUTS); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	ferr := func() error {
		if err := unix.Sethostname([]byte(hostname)); err != nil {
			return err
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/uts", unix.Gettid())
		return unix.Mount(src, file, "", unix.MS_BIND, "")
	}()
	if err := unix.Setns(orig, unix.CLONE_NEWUTS); err != nil {
		return err // thread stays locked and dies with its goroutine
	}
	runtime.UnlockOSThread()
	return ferr
}

// startDaemons starts munged, slurmctld, slurmd and sshd on every node.
func (tb *Testbed) startDaemons(ctx context.Context) error {
	m := filepath.Join(tb.Dir, "munge")
	if _, err := run(ctx, "", "setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "--",
		"/usr/sbin/munged", "--key-file="+m+"/etc/munge.key", "--socket="+tb.MungeSocket(),
		"--log-file="+m+"/log/munged.log", "--pid-file="+m+"/run/munged.pid", "--seed-file="+m+"/lib/munged.seed",
		"--num-threads=4"); err != nil {
		return err
	}
	if _, err := tb.onNode(ctx, tb.Nodes[0], "/usr/sbin/slurmctld", "-i"); err != nil {
		return err
	}
	// A slurmd that cannot register at once retries only ~10 s later.
	if err := waitPort(ctx, tb.Nodes[0].NetNS, net.JoinHostPort(tb.Nodes[0].Eth0V4.String(), "6817"), 30*time.Second); err != nil {
		return fmt.Errorf("slurmctld not listening (log %s): %w", filepath.Join(tb.LogDir(), "slurmctld.log"), err)
	}
	var jobs []func() error
	for _, n := range tb.Nodes {
		jobs = append(jobs, func() error {
			if _, err := tb.onNode(ctx, n, "/usr/sbin/slurmd"); err != nil {
				return err
			}
			_, err := tb.onNode(ctx, n, "/usr/sbin/sshd", "-E", filepath.Join(tb.LogDir(), "sshd-"+n.Name+".log"))
			return err
		})
	}
	return parallel(jobs...)
}

// waitPort waits until a TCP connect to addr from inside netns ns succeeds.
func waitPort(ctx context.Context, ns, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var c net.Conn
		err := inNetns(ns, func() error {
			// socket(2) runs on this (switched) thread, so the socket
			// lives in ns.
			var err error
			c, err = net.DialTimeout("tcp", addr, 200*time.Millisecond)
			return err
		})
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// waitIdle polls sinfo until every node is idle.
func (tb *Testbed) waitIdle(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		out, err := tb.onNode(ctx, tb.Nodes[0], "sinfo", "-h", "-N", "-o", "%N %t")
		if err == nil {
			idle := 0
			for _, l := range strings.Split(out, "\n") {
				if f := strings.Fields(l); len(f) == 2 && f[1] == "idle" {
					idle++
				}
			}
			if idle == len(tb.Nodes) {
				return nil
			}
		}
		last = out
		if time.Now().After(deadline) {
			return fmt.Errorf("nodes not idle after %s: %s (logs in %s)", timeout, last, tb.LogDir())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// processes returns the PIDs that belong to the instance: those in its pid
// files and every process living in one of its network or UTS namespaces.
func (tb *Testbed) processes() []int {
	pids := map[int]bool{}
	nsIno := map[string]bool{}
	for _, ns := range tb.netnsNames() {
		var st unix.Stat_t
		if unix.Stat("/run/netns/"+ns, &st) == nil {
			nsIno[fmt.Sprintf("net:[%d]", st.Ino)] = true
		}
	}
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		var st, parent unix.Stat_t
		// Only if the file is still a namespace mount, not the empty file.
		if unix.Stat(n.UTS, &st) == nil && unix.Stat(filepath.Dir(n.UTS), &parent) == nil && st.Dev != parent.Dev {
			nsIno[fmt.Sprintf("uts:[%d]", st.Ino)] = true
		}
	}
	// Pid files (munged lives in the host namespace), trusted only if the
	// process still is ours: a stale file may name a reused PID.
	files, _ := filepath.Glob(filepath.Join(tb.RunDir(), "*.pid"))
	files = append(files, filepath.Join(tb.Dir, "munge", "run", "munged.pid"))
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
				cl := strings.Join(procfs.Cmdline(pid), " ")
				l, _ := procfs.Namespace(pid, "net")
				if strings.Contains(cl, tb.Dir+"/") || nsIno[l] {
					pids[pid] = true
				}
			}
		}
	}
	if len(nsIno) > 0 {
		for _, pid := range procfs.PIDs() {
			if pid <= 1 {
				continue
			}
			for _, t := range []string{"net", "uts"} {
				if l, err := procfs.Namespace(pid, t); err == nil && nsIno[l] {
					pids[pid] = true
				}
			}
		}
	}
	// Never ourselves or our ancestors (down run from inside a node).
	for p := os.Getpid(); p > 1; {
		delete(pids, p)
		st, _ := procfs.Read(p)
		p = st.PPID
	}
	out := make([]int, 0, len(pids))
	for p := range pids {
		if procfs.Alive(p) { // zombies are dead (pitfall 8)
			out = append(out, p)
		}
	}
	return out
}

// killAll sends TERM to every process of the instance (again each round:
// dying daemons may leave children), KILLs what is left after 5 s, and
// waits up to 2 s more for them to go.
func (tb *Testbed) killAll() {
	start := time.Now()
	for round := 0; ; round++ {
		pids := tb.processes()
		if len(pids) == 0 {
			return
		}
		elapsed := time.Since(start)
		if elapsed > 7*time.Second {
			fmt.Fprintf(os.Stderr, "testbed %s: processes still alive after KILL: %v\n", tb.Name, pids)
			return
		}
		sig := syscall.SIGTERM
		if elapsed > 5*time.Second {
			sig = syscall.SIGKILL
		}
		for _, p := range pids {
			if debug {
				fmt.Fprintf(os.Stderr, "testbed %s: round %d sig %d pid %d %q\n", tb.Name, round, sig, p, procfs.Cmdline(p))
			}
			syscall.Kill(p, sig)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// debug ($PALISADE_TESTBED_DEBUG) traces teardown.
var debug = os.Getenv("PALISADE_TESTBED_DEBUG") != ""

func (tb *Testbed) unmountUTS() {
	for _, n := range append(append([]Node{}, tb.Nodes...), tb.Outside) {
		for unix.Unmount(n.UTS, unix.MNT_DETACH) == nil {
		}
	}
}
