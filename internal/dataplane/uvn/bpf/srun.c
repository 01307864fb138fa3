// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade uvn: Slurm's own connections into a user's VRF.
 *
 * srun and salloc listen inside the user's VRF; slurmctld, slurmd and a
 * slurmstepd that is not (yet) in the VRF connect from the default VRF and
 * would never find those listeners. Slurm's messages are munge-authenticated
 * (srun accepts them only from SlurmUser, root or the job's user), so, like a
 * system service, they may cross — but only to the ports Slurm uses for them
 * (SrunPortRange), never to the user's other listeners.
 *
 *   cgroup/post_bind4, post_bind6  (in each user's VRF cgroup)
 *       A TCP socket bound to a port in SrunPortRange claims the port, for
 *       itself and its VRF, in pal_srun_ports. A port some other socket has
 *       claimed is refused (EPERM; srun moves on to the next port of the
 *       range): a user can never take the callbacks meant for another
 *       user's srun, and two sockets never share a claim. (srun's threads
 *       bind with SO_REUSEADDR from the same first port and listen after
 *       binding, so two of them could both bind a port; the second listen
 *       then fails and Slurm, retrying bind on the bound socket, reports
 *       the whole range exhausted. The refusal moves the second on.)
 *       A socket's own claim met again (the same programs attached at two
 *       levels of nested sessions) is not a conflict. A port whose last
 *       claim, another VRF's, still lingers is refused too (its step's last
 *       I/O must not be taken), and so is a claim beyond the VRF's budget
 *       (srun_budget live claims, pal_srun_count): no user can claim the
 *       whole range.
 *   cgroup/sock_release            (once, at the cgroup2 root)
 *       The claiming socket (by cookie) gives its claim back. At the root,
 *       so that it runs for every socket whatever became of the programs of
 *       the cgroup it was made in (a step's attachment is pruned while srun
 *       still closes its listeners; a removed cgroup keeps the programs it
 *       inherits for as long as its sockets live). The claim lingers for
 *       the connections the listener accepted: they share its port and
 *       outlive it (srun closes its I/O listeners when the step ends, while
 *       slurmstepd's last output and FIN are still on the way).
 *   tc ingress                     (lo and every Ethernet underlay NIC of the node)
 *       A TCP segment from a cluster address to a claimed port (or, unless it
 *       opens a connection, to a lingering claim), for which the
 *       default VRF has no socket (a default-VRF srun - root's, an exempt
 *       account's - may share a port a user's socket claimed), is handed to
 *       the claiming VRF device (addressed to its MAC, redirected to its
 *       ingress: the socket lookup then runs in the VRF) and marked srun_mark; with
 *       net.ipv4.tcp_fwmark_accept=1 the accepted socket keeps that mark and
 *       node rules on it route its replies by the local and main tables, the
 *       way the request came.
 *
 * Users' own traffic never takes this path: from a VRF, cluster addresses are
 * reached over the overlay (or, for underlay_ports, which must not overlap
 * SrunPortRange, from the user's NAT address), so it never arrives on these
 * devices from a cluster address to such a port.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "lpm.h"

char LICENSE[] SEC("license") = "GPL";

/*
 * pal_srun_ports holds two kinds of entries (one map, so that the tc program
 * keeps it alive for the cgroup programs):
 *   key = port                   value = the claim: socket, VRF device, time
 *   key = CLAIM_BIT | cookie     value = the same claim, found by the socket
 *   key = LINGER_BIT | port      value = the last claim of a port whose
 *                                listener has closed: for LINGER_NS, its
 *                                accepted connections' segments still go
 *                                to its VRF (never one with SYN); the
 *                                port's next claim, the VRF's teardown or
 *                                tc once it has expired removes it
 * (sock_release may not read a socket's port, but may read its cookie;
 * cookies never reach 2^62.)
 */
enum srun_key {
	SRUN_KEY_TAG_SHIFT = 62, /* a key's top two bits: its kind */
	SRUN_KEY_LINGER = 1,
	SRUN_KEY_CLAIM = 2,
};
#define CLAIM_BIT ((__u64)SRUN_KEY_CLAIM << SRUN_KEY_TAG_SHIFT)
#define LINGER_BIT ((__u64)SRUN_KEY_LINGER << SRUN_KEY_TAG_SHIFT)
/* Keeps enum srun_key in the BTF, for bpf2go (-type srun_key). */
const enum srun_key *const srun_key_btf __attribute__((unused)) = 0;

struct srun_owner {
	__u64 cookie; /* the claiming socket */
	__u32 ifindex;
	__u32 port;
	__u8 mac[6]; /* the VRF device's address: the frame must be for it */
	__u8 used;   /* tc has handed a segment to this claim */
	__u8 pad;
	__u64 released; /* lingering: bpf_ktime_get_ns() when its listener closed */
};

/* How long a lingering claim carries segments: longer than Slurm waits for
 * a step's last I/O (EioTimeout, 60 s by default), short enough that it
 * does not stand for good in front of other flows that meet the port (a
 * user's masqueraded connection whose source port was remapped into the
 * range: its replies reach tc before conntrack undoes the NAT). */
#define LINGER_NS (120ULL * 1000000000ULL)

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 3 * 32768); /* port, cookie, lingering: at most 32,768 ports (config) */
	__type(key, __u64);
	__type(value, struct srun_owner);
} pal_srun_ports SEC(".maps");

