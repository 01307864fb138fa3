package jupyterhub

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// markers of a JupyterLab page: whose server served it.
func served(page, user, name string) bool {
	return strings.HasPrefix(page, "200 ") && strings.Contains(page, `"hubServerUser": "`+user+`"`) &&
		strings.Contains(page, `"hubServerName": "`+name+`"`)
}

// TestJupyterHub: the four checks of issue 24 through JupyterHub with
// batchspawner, and Dask's dashboard and scheduler in a job — with the
// hub's account a [portal] proxy and NOT an exempt connector, so that its
// proxy reaches a server only as the server's owner (palisade portal
// forward). Last, the positive control: the same attack with the account
// exempt (what a site does without the delegation) reaches alice.
func TestJupyterHub(t *testing.T) {
	if tb == nil {
		t.Skip("needs root and the " + tbName + " testbed")
	}
	// Wrong passwords get nowhere (the portal authenticates its users).
	if got := browse("bob", "alice-pw", "get", "/hub/home"); !strings.HasPrefix(got, "LOGIN-FAILED") {
		t.Errorf("bob with alice's password: %s", got)
	}

	// alice's and bob's servers and alice's project server (named after
	// her group proj1: run under `sg proj1`), spawned through the hub
	// from a browser at once, and alice's Dask scheduler in a job.
	var alice, aliceProj, bob string
	var d *dask
	var derr error
	parallel(
		func() { alice = spawn("alice", "", map[string]string{"node": "node2"}) },
		func() { aliceProj = spawn("alice", "proj1", map[string]string{"node": "node3"}) },
		func() { bob = spawn("bob", "", map[string]string{"node": "node3"}) },
		func() { d, derr = startDask() },
	)
	for who, got := range map[string]string{"alice": alice, "alice/proj1": aliceProj, "bob": bob} {
		if !strings.HasPrefix(got, "READY ") {
			t.Fatalf("spawn %s: %s\n%s\n%s", who, got, hubTail(), jobLogs(strings.Split(who, "/")[0]))
		}
	}
	if derr != nil {
		t.Fatal(derr)
	}
	aliceNode, alicePort := where(t, "alice", "")
	_, projPort := where(t, "alice", "proj1")

	// bob steers the proxy to alice's server: his own server's job, on
	// alice's node, reports her port as its own (batchspawner's API, his
	// own token). The hub routes /user/bob/evil/ there, and the forwarder
	// connects as bob: refused, so the spawn never comes up.
	rerouted := make(chan string, 1)
	go func() {
		rerouted <- spawn("bob", "evil", map[string]string{
			"node": aliceNode, "cmd": "/usr/bin/python3 " + filepath.Join(hubDir, "reroute.py") + " " + strconv.Itoa(alicePort),
		})
	}()

	t.Run("owner", func(t *testing.T) {
		// 1. alice reaches her server through the hub; 3. bob his.
		if got := browse("alice", "alice-pw", "get", "/user/alice/lab"); !served(got, "alice", "") {
			t.Errorf("alice → her server through the hub: %.300s", got)
		}
		if got := browse("bob", "bob-pw", "get", "/user/bob/lab"); !served(got, "bob", "") {
			t.Errorf("bob → his server through the hub: %.300s", got)
		}
		// JupyterHub's own check: bob's login does not open alice's server.
		if got := browse("bob", "bob-pw", "get", "/user/alice/lab"); strings.Contains(got, `"hubServerUser": "alice"`) {
			t.Errorf("bob → alice's server through the hub (JupyterHub's own check): %.300s", got)
		}
	})

	t.Run("project", func(t *testing.T) {
		// 4. The project server: shared with bob through the hub
		// (JupyterHub's sharing: its access control) and with every member
		// of proj1 at its port (Palisade: its listener runs under proj1).
		if got := browse("alice", "alice-pw", "share", "proj1", "bob"); got != "SHARED bob" {
			t.Fatalf("alice shares proj1 with bob: %s", got)
		}
		if got := browse("bob", "bob-pw", "get", "/user/alice/proj1/lab"); !served(got, "alice", "proj1") {
			t.Errorf("bob → alice's shared project server through the hub: %.300s", got)
		}
		if got := browse("carol", "carol-pw", "get", "/user/alice/proj1/lab"); strings.Contains(got, `"hubServerUser": "alice"`) {
			t.Errorf("carol → alice's project server through the hub: %.300s", got)
		}
		if got := tcpFrom(t, "node2", "bob", "node3", projPort); got != "OK" {
			t.Errorf("bob (member of proj1) → the project server's port: %s", got)
		}
		if got := tcpFrom(t, "node2", "carol", "node3", projPort); got != "ERR ECONNREFUSED" {
			t.Errorf("carol → the project server's port: %s", got)
		}
	})

	t.Run("dask", func(t *testing.T) {
		// alice's scheduler from her processes on other nodes; its
		// dashboard through the portal (jupyter-server-proxy in her own
		// server, which connects as alice). bob reaches neither.
		if got := daskClient(t, "node2", "alice", d.node); got != "OK "+d.id {
			t.Errorf("alice's Dask client on node2 → her scheduler: %s (want OK %s)", got, d.id)
		}
		if got := dashboard(t, "node1", "alice", d.node); !strings.Contains(got, d.id) {
			t.Errorf("alice on node1 → her dashboard: %.300s", got)
		}
		path := "/proxy/" + d.node + ":8787/json/identity.json"
		if got := browse("alice", "alice-pw", "get", "/user/alice"+path); !strings.HasPrefix(got, "200 ") || !strings.Contains(got, d.id) {
			t.Errorf("alice → her dashboard through the portal: %.300s", got)
		}
		if got := daskClient(t, "node2", "bob", d.node); strings.HasPrefix(got, "OK") {
			t.Errorf("bob's Dask client → alice's scheduler: %s", got)
		}
		for _, port := range []int{8786, 8787} {
			if got := tcpFrom(t, "node2", "bob", d.node, port); got != "ERR ECONNREFUSED" {
				t.Errorf("bob on node2 → alice's Dask port %d: %s", port, got)
			}
		}
		if got := browse("bob", "bob-pw", "get", "/user/bob"+path); strings.Contains(got, d.id) {
			t.Errorf("bob → alice's dashboard through his own server: %.300s", got)
		}
		if got := browse("bob", "bob-pw", "get", "/user/alice"+path); strings.Contains(got, d.id) {
			t.Errorf("bob → alice's dashboard through her server: %.300s", got)
		}
	})

	t.Run("reroute", func(t *testing.T) {
		// 2. bob cannot reach alice's server through the proxy.
		got := <-rerouted
		if !strings.HasPrefix(got, "FAILED") {
			t.Errorf("bob's server rerouted to alice's port came up: %s", got)
		}
		if page := browse("bob", "bob-pw", "get", "/user/bob/evil/lab"); strings.Contains(page, "/user/alice/") {
			t.Errorf("bob → alice's server through his rerouted route: %.300s", page)
		}
		// The connection the forwarder made was bob's, from the portal.
		refusedEvent(t, aliceNode, "bob", "alice", alicePort, portalV)
	})

	t.Run("forwarder", func(t *testing.T) {
		// bob on the portal host asks the hub's forwarder (and its proxy's
		// API) himself, naming alice: only the hub's account reaches them.
		const fw = "127.0.0.1:8010"
		url := fmt.Sprintf("http://%s/as/alice/rnode/%s/%d/user/alice/api", fw, aliceNode, alicePort)
		if got := httpFrom(t, "node1", "bob", url); !strings.HasPrefix(got, "ERR") {
			t.Errorf("bob → the forwarder as alice: %.200s", got)
		}
		if got := tcpFrom(t, "node1", "bob", "127.0.0.1", 8001); got != "ERR ECONNREFUSED" {
			t.Errorf("bob → the proxy's API: %s", got)
		}
		if got := httpFrom(t, "node1", hubAccount, url); !strings.Contains(got, `"version"`) {
			t.Errorf("the hub's account → the forwarder as alice (control): %.200s", got)
		}
	})

	t.Run("around-the-portal", func(t *testing.T) {
		// bob's own processes, on the portal host and on a compute node.
		for _, node := range []string{"node1", "node3"} {
			if got := tcpFrom(t, node, "bob", aliceNode, alicePort); got != "ERR ECONNREFUSED" {
				t.Errorf("bob on %s → alice's server %s:%d: %s", node, aliceNode, alicePort, got)
			}
		}
	})

	t.Run("batchspawner-api", func(t *testing.T) {
		// bob's own server's token (in his job's environment, which he can
		// read) against the hub's batchspawner API: the site's handler
		// takes a port and nothing else (batchspawner's own would run bob's
		// shell command as the hub's account).
		got := jobAPI(t, "bob", "node3", `{"exec_prefix": "", "batch_cancel_cmd": "id"}`, `{"port": 1}`)
		if got != "400 201" {
			t.Errorf("bob's token posting spawner attributes, then a port: %q, want \"400 201\"", got)
		}
	})

	t.Run("hub-restart", func(t *testing.T) {
		// Sites restart the hub with the jobs running (cleanup_servers
		// off): it finds them through squeue and writes their routes anew
		// into a new proxy, the delegated ones from the spawner's state.
		t0 := time.Now()
		stopHub()
		t1 := time.Now()
		var err error
		if stopHub, err = startHub("hub-restarted.log"); err != nil {
			stopHub = func() {}
			t.Fatal(err)
		}
		t.Logf("hub stopped in %.1fs, up again in %.1fs", t1.Sub(t0).Seconds(), time.Since(t1).Seconds())
		if got := browse("alice", "alice-pw", "get", "/user/alice/lab"); !served(got, "alice", "") {
			t.Errorf("alice → her server through the restarted hub: %.300s", got)
		}
		b, _ := os.ReadFile(hubLog)
		if want := fmt.Sprintf("Route added /user/alice -> http://127.0.0.1:8010/as/alice/rnode/%s/%d", aliceNode, alicePort); !strings.Contains(string(b), want) {
			t.Errorf("the restarted hub's log has no %q", want)
		}
	})

	if t.Failed() {
		return
	}
	t.Run("control-exempt-proxy", func(t *testing.T) {
		// Positive control: the hub's account exempt, routes straight to
		// the jobs (what a site needs without the delegation): bob's same
		// reroute reaches alice's server — the hole the delegation closes.
		if err := configurePalisade(true); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(hubDir, "forward"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		browse("bob", "bob-pw", "stop", "evil")
		got := spawn("bob", "evil", map[string]string{
			"node": aliceNode, "cmd": "/usr/bin/python3 " + filepath.Join(hubDir, "reroute.py") + " " + strconv.Itoa(alicePort),
		})
		if !strings.HasPrefix(got, "READY") {
			t.Fatalf("bob's rerouted server with an exempt hub: %s", got)
		}
		if page := browse("bob", "bob-pw", "get", "/user/bob/evil/lab"); !strings.Contains(page, "/user/alice/") {
			t.Errorf("with an exempt hub bob's route should reach alice's server (its 404 names /user/alice/): %.300s", page)
		}
		// And an exempt listener would open the forwarder to everyone: bob
		// names alice and gets her server.
		url := fmt.Sprintf("http://127.0.0.1:8010/as/alice/rnode/%s/%d/user/alice/api", aliceNode, alicePort)
		if got := httpFrom(t, "node1", "bob", url); !strings.Contains(got, `"version"`) {
			t.Errorf("with the hub's account an exempt listener bob should reach alice through the forwarder: %.200s", got)
		}
	})
}

// jobLogs is the end of user's jobs' output (a failed spawn's diagnosis).
func jobLogs(user string) string {
	var b strings.Builder
	logs, _ := filepath.Glob(filepath.Join(hubDir, "jobs", user+"-*.log"))
	for _, l := range logs {
		out, _ := os.ReadFile(l)
		fmt.Fprintf(&b, "== %s\n%s\n", l, tail(string(out), 15))
	}
	return b.String()
}

// httpFrom GETs url from node as user: "<status> <body>" or "ERR <reason>".
func httpFrom(t *testing.T, node, user, url string) string {
	t.Helper()
	const py = `import sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=10); print(r.status, r.read().decode()[:300])
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()[:300])
except Exception as e:
    print('ERR', e)
`
	out, err := tb.Command(context.Background(), node, user, "/usr/bin/python3", "-c", py, url).CombinedOutput()
	if err != nil {
		t.Fatalf("GET %s as %s on %s: %v: %s", url, user, node, err, out)
	}
	return strings.TrimSpace(string(out))
}

func hubTail() string {
	b, _ := os.ReadFile(hubLog)
	return tail(string(b), 30)
}

// jobAPI posts each body to the hub's batchspawner API as user on node
// with the token of user's running single-user server (read from its
// environment, as the user can) and returns the HTTP statuses.
func jobAPI(t *testing.T, user, node string, bodies ...string) string {
	t.Helper()
	const py = `import json, os, sys, urllib.request, urllib.error
env = None
for pid in os.listdir('/proc'):
    try:
        if not pid.isdigit() or os.stat('/proc/' + pid).st_uid != os.getuid():
            continue
        e = dict(l.split('=', 1) for l in open('/proc/%s/environ' % pid).read().split('\0') if '=' in l)
    except OSError:
        continue
    if e.get('JUPYTERHUB_SERVICE_PREFIX') == '/user/%s/' % e.get('JUPYTERHUB_USER') and 'JUPYTERHUB_API_TOKEN' in e:
        env = e
        break
out = []
for body in sys.argv[1:]:
    req = urllib.request.Request(env['JUPYTERHUB_API_URL'] + '/batchspawner', data=body.encode(), method='POST',
        headers={'Authorization': 'token ' + env['JUPYTERHUB_API_TOKEN'], 'Content-Type': 'application/json'})
    try:
        out.append(str(urllib.request.urlopen(req).status))
    except urllib.error.HTTPError as e:
        out.append(str(e.code))
print(' '.join(out))
`
	argv := append([]string{"/usr/bin/python3", "-c", py}, bodies...)
	out, err := tb.Command(context.Background(), node, user, argv...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s on %s posting to the batchspawner API: %v: %s", user, node, err, out)
	}
	return strings.TrimSpace(string(out))
}
