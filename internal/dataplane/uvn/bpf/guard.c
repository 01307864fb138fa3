// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade uvn: the node's device boundary, for every socket of the node
 * (attached once at the cgroup2 root with BPF_F_ALLOW_MULTI, so processes
 * outside any session — cron, at, systemd --user, a daemon re-parented by
 * init — are covered; the session's own programs, bpf/vrf.c, run first).
 *
 * pal_uvn_devs maps every user device of this node (a VRF and its VXLANs)
 * to its owner: the VRF and the user's uid. Devices not in it are the
 * default VRF's. Several network namespaces share the cgroup2 root (the VM
 * testbed's nodes; containers): only sockets made in this program's own
 * namespace are judged, recognised by their birth record.
 *
 *   cgroup/sock_create  pal_uvn_born
 *       Records the VRF a socket is born in (the session programs have
 *       bound it already; 0 outside any session) in pal_uvn_birth.
 *   cgroup_skb/egress   pal_uvn_out
 *   cgroup_skb/ingress  pal_uvn_in
 *       A socket that has moved to another VRF since its birth (an
 *       unprivileged process can: bind() to a link-local address with
 *       sin6_scope_id sets the bound device even when the bind fails; since
 *       Linux 5.7 SO_BINDTODEVICE on an unbound socket) passes nothing. A
 *       packet through a user's device passes only for a socket bound into
 *       that user's VRF, or for an unbound socket of that user or of a
 *       system account (uid below min_uid, exempt: the default VRF's
 *       services serve every VRF through l3mdev_accept). Identity is the
 *       socket's own uid (sk_uid, what the kernel recorded at creation),
 *       never a process's.
 *       An unbound socket of a user (not a system account) sends nothing to
 *       SrunPortRange ports: the tc hand-over (bpf/srun.c) takes the
 *       default VRF's segments to those ports for Slurm's callbacks; and,
 *       within the node, nothing to another user's unbound socket (two
 *       users' stray processes do not meet).
 *       From the network (a device that is no user's, not lo) a user's
 *       socket outside any VRF takes only what it asked for: segments of
 *       its own TCP connections, datagrams of a connected UDP socket or
 *       from a peer an unconnected one sent to (pal_uvn_sent), ICMP echo
 *       replies; never a new connection or an unsolicited datagram — no
 *       identity travels with a packet between nodes, so a user's stray
 *       listener cannot know who calls (only system accounts and root
 *       listen in the default VRF). Except Slurm's callbacks to an srun
 *       started outside any session: SYNs to an SrunPortRange port from a
 *       cluster address (users' stray sockets send nothing to those
 *       ports, their sessions nothing through the underlay).
 *   cgroup/setsockopt   pal_uvn_sockopt
 *       Refuses (EPERM) SO_BINDTODEVICE, SO_BINDTOIFINDEX, IP_UNICAST_IF,
 *       IPV6_UNICAST_IF, IP_MULTICAST_IF (ip_mreqn) and IPV6_MULTICAST_IF
 *       naming a user's device the socket is not already bound into: the
 *       refusal up front, the skb programs the backstop.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "lpm.h"

char LICENSE[] SEC("license") = "GPL";

/* Macros in the UAPI, absent from BTF. */
#define SOL_SOCKET 1
#define SO_BINDTODEVICE 25
#define SO_BINDTOIFINDEX 62
#define SOL_IP 0
#define IP_MULTICAST_IF 32
#define IP_UNICAST_IF 50
#define SOL_IPV6 41
#define IPV6_MULTICAST_IF 17
#define IPV6_UNICAST_IF 76
#define PAGE_SIZE 4096
#define LOOPBACK_IFINDEX 1 /* lo, in every network namespace */
#define IPPROTO_ICMPV6 58

enum guard_verdict {
	GUARD_REFUSE = 0,
	GUARD_ALLOW = 1,
};

enum guard_limit {
	GUARD_MAX_DEVS = 65536, /* user devices of a node: VRFs and VXLANs */
	GUARD_MAX_EXEMPT = 256, /* exempt accounts */
	GUARD_IFNAMSIZ = 16,
};
const enum guard_limit guard_limit_btf = GUARD_MAX_DEVS;

/* The owner of a user device. */
struct guard_owner {
	__u32 vrf; /* the user's VRF device */
	__u32 uid;
};

/* Key of pal_uvn_names: a device name, NUL-padded. */
struct guard_name {
	char name[GUARD_IFNAMSIZ];
};

/* A packet's peer: address (IPv4 in addr[0]) and port, network order. */
struct guard_peer {
	__u32 addr[4];
	__u16 port;
	__u16 family; /* 4 or 6 */
};

/* The peers an unconnected UDP socket of a user outside any VRF last sent
 * to through the network: their datagrams are replies. */
#define GUARD_SENT 8
struct guard_sent {
	struct guard_peer p[GUARD_SENT];
	__u32 next;
};

struct guard_birth {
	__u32 vrf; /* the VRF the socket was born in (0: the default VRF) */
	__u32 uid; /* its owner: the creator's fs uid, what the kernel records as sk_uid */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, GUARD_MAX_DEVS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* ifindex */
	__type(value, struct guard_owner);
} pal_uvn_devs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, GUARD_MAX_DEVS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct guard_name);
	__type(value, struct guard_owner);
} pal_uvn_names SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, GUARD_MAX_EXEMPT);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* uid */
	__type(value, __u8);
} pal_uvn_exempt SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct guard_birth);
} pal_uvn_birth SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct guard_sent);
} pal_uvn_sent SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 64);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct srun_lpm4);
	__type(value, __u8);
} pal_uvn_src4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 64);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct srun_lpm6);
	__type(value, __u8);
} pal_uvn_src6 SEC(".maps");

