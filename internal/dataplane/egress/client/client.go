// Package client is `palisade egress [--] CMD...`: it joins the gateway with
// the job's token, brings up a WireGuard tunnel (wireguard-go) and runs CMD so
// that all its traffic leaves through the gateway. Three data paths:
//
//   - tun: CMD runs in a fresh unprivileged user + network namespace whose
//     only interface is a tun device; wireguard-go stays in the node's
//     network namespace (where its UDP socket lives) and gets the tun's file
//     descriptor from the namespace over a Unix socket;
//   - socks: no namespace at all; a gVisor netstack carries the tunnel and a
//     local SOCKS5 server (with per-job credentials) hands it to CMD through
//     ALL_PROXY and friends.
//
// "auto" tries tun and falls back to socks when user namespaces or
// /dev/net/tun are unavailable.
package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/join"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/socks"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/stack"
	"golang.org/x/sys/unix"
	"golang.zx2c4.com/wireguard/conn"
	"golang.zx2c4.com/wireguard/device"
	"golang.zx2c4.com/wireguard/tun"
)

// TokenEnv carries the join token to the job (sbatch --export, srun).
const TokenEnv = "PALISADE_EGRESS_TOKEN"

// Options of one egress run.
type Options struct {
	Token      string
	GatewayKey string // optional pin; must match the token's when both are set
	Path       string // auto, tun, socks
	Node       string // overlay name part; default hostname
	Cmd        []string
	Logf       func(string, ...any)
	// SocksListen is where the socks path listens (default 127.0.0.1:0).
	SocksListen string
	// Ready, if set, is called with the proxy URL (socks path) before CMD runs.
	Ready func(proxyURL string)
}

// Session is a joined client.
type Session struct {
	key      join.Key
	gwKey    join.Key
	ini      *join.Initiator
	joinAddr string
	req      join.Request
	// Answer is the join's answer; it does not change after Join (renewals
	// move only leaseEnd, which the renewal goroutine owns).
	Answer   join.Answer
	leaseEnd atomic.Int64
	endpoint string
}

// Join verifies nothing locally but the pin, and asks the gateway.
func Join(o Options) (*Session, error) {
	if o.Token == "" {
		return nil, fmt.Errorf("no join token: set %s or pass --token", TokenEnv)
	}
	claims, err := join.ReadToken(o.Token)
	if err != nil {
		return nil, err
	}
	gwKey, err := join.ParseKey(claims.GatewayKey)
	if err != nil {
		return nil, fmt.Errorf("token: %w", err)
	}
	if o.GatewayKey != "" {
		pin, err := join.ParseKey(o.GatewayKey)
		if err != nil {
			return nil, fmt.Errorf("--gateway-key: %w", err)
		}
		if pin != gwKey {
			return nil, errors.New("token names a gateway key different from the pinned one: refusing")
		}
	}
	host, _, err := net.SplitHostPort(claims.Gateway)
	if err != nil {
		return nil, fmt.Errorf("token: gateway %q: %v", claims.Gateway, err)
	}
	node := o.Node
	if node == "" {
		node, _ = os.Hostname()
	}
	key, err := join.NewPrivateKey() // per-job key, never written to disk
	if err != nil {
		return nil, err
	}
	s := &Session{key: key, gwKey: gwKey, ini: join.NewInitiator(key, gwKey), joinAddr: claims.Gateway,
		req: join.Request{Op: "join", Token: o.Token, Node: node}}
	if s.Answer, err = s.ini.Exchange(s.joinAddr, s.req, 10*time.Second); err != nil {
		return nil, err
	}
	s.leaseEnd.Store(s.Answer.LeaseEnd)
	if !s.Answer.Address.IsValid() {
		return nil, errors.New("gateway sent no address")
	}
	s.endpoint = net.JoinHostPort(host, s.Answer.Endpoint)
	return s, nil
}

// Leave gives the lease back.
func (s *Session) Leave() {
	r := s.req
	r.Op = "leave"
	s.ini.Exchange(s.joinAddr, r, 2*time.Second)
}

// renew keeps the lease alive until ctx ends.
func (s *Session) renew(ctx context.Context, logf func(string, ...any)) {
	for {
		every := time.Until(time.Unix(s.leaseEnd.Load(), 0)) / 3
		every = max(every, 5*time.Second)
		select {
		case <-ctx.Done():
			return
		case <-time.After(every):
		}
		a, err := s.ini.Exchange(s.joinAddr, s.req, 10*time.Second)
		if err != nil {
			logf("lease renewal: %v", err)
			continue
		}
		s.leaseEnd.Store(a.LeaseEnd)
	}
}

