package uvn

import (
	"errors"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
)

// guardKernTestbed runs fn in a scratch namespace holding "alice's device"
// paltest2 (198.18.6.1/24, owned by uid 4242 in the guard's maps) beside a
// default device paltest0 (198.18.5.1/24); behind both, a peer namespace
// (198.18.5.2 and 198.18.6.2) with a TCP server on 198.18.6.2:29400 that
// writes "x" to each connection. The guard (min_uid 1000) is loaded and
// attached to a scratch cgroup the test process is in only while fn runs
// its attached part: fn gets attach, which does that, and inPeer.
func guardKernTestbed(t *testing.T, name string, fn func(fi int, attach func(), inPeer func(func() error)) error) {
	guardKernTestbedEnv(t, name, func(k *kernEnv) error { return fn(k.fi, k.attach, k.inPeer) })
}

// kernEnv is what guardKernTestbedEnv gives its function.
type kernEnv struct {
	fi     int
	attach func()
	inPeer func(func() error)
	cg     *cgroup2
	path   string
	coll   *ebpf.Collection
	owner  guardbpfGuardOwner
	cookie uint64
}

func guardKernTestbedEnv(t *testing.T, name string, fn func(k *kernEnv) error) {
	t.Helper()
	cg, home, path := scratchCgroup(t, name)
	inScratchNetns(t, []string{"198.18.5.1/24"}, func(int) error {
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "paltest2"}, PeerName: "paltest3"}
		if err := netlink.LinkAdd(v); err != nil {
			return err
		}
		foreign, err := netlink.LinkByName("paltest2")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(foreign); err != nil {
			return err
		}
		fi := foreign.Attrs().Index
		ad, _ := netlink.ParseAddr("198.18.6.1/24")
		ad.Flags = unix.IFA_F_NODAD
		if err := netlink.AddrAdd(foreign, ad); err != nil {
			return err
		}
		var peer vnetns.NsHandle
		if err := netns.DoNew(func() error {
			var err error
			peer, err = vnetns.Get()
			return err
		}); err != nil {
			return err
		}
		defer peer.Close()
		for _, n := range []string{"paltest1", "paltest3"} {
			l, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetNsFd(l, int(peer)); err != nil {
				return err
			}
		}
		inPeer := func(fn func() error) {
			t.Helper()
			if err := netns.Do(peer, fn); err != nil {
				t.Fatal(err)
			}
		}
		inPeer(func() error {
			for n, a := range map[string]string{"paltest1": "198.18.5.2/24", "paltest3": "198.18.6.2/24"} {
				l, err := netlink.LinkByName(n)
				if err != nil {
					return err
				}
				ad, _ := netlink.ParseAddr(a)
				ad.Flags = unix.IFA_F_NODAD
				if err := netlink.AddrAdd(l, ad); err != nil {
					return err
				}
				if err := netlink.LinkSetUp(l); err != nil {
					return err
				}
			}
			if lo, err := netlink.LinkByName("lo"); err == nil {
				netlink.LinkSetUp(lo)
			}
			if err := serveByte(t, "tcp4", "198.18.6.2:29400"); err != nil {
				return err
			}
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
		o := guardbpfGuardOwner{Vrf: uint32(fi), Uid: 4242}
		if err := coll.Maps[guardbpfMapPalUvnDevs].Put(uint32(fi), o); err != nil {
			return err
		}
		var kn guardbpfGuardName
		for i, c := range "paltest2" {
			kn.Name[i] = int8(c)
		}
		if err := coll.Maps[guardbpfMapPalUvnNames].Put(kn, o); err != nil {
			return err
		}
		attached := false
		attach := func() {
			t.Helper()
			if attached {
				return
			}
			for _, a := range guardAttach {
				if _, err := cg.attachProg(path, coll.Programs[a.prog], a.at); err != nil {
					t.Fatal(err)
				}
			}
			attached = true
		}
		enterCgroup(t, cg, path)
		defer enterCgroup(t, cg, home)
		return fn(&kernEnv{fi: fi, attach: attach, inPeer: inPeer, cg: cg, path: path, coll: coll, owner: o, cookie: cookie})
	})
}

// asUID runs f with the thread's filesystem uid set to uid (what the kernel
// records as a new socket's owner, sk_uid).
func asUID(uid int, f func()) {
	unix.Setfsuid(uid)
	defer unix.Setfsuid(0)
	f()
}

// dialRead connects a new socket of family/proto to addr:port and reads a
// byte (nil: connected and read).
func dialRead(proto int, addr [4]byte, port int, wait time.Duration) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return connectRead(fd, addr, port, wait)
}

