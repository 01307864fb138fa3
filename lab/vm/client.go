package vm

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

func dialHub(dir string) (net.Conn, error) {
	c, err := net.Dial("unix", filepath.Join(dir, fileHub))
	if err != nil {
		return nil, fmt.Errorf("%w (%s): %v", ErrNoVM, dir, err)
	}
	return c, nil
}

// Running reports whether a VM's hub answers in dir: it does once it holds
// the machine's VM lock and has started qemu (the guest may still boot).
func Running(dir string) bool {
	c, err := dialHub(dir)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// WaitReady blocks until the guest reports its testbed up (or failed).
// timeout counts from when the hub took the machine's VM lock: the time
// spent queued behind other guests (one at a time on the machine) is
// bounded by ctx alone, as long as the hub lives (ci5: a uvn testbed
// queued 30 minutes behind other suites' guests and gave up before its own
// guest had started).
func WaitReady(ctx context.Context, dir string, timeout time.Duration) (*Ready, error) {
	var deadline time.Time
	locked := func() bool {
		if deadline.IsZero() {
			if st, err := os.Stat(filepath.Join(dir, fileLocked)); err == nil {
				deadline = st.ModTime().Add(timeout)
			}
		}
		return !deadline.IsZero()
	}
	var c net.Conn
	var err error
	for {
		c, err = dialHub(dir)
		if err == nil {
			break
		}
		if locked() {
			if time.Now().After(deadline) {
				return nil, err
			}
		} else if !hubAlive(dir) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	defer c.Close()
	if !locked() { // a hub of before lock.taken
		deadline = time.Now().Add(timeout)
	}
	b, _ := json.Marshal(Request{Op: "wait"})
	w := &frameWriter{w: c}
	if err := w.write(fOpen, 0, b); err != nil {
		return nil, err
	}
	c.SetReadDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Now()) })
	defer stop()
	f, err := readFrame(c)
	if err != nil {
		return nil, fmt.Errorf("waiting for the guest (console: %s): %w", filepath.Join(dir, fileConsole), err)
	}
	var rd Ready
	if err := json.Unmarshal(f.payload, &rd); err != nil {
		return nil, err
	}
	return &rd, nil
}

// Exec runs req in the guest, relaying stdin, stdout and stderr, and
// returns the command's exit code (-1: it could not start).
func Exec(ctx context.Context, dir string, req Request, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	c, err := dialHub(dir)
	if err != nil {
		return -1, err
	}
	defer c.Close()
	w := &frameWriter{w: c}
	b, _ := json.Marshal(req)
	if err := w.write(fOpen, 0, b); err != nil {
		return -1, err
	}
	stop := context.AfterFunc(ctx, func() { w.write(fKill, 0, []byte{byte(syscall.SIGKILL)}) })
	defer stop()
	if stdin != nil {
		go func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := stdin.Read(buf)
				if n > 0 {
					if w.write(fStdin, 0, buf[:n]) != nil {
						return
					}
				}
				if err != nil {
					w.write(fStdinEOF, 0, nil)
					return
				}
			}
		}()
	} else {
		w.write(fStdinEOF, 0, nil)
	}
	for {
		f, err := readFrame(c)
		if err != nil {
			return -1, fmt.Errorf("VM connection lost: %w", err)
		}
		switch f.typ {
		case fStdout:
			stdout.Write(f.payload)
		case fStderr:
			stderr.Write(f.payload)
		case fExit:
			if len(f.payload) < 4 {
				return -1, nil
			}
			return int(int32(binary.BigEndian.Uint32(f.payload))), nil
		}
	}
}

// ExecMain is `palisade-lab vm exec`: relay this process's stdio, forward
// SIGINT/SIGTERM as a kill, exit with the guest command's code.
func ExecMain(dir string, req Request) int {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	code, err := Exec(ctx, dir, req, os.Stdin, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "palisade-lab vm:", err)
		if code == 0 {
			code = 255
		}
	}
	if code < 0 {
		code = 255
	}
	return code
}

// hubAlive: dir's hub process (hub.pid) runs.
func hubAlive(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, fileHubPID))
	if err != nil {
		return false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return err == nil && pid > 0 && procfs.Alive(pid) // a dead hub stays a zombie of the process that started it
}
