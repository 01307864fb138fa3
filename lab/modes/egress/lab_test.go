package egress

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/ipam"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// The package's own testbed instance (others run theirs concurrently).
var tbName = testbed.RunName("eg")

var (
	tb  *testbed.Testbed
	env *Env
)

// needTestbed skips t when TestMain brought no testbed up (not root, or
// -short).
func needTestbed(t *testing.T) {
	t.Helper()
	if tb == nil {
		t.Skip("egress lab tests need root and no -short (they bring up a testbed)")
	}
}

func TestMain(m *testing.M) {
	testbed.RegisterExtension(Name, Ext{}) // as cmd/palisade-lab wires it
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		// No testbed: every test reports itself skipped (needTestbed);
		// the package must not pass without saying so.
		os.Exit(m.Run())
	}
	code, err := run(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

func run(m *testing.M) (int, error) {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "palegt-bin-")
	if err != nil {
		return 1, err
	}
	defer os.RemoveAll(dir)
	bin := os.Getenv("PALISADE_EGRESS_TEST_BINARY") // a prebuilt palisade, if given
	if bin == "" {
		bin = filepath.Join(dir, "palisade")
		build := exec.Command("go", "build", "-o", bin, "github.com/palisade-hpc/palisade/cmd/palisade")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return 1, fmt.Errorf("go build: %v\n%s", err, out)
		}
	}
	testbed.DownOrphans(ctx)
	tb, err = testbed.Up(ctx, testbed.Options{Name: tbName, Nodes: 2, Egress: true, Binary: bin})
	if err != nil {
		return 1, err
	}
	defer testbed.Down(context.Background(), tbName)
	if env, err = Open(tb); err != nil {
		return 1, err
	}
	return m.Run(), nil
}

// egress runs `palisade egress ARGS...` as user on node with the token.
func egress(t *testing.T, node, user, token string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := tb.Command(ctx, node, user, append([]string{"palisade", "egress"}, args...)...)
	cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+token)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func token(t *testing.T, user, job string, unpriv bool) string {
	t.Helper()
	tok, err := env.Token(user, job, unpriv, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

const outsideScript = `set -e
curl -sS -m 10 http://outside.pal.test/
echo udp-probe-$$ | socat -t 3 - UDP:outside.pal.test:7
getent hosts "$1"
`

// TestReachOutside: a job reaches the outside host by name over TCP (HTTP)
// and UDP (echo), and resolves its own overlay name, through every data path
// and both gateways.
func TestReachOutside(t *testing.T) {
	needTestbed(t)
	cases := []struct {
		name   string
		path   string
		unpriv bool
	}{
		{"tun-rootgw", "tun", false},
		{"tun-usergw", "tun", true},
		{"netstack-rootgw", "netstack", false},
		{"netstack-usergw", "netstack", true},
		{"socks-rootgw", "socks", false},
		{"socks-usergw", "socks", true},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			job := fmt.Sprintf("reach%d", i)
			tok := token(t, "alice", job, c.unpriv)
			if c.path == "socks" {
				// Programs that honour ALL_PROXY (curl) go through the
				// proxy; DNS is resolved at the gateway (socks5h).
				out, err := egress(t, "node1", "alice", tok, "--path", "socks", "--", "curl", "-sS", "-m", "10", "http://outside.pal.test/")
				if err != nil || !strings.Contains(out, "palisade-outside hello "+GatewayOut.String()) {
					t.Fatalf("socks http: %v\n%s", err, out)
				}
				return
			}
			out, err := egress(t, "node1", "alice", tok, "--path", c.path, "--", "sh", "-c", outsideScript, "sh", "alice-"+job+"-node1")
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			// The outside host sees the gateway's address (masquerade or relay).
			if !strings.Contains(out, "palisade-outside hello "+GatewayOut.String()+":") {
				t.Errorf("no HTTP answer via the gateway:\n%s", out)
			}
			if !strings.Contains(out, "udp-probe-") {
				t.Errorf("no UDP echo:\n%s", out)
			}
			pool := "100.64."
			if c.unpriv {
				pool = "100.65."
			}
			if !strings.Contains(out, pool) || !strings.Contains(out, "alice-"+job+"-node1.egress.palisade") {
				t.Errorf("overlay name not resolved to a pool address:\n%s", out)
			}
		})
	}
}

