package uvn

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// Issue 21: a user's network is a boundary enforced where packets flow. bob
// (and an off-cluster host) attack alice's listeners on node2 the ways the
// kernel leaves open to an unprivileged socket after its creation; each
// attack has its positive control: alice reaching the same listener the
// same way (or the path the attack abuses working for its rightful user).

// attackPy runs probes, `python3 - 'MODE NAME ARGS...'...` (or one
// listener, `python3 - squat|udp-listen NAME ARGS...`); each prints
// "NAME: <outcome>" and never fails itself.
const attackPy = `
import socket, struct, subprocess, sys
def idx(dev):
    return socket.if_nametoindex(dev)
def err(e):
    return "error " + (e.strerror or str(e))
def recv_line(s):
    s.settimeout(20)
    d = s.recv(200).decode(errors="replace").strip()
    return d or "eof"
def run(mode, name, args):
    out = ""
    try:
        if mode == "scoped-bind":  # DEV HOST PORT: bind fe80::1%DEV (fails), then connect
            dev, host, port = args[0], args[1], int(args[2])
            s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            b = "none"
            if dev != "-":
                try:
                    s.bind(("fe80::1", 0, 0, idx(dev)))
                    b = "bound"
                except OSError as e:
                    b = err(e)
            s.settimeout(20)
            try:
                s.connect((host, port))
                out = "bind=%s recv=%s" % (b, recv_line(s))
            except OSError as e:
                out = "bind=%s connect=%s" % (b, err(e))
        elif mode == "pktinfo":  # DEV HOST PORT PAYLOAD: IP_PKTINFO ipi_ifindex=DEV
            dev, host, port, pay = args[0], args[1], int(args[2]), args[3].encode()
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            cm = []
            if dev != "-":
                cm = [(socket.IPPROTO_IP, 8,  # IP_PKTINFO
                        struct.pack("=i4s4s", idx(dev), bytes(4), bytes(4)))]
            try:
                s.sendmsg([pay], cm, 0, (host, port))
                out = "sent"
            except OSError as e:
                out = err(e)
        elif mode == "scoped-send":  # DEV ADDR PORT PAYLOAD: sendto(ADDR%DEV) over IPv6
            dev, addr, port, pay = args[0], args[1], int(args[2]), args[3].encode()
            s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            try:
                s.sendto(pay, (addr, port, 0, idx(dev) if dev != "-" else 0))
                out = "sent"
            except OSError as e:
                out = err(e)
        elif mode == "sockopt":  # OPT DEV HOST PORT: a device option, then connect
            opt, dev, host, port = args[0], args[1], args[2], int(args[3])
            fam = socket.AF_INET6 if opt.startswith("IPV6") else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            try:
                if opt == "SO_BINDTODEVICE":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, dev.encode())
                elif opt == "SO_BINDTOIFINDEX":
                    s.setsockopt(socket.SOL_SOCKET, 62, idx(dev))
                elif opt == "IP_UNICAST_IF":
                    s.setsockopt(socket.IPPROTO_IP, 50, struct.pack("!I", idx(dev)))
                elif opt == "IPV6_UNICAST_IF":
                    s.setsockopt(socket.IPPROTO_IPV6, 76, struct.pack("!I", idx(dev)))
                o = "set"
            except OSError as e:
                o = err(e)
            s.settimeout(20)
            try:
                s.connect((host, port))
                out = "opt=%s recv=%s" % (o, recv_line(s))
            except OSError as e:
                out = "opt=%s connect=%s" % (o, err(e))
        elif mode == "mcast-if":  # OPT DEV GROUP PORT PAYLOAD: multicast interface, then send
            opt, dev, group, port, pay = args[0], args[1], args[2], int(args[3]), args[4].encode()
            v6 = opt.startswith("IPV6")
            s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
            try:
                if v6:
                    s.setsockopt(socket.IPPROTO_IPV6, 17, idx(dev))  # IPV6_MULTICAST_IF
                else:
                    s.setsockopt(socket.IPPROTO_IP, 32, struct.pack("4s4si", bytes(4), bytes(4), idx(dev)))  # ip_mreqn
                o = "set"
            except OSError as e:
                o = err(e)
            try:
                s.sendto(pay, (group, port))
                out = "opt=%s send=sent" % o
            except OSError as e:
                out = "opt=%s send=%s" % (o, err(e))
        elif mode == "nat-connect":  # DEV HOST PORT: bind the NAT address of DEV, connect
            dev, host, port = args[0], args[1], int(args[2])
            a = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", dev], capture_output=True, text=True).stdout
            nat = [w.split("/")[0] for w in a.split() if w.startswith("100.")][0]
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((nat, 0))
            s.settimeout(20)
            try:
                s.connect((host, port))
                out = "from=%s recv=%s" % (nat, recv_line(s))
            except OSError as e:
                out = "from=%s connect=%s" % (nat, err(e))
        elif mode == "squat":  # DEV PORT: bind fe80::1%DEV (fails), then listen on PORT
            dev, port = args[0], int(args[1])
            s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            b = "none"
            if dev != "-":
                try:
                    s.bind(("fe80::1", 0, 0, idx(dev)))
                    b = "bound"
                except OSError as e:
                    b = err(e)
            s.bind(("::", port))
            s.listen(8)
            print("%s: listening bind=%s dev=%d" % (name, b, s.getsockopt(socket.SOL_SOCKET, 62)), flush=True)
            s.settimeout(150)
            while True:
                c, _ = s.accept()
                c.sendall(b"bob-squat\n")
                c.close()
        elif mode == "udp-listen":  # PORT: dual-stack UDP, one line per datagram
            s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", int(args[0])))
            print("%s: listening" % name, flush=True)
            while True:
                d, a = s.recvfrom(200)
                print("%s: got %s" % (name, d.decode(errors="replace")), flush=True)
    except Exception as e:
        out = "probe failed: %r" % (e,)
    print("%s: %s" % (name, out), flush=True)

if sys.argv[1] in ("squat", "udp-listen"):
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
else:
    for spec in sys.argv[1:]:
        p = spec.split()
        run(p[0], p[1], p[2:])
`

