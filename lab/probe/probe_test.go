package probe

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The test binary doubles as a helper process so that the listener and the
// connector can each run inside a scratch network namespace (`ip netns exec`
// applies to a whole process; goroutines cannot be pinned to a netns).
func TestMain(m *testing.M) {
	switch os.Getenv("PALCHK_PROBE_HELPER") {
	case "listen":
		var cfg ListenConfig
		json.Unmarshal([]byte(os.Getenv("PALCHK_PROBE_CFG")), &cfg)
		l, err := Listen(cfg)
		if err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		fmt.Println("ready")
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		go func() { io.Copy(io.Discard, os.Stdin); cancel() }()
		l.Serve(ctx)
		os.Exit(0)
	case "connect":
		plan, err := ReadPlan(os.Stdin)
		if err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		enc := json.NewEncoder(os.Stdout)
		NewConnector(plan).Run(context.Background(), plan.For("*"), func(r Result) {
			enc.Encode(ResultLine("", r))
		})
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// freePort finds a port free for TCP and UDP on both loopbacks, below the
// kernel's ephemeral range. A port from that range (bind to :0) was the
// cause of TestLoopbackBothWays' flake: the test releases it and expects it
// to stay closed, but every socket on the machine that binds port 0 draws
// from the same range, and when an unconnected UDP socket of a parallel test
// (or of another developer's run) got it, the datagram to the "closed" port
// was delivered there and the case timed out instead of being refused.
// Below the range only a process that binds that exact port can take it.
func freePort(t *testing.T) uint16 {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 10000 {
				low = v
			}
		}
	}
	for i := 0; i < 200; i++ {
		p := uint16(low - 1 - rand.IntN(low-10000))
		ok := true
		for _, n := range []string{"tcp6", "udp4", "udp6"} {
			host := "127.0.0.1"
			if strings.HasSuffix(n, "6") {
				host = "::1"
			}
			a := net.JoinHostPort(host, strconv.Itoa(int(p)))
			if strings.HasPrefix(n, "tcp") {
				c, err := net.Listen(n, a)
				if err != nil {
					ok = false
					break
				}
				c.Close()
			} else {
				c, err := net.ListenPacket(n, a)
				if err != nil {
					ok = false
					break
				}
				c.Close()
			}
		}
		if ok {
			return p
		}
	}
	t.Fatal("no free port")
	return 0
}

