package vm

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Files of a running VM in its directory on the host.
const (
	fileQemuArgs = "qemu.json"
	fileQemuPID  = "qemu.pid"
	fileHubPID   = "hub.pid"
	fileCtl      = "ctl.sock" // qemu's end of the virtio-serial port
	fileHub      = "hub.sock" // clients (vm exec, Up, Down)
	fileConsole  = "console.log"
	fileHubLog   = "hub.log"
	fileReady    = "ready.json"
	fileLocked   = "lock.taken" // written when the hub holds the machine's VM lock
)

// hub owns qemu and multiplexes client connections onto the serial port.
type hub struct {
	dir    string
	serial *frameWriter
	mu     sync.Mutex // guards next, conns, ready, qemu
	next   uint32
	conns  map[uint32]*hubClient
	ready  *Ready
	readyC chan struct{}
	log    *os.File
	qemu   *os.Process // once started
}

type hubClient struct {
	c      net.Conn
	w      *frameWriter
	exited bool
}

func (h *hub) logf(format string, args ...any) {
	fmt.Fprintf(h.log, time.Now().Format("15:04:05.000 ")+format+"\n", args...)
}

// RunHub is `palisade-lab vm hub --dir DIR`: start qemu with the arguments in
// DIR/qemu.json, connect to its control port and serve clients on
// DIR/hub.sock until qemu exits.
func RunHub(dir string, owner int) error {
	lf, err := os.OpenFile(filepath.Join(dir, fileHubLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	h := &hub{dir: dir, conns: map[uint32]*hubClient{}, readyC: make(chan struct{}), log: lf, next: 1}
	if owner > 0 {
		if err := h.exitWithOwner(owner); err != nil {
			return err
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, fileQemuArgs))
	if err != nil {
		return err
	}
	var argv []string
	if err := json.Unmarshal(b, &argv); err != nil {
		return err
	}
	// One guest at a time on this machine: two emulated guests (TCG) share
	// its cores with each other and with the host testbeds, and Slurm's and
	// the tests' timing inside both suffered (srun's I/O abandoned after 60
	// s in a CI run with two guests up). The lock goes with the hub, when
	// qemu has exited.
	vl, err := os.OpenFile(filepath.Join(CacheDir(), "vm.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer vl.Close()
	os.Remove(filepath.Join(dir, fileLocked))
	h.logf("waiting for the machine's VM lock")
	if err := syscall.Flock(int(vl.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	h.logf("VM lock taken")
	// Clients count their boot timeout from here (WaitReady).
	if err := os.WriteFile(filepath.Join(dir, fileLocked), nil, 0o644); err != nil {
		return err
	}
	if err := withEtcSnapshot(argv, dir); err != nil {
		return err
	}
	os.Remove(filepath.Join(dir, fileCtl))
	os.Remove(filepath.Join(dir, fileHub))
	ql, err := os.Create(filepath.Join(dir, "qemu.log"))
	if err != nil {
		return err
	}
	q := exec.Command(argv[0], argv[1:]...)
	q.Stdout, q.Stderr = ql, ql
	q.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := q.Start(); err != nil {
		return fmt.Errorf("start qemu: %w", err)
	}
	h.mu.Lock()
	h.qemu = q.Process
	h.mu.Unlock()
	os.WriteFile(filepath.Join(dir, fileQemuPID), []byte(strconv.Itoa(q.Process.Pid)), 0o644)
	h.logf("qemu pid %d: %v", q.Process.Pid, argv)
	qdone := make(chan error, 1)
	go func() { qdone <- q.Wait() }()

	var sc net.Conn
	for start := time.Now(); ; {
		sc, err = net.Dial("unix", filepath.Join(dir, fileCtl))
		if err == nil {
			break
		}
		select {
		case err := <-qdone:
			return fmt.Errorf("qemu exited before its control socket appeared: %v (see %s)", err, filepath.Join(dir, "qemu.log"))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Since(start) > 30*time.Second {
			q.Process.Kill()
			return fmt.Errorf("qemu control socket: %w", err)
		}
	}
	h.serial = &frameWriter{w: sc}
	ln, err := net.Listen("unix", filepath.Join(dir, fileHub))
	if err != nil {
		q.Process.Kill()
		return err
	}
	go h.readSerial(sc)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go h.serve(c)
		}
	}()
	err = <-qdone
	h.logf("qemu exited: %v", err)
	ln.Close()
	sc.Close()
	h.mu.Lock()
	for _, c := range h.conns {
		if !c.exited {
			c.w.write(fStderr, 0, []byte("palisade-lab vm: the VM stopped\n"))
			c.w.write(fExit, 0, exitPayload(-1))
		}
		c.c.Close()
	}
	h.mu.Unlock()
	os.Remove(filepath.Join(dir, fileHub))
	os.Remove(filepath.Join(dir, fileCtl))
	return nil
}

// exitWithOwner ends the hub, and its guest, when process owner exits
// (waiting on a pidfd): before the lock is taken, while waiting for it, or
// with the guest up. The lock goes with the hub's exit.
func (h *hub) exitWithOwner(owner int) error {
	fd, err := unix.PidfdOpen(owner, 0)
	if err != nil {
		return fmt.Errorf("owner pid %d: %w", owner, err)
	}
	go func() {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(fds, -1); err == nil || !errors.Is(err, unix.EINTR) {
				break
			}
		}
		h.logf("owner %d exited: stopping the VM", owner)
		h.mu.Lock()
		if h.qemu != nil {
			h.qemu.Kill()
		}
		h.mu.Unlock()
		os.Remove(filepath.Join(h.dir, fileHub))
		os.Remove(filepath.Join(h.dir, fileCtl))
		os.Exit(2)
	}()
	return nil
}

func exitPayload(code int32) []byte {
	b := make([]byte, 4)
	binary.BigEndian.PutUint32(b, uint32(code))
	return b
}

func (h *hub) readSerial(r io.Reader) {
	for {
		f, err := readFrame(r)
		if err != nil {
			h.logf("serial: %v", err)
			return
		}
		if f.id == 0 {
			switch f.typ {
			case fReady:
				var rd Ready
				json.Unmarshal(f.payload, &rd)
				os.WriteFile(filepath.Join(h.dir, fileReady), f.payload, 0o644)
				h.mu.Lock()
				if h.ready == nil {
					h.ready = &rd
					close(h.readyC)
				}
				h.mu.Unlock()
				h.logf("guest ready: %s", f.payload)
			case fLog:
				h.logf("guest: %s", f.payload)
			}
			continue
		}
		h.mu.Lock()
		c := h.conns[f.id]
		if c != nil && f.typ == fExit {
			c.exited = true
		}
		h.mu.Unlock()
		if c == nil {
			continue
		}
		if err := c.w.write(f.typ, 0, f.payload); err != nil || f.typ == fExit {
			c.c.Close()
		}
	}
}

// serve handles one client: its first frame is an Open; op "wait" waits for
// the guest's Ready without involving the guest.
func (h *hub) serve(c net.Conn) {
	defer c.Close()
	f, err := readFrame(c)
	if err != nil || f.typ != fOpen {
		return
	}
	w := &frameWriter{w: c}
	var req Request
	if err := json.Unmarshal(f.payload, &req); err != nil {
		return
	}
	if req.Op == "wait" {
		<-h.readyC
		h.mu.Lock()
		b, _ := json.Marshal(h.ready)
		h.mu.Unlock()
		w.write(fReady, 0, b)
		return
	}
	h.mu.Lock()
	id := h.next
	h.next++
	hc := &hubClient{c: c, w: w}
	h.conns[id] = hc
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.conns, id)
		exited := hc.exited
		h.mu.Unlock()
		if !exited {
			// The client went away (killed with its context): kill the command.
			h.serial.write(fKill, id, []byte{byte(syscall.SIGKILL)})
		}
	}()
	if err := h.serial.write(fOpen, id, f.payload); err != nil {
		return
	}
	for {
		f, err := readFrame(c)
		if err != nil {
			return
		}
		if f.typ == fStdin || f.typ == fStdinEOF || f.typ == fKill {
			if err := h.serial.write(f.typ, id, f.payload); err != nil {
				return
			}
		}
	}
}

// ErrNoVM is returned when no hub answers in the directory.
var ErrNoVM = errors.New("no VM is running there")