// attempt is one probe of a batch: the probe (mode, args) as user on node,
// judged as an attack (no outcome contains any of bad) or as a control
// (the outcome contains want).
type attempt struct {
	node, user, label string
	mode              string
	args              []string
	bad               []string
	want              string
}

// userCmd is script run as user ("" = root; "stray:UID" = that uid
// outside any session, as cron or systemd --user would start him).
func (e *vmEnv) userCmd(t *testing.T, node, user, script string) string {
	t.Helper()
	pre := ""
	if u, ok := strings.CutPrefix(user, "stray:"); ok {
		user, pre = "", "setpriv --reuid="+u+" --regid="+u+" --init-groups "
	}
	return e.run(t, node, user, pre+script)
}

// probes runs attempts, one process per node and user (a process start
// costs seconds under TCG), and returns each attempt's outcome.
func (e *vmEnv) probes(t *testing.T, as []attempt) []string {
	t.Helper()
	type key struct{ node, user string }
	var order []key
	groups := map[key][]int{}
	for i, a := range as {
		k := key{a.node, a.user}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], i)
	}
	res := make([]string, len(as))
	for _, k := range order {
		var specs []string
		for _, i := range groups[k] {
			specs = append(specs, fmt.Sprintf("'%s p%d %s'", as[i].mode, i, strings.Join(as[i].args, " ")))
		}
		out := e.userCmd(t, k.node, k.user, fmt.Sprintf("python3 - %s <<'EOF'\n%s\nEOF", strings.Join(specs, " "), attackPy))
		for _, i := range groups[k] {
			res[i] = "no result: " + out
			for _, l := range strings.Split(out, "\n") {
				if v, ok := strings.CutPrefix(l, fmt.Sprintf("p%d:", i)); ok {
					res[i] = strings.TrimSpace(v)
				}
			}
		}
	}
	return res
}

// probe runs one probe.
func (e *vmEnv) probe(t *testing.T, node, user, mode string, args ...string) string {
	t.Helper()
	return e.probes(t, []attempt{{node: node, user: user, mode: mode, args: args}})[0]
}