func TestLoopbackBothWays(t *testing.T) {
	open, closed := freePort(t), freePort(t)
	l, err := Listen(ListenConfig{Ports: []uint16{open}, TCP: true, UDP: true,
		Addr4: "127.0.0.1", Addr6: "::1"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Serve(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	var targets []Target
	for _, proto := range []string{"tcp", "udp"} {
		for _, host := range []string{"127.0.0.1", "::1"} {
			for _, p := range []uint16{open, closed} {
				targets = append(targets, Target{ID: fmt.Sprintf("%s/%s/%d", proto, host, p), Proto: proto,
					Addr: net.JoinHostPort(host, strconv.Itoa(int(p)))})
			}
		}
	}
	got := map[string]Result{}
	NewConnector(nil).Run(context.Background(), targets, func(r Result) { got[r.ID] = r })
	if len(got) != len(targets) {
		t.Fatalf("%d results for %d targets", len(got), len(targets))
	}
	self := Self()
	for _, tg := range targets {
		r := got[tg.ID]
		if strings.HasSuffix(tg.ID, "/"+strconv.Itoa(int(open))) {
			if !r.Allowed || r.Peer != self {
				t.Errorf("%s: want allowed by %v, got %+v", tg.ID, self, r)
			}
			continue
		}
		if r.Allowed || r.Kind != "ECONNREFUSED" {
			t.Errorf("%s: want ECONNREFUSED, got allowed=%v kind=%s err=%v", tg.ID, r.Allowed, r.Kind, r.Err)
		}
	}
}

// The abstract Unix sockets answer like TCP and UDP: an open name with the
// listener's identity, a name nobody serves with ECONNREFUSED, at once.
func TestUnixBothWays(t *testing.T) {
	open, closed := freePort(t), freePort(t)
	l, err := Listen(ListenConfig{Ports: []uint16{open}, Unix: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Serve(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	var targets []Target
	for _, proto := range []string{ProtoUnixStream, ProtoUnixDgram} {
		for _, p := range []uint16{open, closed} {
			targets = append(targets, Target{ID: fmt.Sprintf("%s/%d", proto, p), Proto: proto, Addr: UnixName(p, proto)})
		}
	}
	got := map[string]Result{}
	NewConnector(nil).Run(context.Background(), targets, func(r Result) { got[r.ID] = r })
	self := Self()
	for _, tg := range targets {
		r, ok := got[tg.ID]
		switch {
		case !ok:
			t.Errorf("%s: no result", tg.ID)
		case strings.HasSuffix(tg.ID, "/"+strconv.Itoa(int(open))):
			if !r.Allowed || r.Peer != self {
				t.Errorf("%s: want allowed by %v, got %+v", tg.ID, self, r)
			}
		case r.Allowed || r.Kind != "ECONNREFUSED" || r.Elapsed > 300*time.Millisecond:
			t.Errorf("%s: want ECONNREFUSED at once, got allowed=%v kind=%s err=%v in %v", tg.ID, r.Allowed, r.Kind, r.Err, r.Elapsed)
		}
	}
}

func TestBindFailureClosesEverything(t *testing.T) {
	p := freePort(t)
	busy, err := net.ListenPacket("udp6", net.JoinHostPort("::1", strconv.Itoa(int(p))))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	if _, err := Listen(ListenConfig{Ports: []uint16{p}, TCP: true, UDP: true,
		Addr4: "127.0.0.1", Addr6: "::1"}); err == nil {
		t.Fatal("listen on a busy port succeeded")
	}
	// The sockets bound before the failure must be gone again.
	l, err := net.Listen("tcp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(p))))
	if err != nil {
		t.Fatalf("tcp4 port still held after a failed Listen: %v", err)
	}
	l.Close()
}

func TestReadPlanRejectsBadInput(t *testing.T) {
	for _, in := range []string{
		`{"hosts":{"n1":[{"id":"a","addr":"1.2.3.4","proto":"tcp"}]}}`,
		`{"hosts":{"n1":[{"id":"a","addr":"127.0.0.1:1","proto":"sctp"}]}}`,
		`{"hosts":{}, "bogus":1}`,
		`not json`,
	} {
		if _, err := ReadPlan(strings.NewReader(in)); err == nil {
			t.Errorf("plan %s accepted", in)
		}
	}
	p, err := ReadPlan(strings.NewReader(`{"hosts":{"n1":[{"id":"a","addr":"[::1]:9","proto":"udp"}],"*":[{"id":"b","addr":"127.0.0.1:9","proto":"tcp"}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := len(p.For("n1")); got != 2 {
		t.Errorf("For(n1) = %d targets, want 2 (own + *)", got)
	}
	if got := len(p.For("n2")); got != 1 {
		t.Errorf("For(n2) = %d targets, want 1 (*)", got)
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// waitUp waits until dev's operstate is UP: a fresh veth comes up (and with
// it IPv6 routing) only when the kernel's link watch runs, up to a second
// after `ip link set up`; IPv4 does not wait, so the families would differ.
func waitUp(t *testing.T, ns, dev string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		out, _ := exec.Command("ip", "-n", ns, "-o", "link", "show", "dev", dev).Output()
		if strings.Contains(string(out), "state UP") {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s in %s never came up", dev, ns)
}

// TestRefusalKinds builds two scratch namespaces joined by a veth pair and
// refuses traffic in every way a data plane might, checking that the
// connector names each refusal and that only a silent drop costs time.
func TestRefusalKinds(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	tag := strconv.Itoa(os.Getpid() % 100000)
	nsA, nsB := "palchk-"+tag+"-a", "palchk-"+tag+"-b"
	vA, vB := "palchk"+tag+"a", "palchk"+tag+"b"
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", nsA).Run()
		exec.Command("ip", "netns", "del", nsB).Run()
	})
	run(t, "ip", "netns", "add", nsA)
	run(t, "ip", "netns", "add", nsB)
	run(t, "ip", "link", "add", vA, "netns", nsA, "type", "veth", "peer", "name", vB, "netns", nsB)
	for _, s := range []struct{ ns, dev, v4, v6 string }{
		{nsA, vA, "198.18.250.1/24", "2001:2:0:fa::1/64"},
		{nsB, vB, "198.18.250.2/24", "2001:2:0:fa::2/64"},
	} {
		run(t, "ip", "-n", s.ns, "link", "set", "lo", "up")
		run(t, "ip", "-n", s.ns, "addr", "add", s.v4, "dev", s.dev)
		run(t, "ip", "-n", s.ns, "addr", "add", s.v6, "dev", s.dev, "nodad")
		run(t, "ip", "-n", s.ns, "link", "set", s.dev, "up")
	}
	const (
		pOpen   = 29201 // served
		pProhib = 29202 // rejected by B with ICMP administratively prohibited
		pDrop   = 29203 // silently dropped by B
		pReset  = 29204 // TCP reset by B (UDP: no listener → port unreachable)
		pLocal  = 29205 // dropped on A's output: EPERM for UDP; TCP just retransmits its SYN
		pNone   = 29206 // nothing listens
	)
	nftB := fmt.Sprintf(`table inet palchk {
  chain in { type filter hook input priority 0;
    th dport %d reject with icmpx admin-prohibited
    th dport %d drop
    tcp dport %d reject with tcp reset
  }
}`, pProhib, pDrop, pReset)
	nftA := fmt.Sprintf(`table inet palchk {
  chain out { type filter hook output priority 0; th dport %d drop; }
}`, pLocal)
	for ns, rules := range map[string]string{nsA: nftA, nsB: nftB} {
		cmd := exec.Command("ip", "netns", "exec", ns, "nft", "-f", "-")
		cmd.Stdin = strings.NewReader(rules)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("nft in %s: %v\n%s", ns, err, out)
		}
	}

	cfg, _ := json.Marshal(ListenConfig{Ports: []uint16{pOpen, pProhib, pDrop, pLocal}, TCP: true, UDP: true})
	lis := exec.Command("ip", "netns", "exec", nsB, os.Args[0])
	lis.Env = append(os.Environ(), "PALCHK_PROBE_HELPER=listen", "PALCHK_PROBE_CFG="+string(cfg))
	stdin, _ := lis.StdinPipe()
	stdout, _ := lis.StdoutPipe()
	lis.Stderr = os.Stderr
	if err := lis.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); lis.Process.Kill(); lis.Wait() })
	if line, _ := bufio.NewReader(stdout).ReadString('\n'); line != "ready\n" {
		t.Fatalf("listener: %q", line)
	}
	// pReset has no listener: UDP gets port unreachable from B's kernel.
	// ICMP errors are rate limited per peer (burst 6): dozens of concurrent
	// refusals would otherwise turn into timeouts. The limits are per netns.
	for _, kv := range []string{"net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"} {
		run(t, "ip", "netns", "exec", nsB, "sysctl", "-qw", kv)
	}
	waitUp(t, nsA, vA)
	waitUp(t, nsB, vB)
	want := map[string]string{}
	plan := Plan{Hosts: map[string][]Target{}}
	for _, proto := range []string{"tcp", "udp"} {
		for fam, host := range map[int]string{4: "198.18.250.2", 6: "2001:2:0:fa::2"} {
			prohib := "EHOSTUNREACH"
			if fam == 6 {
				prohib = "EACCES"
			}
			local := "EPERM"
			if proto == "tcp" {
				local = KindTimeout
			}
			for p, kind := range map[uint16]string{pOpen: "", pProhib: prohib, pDrop: KindTimeout,
				pReset: "ECONNREFUSED", pLocal: local, pNone: "ECONNREFUSED"} {
				id := fmt.Sprintf("%s%d/%d", proto, fam, p)
				want[id] = kind
				plan.Hosts["*"] = append(plan.Hosts["*"], Target{ID: id, Proto: proto,
					Addr: net.JoinHostPort(host, strconv.Itoa(int(p)))})
			}
		}
	}
	pj, _ := json.Marshal(plan)
	con := exec.Command("ip", "netns", "exec", nsA, os.Args[0])
	con.Env = append(os.Environ(), "PALCHK_PROBE_HELPER=connect")
	con.Stdin = strings.NewReader(string(pj))
	start := time.Now()
	out, err := con.Output()
	if err != nil {
		t.Fatalf("connector: %v\n%s", err, out)
	}
	wall := time.Since(start)
	got := map[string]Line{}
	for _, ln := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var l Line
		if err := json.Unmarshal([]byte(ln), &l); err != nil {
			t.Fatalf("bad line %q", ln)
		}
		got[l.ID] = l
	}
	for id, kind := range want {
		l, ok := got[id]
		switch {
		case !ok:
			t.Errorf("%s: no result", id)
		case kind == "" && (!l.Allowed || l.Peer == nil || l.Peer.UID != 0):
			t.Errorf("%s: want allowed with a peer identity, got %+v", id, l)
		case id == fmt.Sprintf("tcp6/%d", pProhib) && !l.Allowed && (l.Kind == KindTimeout || l.Kind == "EACCES"):
			// Measured on kernel 6.18: the ICMPv6 error to the first SYN
			// arrives while connect() still owns the socket and is kept
			// as a soft error; connect fails (EACCES) only when the
			// retransmitted SYN draws a second one, after 1 s — just
			// before or just after the connector's 1 s timeout.
			t.Logf("%-14s %s after %dµs (ICMPv6 admin-prohibited does not abort a TCP connect at once)", id, l.Kind, l.Micros)
		case kind != "" && (l.Allowed || l.Kind != kind):
			t.Errorf("%s: want refused %s, got allowed=%v kind=%s (%s)", id, kind, l.Allowed, l.Kind, l.Error)
		default:
			t.Logf("%-14s %-13s %6dµs", id, map[bool]string{true: "allowed"}[l.Allowed]+l.Kind, l.Micros)
		}
	}
	// All cases run concurrently: the whole plan costs about one TCP
	// timeout (six of its cases are silent drops that wait for it); run
	// one after the other they would cost six.
	if limit := 2 * NewConnector(&plan).TCPTimeout; wall > limit {
		t.Errorf("plan of %d cases took %v (more than %v); cases must run concurrently", len(want), wall, limit)
	}
}