// TestNoLeak: the node has no route to the outside host; while a job's
// traffic flows, nothing but tunnel UDP leaves the node toward the gateway
// and nothing at all toward the outside network.
func TestNoLeak(t *testing.T) {
	needTestbed(t)
	ctx := context.Background()
	n, _ := tb.Node("node2")
	if out, err := exec.Command("ip", "-n", n.NetNS, "route", "get", OutsideAddr.String()).CombinedOutput(); err == nil {
		t.Fatalf("node2 has a route to the outside host: %s", out)
	}
	if out, err := tb.Output(ctx, "node2", "alice", "curl", "-sS", "-m", "3", "http://"+OutsideAddr.String()+"/"); err == nil {
		t.Fatalf("direct access to the outside host works without the tunnel: %s", out)
	}
	rules := fmt.Sprintf(`table inet palegt_leak {
  chain out {
    type filter hook output priority 0; policy accept;
    ip daddr %s counter name outside_pkts
    ip daddr %s udp dport { %d, %d } counter name tunnel_pkts
    ip daddr %s udp dport != { %d, %d } counter name other_gw_pkts
    ip daddr %s meta l4proto != udp counter name other_gw_pkts
  }
  counter outside_pkts {}
  counter tunnel_pkts {}
  counter other_gw_pkts {}
}
`, OutsideNet, GatewayAddr, RootPort, RootPort+1, GatewayAddr, RootPort, RootPort+1, GatewayAddr)
	nft := exec.Command("ip", "netns", "exec", n.NetNS, "nft", "-f", "-")
	nft.Stdin = strings.NewReader(rules)
	if out, err := nft.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v %s", err, out)
	}
	defer exec.Command("ip", "netns", "exec", n.NetNS, "nft", "delete", "table", "inet", "palegt_leak").Run()
	out, err := egress(t, "node2", "alice", token(t, "alice", "leak", false), "--", "sh", "-c", outsideScript, "sh", "alice-leak-node2")
	if err != nil || !strings.Contains(out, "palisade-outside hello") {
		t.Fatalf("%v\n%s", err, out)
	}
	counters, _ := exec.Command("ip", "netns", "exec", n.NetNS, "nft", "list", "counters", "table", "inet", "palegt_leak").CombinedOutput()
	get := func(name string) string {
		s := string(counters)
		i := strings.Index(s, "counter "+name)
		if i < 0 {
			return "?"
		}
		f := strings.Fields(s[i:])
		for j, w := range f {
			if w == "packets" && j+1 < len(f) {
				return f[j+1]
			}
		}
		return "?"
	}
	if get("outside_pkts") != "0" || get("other_gw_pkts") != "0" {
		t.Errorf("traffic outside the tunnel:\n%s", counters)
	}
	if get("tunnel_pkts") == "0" || get("tunnel_pkts") == "?" {
		t.Errorf("no tunnel traffic counted:\n%s", counters)
	}
}