func attacks(t *testing.T, e *vmEnv) {
	tb := e.tb
	// alice: a TCP listener (dual-stack) on node2 (TestVM's, port 29101,
	// answers "alice-node2"), a dual-stack UDP listener, and a process on
	// node1 so that her VRF exists there too (cross-node attacks through
	// her VXLAN).
	udp := e.bg(t, "node2", "alice", "exec python3 - udp-listen audp 29105 <<'EOF'\n"+attackPy+"\nEOF")
	waitOut(t, udp, "audp: listening", 90*time.Second)
	e.bg(t, "node1", "alice", "exec sleep 3600")
	deadline := time.Now().Add(90 * time.Second)
	for !strings.Contains(e.run(t, "node1", "", "ip -br link show palv2001"), "palv2001") && time.Now().Before(deadline) {
		time.Sleep(time.Second)
	}
	// The kernel's answer to each attack is logged, for the record of what
	// 6.1 does (docs/uvn.md's threat model).
	type result struct{ name, got string }
	var log []result
	check := func(name, got string, bad ...string) {
		t.Helper()
		log = append(log, result{name, got})
		// A probe that could not make its attempt proves nothing.
		for _, b := range append(bad, "probe failed", "no result") {
			if strings.Contains(got, b) {
				t.Errorf("%s: %s (contains %q)", name, got, b)
			}
		}
	}
	must := func(name, got, want string) {
		t.Helper()
		log = append(log, result{name, got})
		if !strings.Contains(got, want) {
			t.Errorf("control %s: %s, want %q", name, got, want)
		}
	}
	defer func() {
		var b strings.Builder
		for _, r := range log {
			fmt.Fprintf(&b, "  %-34s %s\n", r.name, r.got)
		}
		t.Logf("attack outcomes:\n%s", b.String())
	}()

	// 1-4 and 6: one batch of attempts (each with its outcome logged).
	atk := func(node, user, label, mode string, args []string, bad ...string) attempt {
		return attempt{node: node, user: user, label: label, mode: mode, args: args, bad: bad}
	}
	ctl := func(node, user, label, want, mode string, args ...string) attempt {
		return attempt{node: node, user: user, label: "control: " + label, mode: mode, args: args, want: want}
	}
	a := func(args ...string) []string { return args }
	var as []attempt
	// 1. Scoped link-local bind: the kernel binds the socket to the
	// scope's device before the address check fails.
	for _, c := range []struct{ node, dev, host string }{
		{"node2", "palv2001", "::ffff:127.0.0.1"},   // same node, her VRF
		{"node1", "palv2001", "::ffff:198.18.0.2"},  // her VRF on node1, to node2
		{"node1", "pal0x2001", "::ffff:198.18.0.2"}, // her VXLAN
		{"node1", "pal0x2001", "2001:2::2"},
	} {
		as = append(as, atk(c.node, "bob", "scoped-bind "+c.node+" "+c.dev+" "+c.host, "scoped-bind", a(c.dev, c.host, "29101"), "alice-node2", "bind=bound"))
	}
	as = append(as,
		ctl("node2", "alice", "alice same node", "alice-node2", "scoped-bind", "-", "::ffff:127.0.0.1", "29101"),
		ctl("node1", "alice", "alice node1->node2 v6", "alice-node2", "scoped-bind", "-", "2001:2::2", "29101"),
		// 2. IP_PKTINFO naming her devices on sendmsg.
		atk("node2", "bob", "pktinfo node2 palv2001", "pktinfo", a("palv2001", "127.0.0.1", "29105", "ATK-pktinfo-vrf"), "sent"),
		atk("node1", "bob", "pktinfo node1 pal0x2001", "pktinfo", a("pal0x2001", "198.18.0.2", "29105", "ATK-pktinfo-vx"), "sent"),
		ctl("node2", "alice", "alice pktinfo own VRF", "sent", "pktinfo", "palv2001", "127.0.0.1", "29105", "CTL-pktinfo"),
		ctl("node1", "alice", "alice node1 -> node2 udp", "sent", "pktinfo", "-", "198.18.0.2", "29105", "CTL-remote"),
		// 3. IPv6 scoped destinations: link-local multicast and unicast.
		atk("node2", "bob", "scoped-send ff02::1%palv2001", "scoped-send", a("palv2001", "ff02::1", "29105", "ATK-mcast-vrf"), "sent"),
		atk("node1", "bob", "scoped-send ff02::1%pal0x2001", "scoped-send", a("pal0x2001", "ff02::1", "29105", "ATK-mcast-vx"), "sent"),
		ctl("node2", "alice", "alice [::1]", "sent", "scoped-send", "-", "::1", "29105", "CTL-v6"),
	)
	// 4. Device socket options, from a session (the kernel refuses a
	// change of a bound socket's device without CAP_NET_RAW) and from a
	// stray process (the root programs refuse them).
	for _, who := range []string{"bob", "stray:2002"} {
		for _, o := range []struct{ opt, host string }{
			{"SO_BINDTODEVICE", "127.0.0.1"}, {"SO_BINDTOIFINDEX", "127.0.0.1"},
			{"IP_UNICAST_IF", "127.0.0.1"}, {"IPV6_UNICAST_IF", "::ffff:127.0.0.1"},
		} {
			as = append(as, atk("node2", who, who+" "+o.opt, "sockopt", a(o.opt, "palv2001", o.host, "29101"), "alice-node2", "opt=set"))
		}
		// Refused, the datagram leaves by a default device: alice's
		// listener must not see it (checked at the end).
		for _, m := range []struct{ opt, group string }{{"IP_MULTICAST_IF", "224.0.0.1"}, {"IPV6_MULTICAST_IF", "ff02::1"}} {
			as = append(as, atk("node2", who, who+" "+m.opt+" pal0x2001", "mcast-if", a(m.opt, "pal0x2001", m.group, "29105", "ATK-mcastif"), "opt=set"))
		}
	}
	// 6. Stray processes (started outside PAM and Slurm: cron, at,
	// systemd --user): in the default VRF, never in another user's.
	natA := strings.TrimSpace(e.run(t, "node2", "", "ip -4 -o addr show dev palv2001 | grep -o '100\\.[0-9.]*' | head -1"))
	as = append(as,
		atk("node2", "stray:2002", "stray scoped-bind palv2001", "scoped-bind", a("palv2001", "::ffff:127.0.0.1", "29101"), "alice-node2"),
		atk("node2", "stray:2002", "stray pktinfo palv2001", "pktinfo", a("palv2001", "127.0.0.1", "29105", "ATK-stray-pktinfo"), "sent"),
		atk("node2", "stray:2002", "stray scoped-send ff02::1%palv2001", "scoped-send", a("palv2001", "ff02::1", "29105", "ATK-stray-mcast"), "sent"),
		atk("node2", "stray:2002", "stray scoped-send ff02::1%pal0x2001", "scoped-send", a("pal0x2001", "ff02::1", "29105", "ATK-stray-mcast-vx"), "sent"),
		atk("node2", "stray:2002", "stray scoped-send fe80::1%pal0x2001", "scoped-send", a("pal0x2001", "fe80::1", "29105", "ATK-stray-ll-vx"), "sent"),
		atk("node2", "stray:2002", "stray to alice's NAT address", "scoped-bind", a("-", "::ffff:"+natA, "29101"), "alice-node2"),
		ctl("node2", "stray:2002", "stray bob to a system service", "root-node3", "scoped-bind", "-", "::ffff:198.18.0.3", "590"),
		ctl("node2", "stray:2001", "alice's own stray process, her VRF", "sent", "pktinfo", "palv2001", "127.0.0.1", "29105", "CTL-stray-own"),
	)
	for i, got := range e.probes(t, as) {
		if as[i].want != "" {
			must(as[i].label, got, as[i].want)
		} else {
			check(as[i].label, got, as[i].bad...)
		}
	}

	// 5. Listening inside her VRF.
	sq := e.bg(t, "node2", "bob", "exec python3 - squat sq palv2001 47399 <<'EOF'\n"+attackPy+"\nEOF")
	if waitOut(t, sq, "sq: listening", 90*time.Second) {
		check("squat: bob's bind", sq.String(), "bind=bound")
		check("squat: alice to 127.0.0.1:47399", e.probe(t, "node2", "alice", "scoped-bind", "-", "::ffff:127.0.0.1", "47399"), "bob-squat")
		must("control: bob reaches his listener", e.probe(t, "node2", "bob", "scoped-bind", "-", "::ffff:127.0.0.1", "47399"), "bob-squat")
	}

	// A stray listener of bob's, unbound: the default VRF's services serve
	// every VRF (l3mdev_accept), his must not.
	sl := e.bg(t, "node2", "", "exec setpriv --reuid=2002 --regid=2002 --init-groups python3 - squat sl - 47400 <<'EOF'\n"+attackPy+"\nEOF")
	if waitOut(t, sl, "sl: listening", 90*time.Second) {
		check("alice to bob's stray listener", e.probe(t, "node2", "alice", "scoped-bind", "-", "::ffff:127.0.0.1", "47400"), "bob-squat")
		must("control: root to bob's stray listener", e.probe(t, "node2", "", "scoped-bind", "-", "::ffff:127.0.0.1", "47400"), "bob-squat")
	}

	// bob's stray UDP socket, unbound: alice's datagram to the port must
	// not reach it (root's does: system services serve every VRF).
	su := e.bg(t, "node2", "", "exec setpriv --reuid=2002 --regid=2002 --init-groups python3 - udp-listen su 29106 <<'EOF'\n"+attackPy+"\nEOF")
	if waitOut(t, su, "su: listening", 90*time.Second) {
		e.probe(t, "node2", "alice", "pktinfo", "-", "127.0.0.1", "29106", "ALICE-to-stray")
		must("control: root to bob's stray UDP", e.probe(t, "node2", "", "pktinfo", "-", "127.0.0.1", "29106", "ROOT-to-stray"), "sent")
		if waitOut(t, su, "ROOT-to-stray", 30*time.Second) {
			check("alice's datagram to bob's stray UDP", su.String(), "ALICE-to-stray")
		}
	}

	// 7. bob's own NAT address as source to an srun port: rules 998/999
	// would route it by the main table, masquerade would give it node2's
	// address, and the hand-over would take it for Slurm.
	e.bg(t, "node1", "alice", `exec socat TCP-LISTEN:61992,reuseaddr,fork SYSTEM:'echo alice-srun'`)
	waitFor(t, e, "node1", "61992")
	check("nat-source to srun port", e.probe(t, "node2", "bob", "nat-connect", "palv2002", "198.18.0.1", "61992"), "alice-srun")
	check("stray bob to alice's srun port", e.probe(t, "node2", "stray:2002", "scoped-bind", "-", "::ffff:198.18.0.1", "61992"), "alice-srun")
	must("control: default VRF reaches srun port", e.probe(t, "node2", "", "scoped-bind", "-", "::ffff:198.18.0.1", "61992"), "alice-srun")

	// 8. Off-cluster: a host that routes the NAT pool to node2 (any L2
	// neighbour can) to alice's NAT address.
	nat := strings.TrimSpace(e.run(t, "node2", "", "ip -4 -o addr show dev palv2001 | grep -o '100\\.[0-9.]*' | head -1"))
	e.run(t, "node1", "", "ip netns exec "+tb.Router+" ip route replace 100.64.0.0/10 via 198.18.0.2")
	defer e.run(t, "node1", "", "ip netns exec "+tb.Router+" ip route del 100.64.0.0/10")
	check("off-cluster to alice's NAT address", e.probe(t, "outside", "", "scoped-bind", "-", "::ffff:"+nat, "29101"), "alice-node2")
	must("control: alice node2 -> outside (replies)", e.run(t, "node2", "alice", "timeout 30 socat -t20 - TCP:198.18.200.1:29102 </dev/null 2>&1 | head -1"), "outside-saw-198.18.0.2")
	// Control: without the forward filter the same connection succeeds
	// (the attack is real); a setup puts the filter back.
	e.run(t, "node2", "", "nft delete table inet palisade_uvn")
	must("control: off-cluster without the filter", e.probe(t, "outside", "", "scoped-bind", "-", "::ffff:"+nat, "29101"), "alice-node2")
	e.run(t, "node2", "", tb.Binary+" uvn setup --uid alice >/dev/null")
	check("off-cluster after setup restored the filter", e.probe(t, "outside", "", "scoped-bind", "-", "::ffff:"+nat, "29101"), "alice-node2")

	// Nothing of bob's reached alice's UDP listener; her own did.
	time.Sleep(2 * time.Second) // datagrams in flight (no acknowledgement exists for a refused datagram)
	got := udp.String()
	for _, p := range []string{"ATK-"} {
		if strings.Contains(got, p) {
			t.Errorf("bob's datagrams reached alice's UDP listener:\n%s", got)
		}
	}
	for _, p := range []string{"CTL-pktinfo", "CTL-remote", "CTL-v6", "CTL-stray-own"} {
		if !strings.Contains(got, p) {
			t.Errorf("control: alice's datagram %s did not reach her listener:\n%s", p, got)
		}
	}
}
