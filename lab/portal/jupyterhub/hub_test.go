package jupyterhub

import (
	"bufio"
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// The hub's files, as a site would install them.
var (
	//go:embed jupyterhub_config.py
	hubConfig string
	//go:embed browser.py
	browserPy string
	//go:embed reroute.py
	reroutePy string
)

// tbName is this run's testbed (testbed.RunName: runs side by side never
// share one; PALISADE_TEST_TESTBED names one by hand). It also names the
// hub's host account (hubAccount).
var tbName = cmp.Or(os.Getenv("PALISADE_TEST_TESTBED"), testbed.RunName("jh"))

const (
	// venv is what .ci/deps installs (JupyterHub, batchspawner, JupyterLab,
	// jupyter-server-proxy, Dask; configurable-http-proxy in node/).
	venv       = "/opt/pal-hub"
	portalNode = "node1"
	// forwardAddr is the delegation's forwarder on the portal node
	// (palisade portal forward, as the hub's account).
	forwardAddr = "127.0.0.1:8010"
)

var (
	// hubAccount runs the hub and its proxy: a service account, not an
	// exempt connector (an exempt listener: every user reaches the hub).
	// A host account of this run's own, named after its testbed, with a
	// system uid useradd picks (hubUID): two runs at once once shared
	// "paljhub", uid 2090, and the first to end removed the other's.
	hubAccount = tbName
	hubUID     int
	stopHub    func() // stops the running hub (and its proxy)
	tb         *testbed.Testbed
	hubDir     string
	hubURL     string
	hubLog     string
	portalV    string // the portal node's eth0 address
)

func TestMain(m *testing.M) {
	testbed.RegisterMode(uwlab.ModeName, uwlab.TestbedMode{}) // as cmd/palisade-lab wires it
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		fmt.Println("jupyterhub: integration tests need root (and no -short)")
		os.Exit(m.Run())
	}
	if _, err := os.Stat(venv + "/bin/jupyterhub"); err != nil {
		fmt.Fprintln(os.Stderr, "jupyterhub:", venv, "is missing: run .ci/deps")
		os.Exit(1)
	}
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	testbed.DownOrphans(ctx)
	removeOrphanAccounts()
	_ = testbed.Down(ctx, tbName)
	var err error
	tb, err = testbed.Up(ctx, testbed.Options{Name: tbName, Nodes: 3, Mode: uwlab.ModeName})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testbed up:", err)
		_ = testbed.Down(context.Background(), tbName)
		os.Exit(1)
	}
	fmt.Printf("jupyterhub: testbed %s up in %.1fs\n", tbName, time.Since(t0).Seconds())
	t0 = time.Now()
	code := 1
	stop, err := setup()
	fmt.Printf("jupyterhub: portal up in %.1fs\n", time.Since(t0).Seconds())
	if err != nil {
		fmt.Fprintln(os.Stderr, "jupyterhub setup:", err)
	} else {
		code = m.Run()
	}
	t0 = time.Now()
	if stop != nil {
		stop()
	}
	// The account goes while the instance is still up: the testbed's own
	// leftover check compares /etc/passwd only when no instance runs.
	if err := removeAccount(); err != nil {
		fmt.Fprintln(os.Stderr, "jupyterhub: remove", hubAccount+":", err)
		code = 1
	}
	if err := testbed.Down(context.Background(), tbName); err != nil {
		fmt.Fprintln(os.Stderr, "testbed down:", err)
		code = 1
	}
	fmt.Printf("jupyterhub: portal and testbed down in %.1fs\n", time.Since(t0).Seconds())
	os.Exit(code)
}

