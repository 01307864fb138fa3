package check

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/probe"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Connectors are the users whose processes connect, in table order: three
// ordinary users (two sharing proj1), the exempt service account and root.
var Connectors = []string{"alice", "bob", "carol", "svc", "root"}

// ListenerSpec is one listener process started on every host.
type ListenerSpec struct {
	Name  string // label in reports
	User  string
	Group string // run under `sg Group` (effective gid = the group's); "" = the user's own
	Port  uint16
}

// Listeners are the listener identities: each user with their private
// group, alice under `sg proj1` (her project group), and root on a system
// port. User listeners serve unprivileged ports; 590 is below the system
// port limit and outside the ident client's source ports (600–1023).
var Listeners = []ListenerSpec{
	{"alice", "alice", "", 29101},
	{"bob", "bob", "", 29102},
	{"carol", "carol", "", 29103},
	{"svc", "svc", "", 29104},
	{"alice+proj1", "alice", "proj1", 29105},
	{"root", "root", "", 590},
}

// quick keeps every launcher, path, protocol and family and every rule of
// the policy core, with fewer identities: bob meets his own listener (same
// user), alice's (denied) and alice's under sg proj1 (shared group); carol
// shares nothing; root is an exempt connector; svc an exempt listener; root
// listens on a system port.
var (
	quickConnectors = []string{"bob", "carol", "root"}
	quickListeners  = []string{"alice", "bob", "svc", "alice+proj1", "root"}
)

// proc is one connector process (or, for mpirun, one job of two ranks):
// one user under one launcher, probing a plan of many cases.
type proc struct {
	Launcher  Launcher
	User      string
	Start     string   // node the launcher runs on
	Hosts     []string // nodes the connector runs on
	Connector Party
	Cases     []*Case
	tag       string // file-name stem: <launcher>-<user>
	jobID     string // sbatch
	failure   string // launcher-level failure, attached to every unanswered case
	output    string // launcher's own output (stderr, srun/ssh/mpirun messages)
}

// matrix is the planned run.
type matrix struct {
	tb        *testbed.Testbed
	listeners []ListenerSpec
	parties   map[string]Party // listener label → party (Node unset)
	procs     []*proc
	cases     []*Case
	unix      bool // listeners also serve abstract Unix sockets
}

// hostAddrs is what the matrix needs of a host.
type hostAddrs struct {
	eth0, ib [2]netip.Addr // [0] IPv4, [1] IPv6
}

func addrsOf(n testbed.Node) hostAddrs {
	return hostAddrs{eth0: [2]netip.Addr{n.Eth0V4, n.Eth0V6}, ib: [2]netip.Addr{n.IBV4, n.IBV6}}
}

func famIdx(fam int) int { return fam/2 - 2 } // 4 → 0, 6 → 1

// party resolves a user (and optional sg group) from NSS.
func party(res identity.Resolver, name, user, group string) (Party, error) {
	uid, gid, err := res.LookupUser(user)
	if err != nil {
		return Party{}, fmt.Errorf("user %s: %w", user, err)
	}
	p := Party{Name: name, User: user, UID: uid, GID: gid}
	if group != "" {
		g, err := res.LookupGroup(group)
		if err != nil {
			return Party{}, fmt.Errorf("group %s: %w", group, err)
		}
		p.GID = g
	}
	return p, nil
}

// connectorParty adds every group of the user, as setpriv --init-groups,
// sshd and slurmstepd give them.
func connectorParty(res identity.Resolver, user string) (Party, error) {
	p, err := party(res, user, user, "")
	if err != nil {
		return p, err
	}
	gs, err := res.GroupsOf(user)
	if err != nil {
		return p, fmt.Errorf("groups of %s: %w", user, err)
	}
	p.Groups = append([]uint32(nil), gs...)
	if !slices.Contains(p.Groups, p.GID) {
		p.Groups = append(p.Groups, p.GID)
	}
	slices.Sort(p.Groups)
	return p, nil
}