// device starts wireguard-go on td with the gateway as the only peer.
func (s *Session) device(td tun.Device, logf func(string, ...any)) (*device.Device, error) {
	logger := &device.Logger{Verbosef: device.DiscardLogf, Errorf: func(f string, a ...any) { logf("wireguard: "+f, a...) }}
	dev := device.NewDevice(td, conn.NewStdNetBind(), logger)
	cfg := fmt.Sprintf("private_key=%s\npublic_key=%s\nendpoint=%s\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\n",
		s.key.Hex(), s.gwKey.Hex(), s.endpoint)
	for _, r := range s.Answer.Routes {
		cfg += "allowed_ip=" + r.String() + "\n"
	}
	if len(s.Answer.Routes) == 0 {
		cfg += "allowed_ip=0.0.0.0/0\n"
	}
	cfg += "allowed_ip=" + netip.PrefixFrom(s.Answer.Gateway, 32).String() + "\n"
	if err := dev.IpcSet(cfg); err != nil {
		dev.Close()
		return nil, err
	}
	if err := dev.Up(); err != nil {
		dev.Close()
		return nil, err
	}
	return dev, nil
}

// Run joins, brings up the chosen data path, runs CMD and returns its exit
// status.
func Run(o Options) (int, error) {
	if o.Logf == nil {
		o.Logf = func(f string, a ...any) { fmt.Fprintf(os.Stderr, "palisade egress: "+f+"\n", a...) }
	}
	if o.Path == "" {
		o.Path = "auto"
	}
	switch o.Path {
	case "auto", "tun", "netstack", "socks":
	default:
		return 0, fmt.Errorf("--path %q: want auto, tun, netstack or socks", o.Path)
	}
	if len(o.Cmd) == 0 && o.Path != "socks" {
		return 0, errors.New("no command to run (only --path socks serves without one)")
	}
	s, err := Join(o)
	if err != nil {
		return 0, err
	}
	defer s.Leave()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.renew(ctx, o.Logf)
	if o.Path == "tun" || o.Path == "auto" {
		code, err := s.runTun(o)
		if err == nil || o.Path == "tun" || !errors.Is(err, errNoNamespace) {
			return code, err
		}
		o.Logf("%v; trying the netstack path", err)
	}
	if o.Path == "netstack" || o.Path == "auto" {
		code, err := s.runNetstack(o)
		if err == nil || o.Path == "netstack" || !errors.Is(err, errNoNamespace) {
			return code, err
		}
		o.Logf("%v; falling back to the socks path", err)
	}
	return s.runSocks(o)
}

var errNoNamespace = errors.New("cannot create an unprivileged network namespace with a tun device")

// nsConfig is what the namespace helper needs (passed in the environment).
type nsConfig struct {
	Mode   string      `json:"mode"` // "tun" or "veth"
	Answer join.Answer `json:"answer"`
	Cmd    []string    `json:"cmd"`
}

const nsEnv = "PALISADE_EGRESS_NS"

// NSHelperArg is the hidden argv[1] under which the palisade binary runs the
// namespace helper (see NSMain).
const NSHelperArg = "__egress-ns"

// helper is the namespace helper process and its control socket.
type helper struct {
	cmd    *exec.Cmd
	ctl    *os.File
	fd     int      // tun or packet socket from the namespace
	fields []string // words after "ok"
}

func (h *helper) kill() {
	h.cmd.Process.Kill()
	h.cmd.Wait()
	h.ctl.Close()
}