// withUsersLock serialises changes to the host's accounts with the
// testbed's own (other suites bring testbeds up at the same time).
func withUsersLock(f func() error) error {
	lf, err := os.OpenFile(filepath.Join(testbed.BaseDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil {
		return err
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	return f()
}

func run(argv ...string) error {
	if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, out)
	}
	return nil
}

// addAccount creates the hub's service account (and its group) with a
// system uid and gid of useradd's choice (never one of the testbed's), or
// takes the one a crashed run of the same name left.
func addAccount() error {
	return withUsersLock(func() error {
		if _, err := user.Lookup(hubAccount); err != nil {
			if _, err := user.LookupGroup(hubAccount); err != nil {
				if err := run("groupadd", "-r", hubAccount); err != nil {
					return err
				}
			}
			if err := run("useradd", "-r", "-g", hubAccount, "-M", "-d", hubDir, "-s", "/usr/sbin/nologin", hubAccount); err != nil {
				return err
			}
		}
		u, err := user.Lookup(hubAccount)
		if err != nil {
			return err
		}
		hubUID, err = strconv.Atoi(u.Uid)
		return err
	})
}

// removeOrphanAccounts removes the hub accounts of runs killed before they
// could: an account named as testbed.RunName("jh") names whose instance is
// gone (a live run's account exists only while its testbed is up: it is
// added after Up and removed before Down; DownOrphans took the killed
// runs' testbeds down).
func removeOrphanAccounts() {
	b, err := os.ReadFile("/etc/passwd")
	if err != nil {
		return
	}
	for l := range strings.Lines(string(b)) {
		name, _, _ := strings.Cut(l, ":")
		// RunName("jh"): "paljh" and five base-36 characters.
		if len(name) != len("paljh")+5 || !strings.HasPrefix(name, "paljh") || name == tbName {
			continue
		}
		if _, err := os.Stat(testbed.InstanceDir(name)); err == nil {
			continue
		}
		withUsersLock(func() error {
			run("userdel", "-f", name)
			if _, err := user.LookupGroup(name); err == nil {
				run("groupdel", name)
			}
			return nil
		})
	}
}

func removeAccount() error {
	return withUsersLock(func() error {
		if _, err := user.Lookup(hubAccount); err == nil {
			if err := run("userdel", "-f", hubAccount); err != nil {
				return err
			}
		}
		if _, err := user.LookupGroup(hubAccount); err == nil {
			return run("groupdel", hubAccount)
		}
		return nil
	})
}

// setup installs the portal on node1 (the hub's account, its sudo rule for
// batchspawner, its state directory, Palisade's settings for it), starts the
// delegation's forwarder and the hub, and returns what stops them.
func setup() (func(), error) {
	hubDir = filepath.Join(tb.Dir, "hub")
	portalV = tb.Nodes[0].Eth0V4.String()
	hubURL = "http://" + portalV + ":8000"
	if err := addAccount(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(hubDir, "jobs"), 0o755); err != nil {
		return nil, err
	}
	os.Chmod(filepath.Join(hubDir, "jobs"), 0o1777)
	files := map[string]struct {
		text  string
		mode  os.FileMode
		owner int
	}{
		"jupyterhub_config.py": {hubConfig, 0o644, 0},
		"browser.py":           {browserPy, 0o644, 0},
		"reroute.py":           {reroutePy, 0o644, 0},
		"passwords.json":       {`{"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw"}`, 0o600, hubUID},
		// The single-user servers' jupyter-server-proxy may proxy to the
		// cluster's nodes (its default: this host only).
		"jupyter/jupyter_server_config.json": {`{"ServerProxy": {"host_allowlist": ["localhost", "127.0.0.1", "node1", "node2", "node3"]}}`, 0o644, 0},
		"forward":                            {"http://" + forwardAddr + "\n", 0o644, 0},
	}
	for name, f := range files {
		p := filepath.Join(hubDir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(f.text), f.mode); err != nil {
			return nil, err
		}
		os.Chown(p, f.owner, f.owner)
	}
	if err := os.Chown(hubDir, hubUID, hubUID); err != nil {
		return nil, err
	}
	// batchspawner submits, queries and cancels as each user through sudo;
	// the delegation's session is registered the same way (docs/portals.md).
	sudoers := filepath.Join(tb.NodeEtc(portalNode), "sudoers.d")
	if err := os.MkdirAll(sudoers, 0o755); err != nil {
		return nil, err
	}
	rule := fmt.Sprintf("# batchspawner (lab/portal/jupyterhub)\nDefaults:%[1]s !requiretty\n"+
		"%[1]s ALL=(alice,bob,carol) NOPASSWD:SETENV: /usr/bin/sbatch, /usr/bin/squeue, /usr/bin/scancel, "+
		"%[2]s portal session --proxy %[1]s *, %[2]s portal end --proxy %[1]s\n", hubAccount, tb.Binary)
	if err := os.WriteFile(filepath.Join(sudoers, hubAccount), []byte(rule), 0o440); err != nil {
		return nil, err
	}
	if err := configurePalisade(false); err != nil {
		return nil, err
	}
	// Several servers share a node's two CPUs (the hub's test runs four
	// servers and a Dask job at once).
	if out, err := tb.Output(context.Background(), portalNode, "", "scontrol", "update", "PartitionName=debug", "OverSubscribe=FORCE:4"); err != nil {
		return nil, fmt.Errorf("%v: %s", err, out)
	}
	stopFwd, err := startForwarder()
	if err != nil {
		return nil, err
	}
	if stopHub, err = startHub("hub.log"); err != nil {
		stopFwd()
		return nil, err
	}
	return func() { stopHub(); stopFwd() }, nil
}

// hubRules open the hub's two public ports and nothing else of its
// account: its proxy (8000) to the cluster and to browsers outside, its API
// (8081) to the users' jobs. The account is no exempt listener: its other
// listeners (the proxy's API, the delegation's forwarder on a loopback
// port) stay its own.
var hubRules = `
[[rule]]
name = "jupyterhub"
action = "allow"
to = ["` + hubAccount + `"]
on_nodes = ["` + portalNode + `"]
ports = ["8000", "8081"]

[[rule]]
name = "jupyterhub-browsers"
action = "allow"
from_subnets = ["198.18.200.0/24", "2001:2:0:c8::/64"]
to = ["` + hubAccount + `"]
on_nodes = ["` + portalNode + `"]
ports = ["8000"]
`

// configurePalisade writes the portal's settings into every node's policy
// and reloads the agents: the hub's account is a [portal] proxy on the
// portal node and its public ports are open (hubRules). With exempt (the
// positive control: what a site without the delegation does) the account
// is also an exempt connector and an exempt listener.
func configurePalisade(exempt bool) error {
	return testbed.Parallel(tb.Nodes, func(n testbed.Node) error {
		p := tb.ConfigPath(n.Name)
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		s := string(b)
		for _, key := range []string{"exempt_connectors", "exempt_listeners"} {
			re := regexp.MustCompile(`(?m)^` + key + ` = \[(.*?)(, "` + hubAccount + `")?\]$`)
			if exempt {
				s = re.ReplaceAllString(s, key+` = [$1, "`+hubAccount+`"]`)
			} else {
				s = re.ReplaceAllString(s, key+` = [$1]`)
			}
		}
		if n.Name == portalNode {
			s = regexp.MustCompile(`(?m)^proxies = \[(.*?)(, "`+hubAccount+`")?\]$`).ReplaceAllString(s, `proxies = [$1, "`+hubAccount+`"]`)
		}
		if !strings.Contains(s, `name = "jupyterhub"`) {
			s += hubRules
		}
		if s == string(b) {
			return nil
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			return err
		}
		out, err := uwlab.NodeCommand(context.Background(), tb, n, "agent", "--reload").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: agent --reload: %v: %s", n.Name, err, out)
		}
		return nil
	})
}

