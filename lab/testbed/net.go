package testbed

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/palisade-hpc/palisade/internal/sys/netns"
)

// Link names on the host side. The name is at most 10 characters, so
// "<name>-e16" fits the kernel's 15-character limit.
func (tb *Testbed) bridgeEth() string { return tb.Name + "-br0" }
func (tb *Testbed) bridgeIB() string  { return tb.Name + "-br1" }
func (tb *Testbed) vethEth(i int) string {
	return fmt.Sprintf("%s-e%d", tb.Name, i)
}
func (tb *Testbed) vethIB(i int) string { return fmt.Sprintf("%s-i%d", tb.Name, i) }
func (tb *Testbed) vethRouter() string  { return tb.Name + "-r0" }

// netnsNames lists every namespace of the instance.
func (tb *Testbed) netnsNames() []string {
	out := []string{tb.Router, tb.Outside.NetNS}
	for _, n := range tb.Nodes {
		out = append(out, n.NetNS)
	}
	return out
}

// hostLinks lists the instance's links in the host namespace.
func (tb *Testbed) hostLinks() []string {
	out := []string{tb.vethRouter()}
	for i := range tb.Nodes {
		out = append(out, tb.vethEth(i+1), tb.vethIB(i+1))
	}
	return append(out, tb.bridgeEth(), tb.bridgeIB())
}

// run executes a command and returns its trimmed output, with the output in
// the error on failure.
func run(ctx context.Context, stdin string, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	s := strings.TrimSpace(out.String())
	if err != nil {
		return s, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, s)
	}
	return s, nil
}

// ipBatch runs ip commands, in netns ns if not empty. force continues after
// errors (teardown).
func ipBatch(ctx context.Context, ns string, force bool, lines []string) error {
	if len(lines) == 0 {
		return nil
	}
	args := []string{}
	if ns != "" {
		args = append(args, "-n", ns)
	}
	if force {
		args = append(args, "-force")
	}
	args = append(args, "-batch", "-")
	_, err := run(ctx, strings.Join(lines, "\n")+"\n", "ip", args...)
	return err
}

// inNetns runs f on an OS thread switched into netns ns (for per-namespace
// /proc/sys writes).
func inNetns(ns string, f func() error) error {
	return netns.DoPath(filepath.Join("/run/netns", ns), f)
}

func writeSysctls(kv map[string]string) error {
	for k, v := range kv {
		p := "/proc/sys/" + strings.ReplaceAll(k, ".", "/")
		if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
			return fmt.Errorf("sysctl %s=%s: %w", k, v, err)
		}
	}
	return nil
}

