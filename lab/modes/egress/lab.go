package egress

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/gateway"
	"github.com/palisade-hpc/palisade/internal/dataplane/egress/join"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Addresses of the egress lab (all in 198.18.0.0/15 and 100.64.0.0/10).
var (
	GatewayAddr   = netip.MustParseAddr("198.18.0.253")   // on the nodes' eth0 net
	GatewayOut    = netip.MustParseAddr("198.18.201.254") // toward the outside host
	OutsideAddr   = netip.MustParseAddr("198.18.201.1")
	OutsideNet    = netip.MustParsePrefix("198.18.201.0/24")
	Zone          = "pal.test"
	OutsideName   = "outside." + Zone
	RootPort      = 51820 // root gateway (kernel tun)
	UserPort      = 51830 // unprivileged gateway (netstack)
	RootPool      = "100.64.0.0/16"
	UserPool      = "100.65.0.0/16"
	IperfPort     = 5201
	UnprivGateway = "svc" // user the unprivileged gateway runs as
)

// Env describes a running egress lab.
type Env struct {
	Name      string // testbed name
	Dir       string // <tb.Dir>/egress
	GwNS      string // gateway host netns
	OutNS     string // outside host netns
	RootDir   string // state dir of the root gateway
	UserDir   string // state dir of the unprivileged gateway
	PIDs      []int
	Procs     map[string]int // service name -> PID (gateway-root, gateway-user, ...)
	Routes    []string       // nodes' netns that got the "unreachable outside" route
	UserUID   int
	Binary    string // the product binary (gateway, egress)
	LabBinary string // the lab binary (the outside host's servers)
	RootKey   string
	UserKey   string
	Outside   string
	ZoneName  string
}

// Name is the testbed extension (and bench mode) of egress.
const Name = "egress"

// Ext is the testbed extension "egress".
type Ext struct{}

func envPath(tb *testbed.Testbed) string { return filepath.Join(tb.Dir, "egress", "env.json") }

// Open returns the lab of a running testbed.
func Open(tb *testbed.Testbed) (*Env, error) {
	b, err := os.ReadFile(envPath(tb))
	if err != nil {
		return nil, fmt.Errorf("testbed %s has no egress lab (testbed up --egress): %v", tb.Name, err)
	}
	var e Env
	return &e, json.Unmarshal(b, &e)
}