// placement says where each launcher starts and where its connector runs.
// Slurm connectors are spread over the nodes (two CPUs each) so that the
// steps and jobs of all users can run at once instead of queueing.
func placement(l Launcher, i int, nodes []string) (start string, hosts []string) {
	n := len(nodes)
	at := func(k int) string { return nodes[k%n] }
	switch l {
	case SSH:
		return nodes[0], []string{at(1)}
	case Srun:
		return nodes[0], []string{at(i + 2)}
	case Sbatch, Queued:
		return nodes[0], []string{at(i + 1)}
	case MPIRun:
		return nodes[0], []string{at(0), at(1)}
	}
	return nodes[0], []string{nodes[0]}
}

// buildMatrix plans every case (quick: the quick identities). Identities
// come from NSS; the testbed's node list gives the addresses.
func buildMatrix(tb *testbed.Testbed, res identity.Resolver, launchers []Launcher, quick bool) (*matrix, error) {
	if quick {
		return buildMatrixFor(tb, res, launchers, quickConnectors, quickListeners)
	}
	return buildMatrixFor(tb, res, launchers, nil, nil)
}

// SelectIdentities resolves the connector and listener selection of a run:
// explicit lists win, else quick's, else all (nil). Unknown names are an
// error.
func SelectIdentities(quick bool, connectors, listeners []string) ([]string, []string, error) {
	for _, c := range connectors {
		if !slices.Contains(Connectors, c) {
			return nil, nil, fmt.Errorf("unknown connector %q (known: %v)", c, Connectors)
		}
	}
	var names []string
	for _, l := range Listeners {
		names = append(names, l.Name)
	}
	for _, l := range listeners {
		if !slices.Contains(names, l) {
			return nil, nil, fmt.Errorf("unknown listener %q (known: %v)", l, names)
		}
	}
	if quick {
		if connectors == nil {
			connectors = quickConnectors
		}
		if listeners == nil {
			listeners = quickListeners
		}
	}
	return connectors, listeners, nil
}

