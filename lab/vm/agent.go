package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// guestRun is where the agent keeps its own copies (tmpfs).
const guestRun = "/run/palisade-vm"

// AgentArgs are the pal.* words of the kernel command line.
type AgentArgs struct {
	Name  string
	Nodes int
	Mode  string
	Spank string // plugin built on the host
	// Kernel is the guest kernel series (host side only; "" = DefaultKernel).
	Kernel string
	// KernelArgs are extra kernel command-line words (host side only), e.g.
	// an lsm= list.
	KernelArgs []string
}

// ParseAgentArgs reads pal.name=, pal.nodes=, pal.mode=, pal.spank= words.
func ParseAgentArgs(words []string) AgentArgs {
	a := AgentArgs{Name: "pal", Nodes: 3, Mode: "none"}
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok {
			continue
		}
		switch k {
		case "pal.name":
			a.Name = v
		case "pal.nodes":
			a.Nodes, _ = strconv.Atoi(v)
		case "pal.mode":
			a.Mode = v
		case "pal.spank":
			a.Spank = v
		}
	}
	return a
}

// RunAgent is `palisade-lab vm agent` inside the guest: bring the testbed up,
// announce Ready, then run the host's requests until a shutdown request.
func RunAgent(port string, args AgentArgs) error {
	f, err := os.OpenFile(port, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("control port %q: %w", port, err)
	}
	fw := &frameWriter{w: f}
	logf := func(format string, a ...any) {
		msg := fmt.Sprintf(format, a...)
		fmt.Fprintln(os.Stderr, "palvm-agent:", msg)
		fw.write(fLog, 0, []byte(msg))
	}
	start := time.Now()
	ctx := context.Background()
	tb, err := agentUp(ctx, args, logf)
	rd := Ready{Boot: fmt.Sprintf("%.1f", time.Since(start).Seconds())}
	if err != nil {
		rd.Error = err.Error()
	}
	b, _ := json.Marshal(rd)
	fw.write(fReady, 0, b)
	a := &agent{fw: fw, tb: tb, procs: map[uint32]*exec.Cmd{}, stdin: map[uint32]io.WriteCloser{}, logf: logf}
	return a.serve(f)
}

// agentUp copies what it needs out of the testbed's directory (the host's
// copy is visible through the overlay), hides that directory in the guest
// and brings the testbed up natively inside the guest.
func agentUp(ctx context.Context, args AgentArgs, logf func(string, ...any)) (*testbed.Testbed, error) {
	// Everything in the guest runs under emulation; code that waits for
	// processes (agents starting, listeners, launchers) reads this.
	os.Setenv("PALISADE_VM", "1")
	if err := os.MkdirAll(guestRun, 0o755); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	// This agent is the lab binary; the product binary sits next to it
	// (testbed bin/), visible through the guest's view of the host root.
	lab := filepath.Join(guestRun, testbed.LabName)
	if err := copyFile(self, lab, 0o755); err != nil {
		return nil, err
	}
	bin := filepath.Join(guestRun, testbed.ProductName)
	if err := copyFile(filepath.Join(filepath.Dir(self), testbed.ProductName), bin, 0o755); err != nil {
		return nil, fmt.Errorf("product binary: %w", err)
	}
	if args.Spank != "" {
		dst := filepath.Join(guestRun, filepath.Base(args.Spank))
		if err := copyFile(args.Spank, dst, 0o644); err != nil {
			return nil, fmt.Errorf("SPANK plugin: %w", err)
		}
		os.Setenv("PALISADE_UVN_SPANK", dst)
	}
	// The host's instance directory (state "starting", VM) must not be
	// mistaken for a guest instance: remove it from the guest's view only.
	if err := os.RemoveAll(testbed.InstanceDir(args.Name)); err != nil {
		return nil, err
	}
	if args.Nodes == 0 {
		// A bare guest: no testbed; the host runs what it needs with op "sh".
		logf("bare guest (pal.nodes=0): no testbed")
		return nil, nil
	}
	if err := detachFromHostTestbeds(); err != nil {
		return nil, err
	}
	logf("testbed up: name %s, %d nodes, mode %s", args.Name, args.Nodes, args.Mode)
	tb, err := testbed.Up(ctx, testbed.Options{Name: args.Name, Nodes: args.Nodes, Mode: args.Mode, Binary: bin, LabBinary: lab})
	if err != nil {
		return nil, err
	}
	return tb, nil
}

