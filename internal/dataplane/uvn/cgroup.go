package uvn

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
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

// procCgroup returns pid's cgroup2 path from /proc/PID/cgroup ("0::/path").
func procCgroup(pid int) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return path.Clean("/" + strings.TrimSuffix(p, " (deleted)")), nil
		}
	}
	return "", fmt.Errorf("pid %d: no cgroup2 entry in /proc/%d/cgroup", pid, pid)
}

// sessionCgroup picks the cgroup to attach the VRF program to for pid: its
// own cgroup when that belongs to the session (every process in its subtree
// is pid or a descendant), else a new child of it named for the session, into
// which pid is moved. Either way the session stays inside its systemd scope
// or Slurm job cgroup (a child is still inside the parent's subtree), and the
// root cgroup, which holds every unmanaged process, is never used.
func (c *cgroup2) sessionCgroup(pid int, uid uint32) (cg string, created bool, err error) {
	cg, err = procCgroup(pid)
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

// ipprotoMPTCP is IPPROTO_MPTCP.
const ipprotoMPTCP = 262

// vrfProgram builds the cgroup sock_create program that binds every new
// AF_INET/AF_INET6 socket to the VRF (what `ip vrf exec` does):
// ctx->bound_dev_if = ifindex; return 1. A user cannot undo the binding:
// changing SO_BINDTODEVICE on a bound socket needs CAP_NET_RAW.
//
// MPTCP sockets are refused (EPERM): their TCP subflows are kernel sockets
// that do not inherit the binding, so an MPTCP listener would sit in the
// default VRF, reachable by everyone (Go >= 1.24 listens with MPTCP by
// default). Programs fall back to TCP.
func vrfProgram(ifindex int) (*ebpf.Program, error) {
	return ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:       "pal_uvn_vrf",
		Type:       ebpf.CGroupSock,
		AttachType: ebpf.AttachCGroupInetSockCreate,
		License:    "GPL",
		Instructions: asm.Instructions{
			// struct bpf_sock { __u32 bound_dev_if, family, type, protocol; ... }
			asm.LoadMem(asm.R2, asm.R1, 12, asm.Word),
			asm.JEq.Imm(asm.R2, ipprotoMPTCP, "deny"),
			asm.Mov.Imm(asm.R2, int32(ifindex)),
			asm.StoreMem(asm.R1, 0, asm.R2, asm.Word),
			asm.Mov.Imm(asm.R0, 1),
			asm.Return(),
			asm.Mov.Imm(asm.R0, 0).WithSymbol("deny"),
			asm.Return(),
		},
	})
}

const bpfFAllowMulti = 1 << 1 // BPF_F_ALLOW_MULTI

// Offsets in struct bpf_sock_addr.
const (
	offUserIP4   = 4
	offUserPort  = 24
	offMsgSrcIP4 = 40
)

