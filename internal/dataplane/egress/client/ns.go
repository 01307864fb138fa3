package client

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// NSMain runs inside the fresh user + network + mount namespace (argv[1] ==
// NSHelperArg, ambient CAP_NET_ADMIN and CAP_SYS_ADMIN over the namespace):
// it creates and configures the tun device, points /etc/resolv.conf at the
// gateway, sends the tun descriptor to the parent (fd 3), waits for the
// tunnel, drops every capability and becomes CMD. It never returns on
// success.
func NSMain() error {
	ctl := os.NewFile(3, "egress-ctl")
	fail := func(err error) error {
		ctl.Write([]byte("err " + err.Error()))
		return err
	}
	var cfg nsConfig
	var err error
	if err := json.Unmarshal([]byte(os.Getenv(nsEnv)), &cfg); err != nil {
		return fail(fmt.Errorf("helper config: %v", err))
	}
	os.Unsetenv(nsEnv)
	var tfd int
	msg := "ok"
	if cfg.Mode == "veth" {
		var self, job net.HardwareAddr
		tfd, self, job, err = setupVeth(cfg)
		msg = fmt.Sprintf("ok %s %s", self, job)
	} else {
		tfd, err = setupNet(cfg)
	}
	if err != nil {
		return fail(err)
	}
	if err := setupResolv(cfg); err != nil {
		return fail(err)
	}
	if err := unix.Sendmsg(int(ctl.Fd()), []byte(msg), unix.UnixRights(tfd), nil, 0); err != nil {
		return err
	}
	unix.Close(tfd)
	go_ := make([]byte, 8)
	if n, _ := ctl.Read(go_); n == 0 {
		return fmt.Errorf("egress client went away")
	}
	ctl.Close()
	path, err := exec.LookPath(cfg.Cmd[0])
	if err != nil {
		return err
	}
	// CMD runs with no capability: ambient ones would survive execve.
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return err
	}
	return syscall.Exec(path, cfg.Cmd, os.Environ())
}

func setupNet(cfg nsConfig) (int, error) {
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return -1, fmt.Errorf("loopback: %v", err)
	}
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("/dev/net/tun: %v", err)
	}
	const name = "egress0"
	ifr, _ := unix.NewIfreq(name)
	// IFF_VNET_HDR lets wireguard-go use the tun's segmentation offloads.
	ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("create tun: %v", err)
	}
	link, err := netlink.LinkByName(name)
	if err != nil {
		return -1, err
	}
	a := cfg.Answer
	if err := netlink.LinkSetMTU(link, a.MTU); err != nil {
		return -1, err
	}
	ip := &net.IPNet{IP: a.Address.Addr().AsSlice(), Mask: net.CIDRMask(a.Address.Bits(), a.Address.Addr().BitLen())}
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: ip}); err != nil {
		return -1, fmt.Errorf("address %s: %v", a.Address, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return -1, err
	}
	for _, r := range a.Routes {
		dst := &net.IPNet{IP: r.Addr().AsSlice(), Mask: net.CIDRMask(r.Bits(), r.Addr().BitLen())}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK}); err != nil {
			return -1, fmt.Errorf("route %s: %v", r, err)
		}
	}
	return fd, nil
}

// setupResolv bind-mounts a resolv.conf naming the gateway over the node's,
// visible only in this mount namespace.
func setupResolv(cfg nsConfig) error {
	if len(cfg.Answer.DNS) == 0 {
		return nil
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %v", err)
	}
	var b strings.Builder
	for _, d := range cfg.Answer.DNS {
		fmt.Fprintf(&b, "nameserver %s\n", d)
	}
	if len(cfg.Answer.Search) > 0 {
		fmt.Fprintf(&b, "search %s\n", strings.Join(cfg.Answer.Search, " "))
	}
	f, err := os.CreateTemp("", "palisade-egress-resolv-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name()) // the bind mount keeps the inode
	f.WriteString(b.String())
	f.Close()
	target := "/etc/resolv.conf"
	if _, err := os.Stat(target); err != nil {
		return fmt.Errorf("%s: %v", target, err)
	}
	if err := unix.Mount(f.Name(), target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %v", target, err)
	}
	return nil
}

// setupVeth builds the netstack path's segment: egress0 (the job's
// interface, with the lease address and the default route) and egress1,
// whose frames a packet socket hands to the client's userspace stack. Large
// offloaded segments are disabled (gso_max_size = MTU) because the packet
// socket reads one frame of at most the MTU at a time.
func setupVeth(cfg nsConfig) (int, net.HardwareAddr, net.HardwareAddr, error) {
	a := cfg.Answer
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return -1, nil, nil, fmt.Errorf("loopback: %v", err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "egress0", MTU: a.MTU}, PeerName: "egress1"}
	if err := netlink.LinkAdd(veth); err != nil {
		return -1, nil, nil, fmt.Errorf("veth: %v", err)
	}
	job, err := netlink.LinkByName("egress0")
	if err != nil {
		return -1, nil, nil, err
	}
	far, err := netlink.LinkByName("egress1")
	if err != nil {
		return -1, nil, nil, err
	}
	for _, l := range []netlink.Link{job, far} {
		netlink.LinkSetMTU(l, a.MTU)
		if err := netlink.LinkSetGSOMaxSize(l, a.MTU); err != nil {
			return -1, nil, nil, fmt.Errorf("gso_max_size: %v", err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return -1, nil, nil, err
		}
	}
	ip := &net.IPNet{IP: a.Address.Addr().AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := netlink.AddrAdd(job, &netlink.Addr{IPNet: ip}); err != nil {
		return -1, nil, nil, fmt.Errorf("address %s: %v", a.Address, err)
	}
	gw := net.IP(a.Gateway.AsSlice())
	farMAC := far.Attrs().HardwareAddr
	// The next hop is answered by nobody: pin its MAC to the far end.
	if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: job.Attrs().Index, Family: netlink.FAMILY_V4,
		State: netlink.NUD_PERMANENT, IP: gw, HardwareAddr: farMAC}); err != nil {
		return -1, nil, nil, fmt.Errorf("neighbour: %v", err)
	}
	for _, r := range a.Routes {
		dst := &net.IPNet{IP: r.Addr().AsSlice(), Mask: net.CIDRMask(r.Bits(), r.Addr().BitLen())}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: job.Attrs().Index, Dst: dst, Gw: gw,
			Flags: int(netlink.FLAG_ONLINK)}); err != nil {
			return -1, nil, nil, fmt.Errorf("route %s: %v", r, err)
		}
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return -1, nil, nil, fmt.Errorf("packet socket: %v", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: far.Attrs().Index}); err != nil {
		unix.Close(fd)
		return -1, nil, nil, fmt.Errorf("bind packet socket: %v", err)
	}
	return fd, farMAC, job.Attrs().HardwareAddr, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