func sh(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Up builds the gateway and outside hosts and starts the services.
func (Ext) Up(ctx context.Context, tb *testbed.Testbed) (err error) {
	e := &Env{Name: tb.Name, Dir: filepath.Join(tb.Dir, "egress"), GwNS: tb.Name + "-egw", OutNS: tb.Name + "-ego",
		Binary: tb.Binary, LabBinary: tb.LabBinary, Outside: OutsideAddr.String(), ZoneName: OutsideName}
	e.RootDir = filepath.Join(e.Dir, "gw-root")
	e.UserDir = filepath.Join(e.Dir, "gw-user")
	os.RemoveAll(e.Dir)
	if err := os.MkdirAll(e.Dir, 0o755); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			e.down(context.Background())
		}
	}()
	save := func() error {
		b, _ := json.MarshalIndent(e, "", " ")
		return os.WriteFile(envPath(tb), b, 0o644)
	}
	hostVeth := tb.Name + "-eg0"
	steps := [][]string{
		{"ip", "netns", "add", e.GwNS},
		{"ip", "netns", "add", e.OutNS},
	}
	for _, s := range steps {
		if err := sh(ctx, s...); err != nil {
			return err
		}
	}
	if err := save(); err != nil { // from here Down can clean up
		return err
	}
	steps = [][]string{
		{"ip", "link", "add", hostVeth, "type", "veth", "peer", "name", "eth0", "netns", e.GwNS},
		{"ip", "link", "set", hostVeth, "master", tb.Name + "-br0", "up"},
		{"ip", "-n", e.GwNS, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", e.OutNS},
		{"ip", "-n", e.GwNS, "addr", "add", GatewayAddr.String() + "/24", "dev", "eth0"},
		{"ip", "-n", e.GwNS, "addr", "add", GatewayOut.String() + "/24", "dev", "eth1"},
		{"ip", "-n", e.OutNS, "addr", "add", OutsideAddr.String() + "/24", "dev", "eth0"},
		{"ip", "-n", e.GwNS, "link", "set", "lo", "up"},
		{"ip", "-n", e.GwNS, "link", "set", "eth0", "up"},
		{"ip", "-n", e.GwNS, "link", "set", "eth1", "up"},
		{"ip", "-n", e.OutNS, "link", "set", "lo", "up"},
		{"ip", "-n", e.OutNS, "link", "set", "eth0", "up"},
		// Replies for the benchmark's direct (routed, untunnelled) baseline.
		{"ip", "-n", e.OutNS, "route", "add", "198.18.0.0/24", "via", GatewayOut.String()},
	}
	for _, s := range steps {
		if err := sh(ctx, s...); err != nil {
			return err
		}
	}
	// The compute nodes' only way out is the gateway: the outside net is
	// explicitly unreachable from them (their default route leads to the
	// testbed router, which does not know it either).
	for _, n := range tb.Nodes {
		if err := sh(ctx, "ip", "-n", n.NetNS, "route", "add", "unreachable", OutsideNet.String()); err != nil {
			return err
		}
		e.Routes = append(e.Routes, n.NetNS)
		save()
	}
	// Outside services.
	if err := e.spawn(e.OutNS, 0, "outside", e.LabBinary, "__egress-outside", "--addr", OutsideAddr.String(), "--zone", Zone); err != nil {
		return err
	}
	if err := e.spawn(e.OutNS, 0, "iperf3", "iperf3", "-s", "-p", strconv.Itoa(IperfPort)); err != nil {
		return err
	}
	// Root gateway (kernel tun + masquerade).
	rootCfg := filepath.Join(e.Dir, "gateway-root.toml")
	os.WriteFile(rootCfg, fmt.Appendf(nil, "[egress]\nstate_dir = %q\nlisten_port = %d\npool = %q\nmode = \"tun\"\ntun_name = \"palgw0\"\ndeny = [\"198.18.0.0/24\", \"198.19.0.0/24\"]\nupstream_dns = \"%s:53\"\nendpoint = \"%s:%d\"\n",
		e.RootDir, RootPort, RootPool, OutsideAddr, GatewayAddr, RootPort+1), 0o644)
	if err := e.spawn(e.GwNS, 0, "gateway-root", e.Binary, "--config", rootCfg, "gateway"); err != nil {
		return err
	}
	// Unprivileged gateway (netstack) as an ordinary user.
	e.UserUID = 65534
	if u, err := user.Lookup(UnprivGateway); err == nil {
		e.UserUID, _ = strconv.Atoi(u.Uid)
	}
	os.MkdirAll(e.UserDir, 0o700)
	os.Chown(e.UserDir, e.UserUID, e.UserUID)
	userCfg := filepath.Join(e.Dir, "gateway-user.toml")
	os.WriteFile(userCfg, fmt.Appendf(nil, "[egress]\nstate_dir = %q\nlisten_port = %d\npool = %q\nmode = \"netstack\"\ndeny = [\"198.18.0.0/24\", \"198.19.0.0/24\"]\nupstream_dns = \"%s:53\"\nendpoint = \"%s:%d\"\n",
		e.UserDir, UserPort, UserPool, OutsideAddr, GatewayAddr, UserPort+1), 0o644)
	if err := e.spawn(e.GwNS, e.UserUID, "gateway-user", e.Binary, "--config", userCfg, "gateway"); err != nil {
		return err
	}
	for _, d := range []string{e.RootDir, e.UserDir} {
		if err := waitFile(ctx, filepath.Join(d, "stats.json"), 15*time.Second); err != nil {
			return fmt.Errorf("gateway in %s did not start: %v (log in %s)", d, err, e.Dir)
		}
	}
	rk, _ := gateway.LoadOrCreateKey(e.RootDir)
	uk, _ := gateway.LoadOrCreateKey(e.UserDir)
	e.RootKey, e.UserKey = rk.Public().String(), uk.Public().String()
	return save()
}

func waitFile(ctx context.Context, p string, d time.Duration) error {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if _, err := os.Stat(p); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s missing after %s", p, d)
}