// detachFromHostTestbeds gives the guest testbed state of its own. The
// guest's /etc is already its own (a snapshot taken at boot, etc.go); the
// testbeds' base directory, which the guest sees through the read-only 9p
// lower layer, is the host testbeds' live state (they create and delete
// homes and ssh keys there: a guest that reused a host home lost its
// authorized_keys when the host instance went down), so it is replaced by
// an empty tmpfs where the guest testbed makes its own.
func detachFromHostTestbeds() error {
	if err := os.MkdirAll(testbed.BaseDir, 0o755); err != nil {
		return err
	}
	if err := syscall.Mount("paltb", testbed.BaseDir, "tmpfs", 0, "mode=755"); err != nil {
		return fmt.Errorf("tmpfs on %s: %w", testbed.BaseDir, err)
	}
	return nil
}

type agent struct {
	fw    *frameWriter
	tb    *testbed.Testbed
	mu    sync.Mutex
	procs map[uint32]*exec.Cmd
	stdin map[uint32]io.WriteCloser
	logf  func(string, ...any)
}

type streamWriter struct {
	fw  *frameWriter
	typ byte
	id  uint32
}

func (s streamWriter) Write(p []byte) (int, error) {
	if err := s.fw.write(s.typ, s.id, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (a *agent) serve(r io.Reader) error {
	for {
		f, err := readFrame(r)
		if err != nil {
			return err
		}
		switch f.typ {
		case fOpen:
			var req Request
			if err := json.Unmarshal(f.payload, &req); err != nil {
				a.fail(f.id, err)
				continue
			}
			if req.Op == "shutdown" {
				a.shutdown(f.id)
				return nil
			}
			a.start(f.id, req)
		case fStdin, fStdinEOF:
			a.mu.Lock()
			w := a.stdin[f.id]
			a.mu.Unlock()
			if w == nil {
				continue
			}
			if f.typ == fStdinEOF {
				w.Close()
			} else {
				w.Write(f.payload)
			}
		case fKill:
			a.mu.Lock()
			c := a.procs[f.id]
			a.mu.Unlock()
			if c != nil && c.Process != nil {
				sig := syscall.SIGKILL
				if len(f.payload) == 1 {
					sig = syscall.Signal(f.payload[0])
				}
				c.Process.Signal(sig)
			}
		}
	}
}

func (a *agent) fail(id uint32, err error) {
	a.fw.write(fStderr, id, []byte("palisade-lab vm agent: "+err.Error()+"\n"))
	a.fw.write(fExit, id, exitPayload(-1))
}

func (a *agent) start(id uint32, req Request) {
	var cmd *exec.Cmd
	ctx := context.Background()
	switch req.Op {
	case "exec":
		if a.tb == nil {
			a.fail(id, errors.New("the guest testbed is not up"))
			return
		}
		cmd = a.tb.Command(ctx, req.Node, req.User, req.Argv...)
	case "sh":
		if len(req.Argv) == 0 {
			a.fail(id, errors.New("sh: no command"))
			return
		}
		cmd = exec.CommandContext(ctx, req.Argv[0], req.Argv[1:]...)
		cmd.Env = append(os.Environ(), "PALISADE_TESTBED="+a.tbName(), "PALISADE_VM=1")
	case "ping":
		cmd = exec.CommandContext(ctx, "true")
	default:
		a.fail(id, fmt.Errorf("unknown op %q", req.Op))
		return
	}
	cmd.Env = append(cmd.Env, req.Env...)
	cmd.Stdout = streamWriter{a.fw, fStdout, id}
	cmd.Stderr = streamWriter{a.fw, fStderr, id}
	cmd.WaitDelay = 5 * time.Second
	in, err := cmd.StdinPipe()
	if err != nil {
		a.fail(id, err)
		return
	}
	if err := cmd.Start(); err != nil {
		a.fail(id, err)
		return
	}
	a.mu.Lock()
	a.procs[id] = cmd
	a.stdin[id] = in
	a.mu.Unlock()
	go func() {
		err := cmd.Wait()
		code := 0
		if err != nil {
			code = -1
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					code = 128 + int(ws.Signal())
				}
			}
		}
		a.mu.Lock()
		delete(a.procs, id)
		delete(a.stdin, id)
		a.mu.Unlock()
		a.fw.write(fExit, id, exitPayload(int32(code)))
	}()
}

func (a *agent) tbName() string {
	if a.tb == nil {
		return ""
	}
	return a.tb.Name
}

// shutdown takes the guest testbed down (so its own teardown is exercised)
// and reports the result; the guest then powers off.
func (a *agent) shutdown(id uint32) {
	code := int32(0)
	if a.tb != nil {
		if err := testbed.Down(context.Background(), a.tb.Name); err != nil {
			a.fw.write(fStderr, id, []byte("guest testbed down: "+err.Error()+"\n"))
			code = 1
		}
	}
	a.fw.write(fExit, id, exitPayload(code))
}