// buildMatrixFor plans the cases of the given connectors and listener
// labels (nil = all of them).
func buildMatrixFor(tb *testbed.Testbed, res identity.Resolver, launchers []Launcher, connectors, listeners []string) (*matrix, error) {
	if len(tb.Nodes) < 2 {
		return nil, fmt.Errorf("testbed %s has %d node(s); the matrix needs at least 2", tb.Name, len(tb.Nodes))
	}
	m := &matrix{tb: tb, parties: map[string]Party{}}
	for _, l := range Listeners {
		if listeners != nil && !slices.Contains(listeners, l.Name) {
			continue
		}
		p, err := party(res, l.Name, l.User, l.Group)
		if err != nil {
			return nil, err
		}
		m.listeners = append(m.listeners, l)
		m.parties[l.Name] = p
	}
	var users []string
	for _, u := range Connectors { // table order
		if connectors == nil || slices.Contains(connectors, u) {
			users = append(users, u)
		}
	}
	if len(users) == 0 || len(m.listeners) == 0 {
		return nil, fmt.Errorf("the matrix needs at least one connector and one listener")
	}
	conns := map[string]Party{}
	for _, u := range users {
		p, err := connectorParty(res, u)
		if err != nil {
			return nil, err
		}
		conns[u] = p
	}
	nodes := tb.NodeNames()
	hostOf := map[string]testbed.Node{}
	for _, n := range tb.Nodes {
		hostOf[n.Name] = n
	}
	hostOf[OutsideHost] = tb.Outside
	next := func(h string) string { // the "other node" of h
		i := slices.Index(nodes, h)
		return nodes[(i+1)%len(nodes)]
	}

	add := func(p *proc, host string, path Path, lnode string, dst, src func(fam int) netip.Addr) {
		for _, proto := range []policy.Proto{policy.TCP, policy.UDP} {
			for _, fam := range []int{4, 6} {
				for _, l := range m.listeners {
					lp := m.parties[l.Name]
					lp.Node = lnode
					cp := p.Connector
					cp.Node = host
					c := &Case{
						ID:        fmt.Sprintf("c%04d", len(m.cases)+1),
						Launcher:  p.Launcher,
						Path:      path,
						Proto:     proto,
						Family:    fam,
						Connector: cp,
						Listener:  lp,
						Dst:       netip.AddrPortFrom(dst(fam), l.Port),
						Src:       src(fam),
					}
					p.Cases = append(p.Cases, c)
					m.cases = append(m.cases, c)
				}
			}
		}
	}
	loop := [2]netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()}
	for _, l := range launchers {
		for i, u := range users {
			start, hosts := placement(l, i, nodes)
			p := &proc{Launcher: l, User: u, Start: start, Hosts: hosts, Connector: conns[u],
				tag: fmt.Sprintf("%s-%s", l, u)}
			for _, h := range hosts {
				self, other := addrsOf(hostOf[h]), addrsOf(hostOf[next(h)])
				out := addrsOf(tb.Outside)
				add(p, h, Loopback, h, func(f int) netip.Addr { return loop[famIdx(f)] },
					func(f int) netip.Addr { return loop[famIdx(f)] })
				add(p, h, Self, h, func(f int) netip.Addr { return self.eth0[famIdx(f)] },
					func(f int) netip.Addr { return self.eth0[famIdx(f)] })
				add(p, h, Eth0, next(h), func(f int) netip.Addr { return other.eth0[famIdx(f)] },
					func(f int) netip.Addr { return self.eth0[famIdx(f)] })
				add(p, h, IB, next(h), func(f int) netip.Addr { return other.ib[famIdx(f)] },
					func(f int) netip.Addr { return self.ib[famIdx(f)] })
				add(p, h, OutsideOut, OutsideHost, func(f int) netip.Addr { return out.eth0[famIdx(f)] },
					func(f int) netip.Addr { return self.eth0[famIdx(f)] })
			}
			m.procs = append(m.procs, p)
		}
		// Outside → node: a plain process on the outside host (it has no
		// Slurm and no ssh into the cluster), towards the first node.
		if l == Plain {
			for _, u := range users {
				p := &proc{Launcher: Plain, User: u, Start: OutsideHost, Hosts: []string{OutsideHost},
					Connector: conns[u], tag: "outside-" + u}
				in, out := addrsOf(tb.Nodes[0]), addrsOf(tb.Outside)
				add(p, OutsideHost, OutsideIn, nodes[0], func(f int) netip.Addr { return in.eth0[famIdx(f)] },
					func(f int) netip.Addr { return out.eth0[famIdx(f)] })
				m.procs = append(m.procs, p)
			}
		}
	}
	return m, nil
}

// listenerHosts are the hosts some case targets.
func (m *matrix) listenerHosts() []string {
	var hs []string
	for _, c := range m.cases {
		if !slices.Contains(hs, c.Listener.Node) {
			hs = append(hs, c.Listener.Node)
		}
	}
	slices.Sort(hs)
	return hs
}

// addUnix adds, for every connector process on every node it runs on, a
// stream and a datagram case to each listener's abstract Unix sockets on
// that same node (abstract names are per network namespace).
func (m *matrix) addUnix() {
	m.unix = true
	for _, p := range m.procs {
		for _, h := range p.Hosts {
			if h == OutsideHost {
				continue
			}
			for _, proto := range []policy.Proto{policy.TCP, policy.UDP} {
				for _, l := range m.listeners {
					lp := m.parties[l.Name]
					lp.Node = h
					cp := p.Connector
					cp.Node = h
					pp := probe.ProtoUnixStream
					if proto == policy.UDP {
						pp = probe.ProtoUnixDgram
					}
					c := &Case{ID: fmt.Sprintf("c%04d", len(m.cases)+1), Launcher: p.Launcher, Path: Unix, Proto: proto,
						Connector: cp, Listener: lp, Dst: netip.AddrPortFrom(netip.Addr{}, l.Port),
						Abstract: probe.UnixName(l.Port, pp)}
					p.Cases = append(p.Cases, c)
					m.cases = append(m.cases, c)
				}
			}
		}
	}
}
