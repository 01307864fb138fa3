package egress

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/ipam"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Paths the benchmark compares (reference 002, Table 1).
var BenchPaths = []string{"direct", "tun", "tun-usergw", "netstack", "openconnect", "direct-http", "socks"}

// BenchUser runs the client side of the benchmarks.
const BenchUser = "alice"

// Throughput measures node1 -> outside host bandwidth in Mbit/s with
// streams parallel transfers over one path:
//
//	direct       plain routing through the gateway host (no tunnel): the baseline
//	tun          palisade egress, namespace + tun, root gateway (kernel tun)
//	tun-usergw   palisade egress, namespace + tun, unprivileged netstack gateway
//	netstack     palisade egress --path netstack (veth + packet socket + gVisor), root gateway
//	direct-http  parallel HTTP downloads, routed without a tunnel: socks's baseline
//	socks        palisade egress --path socks (the same downloads through the proxy)
//	openconnect  the reference's stack: ocserv on the gateway host, openconnect
//	             on the node (TCP-only, as in reference 002's measurements)
//
// iperf3 is used everywhere but socks, where parallel HTTP downloads of a
// 64 MiB object stand in (iperf3 cannot speak SOCKS).
func (e *Env) Throughput(ctx context.Context, tb *testbed.Testbed, path string, streams int, dur time.Duration) (float64, error) {
	r, err := e.ThroughputCPU(ctx, tb, path, streams, dur)
	return r.Mbps, err
}

// Transfer is one measured transfer.
type Transfer struct {
	Mbps float64
	// ClientCPU is the CPU time (user + system, s) of the client's whole
	// process tree on node1: the transfer program, and for the tunnelled
	// paths the client data path (palisade egress, openconnect).
	ClientCPU float64
}

// ThroughputCPU is Throughput with the client side's CPU time.
func (e *Env) ThroughputCPU(ctx context.Context, tb *testbed.Testbed, path string, streams int, dur time.Duration) (Transfer, error) {
	var cpu float64
	// output runs a client command and adds its tree's CPU time (wait4
	// reports the child with every descendant it waited for).
	output := func(cmd *exec.Cmd) (string, error) {
		out, err := cmd.Output()
		if cmd.ProcessState != nil {
			cpu += (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
		}
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			return string(out), fmt.Errorf("%v: %s%s", err, out, stderr)
		}
		return string(out), nil
	}
	mbps, err := e.throughput(ctx, tb, path, streams, dur, output)
	return Transfer{Mbps: mbps, ClientCPU: cpu}, err
}

func (e *Env) throughput(ctx context.Context, tb *testbed.Testbed, path string, streams int, dur time.Duration, output func(*exec.Cmd) (string, error)) (float64, error) {
	node, _ := tb.Node("node1")
	// A fresh one-shot server per run: a client that dies mid-test leaves a
	// shared iperf3 server "busy" for the next one.
	port, stopServer, err := e.iperfServer(ctx)
	if err != nil {
		return 0, err
	}
	defer stopServer()
	iperf := []string{"iperf3", "-c", OutsideAddr.String(), "-p", strconv.Itoa(port), "-P", strconv.Itoa(streams),
		"-t", strconv.Itoa(int(dur.Seconds())), "-J"}
	switch path {
	case "direct":
		if err := sh(ctx, "ip", "-n", node.NetNS, "route", "replace", OutsideNet.String(), "via", GatewayAddr.String()); err != nil {
			return 0, err
		}
		defer sh(context.Background(), "ip", "-n", node.NetNS, "route", "replace", "unreachable", OutsideNet.String())
		out, err := output(tb.Command(ctx, "node1", BenchUser, iperf...))
		if err != nil {
			return 0, err
		}
		return iperfMbps(out)
	case "tun", "tun-usergw", "netstack":
		tok, err := e.Token(BenchUser, "bench"+strconv.Itoa(streams), path == "tun-usergw", time.Hour)
		if err != nil {
			return 0, err
		}
		cpath := "tun"
		if path == "netstack" {
			cpath = "netstack"
		}
		cmd := tb.Command(ctx, "node1", BenchUser, append([]string{"palisade", "egress", "--path", cpath, "--"}, iperf...)...)
		cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+tok)
		out, err := output(cmd)
		if err != nil {
			return 0, err
		}
		return iperfMbps(out)
	case "socks", "direct-http":
		script := fmt.Sprintf(`for i in $(seq %d); do curl -s -o /dev/null -w "%%{size_download} %%{time_total}\n" http://%s/blob & done; wait`, streams, OutsideAddr)
		var cmd *exec.Cmd
		if path == "socks" {
			tok, err := e.Token(BenchUser, "benchs"+strconv.Itoa(streams), false, time.Hour)
			if err != nil {
				return 0, err
			}
			cmd = tb.Command(ctx, "node1", BenchUser, "palisade", "egress", "--path", "socks", "--", "sh", "-c", script)
			cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+tok)
		} else {
			if err := sh(ctx, "ip", "-n", node.NetNS, "route", "replace", OutsideNet.String(), "via", GatewayAddr.String()); err != nil {
				return 0, err
			}
			defer sh(context.Background(), "ip", "-n", node.NetNS, "route", "replace", "unreachable", OutsideNet.String())
			cmd = tb.Command(ctx, "node1", BenchUser, "sh", "-c", script)
		}
		out, err := output(cmd)
		if err != nil {
			return 0, err
		}
		var bytes, secs float64
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			var b, s float64
			if _, err := fmt.Sscan(l, &b, &s); err == nil {
				bytes += b
				secs = max(secs, s)
			}
		}
		if secs == 0 || bytes < float64(streams)*(64<<20) {
			return 0, fmt.Errorf("downloads incomplete: %q", out)
		}
		return bytes * 8 / secs / 1e6, nil
	case "openconnect":
		stop, err := e.openconnect(ctx, tb, node)
		if err != nil {
			return 0, err
		}
		defer stop()
		out, err := output(tb.Command(ctx, "node1", BenchUser, iperf...))
		if err != nil {
			return 0, err
		}
		return iperfMbps(out)
	}
	return 0, fmt.Errorf("unknown path %q (want one of %v)", path, BenchPaths)
}