// underlayProgram builds the cgroup connect4 (sendmsg=false) or sendmsg4
// program that sends a user's traffic to system/Slurm ports of cluster
// nodes over the underlay: if the destination port is in one of ranges and
// the address in one of nets, the socket gets the user's NAT address as its
// source (bpf_bind for connect, msg_src_ip4 for unconnected UDP). A node
// rule then routes that source through the main table and the node's SNAT
// makes it the node's own address; replies come back into the VRF like
// off-subnet replies. Everything else is left alone (overlay).
func underlayProgram(sendmsg bool, ranges []policy.PortRange, nets []netip.Prefix, self []netip.Addr, nat netip.Addr) (*ebpf.Program, error) {
	le := func(a netip.Addr) int32 {
		b := a.As4()
		return int32(binary.LittleEndian.Uint32(b[:]))
	}
	insns := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, offUserPort, asm.Word),
		asm.HostTo(asm.BE, asm.R2, asm.Half),
	}
	for i, r := range ranges {
		next := fmt.Sprintf("range%d", i+1)
		insns = append(insns,
			asm.JLT.Imm32(asm.R2, int32(r.First), next).WithSymbol(fmt.Sprintf("range%d", i)),
			asm.JLE.Imm32(asm.R2, int32(r.Last), "addr"),
		)
	}
	insns = append(insns, asm.Ja.Label("out").WithSymbol(fmt.Sprintf("range%d", len(ranges))),
		asm.LoadMem(asm.R3, asm.R6, offUserIP4, asm.Word).WithSymbol("addr"))
	for _, a := range self {
		insns = append(insns, asm.JEq.Imm32(asm.R3, le(a), "out"))
	}
	for _, n := range nets {
		mb := lastAddrMask(n.Bits())
		insns = append(insns,
			asm.Mov.Reg(asm.R4, asm.R3),
			asm.And.Imm32(asm.R4, le(mb)),
			asm.JEq.Imm32(asm.R4, le(n.Masked().Addr()), "act"),
		)
	}
	insns = append(insns, asm.Ja.Label("out"))
	if sendmsg {
		insns = append(insns,
			asm.Mov.Imm32(asm.R7, le(nat)).WithSymbol("act"),
			asm.StoreMem(asm.R6, offMsgSrcIP4, asm.R7, asm.Word))
	} else {
		insns = append(insns,
			// struct sockaddr_in {AF_INET, port 0, NAT} at fp-16
			asm.Mov.Imm(asm.R7, 0).WithSymbol("act"),
			asm.StoreMem(asm.RFP, -16, asm.R7, asm.DWord),
			asm.StoreMem(asm.RFP, -8, asm.R7, asm.DWord),
			asm.Mov.Imm(asm.R7, unix.AF_INET),
			asm.StoreMem(asm.RFP, -16, asm.R7, asm.Half),
			asm.Mov.Imm32(asm.R7, le(nat)),
			asm.StoreMem(asm.RFP, -12, asm.R7, asm.Word),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -16),
			asm.Mov.Imm(asm.R3, 16),
			asm.FnBind.Call(),
		)
	}
	insns = append(insns,
		asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
		asm.Return())
	spec := &ebpf.ProgramSpec{Name: "pal_uvn_conn4", Type: ebpf.CGroupSockAddr, AttachType: ebpf.AttachCGroupInet4Connect,
		License: "GPL", Instructions: insns}
	if sendmsg {
		spec.Name, spec.AttachType = "pal_uvn_send4", ebpf.AttachCGroupUDP4Sendmsg
	}
	return ebpf.NewProgram(spec)
}

// lastAddrMask is the IPv4 netmask of a prefix length.
func lastAddrMask(bits int) netip.Addr {
	var b [4]byte
	for i := 0; i < bits; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	return netip.AddrFrom4(b)
}

// attachProg attaches prog to cg with ALLOW_MULTI and returns its id.
func (c *cgroup2) attachProg(cg string, prog *ebpf.Program, at ebpf.AttachType) (uint32, error) {
	fd, err := c.openDir(cg)
	if err != nil {
		return 0, fmt.Errorf("open cgroup %s: %w", cg, err)
	}
	defer unix.Close(fd)
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target: fd, Program: prog, Attach: at, Flags: bpfFAllowMulti,
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

// attach loads the program for ifindex and attaches it to cg (it stays
// attached after the fd closes, for as long as the cgroup exists).
func (c *cgroup2) attach(cg string, ifindex int) (uint32, error) {
	prog, err := vrfProgram(ifindex)
	if err != nil {
		return 0, fmt.Errorf("load VRF socket program: %w", err)
	}
	defer prog.Close()
	fd, err := c.openDir(cg)
	if err != nil {
		return 0, fmt.Errorf("open cgroup %s: %w", cg, err)
	}
	defer unix.Close(fd)
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target: fd, Program: prog, Attach: ebpf.AttachCGroupInetSockCreate, Flags: bpfFAllowMulti,
	}); err != nil {
		return 0, fmt.Errorf("attach VRF socket program to cgroup %s: %w", cg, err)
	}
	info, err := prog.Info()
	if err != nil {
		return 0, err
	}
	id, _ := info.ID()
	return uint32(id), nil
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