func connectRead(fd int, addr [4]byte, port int, wait time.Duration) error {
	tv := unix.NsecToTimeval(int64(wait))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := unix.Connect(fd, &unix.SockaddrInet4{Port: port, Addr: addr}); err != nil {
		return err
	}
	b := make([]byte, 1)
	n, err := unix.Read(fd, b)
	if err == nil && n != 1 {
		err = errors.New("no data")
	}
	return err
}

// TestGuardKernelSockets: sockets the kernel makes on a user's behalf
// (MPTCP subflows, SMC's TCP socket: sock_create_kern runs no sock_create
// program, so they had no birth record and passed the guard unchecked —
// review s9 H1). A user's MPTCP (and inet SMC) socket is refused at
// socket() (EPERM) in the guard, for stray processes too; an MPTCP socket
// made before the guard (its subflow has no record) is recorded from its
// first packet and judged as its owner's: bob's through alice's device is
// dropped, his listener takes nothing from the network. Controls: root's
// MPTCP through alice's device (a system account), bob's plain TCP to a
// default device's peer. A Go program of a user listening with Go's
// default (MPTCP since Go 1.24) falls back to TCP and serves.
func TestGuardKernelSockets(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const bob, alice = 5000, 4001
	foreignPeer, ownPeer := [4]byte{198, 18, 6, 2}, [4]byte{198, 18, 5, 2}
	guardKernTestbed(t, "gkern", func(fi int, attach func(), inPeer func(func() error)) error {
		// Made before the guard: bob's MPTCP socket (its first subflow
		// exists from socket()), and his MPTCP listener.
		var early, earlyLn int
		var err error
		asUID(bob, func() {
			if early, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_MPTCP); err != nil {
				return
			}
			if earlyLn, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_MPTCP); err != nil {
				return
			}
			if err = unix.Bind(earlyLn, &unix.SockaddrInet4{Port: 29410}); err == nil {
				err = unix.Listen(earlyLn, 8)
			}
		})
		if err != nil {
			t.Skipf("MPTCP on this kernel: %v", err)
		}
		defer unix.Close(early)
		defer unix.Close(earlyLn)
		attach()

		// Plain TCP as the baseline: bob's through alice's device is
		// dropped, to a default device's peer it works.
		asUID(bob, func() {
			if err := dialRead(0, foreignPeer, 29400, 2*time.Second); err == nil {
				t.Errorf("bob's plain TCP through alice's device connected")
			}
		})
		// A user's MPTCP and inet-SMC sockets are refused (socket: EPERM).
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			for _, proto := range []int{unix.IPPROTO_MPTCP, 256 /* IPPROTO_SMC */} {
				var err error
				asUID(bob, func() {
					var fd int
					if fd, err = unix.Socket(fam, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, proto); err == nil {
						unix.Close(fd)
					}
				})
				switch {
				case proto == 256 && (errors.Is(err, unix.EPROTONOSUPPORT) || errors.Is(err, unix.EAFNOSUPPORT)):
					t.Logf("inet SMC: not in this kernel (%v)", err)
				case !errors.Is(err, unix.EPERM):
					t.Errorf("bob's socket(family %d, protocol %d): %v, want EPERM", fam, proto, err)
				}
			}
		}
		// Root (a system account) keeps MPTCP, through any device.
		if err := dialRead(unix.IPPROTO_MPTCP, foreignPeer, 29400, 20*time.Second); err != nil {
			t.Errorf("control: root's MPTCP through alice's device: %v", err)
		}
		// bob's MPTCP socket older than the guard: its kernel subflow
		// gets its record from its first packet (owner bob, no VRF).
		if err := connectRead(early, foreignPeer, 29400, 2*time.Second); err == nil {
			t.Errorf("bob's MPTCP socket made before the guard connected through alice's device")
		}
		// His MPTCP listener older than the guard takes no connection from
		// the network (a user's socket outside any VRF); root's TCP
		// listener beside it does (control).
		rootLn, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(rootLn)
		if err := unix.Bind(rootLn, &unix.SockaddrInet4{Port: 29411}); err != nil {
			return err
		}
		if err := unix.Listen(rootLn, 8); err != nil {
			return err
		}
		inPeer(func() error {
			for _, c := range []struct {
				port int
				want bool
			}{{29411, true}, {29410, false}} {
				wait := 2 * time.Second
				if c.want {
					wait = 20 * time.Second
				}
				d := net.Dialer{Timeout: wait}
				d.SetMultipathTCP(false)
				conn, err := d.Dial("tcp4", "198.18.5.1:"+strconv.Itoa(c.port))
				if (err == nil) != c.want {
					t.Errorf("remote connect to :%d (29411 root's TCP listener, 29410 bob's MPTCP listener made before the guard): %v, want connected %v", c.port, err, c.want)
				}
				if err == nil {
					conn.Close()
				}
			}
			return nil
		})

		// A user's Go server: Go listens with MPTCP by default; refused, it
		// falls back to TCP and serves alice's own clients.
		var ln net.Listener
		asUID(alice, func() { ln, err = net.Listen("tcp4", "127.0.0.1:29420") })
		if err != nil {
			t.Fatalf("alice's Go listener (default MPTCP): %v", err)
		}
		defer ln.Close()
		if proto := sockProtocol(t, ln.(*net.TCPListener)); proto != unix.IPPROTO_TCP {
			t.Errorf("alice's Go listener: protocol %d, want TCP (the fallback)", proto)
		}
		rootGo, err := net.Listen("tcp4", "127.0.0.1:29421")
		if err != nil {
			return err
		}
		defer rootGo.Close()
		if proto := sockProtocol(t, rootGo.(*net.TCPListener)); proto != unix.IPPROTO_MPTCP {
			t.Logf("root's Go listener: protocol %d (this Go does not listen with MPTCP by default: the fallback above is not exercised)", proto)
		}
		go func() {
			if c, err := ln.Accept(); err == nil {
				c.Write([]byte("x"))
				c.Close()
			}
		}()
		asUID(alice, func() {
			var c net.Conn
			if c, err = net.DialTimeout("tcp4", "127.0.0.1:29420", 20*time.Second); err != nil {
				return
			}
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			_, err = c.Read(make([]byte, 1))
		})
		if err != nil {
			t.Errorf("alice's Go client to her Go server: %v", err)
		}
		// Control for the baseline: bob's plain TCP to a default device.
		asUID(bob, func() {
			if err := dialRead(0, ownPeer, 29400, 20*time.Second); err == nil || !errors.Is(err, unix.ECONNREFUSED) {
				// 198.18.5.2 has no listener on 29400: refused by the peer
				// (RST) shows the SYN left.
				t.Errorf("control: bob's plain TCP to a default device's peer: %v, want ECONNREFUSED (the peer's answer)", err)
			}
		})
		return nil
	})
}

