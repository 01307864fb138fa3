package attack

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// SinkSpec is a victim socket: bound, listening, reporting.
type SinkSpec struct {
	Sock
	// Echo answers every nonce ("PALATK <nonce>" back to the sender): the
	// victim service's replies create whatever reply state the data plane
	// keeps.
	Echo bool `json:"echo,omitempty"`
	// CloseFirst closes a stream right after the echo, so that the
	// victim's side of the connection ends in TIME_WAIT.
	CloseFirst bool `json:"close_first,omitempty"`
	// SendFirst (datagram sockets): the socket sends one datagram to each
	// of these addresses before it reports ready (a client that talked to
	// a service: its reply state).
	SendFirst []string `json:"send_first,omitempty"`
	// Heartbeat (datagram sockets): the socket sends a datagram to this
	// address every 200 ms while it runs (a multicast peer announcing
	// itself on the group it listens to).
	Heartbeat string `json:"heartbeat,omitempty"`
	// Tag names the socket in every line it reports (ServeAll: many
	// sockets in one process).
	Tag string `json:"tag,omitempty"`
	// EchoMark answers with "PALECHO <nonce>" instead of the payload, so
	// that an echo reflected into another sink is never counted as the
	// sender's bytes there (the fuzzer's sentinels).
	EchoMark bool `json:"echo_mark,omitempty"`
	// Any reports data without a nonce too ("bytes" lines): no byte
	// reaches the socket unseen.
	Any bool `json:"any,omitempty"`
	// Gated: once the socket exists (before SendFirst), print a "created"
	// line and wait for a line on stdin (the starter changes the node
	// meanwhile: e.g. starts the agent, so the socket predates it).
	Gated bool `json:"gated,omitempty"`
	// FailedSend (datagram sockets): after the gate, one send that the
	// kernel refuses after it autobound the socket but before the cgroup
	// sendmsg hook runs: "noaddr" (no destination: EDESTADDRREQ),
	// "port0" (destination port 0: EINVAL). The socket is then bound.
	FailedSend string `json:"failed_send,omitempty"`
	// Creds, for a sink run as root: the ids it takes before it opens its
	// socket (a process that kept a group's gid, as sg leaves it).
	Creds *Creds `json:"creds,omitempty"`
	// Connect (datagram sockets): connected to this address once bound
	// (a wildcard socket is then rehashed onto the source address the
	// route picks, and takes only that peer's datagrams).
	Connect string `json:"connect,omitempty"`
}

// SinkLine is one line of sink output: "ready" once bound (with the bound
// address), then "got" per nonce received.
type SinkLine struct {
	Type  string `json:"type"`
	PID   int    `json:"pid,omitempty"`
	UID   int    `json:"uid,omitempty"`
	GID   int    `json:"gid,omitempty"`
	Addr  string `json:"addr,omitempty"`
	Nonce string `json:"nonce,omitempty"`
	From  string `json:"from,omitempty"`
	Error string `json:"error,omitempty"`
	Errno string `json:"errno,omitempty"`
	Tag   string `json:"tag,omitempty"`
	Bytes int    `json:"bytes,omitempty"` // "bytes": data without a nonce
}

// echoTag starts an EchoMark echo: another sink that receives one (a
// reflection through a co-bound port) neither counts nor reports it.
const echoTag = "PALECHO "

// Serve binds spec's socket, prints a ready line (or an error line, and
// returns the error) and then one line per nonce received until the
// process ends.
func Serve(spec SinkSpec, out io.Writer) error {
	var mu sync.Mutex
	return serve(spec, json.NewEncoder(out), &mu, nil)
}

// ServeGated is Serve for a Gated spec: gate is closed when the starter
// says go on.
func ServeGated(spec SinkSpec, out io.Writer, gate <-chan struct{}) error {
	var mu sync.Mutex
	return serve(spec, json.NewEncoder(out), &mu, gate)
}

// ServeAll serves every spec in one process (a line per socket's ready or
// error, then its receipts, each line tagged with the spec's Tag) until the
// process ends or every socket failed.
func ServeAll(specs []SinkSpec, out io.Writer) error {
	var mu sync.Mutex
	enc := json.NewEncoder(out)
	errs := make(chan error, len(specs))
	for _, s := range specs {
		go func() { errs <- serve(s, enc, &mu, nil) }()
	}
	var last error
	for range specs {
		last = <-errs
	}
	return last
}