/* Claims per VRF device, live and lingering (a lingering claim holds its
 * port against other VRFs as a live one does): a user's budget of the
 * range, so that no user can claim every port and leave others' sruns
 * with "all ports in range exhausted". */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 32768);
	__type(key, __u32); /* VRF ifindex */
	__type(value, __u32);
} pal_srun_count SEC(".maps");

/* Cluster addresses Slurm's daemons connect from (the underlay prefixes). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 64);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct srun_lpm4);
	__type(value, __u8);
} pal_srun_src4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 64);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct srun_lpm6);
	__type(value, __u8);
} pal_srun_src6 SEC(".maps");

/* Set at load time. */
volatile const __u32 vrf_ifindex;  /* cgroup programs: the user's VRF device */
volatile const __u8 vrf_mac[6];    /* and its address */
volatile const __u32 port_min;     /* SrunPortRange */
volatile const __u32 port_max;
volatile const __u32 srun_mark;    /* tc: mark of redirected segments */
volatile const __u32 srun_budget;  /* live claims a VRF may hold */

static __always_inline int in_range(__u32 port)
{
	return port >= port_min && port <= port_max;
}

/* count adds d to the VRF's live claims; it reports whether the VRF is
 * still within its budget. */
static __always_inline int count(__u32 vrf, int d)
{
	__u32 zero = 0, *n;

	n = bpf_map_lookup_elem(&pal_srun_count, &vrf);
	if (!n) {
		if (d < 0)
			return 1;
		bpf_map_update_elem(&pal_srun_count, &vrf, &zero, BPF_NOEXIST);
		n = bpf_map_lookup_elem(&pal_srun_count, &vrf);
		if (!n)
			return 0;
	}
	if (d > 0) {
		/* Add, then read: of claims racing for the last place, each
		 * sees every add before its read, so none goes over (at worst
		 * both are refused). */
		__sync_fetch_and_add(n, 1);
		return *n <= srun_budget;
	}
	if (*n > 0)
		__sync_fetch_and_add(n, -1);
	return 1;
}

/* drop_linger removes the lingering claim lk of VRF vrf and gives back
 * its place in the VRF's budget (once: only the remover that found it). */
static __always_inline void drop_linger(__u64 lk, __u32 vrf)
{
	if (bpf_map_delete_elem(&pal_srun_ports, &lk) == 0)
		count(vrf, -1);
}

struct bpf_map;

struct room {
	__u32 vrf;
	__u32 freed;
	__u64 now;
	__u64 oldest;   /* key of the VRF's oldest live lingering claim */
	__u64 oldest_t; /* its release time */
};

static long room_elem(struct bpf_map *map, __u64 *key, struct srun_owner *v, struct room *r)
{
	if ((*key >> SRUN_KEY_TAG_SHIFT) != SRUN_KEY_LINGER || v->ifindex != r->vrf)
		return 0;
	if (r->now - v->released > LINGER_NS) {
		if (bpf_map_delete_elem(map, key) == 0) {
			count(r->vrf, -1);
			r->freed++;
		}
		return 0;
	}
	if (!r->oldest || v->released < r->oldest_t) {
		r->oldest = *key;
		r->oldest_t = v->released;
	}
	return 0;
}

/* make_room frees the budget of a VRF that has just gone over it: its
 * expired lingering claims go (nothing else removes those of a port no
 * segment reaches), else its oldest lingering claim — the user's own
 * earlier step's last I/O yields to his new step, never another user's.
 * It reports whether it freed any place. */
