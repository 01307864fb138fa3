package bench

// The load generators below run inside testbed nodes as hidden subcommands
// of the palisade binary (`palisade-lab bench conn`, `rr`, `serve`, `hold`).
// Clients use blocking system calls on plain file descriptors rather than
// Go's netpoller so that what is timed is the kernel's work — the part a
// data plane can slow down — and not epoll bookkeeping.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ConnResult is one connection-setup measurement: Threads workers each
// opening Conns connections that send one byte (reference 001, Figure 2).
type ConnResult struct {
	Threads int     `json:"threads"`
	Conns   int     `json:"conns"` // per thread
	OK      int     `json:"ok"`    // connections that completed (all threads)
	Seconds float64 `json:"seconds"`
	Rate    float64 `json:"rate"` // connections per second
	// ConnectUS is the median time spent in connect(), i.e. the handshake
	// including any verdict a data plane takes on it.
	ConnectUS float64 `json:"connect_us"`
	// TotalUS is the median time of a whole transaction (socket, connect,
	// one byte, close seen).
	TotalUS   float64 `json:"total_us"`
	Errors    int     `json:"errors"`
	FirstErr  string  `json:"first_error,omitempty"`
	StartUnix int64   `json:"start_unix_ns"`
	EndUnix   int64   `json:"end_unix_ns"`
	CPUNS     float64 `json:"cpu_ns"` // this process, user + system
}

// sockaddr turns host:port into a syscall address and its family.
func sockaddr(addr string) (syscall.Sockaddr, int, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, 0, fmt.Errorf("bad address %q (want IP:port): %w", addr, err)
	}
	if ap.Addr().Is4() {
		return &syscall.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}, syscall.AF_INET, nil
	}
	return &syscall.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}, syscall.AF_INET6, nil
}

// oneConn opens a connection, sends one byte and waits for the server to
// close (the server closes first, so TIME_WAIT stays on the server's side
// and the client never runs out of ephemeral ports).
func oneConn(sa syscall.Sockaddr, fam int) (connect, total time.Duration, err error) {
	t0 := time.Now()
	fd, err := syscall.Socket(fam, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, 0, err
	}
	defer syscall.Close(fd)
	// A bounded wait: a silently dropped SYN must not hang the run.
	tv := syscall.Timeval{Sec: 5}
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv)
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	for {
		err = syscall.Connect(fd, sa)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		return 0, 0, fmt.Errorf("connect: %w", err)
	}
	t1 := time.Now()
	if _, err := syscall.Write(fd, []byte{'x'}); err != nil {
		return 0, 0, fmt.Errorf("write: %w", err)
	}
	var b [16]byte
	for {
		n, err := syscall.Read(fd, b[:])
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return 0, 0, fmt.Errorf("read: %w", err)
		}
		if n == 0 {
			break
		}
	}
	return t1.Sub(t0), time.Since(t0), nil
}