var iperfPorts = 5300

func (e *Env) iperfServer(ctx context.Context) (int, func(), error) {
	iperfPorts++
	if iperfPorts > 5399 {
		iperfPorts = 5301
	}
	port := iperfPorts
	cmd := exec.Command("ip", "netns", "exec", e.OutNS, "iperf3", "-s", "-1", "-p", strconv.Itoa(port))
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	stop := func() {
		cmd.Process.Kill()
		cmd.Wait()
	}
	for i := 0; i < 50; i++ {
		out, _ := exec.Command("ip", "netns", "exec", e.OutNS, "ss", "-Htln", "sport", "= :"+strconv.Itoa(port)).Output()
		if len(strings.TrimSpace(string(out))) > 0 {
			return port, stop, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	return 0, nil, fmt.Errorf("iperf3 server on port %d did not start", port)
}

func iperfMbps(out string) (float64, error) {
	var r struct {
		End struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
		Error string `json:"error"`
	}
	if i := strings.IndexByte(out, '{'); i > 0 {
		out = out[i:]
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return 0, fmt.Errorf("iperf3 output: %v: %.300s", err, out)
	}
	if r.Error != "" {
		return 0, fmt.Errorf("iperf3: %s", r.Error)
	}
	return r.End.SumReceived.BitsPerSecond / 1e6, nil
}

const (
	ocPort = 4443
	ocPool = "100.66.0.0"
)

// ocserv starts the reference's server on the gateway host once (root; its
// own tun "paloc"; pool 100.66.0.0/24; certificate made here with Go's crypto).
func (e *Env) ocserv(ctx context.Context) (pin string, err error) {
	dir := filepath.Join(e.Dir, "ocserv")
	if b, err := os.ReadFile(filepath.Join(dir, "pin")); err == nil {
		return string(b), nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "palisade-ocserv"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{GatewayAddr.AsSlice()}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return "", err
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	os.WriteFile(filepath.Join(dir, "cert.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(filepath.Join(dir, "key.pem"), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
	spki, _ := x509.MarshalPKIXPublicKey(&key.PublicKey)
	sum := sha256.Sum256(spki)
	pin = "pin-sha256:" + base64.StdEncoding.EncodeToString(sum[:])
	hash, err := exec.CommandContext(ctx, "openssl", "passwd", "-6", "bench").Output()
	if err != nil {
		return "", fmt.Errorf("openssl passwd: %v", err)
	}
	os.WriteFile(filepath.Join(dir, "passwd"), []byte("bench:bench:"+strings.TrimSpace(string(hash))+"\n"), 0o600)
	conf := fmt.Sprintf(`auth = "plain[passwd=%[1]s/passwd]"
tcp-port = %[2]d
run-as-user = nobody
run-as-group = nogroup
socket-file = %[1]s/ocserv.sock
server-cert = %[1]s/cert.pem
server-key = %[1]s/key.pem
isolate-workers = false
max-clients = 16
max-same-clients = 16
keepalive = 300
dpd = 90
mobile-dpd = 90
try-mtu-discovery = false
device = paloc
ipv4-network = %[3]s
ipv4-netmask = 255.255.255.0
route = %[4]s
pid-file = %[1]s/ocserv.pid
cookie-timeout = 300
predictable-ips = true
`, dir, ocPort, ocPool, "198.18.201.0/255.255.255.0")
	os.WriteFile(filepath.Join(dir, "ocserv.conf"), []byte(conf), 0o644)
	// Replies to the ocserv pool (no masquerade in the reference setup's
	// privileged mode: the outside host routes the pool back).
	sh(ctx, "ip", "-n", e.OutNS, "route", "replace", ocPool+"/24", "via", GatewayOut.String())
	if err := e.spawn(e.GwNS, 0, "ocserv", "ocserv", "-f", "-c", filepath.Join(dir, "ocserv.conf")); err != nil {
		return "", err
	}
	time.Sleep(500 * time.Millisecond)
	os.WriteFile(filepath.Join(dir, "pin"), []byte(pin), 0o644)
	return pin, nil
}

// openconnect connects node's netns to ocserv (root, as the reference's
// privileged client); the returned func disconnects and restores the route.
func (e *Env) openconnect(ctx context.Context, tb *testbed.Testbed, node testbed.Node) (func(), error) {
	pin, err := e.ocserv(ctx)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(e.Dir, "ocserv")
	// Our own connect script: vpnc-script would rewrite the host's resolv.conf.
	script := filepath.Join(dir, "connect.sh")
	os.WriteFile(script, []byte(`#!/bin/sh
case "$reason" in
connect)
  ip link set dev "$TUNDEV" up mtu "${INTERNAL_IP4_MTU:-1400}"
  ip addr add "$INTERNAL_IP4_ADDRESS/32" dev "$TUNDEV"
  ip route replace `+OutsideNet.String()+` dev "$TUNDEV"
  ;;
disconnect)
  ip route replace unreachable `+OutsideNet.String()+`
  ;;
esac
exit 0
`), 0o755)
	cmd := exec.Command("ip", "netns", "exec", node.NetNS, "openconnect", "--protocol=anyconnect", "--user=bench",
		"--passwd-on-stdin", "--servercert", pin, "--script", script, "--interface", "paloc0", "--no-dtls",
		fmt.Sprintf("https://%s:%d", GatewayAddr, ocPort))
	cmd.Stdin = strings.NewReader("bench\n")
	logf, _ := os.Create(filepath.Join(dir, "openconnect.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	stop := func() {
		cmd.Process.Signal(syscall.SIGINT)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		logf.Close()
		sh(context.Background(), "ip", "-n", node.NetNS, "route", "replace", "unreachable", OutsideNet.String())
	}
	for i := 0; i < 100; i++ {
		out, _ := exec.Command("ip", "-n", node.NetNS, "route", "get", OutsideAddr.String()).CombinedOutput()
		if strings.Contains(string(out), "paloc0") {
			return stop, nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	log, _ := os.ReadFile(filepath.Join(dir, "openconnect.log"))
	return nil, fmt.Errorf("openconnect did not come up: %s", log)
}

// GatewayRSS joins n clients (tun path, one egress process each, spread over
// the nodes, as n different jobs of two users) to the root gateway, or the
// unprivileged one, and returns the gateway's resident memory in bytes with
// all of them connected and passing a packet.
func (e *Env) GatewayRSS(ctx context.Context, tb *testbed.Testbed, n int, unpriv bool) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var cmds []*exec.Cmd
	defer func() {
		for _, c := range cmds {
			c.Process.Signal(syscall.SIGTERM)
		}
		for _, c := range cmds {
			c.Wait()
		}
	}()
	for i := 0; i < n; i++ {
		user := []string{"alice", "bob"}[i%2]
		node := tb.Nodes[i%len(tb.Nodes)].Name
		tok, err := e.Token(user, fmt.Sprintf("rss%d", i), unpriv, time.Hour)
		if err != nil {
			return 0, err
		}
		c := tb.Command(ctx, node, user, "palisade", "egress", "--", "sh", "-c",
			fmt.Sprintf("echo x | socat -t 2 - UDP:%s:7 >/dev/null; sleep 600", OutsideAddr))
		c.Env = append(c.Env, "PALISADE_EGRESS_TOKEN="+tok)
		if err := c.Start(); err != nil {
			return 0, err
		}
		cmds = append(cmds, c)
	}
	want := n
	var s, _ = e.Stats(unpriv)
	for end := time.Now().Add(time.Duration(n)*500*time.Millisecond + 20*time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		s, _ = e.Stats(unpriv)
		if count(s.Leases, "rss") >= want {
			break
		}
	}
	if got := count(s.Leases, "rss"); got < want {
		return 0, fmt.Errorf("only %d of %d clients joined", got, want)
	}
	// Every client's first packet through, and the gateway settled (it
	// returns burst memory to the OS after a few quiet seconds).
	time.Sleep(15 * time.Second)
	name := "gateway-root"
	if unpriv {
		name = "gateway-user"
	}
	return rss(e.Procs[name])
}

func count(ls []ipam.Lease, prefix string) int {
	n := 0
	for _, l := range ls {
		if strings.HasPrefix(l.Job, prefix) {
			n++
		}
	}
	return n
}

func rss(pid int) (int64, error) {
	r, _, ok := procfs.Memory(pid)
	if !ok {
		return 0, fmt.Errorf("no VmRSS for pid %d", pid)
	}
	return int64(r), nil
}

// ShapeLinks limits the link between the gateway host and the outside host,
// both directions, to rate (tc tbf, e.g. "1gbit", as the reference's 1 Gbit/s
// links); "" removes it.
// Every path crosses that link, so the comparison stays fair.
func (e *Env) ShapeLinks(ctx context.Context, rate string) error {
	for _, ns := range []string{e.GwNS, e.OutNS} {
		dev := "eth1"
		if ns == e.OutNS {
			dev = "eth0"
		}
		sh(ctx, "ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
		if rate == "" {
			continue
		}
		if err := sh(ctx, "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512k", "latency", "20ms"); err != nil {
			return err
		}
	}
	return nil
}