/* Set at load time. */
volatile const __u64 netns_cookie; /* this node's network namespace */
volatile const __u32 min_uid;      /* [uvn] min_uid */
volatile const __u32 srun_first;   /* SrunPortRange (0, 0: none) */
volatile const __u32 srun_last;

static __always_inline __u32 vrf_of(__u32 ifindex)
{
	struct guard_owner *o;

	if (!ifindex)
		return 0;
	o = bpf_map_lookup_elem(&pal_uvn_devs, &ifindex);
	return o ? o->vrf : 0;
}

static __always_inline int system_uid(__u32 uid);

SEC("cgroup/sock_create")
int pal_uvn_born(struct bpf_sock *sk)
{
	struct guard_birth b = {};

	if (bpf_get_netns_cookie(sk) != netns_cookie)
		return GUARD_ALLOW;
	b.vrf = vrf_of(sk->bound_dev_if);
	/* The filesystem uid: what the kernel acts with and records as the
	 * socket's owner (sk_uid), never the real uid. */
	b.uid = BPF_CORE_READ(bpf_get_current_task_btf(), cred, fsuid.val);
	/* MPTCP and inet SMC carry their data on TCP sockets the kernel makes
	 * itself (sock_create_kern: no sock_create hook, so no binding to a
	 * session's VRF and no birth record of their own). Users get plain
	 * TCP: socket() fails with EPERM and programs fall back (Go, which
	 * listens with MPTCP by default, does). System accounts keep them. */
	if ((sk->protocol == IPPROTO_MPTCP || sk->protocol == IPPROTO_SMC) && !system_uid(b.uid))
		return GUARD_REFUSE;
	/* A socket without its record would escape the checks: refuse it
	 * (the kernel is out of memory anyway). */
	if (!bpf_sk_storage_get(&pal_uvn_birth, sk, &b, BPF_SK_STORAGE_GET_F_CREATE))
		return GUARD_REFUSE;
	return GUARD_ALLOW;
}

/* Sockets older than the guard (made before the node's first setup, or
 * before a guard that replaced another) get their record from the socket
 * iterators, run once in this namespace when the programs are attached:
 * their owner (sk_uid), and the VRF they are in if its device is their
 * owner's or the owner is a system account — a socket one user moved onto
 * another user's device (a failed scoped bind) is not made legitimate by
 * a replacement of the guard: it is recorded in the default VRF and
 * passes nothing. A socket made since has its record already and keeps it. */