// ConnRun measures one thread count.
func ConnRun(addr string, threads, conns int) (ConnResult, error) {
	sa, fam, err := sockaddr(addr)
	if err != nil {
		return ConnResult{}, err
	}
	if threads < 1 || conns < 1 {
		return ConnResult{}, errors.New("threads and conns must be positive")
	}
	var (
		mu       sync.Mutex
		connects []float64
		totals   []float64
		nerr     int
		firstErr string
		wg       sync.WaitGroup
	)
	cpu0 := selfCPU()
	start := time.Now()
	for t := 0; t < threads; t++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs := make([]float64, 0, conns)
			ts := make([]float64, 0, conns)
			errs, first := 0, ""
			for i := 0; i < conns; i++ {
				c, tot, err := oneConn(sa, fam)
				if err != nil {
					errs++
					if first == "" {
						first = err.Error()
					}
					// A refused path fails fast; stop early instead of
					// hammering it a thousand times.
					if errs >= 10 {
						break
					}
					continue
				}
				cs = append(cs, float64(c.Nanoseconds())/1e3)
				ts = append(ts, float64(tot.Nanoseconds())/1e3)
			}
			mu.Lock()
			connects = append(connects, cs...)
			totals = append(totals, ts...)
			nerr += errs
			if firstErr == "" {
				firstErr = first
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	end := time.Now()
	secs := end.Sub(start).Seconds()
	zeroNaN := func(x float64) float64 {
		if x != x { // no successful connection: JSON has no NaN
			return 0
		}
		return x
	}
	r := ConnResult{
		Threads: threads, Conns: conns, Seconds: secs,
		OK:        len(connects),
		Rate:      float64(len(connects)) / secs,
		ConnectUS: zeroNaN(medianOf(connects)), TotalUS: zeroNaN(medianOf(totals)),
		Errors: nerr, FirstErr: firstErr,
		StartUnix: start.UnixNano(), EndUnix: end.UnixNano(),
		CPUNS: selfCPU() - cpu0,
	}
	return r, nil
}

// RRResult is the round-trip time of one message size over one TCP
// connection (reference 004, Figures 5–8).
type RRResult struct {
	Size   int     `json:"size"`
	Iters  int     `json:"iters"`
	MedUS  float64 `json:"median_us"`
	MeanUS float64 `json:"mean_us"`
	P90US  float64 `json:"p90_us"`
	// Trips counts every round trip, warm-up included (the accounting
	// divides by it); CPUNS is this process's CPU time for the size.
	Trips int     `json:"trips"`
	CPUNS float64 `json:"cpu_ns"`
}

// RRRun sends each size iters times to an echo server and times the round
// trips. Every reply is checked byte for byte against what was sent.
func RRRun(addr string, sizes []int, iters int) ([]RRResult, error) {
	sa, fam, err := sockaddr(addr)
	if err != nil {
		return nil, err
	}
	fd, err := syscall.Socket(fam, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer syscall.Close(fd)
	tv := syscall.Timeval{Sec: 10}
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv)
	if err := syscall.SetsockoptInt(fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1); err != nil {
		return nil, err
	}
	if err := syscall.Connect(fd, sa); err != nil {
		return nil, fmt.Errorf("connect %s: %w", addr, err)
	}
	var out []RRResult
	for _, size := range sizes {
		msg := make([]byte, size)
		for i := range msg {
			msg[i] = byte(i*7 + size)
		}
		buf := make([]byte, size)
		warm := iters / 10
		if warm < 5 {
			warm = 5
		}
		rtts := make([]float64, 0, iters)
		cpu0 := selfCPU()
		for i := 0; i < warm+iters; i++ {
			t0 := time.Now()
			if err := writeFull(fd, msg); err != nil {
				return nil, fmt.Errorf("size %d: write: %w", size, err)
			}
			if err := readFull(fd, buf); err != nil {
				return nil, fmt.Errorf("size %d: read: %w", size, err)
			}
			d := time.Since(t0)
			if i >= warm {
				rtts = append(rtts, float64(d.Nanoseconds())/1e3)
			}
		}
		if string(buf) != string(msg) {
			return nil, fmt.Errorf("size %d: echo differs from what was sent", size)
		}
		sum := 0.0
		for _, x := range rtts {
			sum += x
		}
		sort.Float64s(rtts)
		out = append(out, RRResult{Size: size, Iters: iters, MedUS: median(rtts),
			MeanUS: sum / float64(len(rtts)), P90US: percentile(rtts, 90),
			Trips: warm + iters, CPUNS: selfCPU() - cpu0})
	}
	return out, nil
}

func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := syscall.Write(fd, b)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

func readFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := syscall.Read(fd, b)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		b = b[n:]
	}
	return nil
}

// ServeConfig says which servers `palisade-lab bench serve` runs.
type ServeConfig struct {
	Addr       string // bind address ("" = all)
	ConnPorts  []int  // connection-setup servers (read one byte, close)
	RRPort     int    // echo server for round trips
	IperfPorts []int  // iperf3 servers started as children
	Iperf3     string // iperf3 binary (default "iperf3")
	UDPSink    int    // UDP port counting datagrams (v4 and v6)
	UDPEcho    int    // UDP echo port (v4 and v6)
}

