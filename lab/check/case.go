// Package check is Palisade's isolation matrix: on a running testbed it
// starts real listeners (one process per identity per node, serving TCP and
// UDP on IPv4 and IPv6) and real connectors under every launcher a user
// has — a plain process, ssh, srun, sbatch and mpirun — and compares what
// really happened to each connection attempt with what a mode (a data
// plane) expects. `none` is the open baseline; `userwall` expects exactly
// the policy core's verdicts; other data planes register their own
// expectation with RegisterMode.
package check

import (
	"fmt"
	"net/netip"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/probe"
)

// Launcher is how a connector process was started.
type Launcher string

const (
	Plain  Launcher = "plain"  // a process started on a node (login-like)
	SSH    Launcher = "ssh"    // `ssh nodeB probe` from nodeA
	Srun   Launcher = "srun"   // a Slurm step
	Sbatch Launcher = "sbatch" // a Slurm batch job
	MPIRun Launcher = "mpirun" // ranks of `mpirun` on two nodes
)

// Launchers lists every launcher in table order.
var Launchers = []Launcher{Plain, SSH, Srun, Sbatch, MPIRun, Queued}

// Path is the way a connection goes from connector to listener.
type Path string

const (
	Loopback   Path = "loopback"    // 127.0.0.1 / ::1 on the connector's node
	Self       Path = "self"        // the connector node's own eth0 address
	Eth0       Path = "eth0"        // another node's eth0 address
	IB         Path = "ib0"         // another node's ib0 (IPoIB stand-in) address
	OutsideIn  Path = "outside-in"  // outside host → a node's eth0
	OutsideOut Path = "outside-out" // a node → the outside host
	// Unix is an abstract Unix socket on the connector's node (Proto TCP
	// = stream, UDP = datagram; Family 0): enforced by userwall's BPF LSM
	// programs where the kernel allows them (Options.Unix).
	Unix Path = "unix"
)

// Paths lists every path in table order.
var Paths = []Path{Loopback, Self, Eth0, IB, OutsideIn, OutsideOut}

// Party is one end of a case.
type Party struct {
	// Name labels the party in reports: the user, or for listeners
	// started under `sg GROUP` "user+group" (e.g. "alice+proj1").
	Name string `json:"name"`
	User string `json:"user"`
	UID  uint32 `json:"uid"`
	// GID is the effective gid (a listener under sg: the group's).
	GID uint32 `json:"gid"`
	// Groups are all of a connector's groups from NSS (empty for listeners).
	Groups []uint32 `json:"groups,omitempty"`
	// Node is the host the party runs on ("node2", "outside").
	Node string `json:"node"`
}

// Identity is the party as the policy core sees it.
func (p Party) Identity() policy.Identity {
	return policy.Identity{UID: p.UID, GID: p.GID, Groups: p.Groups}
}

// Verdict is what a mode expects of a case.
type Verdict struct {
	Allow bool `json:"allow"`
	// Rule names why (a policy rule, "open", "unmanaged-listener", …).
	Rule string `json:"rule"`
	// Audit: the connection is let through but the policy refuses it, so
	// the listener node's event log must hold an audit event for it
	// (check --mode audit).
	Audit bool `json:"audit,omitempty"`
}

// Observation states.
const (
	Allowed = "allowed" // data went both ways; the expected listener answered our nonce
	Refused = "refused" // the attempt failed (Kind says how)
	Broken  = "error"   // nothing was observed: the launcher or listener failed, or the wrong party answered
)

// Observation is what really happened.
type Observation struct {
	State string `json:"state"`
	// Kind is how a refused attempt failed: an errno name (EPERM,
	// ECONNREFUSED, ECONNRESET, EHOSTUNREACH, EACCES, …) or "timeout".
	Kind  string `json:"kind,omitempty"`
	Error string `json:"error,omitempty"`
	// Peer is the identity the answering listener reported.
	Peer   *probe.Identity `json:"peer,omitempty"`
	Micros int64           `json:"us,omitempty"`
}

// Case is one cell of the matrix: one connector, launched one way, trying
// one listener over one path with one protocol and address family. Modes
// read it to state their expectation; everything a data plane could base a
// decision on is here.
type Case struct {
	ID        string       `json:"id"`
	Launcher  Launcher     `json:"launcher"`
	Path      Path         `json:"path"`
	Proto     policy.Proto `json:"-"`
	Family    int          `json:"family"` // 4 or 6
	Connector Party        `json:"connector"`
	Listener  Party        `json:"listener"`
	// Dst is the address and port the connector dials.
	Dst netip.AddrPort `json:"dst"`
	// Abstract is the abstract socket name of a Unix case ("@palprobe-…").
	Abstract string `json:"abstract,omitempty"`
	// Src is the connector's address as the listener's node sees it: the
	// connector node's address on the network of Dst (eth0, ib0, or the
	// outside host's address). Invalid when both ends are on one node.
	Src netip.Addr `json:"src,omitzero"`
	// Policy is the policy configured on the listener's node (the
	// testbed's /etc/palisade/palisade.toml there); nil on the outside
	// host, which no data plane manages.
	Policy *policy.Policy `json:"-"`

	// Filled in by Run.
	Expected Verdict     `json:"expected"`
	Observed Observation `json:"observed"`
	// AuditEvent is, for an expected audit event, "logged" or "missing".
	AuditEvent string `json:"audit_event,omitempty"`
}

// Local reports whether connector and listener share a node (loopback and
// the node's own address): identity is then known first hand.
func (c *Case) Local() bool { return c.Connector.Node == c.Listener.Node }

// Managed reports whether the listener is on a cluster node.
func (c *Case) Managed() bool { return c.Listener.Node != OutsideHost }

// Conn is the case as the policy core's input: Source is the address the
// listener's node sees (for a connection within a node, the dialled local
// address: the kernel picks it as the source), zero for a Unix socket;
// Node is the listener's node (site rules' on_nodes).
func (c *Case) Conn() policy.Conn {
	conn := policy.Conn{Connector: c.Connector.Identity(), Listener: c.Listener.Identity(),
		Port: c.Dst.Port(), Proto: c.Proto, Node: c.Listener.Node}
	switch {
	case c.Path == Unix:
		// No port: an abstract socket is always a user service.
		conn.Port = 65535
	case !c.Local():
		conn.Source = c.Src
	default:
		conn.Source = c.Dst.Addr()
	}
	return conn
}

// Passed reports whether the observation matches the expectation.
func (c *Case) Passed() bool {
	if c.Expected.Audit && c.AuditEvent != AuditLogged {
		return false
	}
	switch c.Observed.State {
	case Allowed:
		return c.Expected.Allow
	case Refused:
		return !c.Expected.Allow
	}
	return false
}

// ProtoFamily is "tcp4", "udp6", ….
func (c *Case) ProtoFamily() string {
	if c.Path == Unix {
		if c.Proto == policy.UDP {
			return "unix-dgram"
		}
		return "unix-stream"
	}
	return fmt.Sprintf("%s%d", c.Proto, c.Family)
}

// Target is where the connector dials.
func (c *Case) Target() string {
	if c.Abstract != "" {
		return c.Abstract
	}
	return c.Dst.String()
}

func (c *Case) String() string {
	return fmt.Sprintf("%s %s %s@%s → %s@%s %s %s", c.ID, c.Launcher, c.Connector.Name, c.Connector.Node,
		c.Listener.Name, c.Listener.Node, c.ProtoFamily(), c.Path)
}

// OutsideHost is the testbed's off-cluster host.
const OutsideHost = "outside"