// daemon starts argv as user on node, its output in logPath, and waits
// for a line of it that matches ready.
func daemon(node, user, logPath string, env []string, ready *regexp.Regexp, argv ...string) (func(), error) {
	ctx, cancel := context.WithCancel(context.Background())
	cmd := tb.Command(ctx, node, user, argv...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	logf, err := os.Create(logPath)
	if err != nil {
		cancel()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		cancel()
		logf.Close()
		return nil, err
	}
	up := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		seen := false
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if !seen && ready.MatchString(sc.Text()) {
				seen = true
				close(up)
			}
		}
		io.Copy(io.Discard, pr)
	}()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait(); pw.Close() }()
	stop := func() {
		cancel()
		<-exited
		logf.Close()
	}
	select {
	case <-up:
		return stop, nil
	case err := <-exited:
		logf.Close()
		cancel()
		b, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("%s exited (%v): %s", argv[0], err, tail(string(b), 10))
	case <-time.After(2 * time.Minute):
		stop()
		b, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("%s: not ready after 2 minutes: %s", argv[0], tail(string(b), 10))
	}
}

func tail(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// startForwarder runs the delegation's HTTP forwarder as the hub's account,
// on a loopback port of the portal node (userwall lets only that account
// connect to it), the user taken from the /as/<user>/ the hub's routes write.
func startForwarder() (func(), error) {
	return daemon(portalNode, hubAccount, filepath.Join(hubDir, "forward.log"), nil, regexp.MustCompile(`^forwarding on `),
		tb.Binary, "portal", "forward", "--config", tb.ConfigPath(portalNode), "--listen", forwardAddr, "--user-in-path")
}

// startHub runs JupyterHub (and its proxy) as the hub's account on the
// portal node.
func startHub(logName string) (func(), error) {
	hubLog = filepath.Join(hubDir, logName)
	env := []string{
		"PAL_HUB_DIR=" + hubDir, "PAL_HUB_PORTAL=" + portalV, "PAL_HUB_VENV=" + venv,
		"PAL_HUB_PALISADE=" + tb.Binary, "PAL_HUB_EXCLUDE=" + portalNode,
	}
	return daemon(portalNode, hubAccount, hubLog, env, regexp.MustCompile(`JupyterHub is now running`),
		venv+"/bin/jupyterhub", "-f", filepath.Join(hubDir, "jupyterhub_config.py"))
}

// browse runs the browser (browser.py) as user from the outside host with
// password and returns its one-line answer (or what went wrong running it).
// Safe to call from several goroutines.
func browse(user, password string, args ...string) string {
	argv := append([]string{venv + "/bin/python", filepath.Join(hubDir, "browser.py"), hubURL, user, password}, args...)
	out, err := tb.Command(context.Background(), "outside", user, argv...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("BROWSER-ERROR %v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

func password(user string) string { return user + "-pw" }

// spawn starts user's server (name "" = the default one) through the hub
// and returns the browser's answer: READY … or FAILED ….
func spawn(user, name string, options map[string]string) string {
	o, _ := json.Marshal(options)
	return browse(user, password(user), "spawn", name, string(o))
}

// where reads from the hub's log the node and port the server of user
// (name "" = default) listens on, as batchspawner learnt them.
func where(t *testing.T, user, name string) (string, int) {
	t.Helper()
	b, _ := os.ReadFile(hubLog)
	re := regexp.MustCompile(`server of ` + regexp.QuoteMeta(user) + ` \(` + regexp.QuoteMeta(cmp.Or(name, "default")) + `\) at (\S+):(\d+)`)
	m := re.FindAllStringSubmatch(string(b), -1)
	if m == nil {
		t.Fatalf("no address of %s's server %q in the hub's log", user, name)
	}
	port, _ := strconv.Atoi(m[len(m)-1][2])
	return m[len(m)-1][1], port
}

// tcpFrom connects from node as user to host:port and reports "OK" or the
// error (ECONNREFUSED is how userwall refuses a TCP connection).
func tcpFrom(t *testing.T, node, user, host string, port int) string {
	t.Helper()
	const py = `import socket, sys, errno
s = socket.socket(); s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print('OK')
except OSError as e:
    print('ERR', errno.errorcode.get(e.errno, str(e)))
`
	out, err := tb.Command(context.Background(), node, user, "/usr/bin/python3", "-c", py, host, strconv.Itoa(port)).CombinedOutput()
	if err != nil {
		t.Fatalf("connect %s@%s → %s:%d: %v: %s", user, node, host, port, err, out)
	}
	return strings.TrimSpace(string(out))
}

// refusedEvent waits until node's agent logged a refusal of connector
// reaching listener at port from address src.
func refusedEvent(t *testing.T, node, connector, listener string, port int, src string) {
	t.Helper()
	c, err := (&control.Options{ConfigPath: tb.ConfigPath(node)}).LoadConfig()
	if err != nil {
		t.Fatal(err)
	}
	suffix := ":" + strconv.Itoa(port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(c.Agent.EventLog)
		for _, l := range strings.Split(string(b), "\n") {
			var e uw.Event
			if json.Unmarshal([]byte(l), &e) == nil && e.Connector != nil && e.Connector.User == connector &&
				e.Listener.User == listener && strings.HasSuffix(e.Dst, suffix) && strings.HasPrefix(e.Src, src+":") {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Errorf("%s's agent logged no refusal of %s from %s → %s port %d", node, connector, src, listener, port)
			return
		}
		time.Sleep(100 * time.Millisecond) // the agent writes its events asynchronously
	}
}

// dask is alice's Dask scheduler (and its dashboard on 8787) in a batch job
// on node3, as a user starts one: no change to Dask.
type dask struct {
	node string
	id   string // the scheduler's id, which its dashboard also serves
}

func startDask() (*dask, error) {
	dir := filepath.Join(hubDir, "jobs")
	file := filepath.Join(dir, "alice-dask.json")
	os.Remove(file)
	script := fmt.Sprintf("#!/bin/bash\nexec %s/bin/dask scheduler --port 8786 --dashboard-address :8787 --scheduler-file %s\n", venv, file)
	cmd := tb.Command(context.Background(), portalNode, "alice", "sbatch", "--parsable", "--nodelist=node3", "--job-name=dask",
		"--output="+filepath.Join(dir, "alice-dask-%j.log"))
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("sbatch dask: %v: %s", err, out)
	}
	job := strings.TrimSpace(string(out))
	// The scheduler writes its file once it listens: its acknowledgement.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		b, err := os.ReadFile(file)
		var info struct {
			ID string `json:"id"`
		}
		if err == nil && json.Unmarshal(b, &info) == nil && info.ID != "" {
			return &dask{node: "node3", id: info.ID}, nil
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "alice-dask-"+job+".log"))
			return nil, fmt.Errorf("alice's Dask scheduler (job %s) did not start: %s", job, tail(string(log), 10))
		}
		time.Sleep(200 * time.Millisecond) // polling the scheduler's file
	}
}

// daskClient connects from node as user with Dask's own client and prints
// the scheduler's id, or the error.
func daskClient(t *testing.T, node, user, host string) string {
	t.Helper()
	py := `import sys
from distributed import Client
try:
    c = Client('tcp://%s:8786', timeout=5)
    print('OK', c.scheduler_info()['id']); c.close()
except Exception as e:
    print('ERR', type(e).__name__)
`
	out, err := tb.Command(context.Background(), node, user, venv+"/bin/python", "-c", fmt.Sprintf(py, host)).CombinedOutput()
	if err != nil {
		t.Fatalf("dask client %s@%s: %v: %s", user, node, err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

// dashboard fetches the dashboard's identity from node as user.
func dashboard(t *testing.T, node, user, host string) string {
	t.Helper()
	py := `import urllib.request, sys
try:
    print('OK', urllib.request.urlopen('http://%s:8787/json/identity.json', timeout=5).read().decode())
except Exception as e:
    print('ERR', e)
`
	out, err := tb.Command(context.Background(), node, user, "/usr/bin/python3", "-c", fmt.Sprintf(py, host)).CombinedOutput()
	if err != nil {
		t.Fatalf("dashboard %s@%s: %v: %s", user, node, err, out)
	}
	return strings.TrimSpace(string(out))
}

func parallel(fs ...func()) {
	var wg sync.WaitGroup
	for _, f := range fs {
		wg.Add(1)
		go func() { defer wg.Done(); f() }()
	}
	wg.Wait()
}