// sockProtocol is SO_PROTOCOL of a listener.
func sockProtocol(t *testing.T, c syscall.Conn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var p int
	var serr error
	if err := rc.Control(func(fd uintptr) { p, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	return p
}

// TestGuardReplacementAdopt: a socket bob moved onto alice's device (a
// failed scoped bind: the kernel keeps the scope's device) passes nothing;
// when the guard is replaced (ensureGuardRoot's repair: new programs and
// maps, the socket iterators adopting every socket), the socket iterators
// must not record the device it was moved to as its birth VRF (review s9
// L1: it could send through alice's device after the repair). Control:
// alice's own socket on her device keeps working across the replacement.
func TestGuardReplacementAdopt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const bob = 5000
	guardKernTestbedEnv(t, "gadopt", func(k *kernEnv) error {
		k.attach()
		var moved, own int
		var err error
		asUID(bob, func() { moved, err = unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0) })
		if err != nil {
			return err
		}
		defer unix.Close(moved)
		unix.Bind(moved, &unix.SockaddrInet6{Addr: [16]byte{0xfe, 0x80, 15: 1}, ZoneId: uint32(k.fi)})
		if dev, _ := unix.GetsockoptInt(moved, unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX); dev != k.fi {
			t.Skipf("the failed scoped bind left the socket on device %d, not %d: the kernel changed", dev, k.fi)
		}
		asUID(int(k.owner.Uid), func() { own, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0) })
		if err != nil {
			return err
		}
		defer unix.Close(own)
		dst6 := &unix.SockaddrInet6{Port: 29440, Addr: [16]byte{10: 0xff, 11: 0xff, 12: 198, 13: 18, 14: 6, 15: 2}}
		dst4 := &unix.SockaddrInet4{Port: 29440, Addr: [4]byte{198, 18, 6, 2}}
		if err := unix.Sendto(moved, []byte("e"), 0, dst6); !errors.Is(err, unix.EPERM) {
			t.Errorf("bob's moved socket through alice's device, first guard: %v, want EPERM", err)
		}
		// The replacement: a second guard attached, the first detached,
		// the iterators run with the new maps.
		coll2, err := loadGuard(k.cookie, 1000, nil, policy.PortRange{First: 61000, Last: 62999})
		if err != nil {
			return err
		}
		defer coll2.Close()
		if err := coll2.Maps[guardbpfMapPalUvnDevs].Put(uint32(k.fi), k.owner); err != nil {
			return err
		}
		for _, a := range guardAttach {
			if _, err := k.cg.attachProg(k.path, coll2.Programs[a.prog], a.at); err != nil {
				return err
			}
		}
		for _, a := range guardAttach {
			info, err := k.coll.Programs[a.prog].Info()
			if err != nil {
				return err
			}
			id, _ := info.ID()
			if err := k.cg.detachAs(k.path, uint32(id), a.at); err != nil {
				return err
			}
		}
		if err := adoptSockets(coll2); err != nil {
			return err
		}
		if err := unix.Sendto(moved, []byte("e"), 0, dst6); !errors.Is(err, unix.EPERM) {
			t.Errorf("bob's moved socket through alice's device after the guard was replaced: %v, want EPERM", err)
		}
		if err := unix.Sendto(own, []byte("e"), 0, dst4); err != nil {
			t.Errorf("control: alice's socket through her device after the replacement: %v", err)
		}
		return nil
	})
}