static __always_inline void adopt(struct sock *sk, __u32 uid)
{
	struct guard_birth b = {};
	struct guard_owner *o;
	__u32 dev = sk->__sk_common.skc_bound_dev_if;

	o = dev ? bpf_map_lookup_elem(&pal_uvn_devs, &dev) : 0;
	if (o && (o->uid == uid || system_uid(uid)))
		b.vrf = o->vrf;
	b.uid = uid;
	bpf_sk_storage_get(&pal_uvn_birth, sk, &b, BPF_SK_STORAGE_GET_F_CREATE);
}

SEC("iter/tcp")
int pal_uvn_adopt_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct tcp_sock *tp;

	if (!skc)
		return 0;
	tp = bpf_skc_to_tcp_sock(skc); /* full sockets only */
	if (tp)
		adopt((struct sock *)tp, ctx->uid);
	return 0;
}

SEC("iter/udp")
int pal_uvn_adopt_udp(struct bpf_iter__udp *ctx)
{
	struct udp_sock *us = ctx->udp_sk;

	if (us)
		adopt((struct sock *)us, ctx->uid);
	return 0;
}

/* The network namespace cookie of a TCP or IPv6 UDP socket (0: neither). */
static __always_inline __u64 sk_netns(struct bpf_sock *sk, __u32 *uid)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	struct udp6_sock *u6;
	struct sock *s;

	if (tp) {
		s = &tp->inet_conn.icsk_inet.sk;
	} else {
		u6 = bpf_skc_to_udp6_sock(sk);
		if (!u6)
			return 0;
		s = &u6->udp.inet.sk;
	}
	*uid = s->sk_uid.val;
	return s->__sk_common.skc_net.net->net_cookie;
}

enum late_birth {
	LATE_OTHER = 0,   /* not judged here: another namespace's, or unknown */
	LATE_RECORDED = 1,
	LATE_FAILED = 2,  /* this namespace's, but no record could be made */
};

/* A socket of this namespace with no birth record was made by the kernel
 * (sock_create_kern: MPTCP subflows, SMC's TCP socket, an accepted
 * connection) or before the guard: it gets its record from its first
 * packet — its owner (sk_uid) and the VRF of its device if that device is
 * its owner's or the owner is a system account, else the default VRF (a
 * socket of one user on another user's device then passes nothing). TCP
 * and IPv6 UDP sockets only: for other kinds the program cannot tell
 * their namespace (docs/uvn.md, Limits). */
static __always_inline int late_birth(struct bpf_sock *sk)
{
	struct guard_birth b = {};
	struct guard_owner *o;
	__u32 dev = sk->bound_dev_if;

	if (sk_netns(sk, &b.uid) != netns_cookie)
		return LATE_OTHER;
	o = dev ? bpf_map_lookup_elem(&pal_uvn_devs, &dev) : 0;
	if (o && (o->uid == b.uid || system_uid(b.uid)))
		b.vrf = o->vrf;
	if (!bpf_sk_storage_get(&pal_uvn_birth, sk, &b, BPF_SK_STORAGE_GET_F_CREATE))
		return LATE_FAILED;
	return LATE_RECORDED;
}

/* Whether the uid is a system account's (root, below min_uid, exempt). */
static __always_inline int system_uid(__u32 uid)
{
	return uid < min_uid || bpf_map_lookup_elem(&pal_uvn_exempt, &uid) != 0;
}

/* Whether the socket's owner may use a device of the user o through a
 * socket bound to no user's VRF: o himself, root and system accounts. */
static __always_inline int may_cross(struct __sk_buff *skb, struct guard_owner *o)
{
	__u32 uid = bpf_get_socket_uid(skb);

	return uid == o->uid || system_uid(uid);
}

/* Whether the packet is TCP to a port of SrunPortRange (Slurm's callbacks
 * into users' VRFs, which tc hands over to the claiming VRF). */
