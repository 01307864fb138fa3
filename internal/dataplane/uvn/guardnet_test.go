package uvn

import (
	"context"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
)

// TestGuardStrayNetwork: a user's socket outside any VRF (a stray
// process's: cron, systemd --user) takes from the network only what it
// asked for. A "remote node" (a second namespace behind paltest1) gets no
// connection to alice's stray TCP listener (IPv4 and IPv6) and no datagram
// into her unbound UDP socket, nor into her srun-port listener from an
// address outside the cluster; controls: root's listener (a system
// service), Slurm's callback from a cluster address to her srun port, the
// reply to her unconnected UDP socket's datagram, her own TCP connection's
// data, and her listener once she is exempt. A listener older than the
// guard is judged from its first packet, before the socket iterators run.
func TestGuardStrayNetwork(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const alice = 4001
	cg, home, path := scratchCgroup(t, "gnet")
	inScratchNetns(t, []string{"198.18.5.1/24"}, func(int) error {
		l0, err := netlink.LinkByName("paltest0")
		if err != nil {
			return err
		}
		a6, _ := netlink.ParseAddr("2001:2::1/64")
		a6.Flags = unix.IFA_F_NODAD
		if err := netlink.AddrAdd(l0, a6); err != nil {
			return err
		}
		// The remote node: paltest1 in a namespace of its own.
		var peer vnetns.NsHandle
		if err := netns.DoNew(func() error {
			var err error
			peer, err = vnetns.Get()
			return err
		}); err != nil {
			return err
		}
		defer peer.Close()
		l1, err := netlink.LinkByName("paltest1")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetNsFd(l1, int(peer)); err != nil {
			return err
		}
		inPeer := func(fn func() error) {
			t.Helper()
			if err := netns.Do(peer, fn); err != nil {
				t.Fatal(err)
			}
		}
		// Echo servers on the remote node (TCP sends a byte, UDP echoes).
		inPeer(func() error {
			l, err := netlink.LinkByName("paltest1")
			if err != nil {
				return err
			}
			for _, a := range []string{"198.18.5.2/24", "198.18.5.3/24", "2001:2::2/64"} {
				ad, _ := netlink.ParseAddr(a)
				ad.Flags = unix.IFA_F_NODAD
				if err := netlink.AddrAdd(l, ad); err != nil {
					return err
				}
			}
			if lo, err := netlink.LinkByName("lo"); err == nil {
				netlink.LinkSetUp(lo)
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			if err := serveByte(t, "tcp", ":29331"); err != nil {
				return err
			}
			pc, err := net.ListenPacket("udp", ":29330")
			if err != nil {
				return err
			}
			t.Cleanup(func() { pc.Close() })
			go func() {
				b := make([]byte, 64)
				for {
					n, from, err := pc.ReadFrom(b)
					if err != nil {
						return
					}
					pc.WriteTo(b[:n], from)
				}
			}()
			return nil
		})

		cookie, err := netns.Cookie()
		if err != nil {
			return err
		}
		coll, err := loadGuard(cookie, 1000, nil, policy.PortRange{First: 61000, Last: 62999})
		if err != nil {
			return err
		}
		defer coll.Close()
		// The cluster: the remote node's 198.18.5.2 and 2001:2::/64, not
		// 198.18.5.3 (an off-cluster host on the same link).
		us := []Underlay{{Nets: []netip.Prefix{netip.MustParsePrefix("198.18.5.2/32"), netip.MustParsePrefix("2001:2::/64")}}}
		if err := fillSources(coll.Maps[guardbpfMapPalUvnSrc4], coll.Maps[guardbpfMapPalUvnSrc6], us); err != nil {
			return err
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		as := func(uid int, f func()) {
			unix.Setfsuid(uid)
			defer unix.Setfsuid(0)
			f()
		}
		listen := func(port int) int {
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0)
			if err := unix.Bind(fd, &unix.SockaddrInet6{Port: port}); err != nil {
				t.Fatal(err)
			}
			if err := unix.Listen(fd, 16); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(fd) })
			return fd
		}
		udp6 := func(port int) int {
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0)
			if err := unix.Bind(fd, &unix.SockaddrInet6{Port: port}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(fd) })
			return fd
		}
		// A listener of alice's older than the guard (no birth record).
		as(alice, func() { listen(29340) })
		for _, a := range guardAttach {
			if _, err := cg.attachProg(path, coll.Programs[a.prog], a.at); err != nil {
				return err
			}
		}
		var udpFd int
		as(alice, func() {
			listen(29310)
			listen(61000)
			udpFd = udp6(29311)
		})
		listen(29320) // root's: a system service

		// From the remote node; from is the source address (empty: any).
		dial := func(name, from, to string, want bool) {
			t.Helper()
			wait := 2 * time.Second
			if want {
				wait = 20 * time.Second
			}
			inPeer(func() error {
				d := net.Dialer{Timeout: wait}
				d.SetMultipathTCP(false)
				if from != "" {
					d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
				}
				c, err := d.Dial("tcp", to)
				if (err == nil) != want {
					t.Errorf("%s: remote connect to %s: %v, want connected %v", name, to, err, want)
				}
				if err == nil {
					c.Close()
				}
				return nil
			})
		}
		// The old listener has no record yet: its first packet gives it
		// one (a TCP socket's namespace is read from the socket), so it is
		// judged before the iterators run, and adoption changes nothing.
		dial("alice's listener older than the guard, before adoption", "", "198.18.5.1:29340", false)
		if err := adoptSockets(coll); err != nil {
			return err
		}
		dial("alice's listener older than the guard, adopted", "", "198.18.5.1:29340", false)
		dial("alice's stray listener, IPv4", "", "198.18.5.1:29310", false)
		dial("alice's stray listener, IPv6", "", "[2001:2::1]:29310", false)
		dial("control: root's listener", "", "198.18.5.1:29320", true)
		dial("control: Slurm's callback to alice's srun port from a cluster address", "198.18.5.2", "198.18.5.1:61000", true)
		dial("alice's srun port from an address off the cluster", "198.18.5.3", "198.18.5.1:61000", false)

		recv := func(name string, want string) {
			t.Helper()
			b := make([]byte, 64)
			wait := 2 * time.Second
			if want != "" {
				wait = 20 * time.Second
			}
			tv := unix.NsecToTimeval(int64(wait))
			unix.SetsockoptTimeval(udpFd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			n, _, err := unix.Recvfrom(udpFd, b, 0)
			got := ""
			if err == nil {
				got = string(b[:n])
			}
			if got != want {
				t.Errorf("%s: alice's UDP socket got %q (%v), want %q", name, got, err, want)
			}
		}
		unsolicited := func(want string) {
			t.Helper()
			for _, to := range []string{"198.18.5.1:29311", "[2001:2::1]:29311"} {
				inPeer(func() error {
					c, err := net.Dial("udp", to)
					if err != nil {
						return err
					}
					defer c.Close()
					_, err = c.Write([]byte("unsolicited"))
					return err
				})
				recv("a datagram from the remote node to "+to, want)
			}
		}
		unsolicited("")
		// Replies to what alice's unconnected socket sent are hers.
		for _, to := range []unix.Sockaddr{
			&unix.SockaddrInet6{Port: 29330, Addr: netip.MustParseAddr("::ffff:198.18.5.2").As16()},
			&unix.SockaddrInet6{Port: 29330, Addr: netip.MustParseAddr("2001:2::2").As16()},
		} {
			if err := unix.Sendto(udpFd, []byte("reply"), 0, to); err != nil {
				t.Errorf("control: alice's sendto: %v", err)
			}
			recv("control: the reply to alice's datagram", "reply")
		}
		// Her own TCP connection's data comes in.
		as(alice, func() {
			d := net.Dialer{Timeout: 20 * time.Second}
			d.SetMultipathTCP(false)
			c, err := d.Dial("tcp", "198.18.5.2:29331")
			if err != nil {
				t.Errorf("control: alice's connection to the remote node: %v", err)
				return
			}
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			if _, err := c.Read(make([]byte, 1)); err != nil {
				t.Errorf("control: alice's connection: read: %v", err)
			}
		})
		if os.Getenv("PALISADE_UVN_GUARD_COST") != "" {
			guardNetCost(t, coll, as, alice)
		}
		// An exempt account is a system service.
		if err := coll.Maps[guardbpfMapPalUvnExempt].Put(uint32(alice), uint8(1)); err != nil {
			return err
		}
		dial("control: alice exempt, IPv4", "", "198.18.5.1:29310", true)
		dial("control: alice exempt, IPv6", "", "[2001:2::1]:29310", true)
		unsolicited("unsolicited")
		return nil
	})
}

