package uvn

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
	cg2 "github.com/palisade-hpc/palisade/internal/sys/cgroup2"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// cgroup2 is a private, detached mount of the cgroup2 hierarchy
// (sys/cgroup2.Open): it works on hybrid and pure v2 hosts alike, and inside
// `ip netns exec`, which remounts /sys without any cgroup mount.
type cgroup2 struct{ root int }

func openCgroup2() (*cgroup2, error) {
	fd, err := cg2.Open()
	if err != nil {
		return nil, err
	}
	return &cgroup2{root: fd}, nil
}

func (c *cgroup2) Close() { unix.Close(c.root) }

// rel turns a cgroup path ("/a/b") into one relative to the mount root.
func rel(cg string) string {
	r := strings.TrimPrefix(path.Clean("/"+cg), "/")
	if r == "" {
		return "."
	}
	return r
}

func (c *cgroup2) openDir(cg string) (int, error) {
	return unix.Openat(c.root, rel(cg), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

func (c *cgroup2) readFile(cg, name string) ([]byte, error) {
	fd, err := unix.Openat(c.root, path.Join(rel(cg), name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var b bytes.Buffer
	_, err = b.ReadFrom(f)
	return b.Bytes(), err
}

func (c *cgroup2) writeFile(cg, name, data string) error {
	fd, err := unix.Openat(c.root, path.Join(rel(cg), name), unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(data))
	return err
}

// procs lists the PIDs in cg and (recursively) its children.
func (c *cgroup2) procs(cg string, recursive bool) ([]int, error) {
	b, err := c.readFile(cg, "cgroup.procs")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	if !recursive {
		return pids, nil
	}
	fd, err := c.openDir(cg)
	if err != nil {
		return nil, err
	}
	d := os.NewFile(uintptr(fd), cg)
	ents, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if e.IsDir() {
			sub, err := c.procs(path.Join(cg, e.Name()), true)
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, err
			}
			pids = append(pids, sub...)
		}
	}
	return pids, nil
}

func (c *cgroup2) exists(cg string) bool {
	fd, err := c.openDir(cg)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// sessionCgroup picks the cgroup to attach the VRF program to for pid: its
// own cgroup when that belongs to the session (every process in its subtree
// is pid or a descendant), else a new child of it named for the session, into
// which pid is moved. Either way the session stays inside its systemd scope
// or Slurm job cgroup (a child is still inside the parent's subtree), and the
// root cgroup, which holds every unmanaged process, is never used.
func (c *cgroup2) sessionCgroup(pid int, uid uint32) (cg string, created bool, err error) {
	cg, err = procfs.Cgroup2(pid)
	if err != nil {
		return "", false, err
	}
	if cg != "/" {
		pids, err := c.procs(cg, true)
		if err != nil {
			return "", false, fmt.Errorf("cgroup %s: %w", cg, err)
		}
		mine := procfs.Descendants(pid)
		own := true
		for _, p := range pids {
			if !mine[p] {
				if _, alive := procStart(p); alive {
					own = false
					break
				}
			}
		}
		if own {
			return cg, false, nil
		}
	}
	child := path.Join(cg, fmt.Sprintf("pal-uvn-%d-%d", uid, pid))
	if err := unix.Mkdirat(c.root, rel(child), 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
		return "", false, fmt.Errorf("create cgroup %s: %w", child, err)
	}
	if err := c.writeFile(child, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		c.removeCgroup(child)
		return "", false, fmt.Errorf("move pid %d into %s: %w", pid, child, err)
	}
	return child, true, nil
}

// removeCgroup moves whatever is left in cg to its parent and removes it.
func (c *cgroup2) removeCgroup(cg string) error {
	if !c.exists(cg) {
		return nil
	}
	parent := path.Dir(cg)
	for range 3 {
		pids, err := c.procs(cg, false)
		if err != nil {
			break
		}
		if len(pids) == 0 {
			break
		}
		for _, p := range pids {
			c.writeFile(parent, "cgroup.procs", strconv.Itoa(p)) // a process may exit meanwhile
		}
	}
	err := unix.Unlinkat(c.root, rel(cg), unix.AT_REMOVEDIR)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// vrfProgram loads pal_uvn_vrf (bpf/vrf.c) for the VRF device ifindex: it
// binds every new inet socket of the cgroup to the VRF and refuses MPTCP.
func vrfProgram(ifindex int) (*ebpf.Program, error) {
	spec, err := loadVrfbpf()
	if err != nil {
		return nil, err
	}
	if err := spec.Variables[vrfbpfVarVrfIfindex].Set(uint32(ifindex)); err != nil {
		return nil, err
	}
	var objs struct {
		Prog *ebpf.Program `ebpf:"pal_uvn_vrf"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, err
	}
	return objs.Prog, nil
}

// underlayPrograms loads pal_uvn_conn4 and pal_uvn_send4 (bpf/vrf.c): a
// user's connection or datagram to one of ranges on an address in nets (the
// IPv4 underlay prefixes) leaves from nat, the user's NAT address, over
// the underlay; everything else stays on the overlay. The two programs share
// one map of nets; it lives as long as they do.
func underlayPrograms(ranges []policy.PortRange, nets []netip.Prefix, nat netip.Addr) (conn, send *ebpf.Program, err error) {
	if len(ranges) > int(vrfbpfUvnLimitUVN_MAX_PORT_RANGES) {
		return nil, nil, fmt.Errorf("%d underlay port ranges; at most %d", len(ranges), vrfbpfUvnLimitUVN_MAX_PORT_RANGES)
	}
	if len(nets) > int(vrfbpfUvnLimitUVN_MAX_NETS4) {
		return nil, nil, fmt.Errorf("%d IPv4 underlay prefixes; at most %d", len(nets), vrfbpfUvnLimitUVN_MAX_NETS4)
	}
	if !nat.Is4() {
		return nil, nil, fmt.Errorf("NAT address %s is not IPv4", nat)
	}
	spec, err := loadVrfbpf()
	if err != nil {
		return nil, nil, err
	}
	var pr [vrfbpfUvnLimitUVN_MAX_PORT_RANGES]vrfbpfUvnPortRange
	for i, r := range ranges {
		pr[i] = vrfbpfUvnPortRange{First: r.First, Last: r.Last}
	}
	for name, v := range map[string]any{
		vrfbpfVarUnderlayPorts:   pr,
		vrfbpfVarN_underlayPorts: uint32(len(ranges)),
		vrfbpfVarNatAddr:         nativeAddr4(nat),
		vrfbpfVarNatMark:         uint32(natMark),
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, nil, fmt.Errorf("underlay programs: set %s: %w", name, err)
		}
	}
	var objs struct {
		Conn *ebpf.Program `ebpf:"pal_uvn_conn4"`
		Send *ebpf.Program `ebpf:"pal_uvn_send4"`
		Nets *ebpf.Map     `ebpf:"pal_uvn_nets4"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, nil, err
	}
	defer objs.Nets.Close() // the programs hold it
	for _, n := range nets {
		if !n.Addr().Is4() {
			err = fmt.Errorf("underlay prefix %s is not IPv4", n)
		} else {
			err = objs.Nets.Put(vrfbpfUvnLpm4{Prefixlen: uint32(n.Bits()), Addr: nativeAddr4(n.Masked().Addr())}, uint8(1))
		}
		if err != nil {
			objs.Conn.Close()
			objs.Send.Close()
			return nil, nil, fmt.Errorf("underlay prefix %s: %w", n, err)
		}
	}
	return objs.Conn, objs.Send, nil
}

// linkLocalProgram loads pal_uvn_bind6 (bpf/vrf.c): link-local binds are
// refused (the kernel would take the scope as the socket's device even when
// the bind fails; the hook cannot see the scope).
func linkLocalProgram() (*ebpf.Program, error) {
	spec, err := loadVrfbpf()
	if err != nil {
		return nil, err
	}
	var objs struct {
		Bind6 *ebpf.Program `ebpf:"pal_uvn_bind6"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, err
	}
	return objs.Bind6, nil
}

// attachProg attaches prog to cg with ALLOW_MULTI and returns its id.
func (c *cgroup2) attachProg(cg string, prog *ebpf.Program, at ebpf.AttachType) (uint32, error) {
	fd, err := c.openDir(cg)
	if err != nil {
		return 0, fmt.Errorf("open cgroup %s: %w", cg, err)
	}
	defer unix.Close(fd)
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target: fd, Program: prog, Attach: at, Flags: unix.BPF_F_ALLOW_MULTI,
	}); err != nil {
		return 0, fmt.Errorf("attach %s to cgroup %s: %w", at, cg, err)
	}
	info, err := prog.Info()
	if err != nil {
		return 0, err
	}
	id, _ := info.ID()
	return uint32(id), nil
}

// attach loads the VRF program for ifindex and attaches it to cg (it stays
// attached after the fd closes, for as long as the cgroup exists).
func (c *cgroup2) attach(cg string, ifindex int) (uint32, error) {
	prog, err := vrfProgram(ifindex)
	if err != nil {
		return 0, fmt.Errorf("load VRF socket program: %w", err)
	}
	defer prog.Close()
	return c.attachProg(cg, prog, ebpf.AttachCGroupInetSockCreate)
}

// detach removes program id from cg; a missing program or cgroup is fine.
func (c *cgroup2) detach(cg string, id uint32) error {
	return c.detachAs(cg, id, ebpf.AttachCGroupInetSockCreate)
}

func (c *cgroup2) detachAs(cg string, id uint32, at ebpf.AttachType) error {
	if id == 0 {
		return nil
	}
	prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
	if err != nil {
		return nil // gone with its last cgroup
	}
	defer prog.Close()
	fd, err := c.openDir(cg)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	err = link.RawDetachProgram(link.RawDetachProgramOptions{Target: fd, Program: prog, Attach: at})
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("detach program %d from cgroup %s: %w", id, cg, err)
	}
	return nil
}

// programAlive reports whether a program id still exists.
func programAlive(id uint32) bool {
	p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
	if err != nil {
		return false
	}
	p.Close()
	return true
}