// startHelper re-executes palisade in a new user + network + mount
// namespace and waits for the descriptor of its data path.
func (s *Session) startHelper(o Options, mode string) (*helper, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	parent := os.NewFile(uintptr(fds[0]), "egress-parent")
	child := os.NewFile(uintptr(fds[1]), "egress-child")
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cfg, _ := json.Marshal(nsConfig{Mode: mode, Answer: s.Answer, Cmd: o.Cmd})
	cmd := exec.Command(exe, NSHelperArg)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), nsEnv+"="+string(cfg))
	cmd.ExtraFiles = []*os.File{child}
	uid, gid := os.Getuid(), os.Getgid()
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET | syscall.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: uid, HostID: uid, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: gid, HostID: gid, Size: 1}},
		AmbientCaps: []uintptr{unix.CAP_NET_ADMIN, unix.CAP_NET_RAW, unix.CAP_SYS_ADMIN},
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		child.Close()
		parent.Close()
		return nil, fmt.Errorf("%w: %v", errNoNamespace, err)
	}
	child.Close()
	h := &helper{cmd: cmd, ctl: parent}
	// The helper answers "ok [words]" with a descriptor, or "err <why>".
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(int(parent.Fd()), buf, oob, 0)
	if err != nil || n == 0 {
		h.kill()
		return nil, fmt.Errorf("%w: helper died", errNoNamespace)
	}
	msg := strings.Fields(string(buf[:n]))
	if len(msg) == 0 || msg[0] != "ok" {
		h.kill()
		return nil, fmt.Errorf("%w: %s", errNoNamespace, strings.TrimPrefix(string(buf[:n]), "err "))
	}
	h.fields = msg[1:]
	scms, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(scms) != 1 {
		h.kill()
		return nil, errors.New("helper sent no descriptor")
	}
	dfds, err := unix.ParseUnixRights(&scms[0])
	if err != nil || len(dfds) != 1 {
		h.kill()
		return nil, errors.New("helper sent no descriptor")
	}
	h.fd = dfds[0]
	return h, nil
}

func (s *Session) runTun(o Options) (int, error) {
	h, err := s.startHelper(o, "tun")
	if err != nil {
		return 0, err
	}
	serialTunnel()
	defer h.ctl.Close()
	td, _, err := tun.CreateUnmonitoredTUNFromFD(h.fd)
	if err != nil {
		h.kill()
		return 0, fmt.Errorf("tun: %w", err)
	}
	dev, err := s.device(&fixedMTU{td, s.Answer.MTU}, o.Logf)
	if err != nil {
		h.kill()
		return 0, fmt.Errorf("wireguard: %w", err)
	}
	defer dev.Close()
	if err := handshake(dev, 5*time.Second); err != nil {
		o.Logf("warning: %v", err)
	}
	h.ctl.Write([]byte("go"))
	return waitForwarding(h.cmd)
}

// runNetstack is the data path for nodes without /dev/net/tun: the job's
// namespace gets a veth pair; the far end is read through a packet socket
// by a gVisor stack that ends the job's flows and relays them through the
// tunnel's own gVisor stack.
func (s *Session) runNetstack(o Options) (int, error) {
	h, err := s.startHelper(o, "veth")
	if err != nil {
		return 0, err
	}
	defer h.ctl.Close()
	if len(h.fields) != 2 {
		h.kill()
		return 0, errors.New("helper sent no MAC addresses")
	}
	self, err1 := net.ParseMAC(h.fields[0])
	jobMAC, err2 := net.ParseMAC(h.fields[1])
	if err1 != nil || err2 != nil {
		h.kill()
		return 0, errors.New("helper sent bad MAC addresses")
	}
	st, err := stack.New([]netip.Addr{s.Answer.Address.Addr()}, s.Answer.MTU)
	if err != nil {
		h.kill()
		return 0, err
	}
	dev, err := s.device(st, o.Logf)
	if err != nil {
		h.kill()
		return 0, fmt.Errorf("wireguard: %w", err)
	}
	defer dev.Close()
	front, err := stack.NewFront(h.fd, s.Answer.MTU, self, jobMAC, s.Answer.Address.Addr(), st)
	if err != nil {
		h.kill()
		return 0, err
	}
	defer front.Close()
	if err := handshake(dev, 5*time.Second); err != nil {
		o.Logf("warning: %v", err)
	}
	h.ctl.Write([]byte("go"))
	return waitForwarding(h.cmd)
}

// handshake waits for the first completed handshake so CMD's first packet
// (often a DNS query) does not race the tunnel's setup.
func handshake(dev *device.Device, d time.Duration) error {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		st, err := dev.IpcGet()
		if err == nil && strings.Contains(st, "last_handshake_time_sec=") && !strings.Contains(st, "last_handshake_time_sec=0\n") {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.New("no WireGuard handshake with the gateway yet")
}

// waitForwarding waits for cmd, passing termination signals on.
func waitForwarding(cmd *exec.Cmd) (int, error) {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sig)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-sig:
			cmd.Process.Signal(s)
		case err := <-done:
			if cmd.ProcessState != nil {
				if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return 128 + int(ws.Signal()), nil
				}
				return cmd.ProcessState.ExitCode(), nil
			}
			return 1, err
		}
	}
}