static __always_inline int make_room(__u32 vrf)
{
	struct room r = { .vrf = vrf, .now = bpf_ktime_get_ns() };

	bpf_for_each_map_elem(&pal_srun_ports, room_elem, &r, 0);
	if (r.freed)
		return 1;
	if (!r.oldest || bpf_map_delete_elem(&pal_srun_ports, &r.oldest) != 0)
		return 0;
	count(vrf, -1);
	return 1;
}

static __always_inline int claim(struct bpf_sock *sk)
{
	struct srun_owner mine = { .ifindex = vrf_ifindex }, *o, *l;
	__u64 key, ck, lk;
	int i;

	if (sk->protocol != IPPROTO_TCP || !in_range(sk->src_port))
		return 1;
	key = sk->src_port;
	lk = LINGER_BIT | key;
	mine.port = sk->src_port;
	for (i = 0; i < 6; i++)
		mine.mac[i] = vrf_mac[i];
	mine.cookie = bpf_get_socket_cookie(sk);
	/* Atomic: of two sockets binding the port at once, one claims it. */
	if (bpf_map_update_elem(&pal_srun_ports, &key, &mine, BPF_NOEXIST) != 0) {
		o = bpf_map_lookup_elem(&pal_srun_ports, &key);
		return o && o->cookie == mine.cookie; /* else another socket's port: EPERM */
	}
	/* Another VRF's lingering claim still carries its step's last I/O:
	 * the port is not free for this VRF until it expires (its release
	 * writes the lingering claim before it frees the port, so a claim
	 * that won the port sees it here). */
	l = bpf_map_lookup_elem(&pal_srun_ports, &lk);
	if (l && l->ifindex != vrf_ifindex && bpf_ktime_get_ns() - l->released <= LINGER_NS) {
		bpf_map_delete_elem(&pal_srun_ports, &key);
		return 0;
	}
	if (!count(vrf_ifindex, 1) && !make_room(vrf_ifindex)) {
		count(vrf_ifindex, -1);
		bpf_map_delete_elem(&pal_srun_ports, &key);
		return 0; /* over the user's budget */
	}
	ck = CLAIM_BIT | mine.cookie;
	if (bpf_map_update_elem(&pal_srun_ports, &ck, &mine, BPF_ANY) != 0) {
		/* A claim its release could not find would never go. */
		count(vrf_ifindex, -1);
		bpf_map_delete_elem(&pal_srun_ports, &key);
		return 0;
	}
	/* The live claim takes the port's segments from now on (a lingering
	 * claim found here is this VRF's or expired). */
	l = bpf_map_lookup_elem(&pal_srun_ports, &lk);
	if (l)
		drop_linger(lk, l->ifindex);
	return 1;
}

SEC("cgroup/post_bind4")
int pal_uvn_pbind4(struct bpf_sock *sk)
{
	return claim(sk);
}

SEC("cgroup/post_bind6")
int pal_uvn_pbind6(struct bpf_sock *sk)
{
	return claim(sk);
}

SEC("cgroup/sock_release")
int pal_uvn_release(struct bpf_sock *sk)
{
	__u64 ck = CLAIM_BIT | bpf_get_socket_cookie(sk), key;
	struct srun_owner *c, *o;

	/* Only the claiming socket gives the claim back: accepted
	 * connections share the listener's port but not its cookie. */
	c = bpf_map_lookup_elem(&pal_srun_ports, &ck);
	if (!c)
		return 1;
	key = c->port;
	o = bpf_map_lookup_elem(&pal_srun_ports, &key);
	if (o && o->cookie == c->cookie) {
		/* A claim tc handed segments to lingers (first, so that no
		 * segment of an accepted connection finds neither), still
		 * counted in its VRF's budget; one nobody called does not (a
		 * bind and close holds no port). If the map is full, the
		 * claim goes all the same: a port is never left claimed by a
		 * closed socket. */
		__u64 lk = LINGER_BIT | key;
		struct srun_owner l = *o;
		int lingers = 0;

		if (l.used) {
			l.released = bpf_ktime_get_ns();
			lingers = bpf_map_update_elem(&pal_srun_ports, &lk, &l, BPF_NOEXIST) == 0;
		}
		bpf_map_delete_elem(&pal_srun_ports, &key);
		if (!lingers)
			count(c->ifindex, -1);
	}
	bpf_map_delete_elem(&pal_srun_ports, &ck);
	return 1;
}

