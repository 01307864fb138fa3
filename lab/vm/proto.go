package vm

import (
	"encoding/binary"
	"fmt"
	"io"
	"sync"
)

// The control channel carries frames: type (1 byte), stream id (4), payload
// length (4), payload. One virtio-serial port carries every stream; the host
// hub gives each client connection its own stream id.
const (
	fOpen     = 'O' // host→guest: start a command; payload JSON Request
	fStdin    = 'I' // host→guest: stdin data
	fStdinEOF = 'i' // host→guest: close stdin
	fKill     = 'k' // host→guest: kill the command (payload: signal number, 1 byte)
	fStdout   = 'o' // guest→host
	fStderr   = 'e' // guest→host
	fExit     = 'x' // guest→host: payload int32 exit code (-1: could not start; stderr says why)
	fReady    = 'R' // guest→host, stream 0: payload JSON Ready
	fLog      = 'L' // guest→host, stream 0: a line for the hub's log
)

const maxPayload = 1 << 20

type frame struct {
	typ     byte
	id      uint32
	payload []byte
}

func readFrame(r io.Reader) (frame, error) {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return frame{}, err
	}
	n := binary.BigEndian.Uint32(h[5:])
	if n > maxPayload {
		return frame{}, fmt.Errorf("control channel: frame of %d bytes (desynchronised?)", n)
	}
	f := frame{typ: h[0], id: binary.BigEndian.Uint32(h[1:5]), payload: make([]byte, n)}
	if _, err := io.ReadFull(r, f.payload); err != nil {
		return frame{}, err
	}
	return f, nil
}

// frameWriter serialises frames from many goroutines onto one writer.
type frameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (fw *frameWriter) write(typ byte, id uint32, p []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	for {
		n := len(p)
		if n > maxPayload {
			n = maxPayload
		}
		var h [9]byte
		h[0] = typ
		binary.BigEndian.PutUint32(h[1:5], id)
		binary.BigEndian.PutUint32(h[5:], uint32(n))
		if _, err := fw.w.Write(append(h[:], p[:n]...)); err != nil {
			return err
		}
		p = p[n:]
		if len(p) == 0 {
			return nil
		}
	}
}

// Request is what a host client asks the guest to run.
type Request struct {
	// Op: "exec" (Argv on Node as User through the guest's testbed),
	// "sh" (Argv in the guest's root namespaces), "ping", "shutdown".
	Op   string   `json:"op"`
	Node string   `json:"node,omitempty"`
	User string   `json:"user,omitempty"`
	Argv []string `json:"argv,omitempty"`
	Env  []string `json:"env,omitempty"`
}

// Ready is the guest's announcement once its testbed is up (or failed).
type Ready struct {
	Error string `json:"error,omitempty"`
	Boot  string `json:"boot,omitempty"` // seconds from agent start to ready
}
