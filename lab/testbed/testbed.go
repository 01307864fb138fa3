// Package testbed runs a real simulated HPC cluster on one machine: every
// node is a network namespace with its own hostname (a persistent UTS
// namespace), two underlay networks (eth0 and an IPoIB stand-in, each on a
// bridge), a router to an off-subnet "outside" host, real munge, Slurm,
// sshd and OpenMPI, and a handful of users. Several instances, told apart by
// their name, can run side by side; they share nothing but the users.
//
// Everything an instance creates derives from its name, and everything it
// creates is recorded so that Down removes exactly that and nothing else.
package testbed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"sync"
)

const (
	// DefaultName is the instance name when neither --name nor
	// $PALISADE_TESTBED says otherwise.
	DefaultName = "pal"
	// DefaultNodes is the default cluster size.
	DefaultNodes = 3
	// MaxNodes bounds the cluster size: every node runs slurmd and sshd on
	// a 2-core machine, and link names must stay within 15 characters.
	MaxNodes = 16
	// BaseDir holds one directory per instance plus the state shared by
	// all instances (the users).
	BaseDir = "/var/lib/palisade-testbed"
)

// Options select what Up builds.
type Options struct {
	Nodes int    // number of compute nodes (default DefaultNodes)
	Name  string // instance name (default $PALISADE_TESTBED or DefaultName)
	Mode  string // registered data-plane mode run after bring-up ("" or "none": nothing)
	// Egress brings up the "egress" extension after the mode.
	Egress bool
	// VM delegates the whole instance to the registered VMHandler.
	VM bool
	// Kernel is the VM's guest kernel series ("6.1", "6.12"; "" = the
	// handler's default). Only with VM.
	Kernel string
	// Directory is "" (users in the host's /etc files) or "ldap": a real
	// slapd and an SSSD per node as the nodes' NSS source (directory.go).
	Directory string
	// DirectoryUsers adds that many synthetic users (and groups) to the
	// directory.
	DirectoryUsers int
	// Binary is the product binary (cmd/palisade) copied to
	// <Dir>/bin/palisade, LabBinary the lab binary (cmd/palisade-lab)
	// copied to <Dir>/bin/palisade-lab. Empty LabBinary: the running
	// executable; empty Binary: "palisade" next to LabBinary. When the
	// running executable is a Go test binary, both are built fresh from the
	// module the test runs in.
	Binary    string
	LabBinary string
	// Audit writes [agent] audit = true on every node (the data plane
	// decides and reports, refuses nothing) and an event rate high enough
	// for `check --mode audit` to find every would-be refusal.
	Audit bool
	// Agents names the nodes that run the data plane's agent (staged
	// rollout); empty = every node. The others are listed in every
	// node's [cluster] unenforced_nodes.
	Agents []string
}

// Node is one host of the testbed: a compute node or the outside host.
type Node struct {
	Name  string // node1..nodeN, or "outside"
	NetNS string // network namespace (as in `ip netns list`)
	// UTS is the file the node's persistent UTS namespace is bound to.
	UTS    string
	Eth0V4 netip.Addr
	Eth0V6 netip.Addr
	IBV4   netip.Addr // zero for the outside host
	IBV6   netip.Addr // zero for the outside host
	// With a directory, Etc is the node's /etc layer and SSS its own
	// /var/lib/sss, both mounted by enter in the node's mount namespace
	// (nodeView); "" otherwise.
	Etc, SSS string
}

// Testbed is a running instance.
type Testbed struct {
	Name       string
	Dir        string // the instance's own directory
	Binary     string // <Dir>/bin/palisade: the product (agent, uvn, gateway, ...)
	LabBinary  string // <Dir>/bin/palisade-lab: probes, bench tools, VM plumbing
	Mode       string
	Extensions []string
	VM         bool
	// Directory is "" or "ldap" (Options.Directory).
	Directory      string
	DirectoryUsers int
	// Audit and Agents are Options.Audit and Options.Agents.
	Audit   bool
	Agents  []string
	Kernel  string // guest kernel series of a VM testbed
	Nodes   []Node
	Outside Node
	Router  string // router netns
	// MPIHello is an MPI program (built at up time with mpicc) that prints
	// "rank R of N on HOST" for every rank; empty if mpicc failed.
	MPIHello string
	// AlreadyUp is set when Up found the instance running.
	AlreadyUp bool

	mu    sync.Mutex
	users map[string]*account
}