static __always_inline int to_srun_port(struct __sk_buff *skb)
{
	__u8 h[2];
	__u16 dport;
	__u32 off;

	if (!srun_first)
		return 0;
	if (skb->protocol == bpf_htons(0x0800)) {
		__u8 v[10];

		if (bpf_skb_load_bytes(skb, 0, v, sizeof(v)) || v[9] != IPPROTO_TCP)
			return 0;
		off = (v[0] & 0xf) * 4;
	} else if (skb->protocol == bpf_htons(0x86dd)) {
		__u8 nh;

		if (bpf_skb_load_bytes(skb, 6, &nh, 1) || nh != IPPROTO_TCP)
			return 0;
		off = 40;
	} else {
		return 0;
	}
	if (bpf_skb_load_bytes(skb, off + 2, h, 2))
		return 0;
	dport = (__u16)h[0] << 8 | h[1];
	return dport >= srun_first && dport <= srun_last;
}

/* Whether a packet sent within the node (through lo) is for a socket of
 * another user that is in the default VRF too (a stray process's; not a
 * system account's): two users' stray processes do not meet. Judged at the
 * sender's egress, where both owners are known; a packet from another node
 * carries no owner (docs/uvn.md, Limits). */
static __always_inline int to_other_stray(struct __sk_buff *skb, __u32 uid)
{
	struct bpf_sock_tuple t = {};
	struct guard_birth *pb;
	struct bpf_sock *peer;
	__u32 size;
	__u8 proto;
	int other = 0;

	if (skb->protocol == bpf_htons(0x0800)) {
		__u8 v[20];
		__u32 off;

		if (bpf_skb_load_bytes(skb, 0, v, sizeof(v)))
			return 0;
		proto = v[9];
		off = (v[0] & 0xf) * 4;
		__builtin_memcpy(&t.ipv4.saddr, &v[12], 4);
		__builtin_memcpy(&t.ipv4.daddr, &v[16], 4);
		/* Source and destination port, adjacent in both. */
		if (bpf_skb_load_bytes(skb, off, &t.ipv4.sport, 4))
			return 0;
		size = sizeof(t.ipv4);
	} else if (skb->protocol == bpf_htons(0x86dd)) {
		if (bpf_skb_load_bytes(skb, 6, &proto, 1))
			return 0;
		/* Source and destination address, adjacent in both. */
		if (bpf_skb_load_bytes(skb, 8, t.ipv6.saddr, 32))
			return 0;
		if (bpf_skb_load_bytes(skb, 40, &t.ipv6.sport, 4))
			return 0;
		size = sizeof(t.ipv6);
	} else {
		return 0;
	}
	if (proto == IPPROTO_TCP)
		peer = bpf_sk_lookup_tcp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	else if (proto == IPPROTO_UDP)
		peer = bpf_sk_lookup_udp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	else
		return 0;
	if (!peer)
		return 0;
	pb = bpf_sk_storage_get(&pal_uvn_birth, peer, 0, 0);
	if (!pb && late_birth(peer) == LATE_RECORDED)
		pb = bpf_sk_storage_get(&pal_uvn_birth, peer, 0, 0);
	if (pb && pb->vrf == 0 && vrf_of(peer->bound_dev_if) == 0 && pb->uid != uid && !system_uid(pb->uid))
		other = 1;
	bpf_sk_release(peer);
	return other;
}

/* Whether a packet delivered within the node (through lo) to a user's
 * socket outside any VRF (a TCP listener, an unconnected UDP socket) may
 * be from another user: judged at the receiver, because the sender's
 * egress check finds one receiving socket with device lo and misses a
 * broadcast's (every wildcard socket of the port gets it) and a receiver
 * bound to a default device (local delivery looks sockets up on the
 * device holding the address). The sender is found by the reversed
 * tuple; it must be the receiver's owner's or a system account's socket.
 * Not found (bound to a device, gone) or the receiver itself (an
 * unconnected socket of the port: which sent is unknown): refused. */