// listen starts a job that serves one TCP line on port 7000 inside its
// namespace and stays up; it returns a stop function.
func listen(t *testing.T, node, user, job string) func() {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := tb.Command(ctx, node, user, "palisade", "egress", "--", "socat", "TCP-LISTEN:7000,fork,reuseaddr", "SYSTEM:echo served-by-"+user)
	cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+token(t, user, job, false))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop := func() { cancel(); cmd.Wait() }
	// Wait for its lease to show up at the gateway.
	for i := 0; i < 100; i++ {
		s, _ := env.Stats(false)
		for _, l := range s.Leases {
			if l.Name() == user+"-"+job+"-"+node {
				time.Sleep(500 * time.Millisecond)
				return stop
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	t.Fatalf("listener job %s-%s never joined", user, job)
	return nil
}

// TestUserIsolation: another user's client is unreachable through the
// gateway; the same user's other job reaches it (by its overlay name).
func TestUserIsolation(t *testing.T) {
	needTestbed(t)
	stop := listen(t, "node1", "alice", "srv")
	defer stop()
	connect := "socat -T 3 - TCP:alice-srv-node1:7000,connect-timeout=3 </dev/null"
	out, err := egress(t, "node2", "alice", token(t, "alice", "cli", false), "--", "sh", "-c", connect)
	if err != nil || !strings.Contains(out, "served-by-alice") {
		t.Fatalf("same user's job not reachable: %v\n%s", err, out)
	}
	before, _ := env.Stats(false)
	out, err = egress(t, "node2", "bob", token(t, "bob", "cli", false), "--", "sh", "-c", connect)
	if err == nil || strings.Contains(out, "served-by-alice") {
		t.Fatalf("bob reached alice's job through the gateway:\n%s", out)
	}
	// The gateway writes its counters every second: wait for the drop to
	// show, within a bound.
	after := before
	for deadline := time.Now().Add(10 * time.Second); after.IsolationDrop <= before.IsolationDrop && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		after, _ = env.Stats(false)
	}
	if after.IsolationDrop <= before.IsolationDrop {
		t.Errorf("gateway counted no isolation drop (%d -> %d)", before.IsolationDrop, after.IsolationDrop)
	}
}

// TestCredentials: bad, expired, wrongly pinned and revoked credentials get a
// clear error and no access; revoking a running job cuts it off.
func TestCredentials(t *testing.T) {
	needTestbed(t)
	good := token(t, "carol", "creds", false)
	tampered := good[:len(good)-3] + "AAA"
	if good[len(good)-3:] == "AAA" {
		tampered = good[:len(good)-3] + "BBB"
	}
	cases := []struct {
		name, token, want string
		args              []string
	}{
		{"tampered", tampered, "invalid join token", nil},
		{"garbage", "not-a-token", "invalid join token", nil},
		{"wrong-pin", good, "different from the pinned one", []string{"--gateway-key", env.UserKey}},
	}
	expired, err := env.Token("carol", "old", false, -time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	cases = append(cases, struct {
		name, token, want string
		args              []string
	}{"expired", expired, "expired", nil})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			args := append(append([]string{}, c.args...), "--", "curl", "-sS", "-m", "3", "http://outside.pal.test/")
			out, err := egress(t, "node1", "carol", c.token, args...)
			if err == nil || !strings.Contains(out, c.want) || strings.Contains(out, "palisade-outside hello") {
				t.Fatalf("want refusal %q, got err=%v:\n%s", c.want, err, out)
			}
		})
	}
	// Revocation of a job: refused at join; a running client is cut off.
	t.Run("revoked", func(t *testing.T) {
		tok := token(t, "carol", "rev", false)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		// The job's second request goes once the gateway has dropped its
		// lease (the test writes flag then), not after a fixed pause.
		flag := filepath.Join(testbed.HomeDir, "carol", tb.Name+"-revoked")
		os.Remove(flag)
		defer os.Remove(flag)
		script := `curl -sS -m 5 http://outside.pal.test/; while [ ! -e ` + flag + ` ]; do sleep 0.1; done; curl -sS -m 4 http://outside.pal.test/ && echo STILL-REACHABLE || echo CUT-OFF`
		cmd := tb.Command(ctx, "node1", "carol", "palisade", "egress", "--", "sh", "-c", script)
		cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+tok)
		// The job's output is read by one goroutine as it comes (the
		// first answer is the acknowledgement that the job is in) and
		// read here only once that goroutine has ended: a strings.Builder
		// read while the command writes to it was a data race.
		pipe, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = cmd.Stdout
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		hello, outDone := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(outDone)
			sc := bufio.NewScanner(pipe)
			for seen := false; sc.Scan(); {
				out.WriteString(sc.Text() + "\n")
				if !seen && strings.Contains(sc.Text(), "palisade-outside hello") {
					seen = true
					close(hello)
				}
			}
		}()
		// output ends the job (if it still runs) and returns all it wrote.
		output := func() string {
			cancel()
			<-outDone
			cmd.Wait()
			return out.String()
		}
		select {
		case <-hello:
		case <-outDone:
			t.Fatalf("the job ended before its first answer:\n%s", output())
		}
		// The gateway acknowledges a revocation by ending the lease (its
		// counters list the leases every second): first the lease is seen.
		leased := func() bool {
			st, _ := env.Stats(false)
			return slices.ContainsFunc(st.Leases, func(l ipam.Lease) bool { return l.Name() == "carol-rev-node1" })
		}
		for deadline := time.Now().Add(15 * time.Second); !leased(); time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the job's lease carol-rev-node1 never listed by the gateway:\n%s", output())
			}
		}
		if err := env.Revoke(false, "carol/rev"); err != nil {
			t.Fatal(err)
		}
		gone := false
		for deadline := time.Now().Add(15 * time.Second); !gone && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			gone = !leased()
		}
		if !gone {
			t.Fatal("the gateway kept the revoked job's lease for 15 s")
		}
		if err := os.WriteFile(flag, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		<-outDone
		cmd.Wait()
		if o := out.String(); !strings.Contains(o, "CUT-OFF") {
			t.Fatalf("revoked running job not cut off:\n%s", o)
		}
		o2, err := egress(t, "node1", "carol", tok, "--", "true")
		if err == nil || !strings.Contains(o2, "credentials revoked") {
			t.Fatalf("revoked job could rejoin: %v\n%s", err, o2)
		}
	})
}

