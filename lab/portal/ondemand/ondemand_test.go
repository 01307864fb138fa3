package ondemand

import (
	"bufio"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// instance is this run's own testbed (packages test in parallel).
var instance = testbed.RunName("od")

// jupyterLab is JupyterLab from PyPI, installed by .ci/deps (/opt/pal-hub,
// pinned in .ci/pal-hub/requirements.txt).
const jupyterLab = "/opt/pal-hub/bin/jupyter-lab"

// The portal is node1 (its Apache and forwarder); apps run on node2, node3.
const portalNode = "node1"

//go:embed testdata/jupyter.sbatch
var batchScript []byte

//go:embed testdata/portal.conf
var apacheConf string

var tb *testbed.Testbed

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		fmt.Println("ondemand: integration tests need root (and no -short)")
		os.Exit(m.Run())
	}
	testbed.RegisterMode(uwlab.ModeName, uwlab.TestbedMode{}) // as cmd/palisade-lab wires it
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	testbed.DownOrphans(ctx)
	var err error
	tb, err = testbed.Up(ctx, testbed.Options{Name: instance, Nodes: 3, Mode: "userwall"})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testbed up:", err)
		_ = testbed.Down(context.Background(), instance)
		os.Exit(1)
	}
	code := m.Run()
	if err := testbed.Down(context.Background(), instance); err != nil {
		fmt.Fprintln(os.Stderr, "testbed down:", err)
		code = 1
	}
	os.Exit(code)
}

func nonce() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// app is one interactive app as its connection file describes it.
type app struct {
	owner, host, port, password, data string
}

// portal is the running portal node: Apache, the forwarder, the users'
// sessions and passwords.
type portal struct {
	t      *testing.T
	ctx    context.Context
	dir    string
	url    string
	passwd map[string]string
}