static __always_inline int from_other_local(struct __sk_buff *skb, struct bpf_sock *sk, __u32 uid)
{
	struct bpf_sock_tuple t = {};
	struct guard_birth *pb;
	struct bpf_sock *peer;
	__u16 ports[2];
	__u32 size;
	__u8 proto;
	int other = 1;

	if (sk->protocol == IPPROTO_TCP) {
		if (sk->state != BPF_TCP_LISTEN)
			return 0; /* its own connection: its SYN was judged */
	} else if (sk->protocol == IPPROTO_UDP) {
		if (sk->dst_port)
			return 0; /* connected: the kernel delivers only its peer's */
	} else {
		return 0;
	}
	/* The sender's view of the packet: its local end is the source. */
	if (skb->protocol == bpf_htons(0x0800)) {
		__u8 v[20];
		__u32 off;

		if (bpf_skb_load_bytes(skb, 0, v, sizeof(v)))
			return 1;
		proto = v[9];
		off = (v[0] & 0xf) * 4;
		__builtin_memcpy(&t.ipv4.daddr, &v[12], 4);
		__builtin_memcpy(&t.ipv4.saddr, &v[16], 4);
		if (bpf_skb_load_bytes(skb, off, ports, 4))
			return 1;
		t.ipv4.dport = ports[0];
		t.ipv4.sport = ports[1];
		size = sizeof(t.ipv4);
	} else if (skb->protocol == bpf_htons(0x86dd)) {
		__u8 a[32];

		if (bpf_skb_load_bytes(skb, 6, &proto, 1) || bpf_skb_load_bytes(skb, 8, a, 32))
			return 1;
		__builtin_memcpy(t.ipv6.daddr, &a[0], 16);
		__builtin_memcpy(t.ipv6.saddr, &a[16], 16);
		if (bpf_skb_load_bytes(skb, 40, ports, 4))
			return 1;
		t.ipv6.dport = ports[0];
		t.ipv6.sport = ports[1];
		size = sizeof(t.ipv6);
	} else {
		return 1;
	}
	if (proto != sk->protocol)
		return 1;
	if (proto == IPPROTO_TCP)
		peer = bpf_sk_lookup_tcp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	else
		peer = bpf_sk_lookup_udp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!peer)
		return 1;
	pb = bpf_sk_storage_get(&pal_uvn_birth, peer, 0, 0);
	if (!pb && late_birth(peer) == LATE_RECORDED)
		pb = bpf_sk_storage_get(&pal_uvn_birth, peer, 0, 0);
	if (pb && peer != sk && (pb->uid == uid || system_uid(pb->uid)))
		other = 0;
	bpf_sk_release(peer);
	return other;
}

/* The packet's source (src) or destination peer; 0 unless it is TCP, UDP or
 * UDP-Lite over IPv4, or over IPv6 without extension headers. */
static __always_inline int peer_of(struct __sk_buff *skb, int src, struct guard_peer *p)
{
	__u32 off;

	if (skb->protocol == bpf_htons(0x0800)) {
		__u8 v[20];

		if (bpf_skb_load_bytes(skb, 0, v, sizeof(v)))
			return 0;
		if (v[9] != IPPROTO_TCP && v[9] != IPPROTO_UDP && v[9] != IPPROTO_UDPLITE)
			return 0;
		off = (v[0] & 0xf) * 4;
		__builtin_memcpy(&p->addr[0], &v[src ? 12 : 16], 4);
		p->family = 4;
	} else if (skb->protocol == bpf_htons(0x86dd)) {
		__u8 nh;

		if (bpf_skb_load_bytes(skb, 6, &nh, 1) || (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_UDPLITE))
			return 0;
		if (bpf_skb_load_bytes(skb, src ? 8 : 24, p->addr, 16))
			return 0;
		off = 40;
		p->family = 6;
	} else {
		return 0;
	}
	return !bpf_skb_load_bytes(skb, off + (src ? 0 : 2), &p->port, 2);
}

static __always_inline int same_peer(struct guard_peer *a, struct guard_peer *b)
{
	return a->family == b->family && a->port == b->port && a->addr[0] == b->addr[0] &&
	       a->addr[1] == b->addr[1] && a->addr[2] == b->addr[2] && a->addr[3] == b->addr[3];
}

/* Whether the peer is in a cluster prefix (a node's address). */
static __always_inline int from_cluster(struct guard_peer *p)
{
	if (p->family == 4) {
		struct srun_lpm4 k = { .prefixlen = 32, .addr = p->addr[0] };

		return bpf_map_lookup_elem(&pal_uvn_src4, &k) != 0;
	}
	struct srun_lpm6 k6 = { .prefixlen = 128 };

	__builtin_memcpy(k6.addr, p->addr, sizeof(k6.addr));
	return bpf_map_lookup_elem(&pal_uvn_src6, &k6) != 0;
}

