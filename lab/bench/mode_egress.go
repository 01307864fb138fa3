package bench

import (
	"context"
	"math"
	"slices"
	"strings"
	"time"

	egresslab "github.com/palisade-hpc/palisade/lab/modes/egress"
)

// egressDriver measures the user-level VPN of issue 5 with the egress
// lab's hooks: iperf3 from node1 to the outside host directly (routed
// through the gateway host without a tunnel: the baseline) and through
// each client data path, plus the reference's own stack (openconnect +
// ocserv) side by side (reference 002, Table 1).
type egressDriver struct {
	lab   *egresslab.Env
	links []string
}

func (*egressDriver) Requires() Requirements { return Requirements{Egress: true} }
func (*egressDriver) BaselineText() string {
	return "direct: the same transfers routed through the gateway host without a tunnel"
}
func (*egressDriver) Suites() []string { return []string{SuiteEgress} }
func (*egressDriver) Wrap(_, user string, argv []string) (string, []string) {
	return user, argv
}
func (*egressDriver) Set(context.Context, *Env, string) error { return nil }
func (*egressDriver) Restore(context.Context, *Env) error     { return nil }

// AdjustPlan: every path at every transfer count on two link settings is
// long; two rounds (each path's figure has its own direct baseline in each).
// --quick measures the reference's setting (1 Gbit/s) only.
func (d *egressDriver) AdjustPlan(p Plan, quick bool) Plan {
	d.links = egressLinks
	if quick {
		d.links = []string{"1gbit"}
		p.EgressXfers = []int{1}
	}
	p.Rounds = min(p.Rounds, 2)
	return p
}

func (d *egressDriver) Prepare(_ context.Context, env *Env) error {
	if env.VM || env.TB == nil {
		return Skip("egress is measured on the host testbed")
	}
	if !slices.Contains(env.TB.Extensions, "egress") {
		return Skip("testbed %s is up without --egress (bring it up with `palisade-lab testbed up --egress`, or let the bench bring its own up)", env.Name)
	}
	e, err := egresslab.Open(env.TB)
	if err != nil {
		return Skip("egress lab of testbed %s: %v", env.Name, err)
	}
	d.lab = e
	return nil
}

// egressLinks: each path is measured on this machine's links as they are
// and with the gateway's outside link shaped to 1 Gbit/s, the reference's
// setting (its 334/872 Mbit/s were on 1 GbE).
var egressLinks = []string{"", "1gbit"}

// EgressPaths: Palisade's client data paths and the reference's stack,
// each on every link setting ("tun", "tun@1gbit", ...).
func (d *egressDriver) EgressPaths() []string {
	links := d.links
	if links == nil {
		links = egressLinks
	}
	var out []string
	for _, l := range links {
		for _, p := range egresslab.BenchPaths {
			if !strings.HasPrefix(p, "direct") {
				out = append(out, withLink(p, l))
			}
		}
	}
	return out
}

func withLink(path, link string) string {
	if link == "" {
		return path
	}
	return path + "@" + link
}

// EgressBaseline: direct, on the same link setting; socks (HTTP
// downloads, iperf3 cannot speak SOCKS) against the same downloads direct.
func (*egressDriver) EgressBaseline(path string) string {
	p, link, _ := strings.Cut(path, "@")
	base := "direct"
	if p == "socks" && slices.Contains(egresslab.BenchPaths, "direct-http") {
		base = "direct-http"
	}
	return withLink(base, link)
}

func (d *egressDriver) EgressThroughput(ctx context.Context, env *Env, path string, xfers int, dur time.Duration) (float64, error) {
	mbit, _, err := d.EgressTransfer(ctx, env, path, xfers, dur)
	return mbit, err
}

// EgressTransfer also returns the CPU time of the client's process tree
// (the transfer program and the client data path; for openconnect, whose
// daemon runs apart, NaN).
func (d *egressDriver) EgressTransfer(ctx context.Context, env *Env, path string, xfers int, dur time.Duration) (mbit, clientCPU float64, err error) {
	if path == "" {
		path = "direct"
	}
	path, link, shaped := strings.Cut(path, "@")
	if shaped {
		if err := d.lab.ShapeLinks(ctx, link); err != nil {
			return 0, 0, err
		}
		defer d.lab.ShapeLinks(context.WithoutCancel(ctx), "")
	}
	t, err := d.lab.ThroughputCPU(ctx, env.TB, path, xfers, dur)
	if path == "openconnect" {
		t.ClientCPU = math.NaN()
	}
	return t.Mbps, t.ClientCPU, err
}

func (d *egressDriver) EgressGatewayRSS(ctx context.Context, env *Env, clients int) (float64, error) {
	b, err := d.lab.GatewayRSS(ctx, env.TB, clients, false)
	return float64(b) / (1 << 20), err
}

func (d *egressDriver) Processes(context.Context, *Env) []Proc {
	if d.lab == nil {
		return nil
	}
	var out []Proc
	for name, pid := range d.lab.Procs {
		if name == "gateway-root" || name == "gateway-user" {
			out = append(out, Proc{Node: "gateway host", Name: name, PID: pid})
		}
	}
	return out
}

// EgressGatewayDriver measures the egress gateway against direct access.
func EgressGatewayDriver() Driver { return &egressDriver{} }