// upNetwork creates the namespaces, bridges, veths, addresses and routes.
func (tb *Testbed) upNetwork(ctx context.Context) error {
	var root []string
	for _, ns := range tb.netnsNames() {
		root = append(root, "netns add "+ns)
	}
	if err := ipBatch(ctx, "", false, root); err != nil {
		return err
	}
	// DAD off before any interface exists in the namespace, so addresses
	// (link-local ones included) are usable at once.
	base := map[string]string{
		"net.ipv6.conf.all.accept_dad":     "0",
		"net.ipv6.conf.default.accept_dad": "0",
		"net.ipv6.conf.all.accept_ra":      "0",
		"net.ipv6.conf.default.accept_ra":  "0",
		"net.ipv4.ping_group_range":        "0 2147483647",
		// Refusals by ICMP (unreachable / admin-prohibited) must come back
		// at once in tests: no per-peer ICMP rate limit (burst 6 by
		// default), a generous global one. All per network namespace.
		"net.ipv4.icmp_ratelimit":    "0",
		"net.ipv6.icmp.ratelimit":    "0",
		"net.ipv4.icmp_msgs_per_sec": "10000",
		"net.ipv4.icmp_msgs_burst":   "1000",
		// The fuzzer's sentinels (lab/check/fuzz, 47000+) lie in the
		// ephemeral range: no connection of the node's own may take
		// (or leave in TIME_WAIT) a port a sentinel must bind.
		"net.ipv4.ip_local_reserved_ports": "47000-48999",
	}
	for _, ns := range tb.netnsNames() {
		kv := base
		if ns == tb.Router {
			// No source filtering on the router (rp_filter 0, explicitly:
			// a kernel may inherit another default): an off-cluster host
			// can send with a cluster source address, as behind a real
			// router without filters. The attack suite's spoofing cases
			// rely on it (check --attacks).
			kv = map[string]string{"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.forwarding": "1",
				"net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0"}
			for k, v := range base {
				kv[k] = v
			}
		}
		if err := inNetns(ns, func() error { return writeSysctls(kv) }); err != nil {
			return err
		}
	}

	// Host side: two bridges that the host firewall must not see
	// (br_netfilter is on with bridge-nf-call-iptables=1 on this machine
	// kind), no IPv6 on host-side ports, no multicast snooping (ND relies on
	// multicast and there is no querier).
	root = nil
	for _, br := range []string{tb.bridgeEth(), tb.bridgeIB()} {
		root = append(root,
			"link add "+br+" type bridge nf_call_iptables 0 nf_call_ip6tables 0 nf_call_arptables 0 mcast_snooping 0",
			"link set "+br+" addrgenmode none",
			"link set "+br+" up")
	}
	port := func(host, peer, ns, br string) []string {
		return []string{
			"link add " + host + " type veth peer name " + peer + " netns " + ns,
			"link set " + host + " addrgenmode none",
			"link set " + host + " master " + br + " up",
		}
	}
	for i, n := range tb.Nodes {
		root = append(root, port(tb.vethEth(i+1), "eth0", n.NetNS, tb.bridgeEth())...)
		root = append(root, port(tb.vethIB(i+1), "ib0", n.NetNS, tb.bridgeIB())...)
	}
	root = append(root, port(tb.vethRouter(), "eth0", tb.Router, tb.bridgeEth())...)
	if err := ipBatch(ctx, "", false, root); err != nil {
		return err
	}

	// Inside the namespaces, in parallel.
	jobs := map[string][]string{}
	for _, n := range tb.Nodes {
		jobs[n.NetNS] = []string{
			"link set lo up",
			"addr add " + n.Eth0V4.String() + "/24 dev eth0",
			"addr add " + n.Eth0V6.String() + "/64 dev eth0 nodad",
			"link set eth0 up",
			"addr add " + n.IBV4.String() + "/24 dev ib0",
			"addr add " + n.IBV6.String() + "/64 dev ib0 nodad",
			"link set ib0 up",
			"route add default via " + RouterEth0V4.String(),
			"route add default via " + RouterEth0V6.String(),
		}
	}
	jobs[tb.Router] = []string{
		"link set lo up",
		"link add eth1 type veth peer name eth0 netns " + tb.Outside.NetNS,
		"addr add " + RouterEth0V4.String() + "/24 dev eth0",
		"addr add " + RouterEth0V6.String() + "/64 dev eth0 nodad",
		"link set eth0 up",
		"addr add " + RouterOutsideV4.String() + "/24 dev eth1",
		"addr add " + RouterOutsideV6.String() + "/64 dev eth1 nodad",
		"link set eth1 up",
	}
	if err := ipBatch(ctx, tb.Router, false, jobs[tb.Router]); err != nil {
		return err
	}
	delete(jobs, tb.Router)
	jobs[tb.Outside.NetNS] = []string{
		"link set lo up",
		"addr add " + tb.Outside.Eth0V4.String() + "/24 dev eth0",
		"addr add " + tb.Outside.Eth0V6.String() + "/64 dev eth0 nodad",
		"link set eth0 up",
		"route add default via " + RouterOutsideV4.String(),
		"route add default via " + RouterOutsideV6.String(),
	}
	var fs []func() error
	for ns, lines := range jobs {
		fs = append(fs, func() error { return ipBatch(ctx, ns, false, lines) })
	}
	return parallel(fs...)
}

// downNetwork deletes the host-side links (which takes their peers along)
// and the namespaces. Missing objects are fine: Down is idempotent.
func (tb *Testbed) downNetwork(ctx context.Context) error {
	var lines []string
	for _, l := range tb.hostLinks() {
		if _, err := os.Stat("/sys/class/net/" + l); err == nil {
			lines = append(lines, "link del "+l)
		}
	}
	for _, ns := range tb.netnsNames() {
		if _, err := os.Stat("/run/netns/" + ns); err == nil {
			lines = append(lines, "netns del "+ns)
		}
	}
	return ipBatch(ctx, "", true, lines)
}

// parallel runs jobs concurrently and returns the first error.
func parallel(jobs ...func() error) error {
	errs := make(chan error, len(jobs))
	for _, j := range jobs {
		go func() { errs <- j() }()
	}
	var first error
	for range jobs {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}