/* Records the destination of a datagram an unconnected UDP socket sends
 * to the network (its replies may come in). */
static __always_inline void note_sent(struct __sk_buff *skb, struct bpf_sock *sk)
{
	struct guard_peer p = {};
	struct guard_sent *s;
	int i;

	if (!peer_of(skb, 0, &p))
		return;
	s = bpf_sk_storage_get(&pal_uvn_sent, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!s)
		return; /* its replies are refused: fails closed */
	for (i = 0; i < GUARD_SENT; i++)
		if (same_peer(&s->p[i], &p))
			return;
	s->p[s->next % GUARD_SENT] = p;
	s->next++;
}

/* Whether a user's socket outside any VRF may take this packet from the
 * network: only what it asked for. */
static __always_inline int stray_may_receive(struct __sk_buff *skb, struct bpf_sock *sk)
{
	struct guard_peer p = {};
	struct guard_sent *s;
	int i;

	switch (sk->protocol) {
	case IPPROTO_TCP:
		if (sk->state != BPF_TCP_LISTEN)
			return 1; /* its own connection (a connect, or accepted) */
		/* Slurm's callbacks to a stray srun. */
		return to_srun_port(skb) && peer_of(skb, 1, &p) && from_cluster(&p);
	case IPPROTO_UDP:
	case IPPROTO_UDPLITE:
		if (sk->dst_port)
			return 1; /* connected: the kernel delivers only its peer's */
		if (!peer_of(skb, 1, &p))
			return 0;
		s = bpf_sk_storage_get(&pal_uvn_sent, sk, 0, 0);
		if (!s)
			return 0;
		for (i = 0; i < GUARD_SENT; i++)
			if (same_peer(&s->p[i], &p))
				return 1;
		return 0;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		return 1; /* ping sockets take echo replies only */
	default:
		return 0;
	}
}

static __always_inline int skb_verdict(struct __sk_buff *skb, int egress)
{
	struct bpf_sock *sk = skb->sk;
	struct guard_birth *b;
	struct guard_owner *o;
	__u32 cur, dev = skb->ifindex;

	if (!sk)
		return GUARD_ALLOW;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return GUARD_ALLOW;
	/* No record: another namespace's socket, or one the kernel made
	 * (an accepted connection, an MPTCP subflow, SMC's TCP socket) or
	 * made before uvn: recorded now, from what it is. */
	b = bpf_sk_storage_get(&pal_uvn_birth, sk, 0, 0);
	if (!b) {
		switch (late_birth(sk)) {
		case LATE_OTHER:
			return GUARD_ALLOW;
		case LATE_FAILED:
			return GUARD_REFUSE;
		}
		b = bpf_sk_storage_get(&pal_uvn_birth, sk, 0, 0);
		if (!b)
			return GUARD_REFUSE;
	}
	cur = vrf_of(sk->bound_dev_if);
	if (cur != b->vrf)
		return GUARD_REFUSE;
	/* A user's process outside any VRF does not call srun's listeners:
	 * the hand-over takes the default VRF's segments to those ports as
	 * Slurm's. */
	if (egress && cur == 0 && to_srun_port(skb) && !system_uid(bpf_get_socket_uid(skb)))
		return GUARD_REFUSE;
	if (egress && cur == 0 && dev == LOOPBACK_IFINDEX) {
		__u32 uid = bpf_get_socket_uid(skb);

		if (!system_uid(uid) && to_other_stray(skb, uid))
			return GUARD_REFUSE;
	}
	if (!egress && cur == 0 && dev == LOOPBACK_IFINDEX) {
		__u32 uid = bpf_get_socket_uid(skb);

		if (!system_uid(uid) && from_other_local(skb, sk, uid))
			return GUARD_REFUSE;
	}
	o = bpf_map_lookup_elem(&pal_uvn_devs, &dev);
	/* The network, into the default VRF: a user's socket there takes only
	 * what it asked for. */
	if (!o && cur == 0 && dev != LOOPBACK_IFINDEX && !system_uid(bpf_get_socket_uid(skb))) {
		if (egress) {
			if ((sk->protocol == IPPROTO_UDP || sk->protocol == IPPROTO_UDPLITE) && !sk->dst_port)
				note_sent(skb, sk);
			return GUARD_ALLOW;
		}
		return stray_may_receive(skb, sk) ? GUARD_ALLOW : GUARD_REFUSE;
	}
	if (!o || o->vrf == cur)
		return GUARD_ALLOW;
	if (cur == 0 && may_cross(skb, o))
		return GUARD_ALLOW;
	return GUARD_REFUSE;
}