// guardNetCost (PALISADE_UVN_GUARD_COST=1) reports what the packet programs
// cost per run for unconnected UDP to the remote node's echo and back: as
// root (a system account: no network check) and as alice's stray socket
// (each datagram out noted among its peers, each reply looked up there).
func guardNetCost(t *testing.T, coll *ebpf.Collection, as func(int, func()), alice int) {
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatal(err)
	}
	defer stats.Close()
	progs := map[string]*ebpf.Program{"egress": coll.Programs[guardbpfProgPalUvnOut], "ingress": coll.Programs[guardbpfProgPalUvnIn]}
	for _, who := range []struct {
		name string
		uid  int
	}{{"root", 0}, {"stray user", alice}} {
		var fd int
		as(who.uid, func() {
			fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		})
		if err != nil {
			t.Fatal(err)
		}
		tv := unix.NsecToTimeval(int64(5 * time.Second))
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		before := map[string]*ebpf.ProgramStats{}
		for name, p := range progs {
			if before[name], err = p.Stats(); err != nil {
				t.Fatal(err)
			}
		}
		to := &unix.SockaddrInet4{Port: 29330, Addr: [4]byte{198, 18, 5, 2}}
		buf := make([]byte, 64)
		const n = 5000
		for i := 0; i < n; i++ {
			if err := unix.Sendto(fd, buf, 0, to); err != nil {
				t.Fatal(err)
			}
			if _, _, err := unix.Recvfrom(fd, buf, 0); err != nil {
				t.Fatalf("%s: reply %d: %v", who.name, i, err)
			}
		}
		unix.Close(fd)
		for name, p := range progs {
			st, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if runs := st.RunCount - before[name].RunCount; runs > 0 {
				t.Logf("%-10s %-8s %6d runs, %5.0f ns per run", who.name, name, runs,
					float64((st.Runtime-before[name].Runtime).Nanoseconds())/float64(runs))
			}
		}
	}
}

// serveByte listens on addr with plain TCP (the VRF program refuses Go's
// default MPTCP) and answers every connection with one byte, "x", until
// the test ends.
func serveByte(t *testing.T, network, addr string) error {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), network, addr)
	if err != nil {
		return err
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("x"))
			c.Close()
		}
	}()
	return nil
}