// spawn starts a long-lived service in a netns, detached (it outlives
// `testbed up`), logging to <Dir>/<name>.log; its PID is recorded for Down.
func (e *Env) spawn(netns string, uid int, name string, argv ...string) error {
	args := []string{"netns", "exec", netns}
	if uid != 0 {
		args = append(args, "setpriv", "--reuid="+strconv.Itoa(uid), "--regid="+strconv.Itoa(uid), "--clear-groups", "--")
	}
	cmd := exec.Command("ip", append(args, argv...)...)
	logf, err := os.Create(filepath.Join(e.Dir, name+".log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %v", name, err)
	}
	e.PIDs = append(e.PIDs, cmd.Process.Pid)
	if e.Procs == nil {
		e.Procs = map[string]int{}
	}
	e.Procs[name] = cmd.Process.Pid
	go cmd.Wait() // reap it if it dies while we run
	b, _ := json.MarshalIndent(e, "", " ")
	return os.WriteFile(filepath.Join(e.Dir, "env.json"), b, 0o644)
}

// Down stops the services and removes the hosts and routes.
func (Ext) Down(ctx context.Context, tb *testbed.Testbed) error {
	e, err := Open(tb)
	if err != nil {
		return nil // nothing of ours is up
	}
	return e.down(ctx)
}

func (e *Env) down(ctx context.Context) error {
	var errs []error
	for _, pid := range e.PIDs {
		// Only signal what is still our process (the PID may be reused).
		if b := strings.Join(procfs.Cmdline(pid), " "); b != "" &&
			(strings.Contains(string(b), "gateway") || strings.Contains(string(b), "__egress-outside") ||
				strings.Contains(string(b), "iperf3") || strings.Contains(string(b), "ocserv")) {
			syscall.Kill(pid, syscall.SIGTERM)
		}
	}
	for _, pid := range e.PIDs {
		for i := 0; i < 50; i++ {
			if syscall.Kill(pid, 0) != nil || zombie(pid) {
				break
			}
			time.Sleep(100 * time.Millisecond)
			if i == 30 {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	for _, ns := range e.Routes {
		exec.CommandContext(ctx, "ip", "-n", ns, "route", "del", "unreachable", OutsideNet.String()).Run()
	}
	for _, ns := range []string{e.GwNS, e.OutNS} {
		if err := exec.CommandContext(ctx, "ip", "netns", "del", ns).Run(); err != nil {
			if _, serr := os.Stat("/run/netns/" + ns); serr == nil {
				errs = append(errs, fmt.Errorf("netns del %s: %v", ns, err))
			}
		}
	}
	os.Remove(filepath.Join(e.Dir, "env.json"))
	return errors.Join(errs...)
}

// zombie reports whether pid has exited (gone, or a zombie not yet reaped).
func zombie(pid int) bool {
	s, ok := procfs.Read(pid)
	return !ok || s.Zombie()
}

// Token issues a join token for user/job from the root gateway (or the
// unprivileged one), valid for ttl.
func (e *Env) Token(user, job string, unprivileged bool, ttl time.Duration) (string, error) {
	dir, port := e.RootDir, RootPort
	if unprivileged {
		dir, port = e.UserDir, UserPort
	}
	k, err := gateway.LoadOrCreateKey(dir)
	if err != nil {
		return "", err
	}
	return join.IssueToken(k, join.Claims{User: user, Job: job, Expires: time.Now().Add(ttl).Unix(),
		Gateway: fmt.Sprintf("%s:%d", GatewayAddr, port+1)})
}

// Revoke revokes "user", "user/job" or "key:<k>" on a gateway.
func (e *Env) Revoke(unprivileged bool, what string) error {
	dir := e.RootDir
	if unprivileged {
		dir = e.UserDir
	}
	if err := gateway.Revoke(dir, what); err != nil {
		return err
	}
	if unprivileged {
		os.Chown(filepath.Join(dir, "revoked.json"), e.UserUID, e.UserUID)
	}
	return nil
}

// Stats reads a gateway's counters.
func (e *Env) Stats(unprivileged bool) (gateway.Stats, error) {
	dir := e.RootDir
	if unprivileged {
		dir = e.UserDir
	}
	var s gateway.Stats
	b, err := os.ReadFile(filepath.Join(dir, "stats.json"))
	if err != nil {
		return s, err
	}
	return s, json.Unmarshal(b, &s)
}