func serve(spec SinkSpec, enc *json.Encoder, mu *sync.Mutex, gate <-chan struct{}) error {
	emit := func(l SinkLine) {
		l.Tag = spec.Tag
		mu.Lock()
		enc.Encode(l)
		mu.Unlock()
	}
	echo := func(nc string) []byte {
		if spec.EchoMark {
			return []byte(echoTag + nc + "\n")
		}
		return Payload(nc)
	}
	if spec.Creds != nil {
		if err := spec.Creds.take(); err != nil {
			emit(SinkLine{Type: "error", Error: err.Error(), Errno: Errno(err)})
			return err
		}
	}
	fd, err := bindSock(spec.Sock)
	if err != nil {
		emit(SinkLine{Type: "error", Error: err.Error(), Errno: Errno(err)})
		return err
	}
	if spec.Gated && gate != nil {
		emit(SinkLine{Type: "created", PID: os.Getpid()})
		<-gate
	}
	if spec.stream() {
		if err := unix.Listen(fd, 128); err != nil {
			emit(SinkLine{Type: "error", Error: at("listen", err).Error(), Errno: Errno(err)})
			return err
		}
	}
	if spec.Connect != "" && !spec.stream() {
		sa, err := sockaddr(spec.Sock, spec.Connect)
		if err == nil {
			err = connectFD(fd, sa)
		}
		if err != nil {
			emit(SinkLine{Type: "error", Error: at("connect", err).Error(), Errno: Errno(err)})
			return err
		}
	}
	switch spec.FailedSend {
	case "noaddr":
		_ = unix.Sendto(fd, []byte("PALISADE hello\n"), 0, nil)
	case "port0":
		if sa, err := sockaddr(spec.Sock, ap(lo(spec.Sock.Family), 0)); err == nil {
			_ = unix.Sendto(fd, []byte("PALISADE hello\n"), 0, sa)
		}
	}
	for _, to := range spec.SendFirst {
		sa, err := sockaddr(spec.Sock, to)
		if err == nil {
			err = sendtoFD(fd, []byte("PALISADE hello\n"), 0, sa)
		}
		if err != nil && err != unix.ECONNREFUSED && err != unix.EHOSTUNREACH {
			emit(SinkLine{Type: "error", Error: at("send first to "+to, err).Error(), Errno: Errno(err)})
			return err
		}
	}
	if spec.Heartbeat != "" {
		sa, err := sockaddr(spec.Sock, spec.Heartbeat)
		if err != nil {
			emit(SinkLine{Type: "error", Error: at("heartbeat", err).Error()})
			return err
		}
		go func() {
			for {
				sendtoFD(fd, []byte("PALISADE heartbeat, padded beyond forty-eight bytes\n"), 0, sa)
				time.Sleep(200 * time.Millisecond)
			}
		}()
	}
	local, _ := unix.Getsockname(fd)
	emit(SinkLine{Type: "ready", PID: os.Getpid(), UID: os.Getuid(), GID: os.Getegid(), Addr: sockString(local)})
	buf := make([]byte, 2048)
	if !spec.stream() {
		for {
			n, from, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				if err == unix.EINTR {
					continue
				}
				return err
			}
			ns := nonces(buf[:n])
			if len(ns) == 0 && spec.Any && !bytes.Contains(buf[:n], []byte(echoTag)) {
				emit(SinkLine{Type: "bytes", Bytes: n, From: sockString(from)})
			}
			for _, nc := range ns {
				emit(SinkLine{Type: "got", Nonce: nc, From: sockString(from)})
				if spec.Echo && from != nil {
					sendtoFD(fd, echo(nc), 0, from)
				}
			}
		}
	}
	for {
		cfd, from, err := unix.Accept4(fd, unix.SOCK_CLOEXEC)
		if err != nil {
			if err == unix.EINTR || err == unix.ECONNABORTED {
				continue
			}
			return err
		}
		go func() {
			defer unix.Close(cfd)
			tv := unix.NsecToTimeval(int64(3 * time.Second))
			unix.SetsockoptTimeval(cfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			var got []byte
			b := make([]byte, 512)
			for len(got) < 4096 {
				n, err := readFD(cfd, b)
				if n <= 0 || err != nil {
					if len(got) > 0 && spec.Any && !bytes.Contains(got, []byte(echoTag)) {
						emit(SinkLine{Type: "bytes", Bytes: len(got), From: sockString(from)})
					}
					break
				}
				got = append(got, b[:n]...)
				if ns := nonces(got); len(ns) > 0 {
					for _, nc := range ns {
						emit(SinkLine{Type: "got", Nonce: nc, From: sockString(from)})
						if spec.Echo {
							writeFD(cfd, echo(nc))
						}
					}
					if spec.CloseFirst {
						return
					}
					got = nil
				}
			}
		}()
	}
}

// bindSock opens spec's socket and binds it (and joins its groups).
func bindSock(s Sock) (int, error) {
	fd, _, err := bindSockPre(s)
	return fd, err
}

// bindSockPre is bindSock that also returns what PreBind's bind returned.
func bindSockPre(s Sock) (int, error, error) {
	fd, err := s.open()
	if err != nil {
		return -1, nil, err
	}
	var pre error
	if s.PreBind != "" {
		sa, err := sockaddr(s, s.PreBind)
		if err == nil {
			err = unix.Bind(fd, sa)
		}
		pre = at("pre-bind", err)
	}
	fd, err = bindRest(fd, s)
	return fd, pre, err
}

func bindRest(fd int, s Sock) (int, error) {
	if s.Bind != "" {
		sa, err := sockaddr(s, s.Bind)
		if err != nil {
			unix.Close(fd)
			return -1, at("bind", err)
		}
		if err := unix.Bind(fd, sa); err != nil {
			unix.Close(fd)
			return -1, at("bind", err)
		}
		if s.FreeBindOff {
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_FREEBIND, 0); err != nil {
				unix.Close(fd)
				return -1, at("IP_FREEBIND off", err)
			}
		}
	}
	if err := join(fd, s); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}