// Mode is a data plane (or any add-on) brought up on a running testbed and
// taken down before the testbed itself.
type Mode interface {
	Up(ctx context.Context, tb *Testbed) error
	Down(ctx context.Context, tb *Testbed) error
}

// VMHandler runs a whole testbed instance in a VM (uvn engineer). Up gets a
// Testbed with Name, Dir, Binary, Nodes and Outside filled in; Command runs
// a login-like command on a node of that VM testbed.
type VMHandler interface {
	Up(ctx context.Context, tb *Testbed, opts Options) error
	Down(ctx context.Context, tb *Testbed) error
	Command(ctx context.Context, tb *Testbed, node, user string, argv ...string) *exec.Cmd
}

var (
	regMu      sync.Mutex
	modes      = map[string]Mode{}
	extensions = map[string]Mode{}
	vmHandler  VMHandler
)

// RegisterMode makes a data-plane mode selectable with `testbed up --mode name`.
func RegisterMode(name string, m Mode) {
	regMu.Lock()
	defer regMu.Unlock()
	modes[name] = m
}

// RegisterExtension makes an extension selectable (e.g. "egress" for --egress).
func RegisterExtension(name string, m Mode) {
	regMu.Lock()
	defer regMu.Unlock()
	extensions[name] = m
}

// RegisterVM installs the handler for `testbed up --vm`.
func RegisterVM(h VMHandler) {
	regMu.Lock()
	defer regMu.Unlock()
	vmHandler = h
}

// Modes lists the registered modes, "none" included.
func Modes() []string {
	regMu.Lock()
	defer regMu.Unlock()
	out := []string{"none"}
	for n := range modes {
		if n != "none" {
			out = append(out, n)
		}
	}
	sort.Strings(out[1:])
	return out
}

func lookupMode(name string) (Mode, bool) {
	regMu.Lock()
	defer regMu.Unlock()
	if name == "" || name == "none" {
		return noneMode{}, true
	}
	m, ok := modes[name]
	return m, ok
}

func lookupExtension(name string) (Mode, bool) {
	regMu.Lock()
	defer regMu.Unlock()
	m, ok := extensions[name]
	return m, ok
}

func getVM() VMHandler {
	regMu.Lock()
	defer regMu.Unlock()
	return vmHandler
}

type noneMode struct{}

func (noneMode) Up(context.Context, *Testbed) error   { return nil }
func (noneMode) Down(context.Context, *Testbed) error { return nil }

// ErrNotUp is returned by Open for an instance that is not running.
var ErrNotUp = errors.New("testbed is not up")

// nameRE keeps every derived link name (<name>-br0, <name>-e16) within the
// kernel's 15-character limit.
var nameRE = regexp.MustCompile(`^[a-z][a-z0-9]{0,9}$`)

// ResolveName applies the default and $PALISADE_TESTBED.
func ResolveName(name string) string {
	if name != "" {
		return name
	}
	if env := os.Getenv("PALISADE_TESTBED"); env != "" {
		return env
	}
	return DefaultName
}

func validateName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("invalid testbed name %q: want a lowercase letter followed by up to 9 lowercase letters or digits", name)
	}
	return nil
}

// InstanceDir is the directory of instance name.
func InstanceDir(name string) string { return filepath.Join(BaseDir, name) }