SEC("cgroup_skb/egress")
int pal_uvn_out(struct __sk_buff *skb)
{
	return skb_verdict(skb, 1);
}

SEC("cgroup_skb/ingress")
int pal_uvn_in(struct __sk_buff *skb)
{
	return skb_verdict(skb, 0);
}

/* opt_int reads the option's first 4 bytes (host order). */
static __always_inline int opt_int(struct bpf_sockopt *ctx, int off, __u32 *v)
{
	__u8 *p = ctx->optval;

	if ((void *)(p + off + 4) > ctx->optval_end)
		return 0;
	*v = *(__u32 *)(p + off);
	return 1;
}

static __always_inline int sockopt_verdict(struct bpf_sockopt *ctx);

SEC("cgroup/setsockopt")
int pal_uvn_sockopt(struct bpf_sockopt *ctx)
{
	/* Options longer than a page reach the program cut short, to their
	 * first page (which holds every field judged below: the kernel reads
	 * a device name or an index from the start of the caller's buffer);
	 * an optlen of 0 lets the kernel use the caller's own buffer. */
	if (ctx->optlen > PAGE_SIZE) {
		if (sockopt_verdict(ctx) == GUARD_REFUSE)
			return GUARD_REFUSE;
		ctx->optlen = 0;
		return GUARD_ALLOW;
	}
	return sockopt_verdict(ctx);
}

static __always_inline int sockopt_verdict(struct bpf_sockopt *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct guard_owner *o = 0;
	__u32 idx = 0, cur;
	int level = ctx->level, name = ctx->optname;

	if (!sk || bpf_get_netns_cookie(ctx) != netns_cookie)
		return GUARD_ALLOW;
	if (level == SOL_SOCKET && name == SO_BINDTODEVICE) {
		struct guard_name n = {};
		__u8 *p = ctx->optval;
		int i;

		for (i = 0; i < GUARD_IFNAMSIZ - 1; i++) {
			if (i >= ctx->optlen || (void *)(p + i + 1) > ctx->optval_end)
				break;
			n.name[i] = p[i];
			if (!p[i])
				break;
		}
		o = bpf_map_lookup_elem(&pal_uvn_names, &n);
	} else {
		if (level == SOL_SOCKET && name == SO_BINDTOIFINDEX) {
			if (!opt_int(ctx, 0, &idx))
				return GUARD_ALLOW;
		} else if (level == SOL_IP && name == IP_UNICAST_IF) {
			if (!opt_int(ctx, 0, &idx))
				return GUARD_ALLOW;
			idx = bpf_ntohl(idx);
		} else if (level == SOL_IP && name == IP_MULTICAST_IF) {
			/* struct ip_mreqn: imr_ifindex at 8. The address forms
			 * (ip_mreq, in_addr) name no index: the skb programs
			 * judge where the datagrams go. */
			if (ctx->optlen < 12 || !opt_int(ctx, 8, &idx))
				return GUARD_ALLOW;
		} else if (level == SOL_IPV6 && name == IPV6_UNICAST_IF) {
			if (!opt_int(ctx, 0, &idx))
				return GUARD_ALLOW;
			idx = bpf_ntohl(idx);
		} else if (level == SOL_IPV6 && name == IPV6_MULTICAST_IF) {
			if (!opt_int(ctx, 0, &idx))
				return GUARD_ALLOW;
		} else {
			return GUARD_ALLOW;
		}
		if (idx)
			o = bpf_map_lookup_elem(&pal_uvn_devs, &idx);
	}
	if (!o)
		return GUARD_ALLOW;
	cur = vrf_of(sk->bound_dev_if);
	return o->vrf == cur ? GUARD_ALLOW : GUARD_REFUSE;
}