// TestOnDemand runs Open OnDemand's node proxy path: users authenticate to
// Apache, which proxies /rnode/<host>/<port>/ through `palisade portal
// forward` (as www-data, never exempt) to JupyterLab servers started by
// sbatch; every connection to an app is made as the authenticated user.
func TestOnDemand(t *testing.T) {
	if tb == nil {
		t.Skip("needs root and the " + instance + " testbed")
	}
	if _, err := os.Stat(jupyterLab); err != nil {
		t.Fatalf("JupyterLab is not installed (%v): run .ci/deps", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	// The portal's account is a [portal] proxy, not an exempt connector.
	cfg, err := config.Load(tb.ConfigPath(portalNode))
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := user.Lookup(testbed.PortalProxy)
	if err != nil {
		t.Fatal(err)
	}
	puid, _ := strconv.Atoi(proxy.Uid)
	if slices.Contains(cfg.Policy.ExemptConnectors, uint32(puid)) || !slices.Contains(cfg.Portal.Proxies, testbed.PortalProxy) {
		t.Fatalf("%s must be a [portal] proxy and not an exempt connector: exempt %v, proxies %v",
			testbed.PortalProxy, cfg.Policy.ExemptConnectors, cfg.Portal.Proxies)
	}

	p := startPortal(ctx, t)
	// Each user's portal login: OnDemand starts her per-user nginx as her
	// after Apache authenticated her; its start registers her session.
	for _, u := range []string{"alice", "bob", "carol"} {
		p.session(u)
	}

	// The apps, started through sbatch as OnDemand's batch connect does.
	aliceApp := submit(ctx, t, "alice", "node2", "")
	bobApp := submit(ctx, t, "bob", "node3", "")
	sharedApp := submit(ctx, t, "alice", "node2", testbed.ProjectGroup)
	for _, a := range []*app{aliceApp, bobApp, sharedApp} {
		a.wait(ctx, t)
	}

	t.Run("OwnerReachesHerApp", func(t *testing.T) {
		p.expectData(t, "alice", aliceApp, nil)
	})
	t.Run("OtherUserRefused", func(t *testing.T) {
		p.expectRefused(t, "bob", aliceApp, nil)
		// Where it was refused: at alice's node, as bob's connection. The
		// agent records a verdict a moment after the kernel took it (ring
		// buffer, then its recorder): wait for the record.
		for deadline := time.Now().Add(15 * time.Second); ; {
			out, err := tb.Output(ctx, portalNode, "", "palisade", "flows", "--node", aliceApp.host, "--port", aliceApp.port,
				"--verdict", "deny", "--connector-user", "bob", "-o", "json")
			if err == nil && strings.Contains(out, `"default-deny"`) {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("no default-deny of bob's connection to %s:%s in node %s's flows after 15 s: %v\n%s", aliceApp.host, aliceApp.port, aliceApp.host, err, out)
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
	t.Run("ForgedUserHeader", func(t *testing.T) {
		// bob sends the header Apache sets himself: Apache replaces it.
		p.expectRefused(t, "bob", aliceApp, []string{"X-Palisade-User: alice"})
	})
	t.Run("OwnAppWorks", func(t *testing.T) {
		p.expectData(t, "bob", bobApp, nil)
		p.expectRefused(t, "alice", bobApp, nil)
	})
	t.Run("SharedProjectApp", func(t *testing.T) {
		p.expectData(t, "alice", sharedApp, nil)
		p.expectData(t, "bob", sharedApp, nil) // proj1
		p.expectRefused(t, "carol", sharedApp, nil)
	})
	t.Run("WebSocket", func(t *testing.T) {
		// JupyterLab's kernels and events are WebSockets: the upgrade
		// passes Apache and the forwarder over alice's connection.
		if got := p.upgrade("alice", aliceApp); !strings.HasPrefix(got, "HTTP/1.1 101") {
			t.Errorf("alice's WebSocket to her app: %q, want 101 Switching Protocols", got)
		}
		if got := p.upgrade("bob", aliceApp); strings.HasPrefix(got, "HTTP/1.1 101") || !strings.Contains(got, " 502") {
			t.Errorf("bob's WebSocket to alice's app: %q, want 502", got)
		}
	})
	t.Run("Unauthenticated", func(t *testing.T) {
		code, body := p.get("alice", "", aliceApp, nil)
		if code != "401" || strings.Contains(body, aliceApp.data) {
			t.Errorf("no credentials: HTTP %s, want 401: %s", code, body)
		}
		code, body = p.get("alice", "wrong", aliceApp, nil)
		if code != "401" || strings.Contains(body, aliceApp.data) {
			t.Errorf("wrong password: HTTP %s, want 401: %s", code, body)
		}
	})
	t.Run("NoSession", func(t *testing.T) {
		// carol logs out (her PUN ends): the portal can no longer act for
		// her, even toward an app she may reach. Control: bob, still in.
		if out, err := tb.Output(ctx, portalNode, "carol", "palisade", "portal", "end"); err != nil {
			t.Fatalf("carol's logout: %v: %s", err, out)
		}
		code, body := p.get("carol", p.passwd["carol"], bobApp, nil)
		if code != "403" || strings.Contains(body, bobApp.data) || !strings.Contains(body, "no session") {
			t.Errorf("carol without a session: HTTP %s, want 403 no session: %s", code, body)
		}
		p.expectData(t, "bob", bobApp, nil)
	})
}

func startPortal(ctx context.Context, t *testing.T) *portal {
	dir := filepath.Join(tb.Dir, "ondemand")
	os.RemoveAll(dir)
	fwd := filepath.Join(dir, "fwd")
	if err := os.MkdirAll(fwd, 0o755); err != nil {
		t.Fatal(err)
	}
	proxy, err := user.Lookup(testbed.PortalProxy)
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(proxy.Uid)
	gid, _ := strconv.Atoi(proxy.Gid)
	if err := os.Chown(fwd, uid, gid); err != nil {
		t.Fatal(err)
	}
	os.Chmod(fwd, 0o750)
	p := &portal{t: t, ctx: ctx, dir: dir, passwd: map[string]string{}}
	for i, u := range []string{"alice", "bob", "carol"} {
		p.passwd[u] = "pw-" + nonce()
		args := []string{"-bB", filepath.Join(dir, "htpasswd"), u, p.passwd[u]}
		if i == 0 {
			args = append([]string{"-c"}, args...)
		}
		if out, err := exec.Command("htpasswd", args...).CombinedOutput(); err != nil {
			t.Fatalf("htpasswd: %v: %s", err, out)
		}
	}
	os.Chmod(filepath.Join(dir, "htpasswd"), 0o644)

	// The forwarder, as the proxy account, on a socket only it and the
	// web server's account (the same here) can open.
	ready := background(ctx, t, portalNode, testbed.PortalProxy, "forwarding on", "palisade", "portal", "forward",
		"--listen", "unix:"+filepath.Join(fwd, "forward.sock"), "--mode", "0660", "--group", testbed.PortalProxy,
		"--host-regex", `node[0-9]+`)
	if !ready {
		t.Fatal("the forwarder did not start")
	}

	n, _ := tb.Node(portalNode)
	listen := n.Eth0V4.String() + ":8080"
	p.url = "http://" + listen
	var conf strings.Builder
	template.Must(template.New("conf").Parse(apacheConf)).Execute(&conf, map[string]string{
		"ServerName": portalNode, "Listen": listen, "User": testbed.PortalProxy, "Dir": dir,
		"Socket": filepath.Join(fwd, "forward.sock")})
	confPath := filepath.Join(dir, "apache.conf")
	if err := os.WriteFile(confPath, []byte(conf.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := tb.Output(ctx, portalNode, "", "apache2", "-t", "-f", confPath); err != nil {
		t.Fatalf("apache2 -t: %v: %s", err, out)
	}
	cmd := tb.Command(ctx, portalNode, "", "apache2", "-f", confPath, "-DFOREGROUND")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			for _, f := range []string{"error.log", "access.log"} {
				b, _ := os.ReadFile(filepath.Join(dir, f))
				t.Logf("apache %s:\n%s", f, b)
			}
		}
	})
	// Up once it answers (an unauthenticated request: 401).
	for deadline := time.Now().Add(30 * time.Second); ; {
		out, _ := tb.Output(ctx, portalNode, "alice", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", p.url+"/rnode/")
		if out == "401" {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Fatalf("apache does not answer on %s (%q):\n%s", listen, out, b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return p
}

// background starts argv as user on node, kept until the test ends, and
// waits for a line of its output containing ready.
func background(ctx context.Context, t *testing.T, node, user, ready string, argv ...string) bool {
	cmd := tb.Command(ctx, node, user, argv...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
		if t.Failed() {
			t.Logf("%s (%s@%s) stderr:\n%s", strings.Join(argv, " "), user, node, stderr.String())
		}
	})
	got := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(out)
		ok := false
		for sc.Scan() {
			if !ok && strings.Contains(sc.Text(), ready) {
				ok = true
				got <- true
			}
		}
		if !ok {
			got <- false
		}
		io.Copy(io.Discard, out)
	}()
	select {
	case ok := <-got:
		return ok
	case <-time.After(30 * time.Second):
		return false
	}
}

// session registers u's session with the proxy, held for the test.
func (p *portal) session(u string) {
	if !background(p.ctx, p.t, portalNode, u, "held", "palisade", "portal", "session", "--proxy", testbed.PortalProxy, "--hold") {
		p.t.Fatalf("%s's session did not start", u)
	}
}

// submit starts a JupyterLab as owner on node through sbatch (under group
// if set, to share it with the project).
func submit(ctx context.Context, t *testing.T, owner, node, group string) *app {
	a := &app{owner: owner, data: nonce()}
	name := "ood-" + owner + "-" + node
	if group != "" {
		name += "-" + group
	}
	appDir := filepath.Join(testbed.HomeDir, owner, name)
	script := filepath.Join(tb.Dir, "ondemand", "jupyter.sbatch")
	if err := os.WriteFile(script, batchScript, 0o755); err != nil {
		t.Fatal(err)
	}
	mode, prefix := "700", ""
	if group != "" {
		mode, prefix = "2770", "sg "+group+" -c "
	}
	setup := fmt.Sprintf("rm -rf %[1]s && mkdir -m %[2]s %[1]s && mkdir %[1]s/notebooks && echo %[3]s > %[1]s/notebooks/data.txt", appDir, mode, a.data)
	if prefix != "" {
		setup = prefix + strconv.Quote(setup)
	}
	if out, err := tb.Output(ctx, portalNode, owner, "sh", "-c", setup); err != nil {
		t.Fatalf("%s's session directory: %v: %s", owner, err, out)
	}
	out, err := tb.Output(ctx, portalNode, owner, "env", "PAL_APPDIR="+appDir, "PAL_GROUP="+group, "PAL_JUPYTER="+jupyterLab,
		"sbatch", "-w", node, "-J", name, "-o", filepath.Join(appDir, "output.log"), script)
	m := regexp.MustCompile(`Submitted batch job (\d+)`).FindStringSubmatch(out)
	if err != nil || m == nil {
		t.Fatalf("sbatch as %s: %v: %s", owner, err, out)
	}
	t.Cleanup(func() {
		tb.Output(context.Background(), portalNode, "", "scancel", m[1])
		os.RemoveAll(appDir) // homes are shared by the machine's testbeds
	})
	a.host = appDir // until wait reads the connection file
	return a
}

// wait reads the app's connection file once the job wrote it.
func (a *app) wait(ctx context.Context, t *testing.T) {
	appDir := a.host
	conn := filepath.Join(appDir, "connection.yml")
	deadline := time.Now().Add(4 * time.Minute)
	for {
		b, err := os.ReadFile(conn)
		if err == nil {
			for _, l := range strings.Split(string(b), "\n") {
				k, v, _ := strings.Cut(l, ": ")
				switch k {
				case "host":
					a.host = v
				case "port":
					a.port = v
				case "password":
					a.password = v
				}
			}
			if a.host == "" || a.port == "" || a.password == "" {
				t.Fatalf("%s: incomplete connection file: %q", conn, b)
			}
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			log, _ := os.ReadFile(filepath.Join(appDir, "output.log"))
			t.Fatalf("no %s after 4 min; job output:\n%s", conn, log)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// get asks the portal, as the browser of user (authenticated with
// password; "" none), for the app's data file through JupyterLab's
// contents API with the app's own password.
func (p *portal) get(user, password string, a *app, headers []string) (code, body string) {
	url := fmt.Sprintf("%s/rnode/%s/%s/api/contents/data.txt?content=1&token=%s", p.url, a.host, a.port, a.password)
	args := []string{"curl", "-s", "-m", "30", "-w", "\n%{http_code}"}
	if password != "" {
		args = append(args, "-u", user+":"+password)
	}
	for _, h := range headers {
		args = append(args, "-H", h)
	}
	out, _ := tb.Output(p.ctx, portalNode, user, append(args, url)...)
	out = strings.TrimRight(out, "\n")
	i := strings.LastIndex(out, "\n")
	if i < 0 {
		return out, ""
	}
	return out[i+1:], out[:i]
}

// expectData: user, through the portal, gets the app's data.
func (p *portal) expectData(t *testing.T, user string, a *app, headers []string) {
	t.Helper()
	code, body := p.get(user, p.passwd[user], a, headers)
	if code != "200" || !strings.Contains(body, a.data) {
		t.Errorf("%s → %s's app on %s:%s through the portal: HTTP %s, want 200 with its data %s: %s", user, a.owner, a.host, a.port, code, a.data, body)
	}
}

// expectRefused: user, authenticated as herself and holding the app's own
// password, is refused by the network: the connection made as her is
// refused at the app's node.
func (p *portal) expectRefused(t *testing.T, user string, a *app, headers []string) {
	t.Helper()
	code, body := p.get(user, p.passwd[user], a, headers)
	if code != "502" || strings.Contains(body, a.data) || !strings.Contains(body, "connection refused") {
		t.Errorf("%s → %s's app on %s:%s through the portal: HTTP %s, want 502 connection refused: %s", user, a.owner, a.host, a.port, code, body)
	}
}

// upgrade opens a WebSocket to the app's event stream through the portal as
// user and returns the answer's status line.
func (p *portal) upgrade(user string, a *app) string {
	url := fmt.Sprintf("%s/rnode/%s/%s/api/events/subscribe?token=%s", p.url, a.host, a.port, a.password)
	// curl keeps an upgraded connection open: it ends at -m, the status
	// line long printed.
	out, _ := tb.Output(p.ctx, portalNode, user, "curl", "-s", "-i", "-m", "3", "-u", user+":"+p.passwd[user],
		"-H", "Connection: Upgrade", "-H", "Upgrade: websocket", "-H", "Sec-WebSocket-Version: 13",
		"-H", "Sec-WebSocket-Key: cGFsaXNhZGUtcG9ydGFsLTE=", url)
	line, _, _ := strings.Cut(out, "\n")
	return strings.TrimSpace(line)
}