// Serve runs the servers of cfg until stdin reaches EOF (the bench closes
// it), printing "ready" once every socket listens, and a ServeStats line
// for every "stats" line it reads. iperf3 children are ended by their PID
// when Serve returns.
func Serve(ctx context.Context, cfg ServeConfig, stdin io.Reader, stdout io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			c.Close()
		}
	}()
	// Plain TCP, like the C programs users run: since Go 1.24 net.Listen
	// makes MPTCP listeners, whose subflow sockets are kernel-created and
	// would slip past per-socket hooks (and measure a different stack).
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	listen := func(port int) (net.Listener, error) {
		l, err := lc.Listen(ctx, "tcp", net.JoinHostPort(cfg.Addr, strconv.Itoa(port)))
		if err == nil {
			closers = append(closers, l)
		}
		return l, err
	}
	for _, p := range cfg.ConnPorts {
		l, err := listen(p)
		if err != nil {
			return err
		}
		go acceptLoop(l, func(c net.Conn) {
			// Long enough for the scale test's held connections.
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Minute))
			var b [1]byte
			_, _ = c.Read(b[:])
			c.Close()
		})
	}
	if cfg.RRPort > 0 {
		l, err := listen(cfg.RRPort)
		if err != nil {
			return err
		}
		go acceptLoop(l, func(c net.Conn) {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetNoDelay(true)
			}
			buf := make([]byte, 256<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := c.Write(buf[:n]); werr != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			c.Close()
		})
	}
	var children []*exec.Cmd
	defer func() {
		for _, c := range children {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}()
	ip := cfg.Iperf3
	if ip == "" {
		ip = "iperf3"
	}
	for _, p := range cfg.IperfPorts {
		args := []string{"-s", "-p", strconv.Itoa(p)}
		if cfg.Addr != "" {
			args = append(args, "-B", cfg.Addr)
		}
		c := exec.Command(ip, args...)
		c.Stdout, c.Stderr = io.Discard, os.Stderr
		// Die with us even if we are killed without a chance to clean up.
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			return fmt.Errorf("start iperf3: %w", err)
		}
		children = append(children, c)
	}
	for _, p := range cfg.IperfPorts {
		if err := waitListening(ctx, p, 10*time.Second); err != nil {
			return err
		}
	}
	var cnt udpCounter
	done := make(chan struct{})
	var udpStops []func()
	defer func() {
		close(done)
		for _, stop := range udpStops {
			stop()
		}
	}()
	for _, u := range []struct {
		port int
		echo bool
	}{{cfg.UDPSink, false}, {cfg.UDPEcho, true}} {
		if u.port == 0 {
			continue
		}
		for _, fam := range []int{syscall.AF_INET, syscall.AF_INET6} {
			c := &cnt
			if u.echo {
				c = nil
			}
			stop, err := udpServe(fam, u.port, u.echo, c, done)
			if err != nil {
				return err
			}
			udpStops = append(udpStops, stop)
		}
	}
	fmt.Fprintln(stdout, "ready")
	// Answer "stats" until the bench closes our stdin.
	answerStats(stdin, stdout, func() []int {
		var pids []int
		for _, c := range children {
			pids = append(pids, c.Process.Pid)
		}
		return pids
	}, &cnt)
	return nil
}

func acceptLoop(l net.Listener, handle func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return
		}
		go handle(c)
	}
}

// waitListening polls /proc/net/tcp{,6} of our network namespace for a
// listening socket on port (a connect probe would disturb iperf3, which
// takes any connection for a test's control channel).
func waitListening(ctx context.Context, port int, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	want := fmt.Sprintf(":%04X ", port)
	for {
		for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			sc := bufio.NewScanner(strings.NewReader(string(b)))
			for sc.Scan() {
				fs := strings.Fields(sc.Text())
				// local_address rem_address st: 0A = LISTEN
				if len(fs) > 3 && strings.HasSuffix(fs[1]+" ", want) && fs[3] == "0A" {
					return nil
				}
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nothing listens on port %d after %s", port, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Hold opens n idle TCP connections to addr and keeps them until stdin
// closes: the scale test measures whether a data plane's verdict cost grows
// with the number of live sockets.
func Hold(addr string, n int, stdin io.Reader, stdout io.Writer) error {
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	d := net.Dialer{Timeout: 5 * time.Second}
	d.SetMultipathTCP(false)
	for i := 0; i < n; i++ {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			return fmt.Errorf("hold: connection %d of %d: %w", i+1, n, err)
		}
		conns = append(conns, c)
	}
	fmt.Fprintln(stdout, "ready")
	_, _ = io.Copy(io.Discard, stdin)
	return nil
}

// DropPrivileges is used by the scale test, whose helpers start as root in
// a node and become an arbitrary uid (no passwd entry needed): raise the
// descriptor limit first (only root may), then set groups, gid and uid.
// Go applies setuid to every thread of the process.
func DropPrivileges(uid, gid int, nofile uint64) error {
	if nofile > 0 {
		lim := syscall.Rlimit{Cur: nofile, Max: nofile}
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			return fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", nofile, err)
		}
	}
	if uid < 0 {
		return nil
	}
	if gid < 0 {
		gid = uid
	}
	if err := syscall.Setgroups([]int{}); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setgid(gid); err != nil {
		return fmt.Errorf("setgid %d: %w", gid, err)
	}
	if err := syscall.Setuid(uid); err != nil {
		return fmt.Errorf("setuid %d: %w", uid, err)
	}
	return nil
}

// ParseInts parses "1,2,4".
func ParseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad number %q in %q", f, s)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list %q", s)
	}
	return out, nil
}