// TestGuardStrayLocalDelivery: two users' stray processes on one node do
// not meet through deliveries the sender's egress check cannot see
// (review s9 M1): a broadcast to 127.255.255.255 (delivered to every
// wildcard socket of the port) and a datagram to the node's address for a
// socket bound to a default device (looked up on that device, not lo).
// The receiver's ingress finds the sender by the reversed tuple. Controls:
// alice's own stray socket and root's, the same ways.
func TestGuardStrayLocalDelivery(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const alice, bob = 4001, 5000
	guardKernTestbed(t, "glocal", func(fi int, attach func(), inPeer func(func() error)) error {
		attach()
		udp := func(uid int, setup func(fd int) error) int {
			var fd int
			var err error
			asUID(uid, func() {
				if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err == nil && setup != nil {
					err = setup(fd)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(fd) })
			return fd
		}
		reuse := func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) }
		// alice's stray sockets: on 0.0.0.0:29420, and bound to paltest0
		// (a default device) on 29430.
		wild := udp(alice, func(fd int) error {
			if err := reuse(fd); err != nil {
				return err
			}
			return unix.Bind(fd, &unix.SockaddrInet4{Port: 29420})
		})
		dev := udp(alice, func(fd int) error {
			if err := unix.BindToDevice(fd, "paltest0"); err != nil {
				return err
			}
			return unix.Bind(fd, &unix.SockaddrInet4{Port: 29430})
		})
		got := func(fd int, want bool) string {
			wait := 500 * time.Millisecond
			if want {
				wait = 10 * time.Second
			}
			tv := unix.NsecToTimeval(int64(wait))
			unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			b := make([]byte, 32)
			n, _, err := unix.Recvfrom(fd, b, 0)
			if err != nil {
				return ""
			}
			return string(b[:n])
		}
		bcast := [4]byte{127, 255, 255, 255}
		node := [4]byte{198, 18, 5, 1}
		broadcaster := func(uid int, bindPort int) int {
			return udp(uid, func(fd int) error {
				if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BROADCAST, 1); err != nil {
					return err
				}
				if bindPort == 0 {
					return nil
				}
				if err := reuse(fd); err != nil {
					return err
				}
				return unix.Bind(fd, &unix.SockaddrInet4{Port: bindPort, Addr: bcast})
			})
		}
		// Sockets are made as each step runs: bob's socket bound to
		// 127.255.255.255:29420 would be the receiver the egress check
		// finds for everyone's broadcast after it.
		for _, c := range []struct {
			name string
			fd   func() int
			to   [4]byte
			port int
			recv int
			want bool
		}{
			{"control: alice's own broadcast", func() int { return broadcaster(alice, 0) }, bcast, 29420, wild, true},
			{"control: root's broadcast", func() int { return broadcaster(0, 0) }, bcast, 29420, wild, true},
			{"bob's broadcast from an ephemeral port", func() int { return broadcaster(bob, 0) }, bcast, 29420, wild, false},
			{"bob's broadcast from 127.255.255.255:29420", func() int { return broadcaster(bob, 29420) }, bcast, 29420, wild, false},
			{"control: alice's own datagram to her device-bound socket", func() int { return udp(alice, nil) }, node, 29430, dev, true},
			{"control: root's", func() int { return udp(0, nil) }, node, 29430, dev, true},
			{"bob's datagram to the node's address, for a socket bound to paltest0", func() int { return udp(bob, nil) }, node, 29430, dev, false},
			{"bob's, from a socket bound to paltest0 too", func() int {
				return udp(bob, func(fd int) error { return unix.BindToDevice(fd, "paltest0") })
			}, node, 29430, dev, false},
		} {
			msg := "pal-" + strconv.Itoa(c.port)
			if err := unix.Sendto(c.fd(), []byte(msg), 0, &unix.SockaddrInet4{Port: c.port, Addr: c.to}); err != nil {
				if c.want {
					t.Errorf("%s: sendto: %v", c.name, err)
				}
				continue
			}
			if r := got(c.recv, c.want); (r == msg) != c.want {
				t.Errorf("%s: alice's stray socket got %q, want delivered %v", c.name, r, c.want)
			}
		}
		return nil
	})
}