// state is what an instance records about itself in <Dir>/state.json.
type state struct {
	Name       string   `json:"name"`
	Nodes      int      `json:"nodes"`
	Mode       string   `json:"mode"`
	Extensions []string `json:"extensions,omitempty"`
	VM         bool     `json:"vm,omitempty"`
	Directory  string   `json:"directory,omitempty"`
	DirUsers   int      `json:"directory_users,omitempty"`
	Kernel     string   `json:"kernel,omitempty"`
	Audit      bool     `json:"audit,omitempty"`
	Agents     []string `json:"agents,omitempty"`
	// Phase is "starting" until bring-up (mode included) completed, then "up".
	Phase    string `json:"phase"`
	MPIHello string `json:"mpi_hello,omitempty"`
	// Owner is the test process that brought the instance up (its pid and
	// start time, in clock ticks), 0 for the CLI's: DownOrphans.
	Owner      int    `json:"owner_pid,omitempty"`
	OwnerStart uint64 `json:"owner_start,omitempty"`
}

func statePath(name string) string { return filepath.Join(InstanceDir(name), "state.json") }

func readState(name string) (*state, error) {
	b, err := os.ReadFile(statePath(name))
	if err != nil {
		return nil, err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: %w", statePath(name), err)
	}
	return &s, nil
}

func writeState(s *state) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	p := statePath(s.Name)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// build fills in the derived layout of an instance.
func build(s *state) *Testbed {
	dir := InstanceDir(s.Name)
	tb := &Testbed{
		Name:       s.Name,
		Dir:        dir,
		Binary:     filepath.Join(dir, "bin", ProductName),
		LabBinary:  filepath.Join(dir, "bin", LabName),
		Mode:       s.Mode,
		Extensions: s.Extensions,
		VM:         s.VM,
		Kernel:     s.Kernel,
		Router:     s.Name + "-rtr",
		MPIHello:   s.MPIHello,
		Directory:  s.Directory,
	}
	tb.DirectoryUsers = s.DirUsers
	tb.Audit, tb.Agents = s.Audit, s.Agents
	if tb.Mode == "" {
		tb.Mode = "none"
	}
	for i := 1; i <= s.Nodes; i++ {
		b := byte(i)
		tb.Nodes = append(tb.Nodes, Node{
			Name:   fmt.Sprintf("node%d", i),
			NetNS:  fmt.Sprintf("%s-n%d", s.Name, i),
			UTS:    filepath.Join(dir, "ns", fmt.Sprintf("uts-node%d", i)),
			Eth0V4: netip.AddrFrom4([4]byte{198, 18, 0, b}),
			Eth0V6: netip.AddrFrom16([16]byte{0x20, 0x01, 0, 2, 15: b}),
			IBV4:   netip.AddrFrom4([4]byte{198, 19, 0, b}),
			IBV6:   netip.AddrFrom16([16]byte{0x20, 0x01, 0, 2, 0, 0, 0, 1, 15: b}),
		})
		if s.Directory != "" {
			tb.Nodes[i-1].Etc = tb.NodeEtc(tb.Nodes[i-1].Name)
			tb.Nodes[i-1].SSS = tb.SSSDir(tb.Nodes[i-1].Name)
		}
	}
	tb.Outside = Node{
		Name:   "outside",
		NetNS:  s.Name + "-out",
		UTS:    filepath.Join(dir, "ns", "uts-outside"),
		Eth0V4: netip.MustParseAddr("198.18.200.1"),
		Eth0V6: netip.MustParseAddr("2001:2:0:c8::1"),
	}
	return tb
}

// Fixed addresses of the router and the networks.
var (
	RouterEth0V4    = netip.MustParseAddr("198.18.0.254")
	RouterEth0V6    = netip.MustParseAddr("2001:2::fe")
	RouterOutsideV4 = netip.MustParseAddr("198.18.200.254")
	RouterOutsideV6 = netip.MustParseAddr("2001:2:0:c8::fe")
	// ClusterSubnets are the four node networks (identity trusted from these).
	ClusterSubnets = []netip.Prefix{
		netip.MustParsePrefix("198.18.0.0/24"),
		netip.MustParsePrefix("198.19.0.0/24"),
		netip.MustParsePrefix("2001:2::/64"),
		netip.MustParsePrefix("2001:2:0:1::/64"),
	}
	// OutsideSubnets are the off-cluster networks of the outside host.
	OutsideSubnets = []netip.Prefix{
		netip.MustParsePrefix("198.18.200.0/24"),
		netip.MustParsePrefix("2001:2:0:c8::/64"),
	}
)