// TestSlurm: the token travels with the job through srun and sbatch (the
// submission environment), and the job step's traffic leaves by the tunnel.
func TestSlurm(t *testing.T) {
	needTestbed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	tok := token(t, "alice", "slurm1", false)
	cmd := tb.Command(ctx, "node1", "alice", "srun", "-N1", "-w", "node2", "palisade", "egress", "--",
		"sh", "-c", "curl -sS -m 10 http://outside.pal.test/ && getent hosts alice-slurm1-node2")
	cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+tok)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "palisade-outside hello "+GatewayOut.String()) ||
		!strings.Contains(string(out), "alice-slurm1-node2.egress.palisade") {
		t.Fatalf("srun: %v\n%s", err, out)
	}
	jobOut := filepath.Join(testbed.HomeDir, "alice", tb.Name+"-sbatch.out") // homes are shared by instances
	os.Remove(jobOut)
	defer os.Remove(jobOut)
	cmd = tb.Command(ctx, "node2", "alice", "sbatch", "-N1", "-w", "node1", "-o", jobOut, "--wrap",
		"palisade egress -- curl -sS -m 10 http://outside.pal.test/; echo job-done")
	cmd.Env = append(cmd.Env, "PALISADE_EGRESS_TOKEN="+token(t, "alice", "slurm2", false))
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "Submitted batch job") {
		t.Fatalf("sbatch: %v\n%s", err, out)
	}
	var got string
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		b, _ := os.ReadFile(jobOut)
		if got = string(b); strings.Contains(got, "job-done") {
			break
		}
	}
	if !strings.Contains(got, "palisade-outside hello "+GatewayOut.String()) {
		t.Fatalf("sbatch job output: %q", got)
	}
}

// TestClusterDenied: the tunnel is a way out, not a way around the cluster's
// own isolation: through the gateway a job cannot reach the cluster networks
// (here a node's sshd), while the node itself can.
func TestClusterDenied(t *testing.T) {
	needTestbed(t)
	ctx := context.Background()
	target := "TCP:198.18.0.2:22,connect-timeout=3"
	if out, err := tb.Output(ctx, "node1", "alice", "sh", "-c", "echo | socat -T 2 - "+target); err != nil || !strings.Contains(out, "SSH-") {
		t.Fatalf("positive control: node1 cannot reach node2's sshd: %v %s", err, out)
	}
	for _, unpriv := range []bool{false, true} {
		out, err := egress(t, "node1", "alice", token(t, "alice", fmt.Sprintf("deny%v", unpriv), unpriv), "--", "sh", "-c", "echo | socat -T 2 - "+target)
		if err == nil || strings.Contains(out, "SSH-") {
			t.Errorf("unprivileged=%v: job reached the cluster through the gateway: %s", unpriv, out)
		}
	}
}