// serialTunnel runs the Go side of a tun-path client on one P (unless
// GOMAXPROCS is set): one job's tunnel is one peer's pipeline of hand-offs
// (tun read -> seal -> UDP send; UDP receive -> open -> tun write), which
// more Ps do not make faster for one flow — every hand-off to another P
// costs a futex wake-up and a thread spinning for work, CPU the job and the
// kernel's half of the path need. On the 2-vCPU testbed this cut the
// client's CPU per GB carried by 15-20 % with no loss of throughput (one P
// still carries ~3 Gbit/s there; docs/benchmarks/README.md, "Egress: where
// the time of the tun path goes").
func serialTunnel() {
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
}

type fixedMTU struct {
	tun.Device
	mtu int
}

func (f *fixedMTU) MTU() (int, error) { return f.mtu, nil }

func (s *Session) runSocks(o Options) (int, error) {
	st, err := stack.New([]netip.Addr{s.Answer.Address.Addr()}, s.Answer.MTU)
	if err != nil {
		return 0, err
	}
	dev, err := s.device(st, o.Logf)
	if err != nil {
		return 0, fmt.Errorf("wireguard: %w", err)
	}
	defer dev.Close()
	if err := handshake(dev, 5*time.Second); err != nil {
		o.Logf("warning: %v", err)
	}
	listen := o.SocksListen
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return 0, err
	}
	defer l.Close()
	pw := make([]byte, 12)
	rand.Read(pw)
	srv := &socks.Server{User: "egress", Pass: hex.EncodeToString(pw), DialTCP: st.DialTCP, DialUDP: st.DialUDP,
		Resolve: s.resolver(st)}
	go srv.Serve(l)
	url := socks.URL(l.Addr(), srv.User, srv.Pass)
	if o.Ready != nil {
		o.Ready(url)
	}
	if len(o.Cmd) == 0 {
		o.Logf("SOCKS5 proxy at %s (ALL_PROXY=%s); interrupt to stop", l.Addr(), url)
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
		<-sig
		return 0, nil
	}
	cmd := exec.Command(o.Cmd[0], o.Cmd[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = os.Environ()
	for _, k := range []string{"ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"} {
		cmd.Env = append(cmd.Env, k+"="+url)
	}
	cmd.Env = append(cmd.Env, "PALISADE_EGRESS_SOCKS="+l.Addr().String(), "PALISADE_EGRESS_SOCKS_USER="+srv.User,
		"PALISADE_EGRESS_SOCKS_PASS="+srv.Pass, "NO_PROXY=", "no_proxy=")
	if path, err := exec.LookPath(o.Cmd[0]); err == nil {
		cmd.Path = path
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	return waitForwarding(cmd)
}

// resolver asks the gateway's DNS through the tunnel, trying the search
// domains for single-label names.
func (s *Session) resolver(st *stack.Stack) func(context.Context, string) (netip.Addr, error) {
	return func(ctx context.Context, host string) (netip.Addr, error) {
		names := []string{mdns.Fqdn(host)}
		if !strings.Contains(strings.TrimSuffix(host, "."), ".") {
			for _, d := range s.Answer.Search {
				names = append([]string{mdns.Fqdn(host + "." + d)}, names...)
			}
		}
		for _, srv := range s.Answer.DNS {
			for _, n := range names {
				c, err := st.DialUDP(netip.AddrPortFrom(srv, 53))
				if err != nil {
					continue
				}
				q := new(mdns.Msg)
				q.SetQuestion(n, mdns.TypeA)
				dc := &mdns.Conn{Conn: c}
				dc.SetDeadline(time.Now().Add(3 * time.Second))
				err = dc.WriteMsg(q)
				var r *mdns.Msg
				if err == nil {
					r, err = dc.ReadMsg()
				}
				c.Close()
				if err != nil || r.Rcode != mdns.RcodeSuccess {
					continue
				}
				for _, rr := range r.Answer {
					if a, ok := rr.(*mdns.A); ok {
						ip, _ := netip.AddrFromSlice(a.A.To4())
						return ip, nil
					}
				}
			}
		}
		return netip.Addr{}, fmt.Errorf("cannot resolve %s", host)
	}
}