// Node returns the named node ("node1".., or "outside").
func (tb *Testbed) Node(name string) (Node, bool) {
	if name == "outside" {
		return tb.Outside, true
	}
	for _, n := range tb.Nodes {
		if n.Name == name {
			return n, true
		}
	}
	return Node{}, false
}

// NodeNames lists node1..nodeN.
func (tb *Testbed) NodeNames() []string {
	out := make([]string, len(tb.Nodes))
	for i, n := range tb.Nodes {
		out[i] = n.Name
	}
	return out
}

// SlurmConfDir is the directory seen as /etc/slurm on every node
// (slurm.conf, cgroup.conf, plugstack.conf; plugstack.conf includes
// SlurmConfDir()/plugstack.conf.d/*.conf, so SPANK plugins can be added
// without touching the file).
func (tb *Testbed) SlurmConfDir() string { return filepath.Join(tb.Dir, "etc", "slurm") }

// SlurmConf is the path of slurm.conf.
func (tb *Testbed) SlurmConf() string { return filepath.Join(tb.SlurmConfDir(), "slurm.conf") }

// NodeEtc is the directory overlaid on /etc inside the node (hosts, ssh,
// slurm, palisade, profile.d), via /etc/netns/<netns>.
func (tb *Testbed) NodeEtc(node string) string { return filepath.Join(tb.Dir, "nodes", node, "etc") }

// SSHDir is the directory seen as /etc/ssh on the node (sshd_config,
// ssh_config, ssh_known_hosts, host key).
func (tb *Testbed) SSHDir(node string) string { return filepath.Join(tb.NodeEtc(node), "ssh") }

// ConfigDir is the directory seen as /etc/palisade on the node.
func (tb *Testbed) ConfigDir(node string) string { return filepath.Join(tb.NodeEtc(node), "palisade") }

// ConfigPath is the node's /etc/palisade/palisade.toml (host path).
func (tb *Testbed) ConfigPath(node string) string {
	return filepath.Join(tb.ConfigDir(node), "palisade.toml")
}

// LogDir holds daemon logs (slurmctld.log, slurmd-nodeN.log, sshd-nodeN.log, munged.log).
func (tb *Testbed) LogDir() string { return filepath.Join(tb.Dir, "log") }

// RunDir holds pid files; modes may put theirs here too.
func (tb *Testbed) RunDir() string { return filepath.Join(tb.Dir, "run") }

// MungeSocket is the instance's munge socket.
func (tb *Testbed) MungeSocket() string { return filepath.Join(tb.Dir, "munge", "run", "munge.socket") }

// RootKey is the private key root uses for ssh between nodes.
func (tb *Testbed) RootKey() string { return filepath.Join(tb.Dir, "ssh", "root_ed25519") }

// Open returns the running instance name ("" = default).
func Open(name string) (*Testbed, error) {
	name = ResolveName(name)
	if err := validateName(name); err != nil {
		return nil, err
	}
	s, err := readState(name)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("testbed %s: %w", name, ErrNotUp)
		}
		return nil, err
	}
	if s.Phase != "up" {
		return nil, fmt.Errorf("testbed %s is %s (not up); run `palisade-lab testbed down --name %s`", name, s.Phase, name)
	}
	tb := build(s)
	if !tb.alive() {
		return nil, fmt.Errorf("testbed %s has state but its namespaces are gone (reboot?): run `palisade-lab testbed down --name %s`", name, name)
	}
	return tb, nil
}

// Enforcing reports whether node runs the data plane's agent (Options.Agents).
func (tb *Testbed) Enforcing(node string) bool {
	return len(tb.Agents) == 0 || slices.Contains(tb.Agents, node)
}