/* default_vrf_socket reports whether a socket of the default VRF (listener,
 * connection, request or time-wait) would take the segment. */
static __always_inline int default_vrf_socket(struct __sk_buff *skb, int v6, struct bpf_sock_tuple *t)
{
	struct bpf_sock *sk;

	sk = bpf_skc_lookup_tcp(skb, t, v6 ? sizeof(t->ipv6) : sizeof(t->ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

SEC("tc")
int pal_uvn_srun_in(struct __sk_buff *skb)
{
	struct bpf_sock_tuple tuple = {};
	struct srun_owner *o;
	struct {
		__be16 sport, dport;
		__be32 seq, ack;
		__u8 off, flags;
		__u16 win;
	} th; /* the first 16 bytes of the TCP header */
	__u64 dport;
	int v6 = 0;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		struct srun_lpm4 k = { .prefixlen = 32 };

		if (bpf_skb_load_bytes_relative(skb, 0, &ip, sizeof(ip), BPF_HDR_START_NET))
			return TC_ACT_OK;
		if (ip.protocol != IPPROTO_TCP || ip.ihl < 5 || (ip.frag_off & bpf_htons(0x1fff)))
			return TC_ACT_OK;
		if (bpf_skb_load_bytes_relative(skb, ip.ihl * 4, &th, sizeof(th), BPF_HDR_START_NET))
			return TC_ACT_OK;
		dport = bpf_ntohs(th.dport);
		if (!in_range(dport))
			return TC_ACT_OK;
		k.addr = ip.saddr;
		if (!bpf_map_lookup_elem(&pal_srun_src4, &k))
			return TC_ACT_OK;
		tuple.ipv4.saddr = ip.saddr;
		tuple.ipv4.daddr = ip.daddr;
		tuple.ipv4.sport = th.sport;
		tuple.ipv4.dport = th.dport;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		struct srun_lpm6 k = { .prefixlen = 128 };

		if (bpf_skb_load_bytes_relative(skb, 0, &ip6, sizeof(ip6), BPF_HDR_START_NET))
			return TC_ACT_OK;
		if (ip6.nexthdr != IPPROTO_TCP) /* Slurm sends no extension headers */
			return TC_ACT_OK;
		if (bpf_skb_load_bytes_relative(skb, sizeof(ip6), &th, sizeof(th), BPF_HDR_START_NET))
			return TC_ACT_OK;
		dport = bpf_ntohs(th.dport);
		if (!in_range(dport))
			return TC_ACT_OK;
		__builtin_memcpy(k.addr, &ip6.saddr, sizeof(k.addr));
		if (!bpf_map_lookup_elem(&pal_srun_src6, &k))
			return TC_ACT_OK;
		__builtin_memcpy(tuple.ipv6.saddr, &ip6.saddr, sizeof(tuple.ipv6.saddr));
		__builtin_memcpy(tuple.ipv6.daddr, &ip6.daddr, sizeof(tuple.ipv6.daddr));
		tuple.ipv6.sport = th.sport;
		tuple.ipv6.dport = th.dport;
		v6 = 1;
	} else {
		return TC_ACT_OK;
	}
	o = bpf_map_lookup_elem(&pal_srun_ports, &dport);
	if (!o) {
		/* A lingering claim carries its accepted connections to their
		 * end, but opens none: nothing with SYN is taken. */
		if (th.flags & 0x02)
			return TC_ACT_OK;
		dport |= LINGER_BIT;
		o = bpf_map_lookup_elem(&pal_srun_ports, &dport);
		if (!o)
			return TC_ACT_OK;
		if (bpf_ktime_get_ns() - o->released > LINGER_NS) {
			drop_linger(dport, o->ifindex);
			return TC_ACT_OK;
		}
	}
	/* The kernel's own lookup, as the segment arrived (default VRF): a
	 * socket there owns the flow, claim or not. */
	if (default_vrf_socket(skb, v6, &tuple))
		return TC_ACT_OK;
	/* The VRF device takes the frame as its own (TCP drops any other
	 * packet type) only if it is addressed to it. Attached to Ethernet
	 * and loopback devices only: offset 0 is the destination address. */
	if (!o->used)
		o->used = 1; /* its listener's claim will linger */
	if (bpf_skb_store_bytes(skb, 0, o->mac, 6, 0))
		return TC_ACT_OK;
	skb->mark = srun_mark;
	return bpf_redirect(o->ifindex, BPF_F_INGRESS);
}
