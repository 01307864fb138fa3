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
 *   cgroup/sock_release            (in each user's VRF cgroup)
 *       The claiming socket (by cookie) gives its claim back. Claims of
 *       sockets that closed where no release program ran (their cgroup's
 *       programs detached first) are swept by the agent (srun.go).
 *   tc ingress                     (lo and every Ethernet underlay NIC of the node)
 *       A TCP segment from a cluster address to a claimed port is handed to
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

char LICENSE[] SEC("license") = "GPL";

/*
 * pal_srun_ports holds two kinds of entries (one map, so that the tc program
 * keeps it alive for the cgroup programs):
 *   key = port                   value = the claim: socket, VRF device, time
 *   key = CLAIM_BIT | cookie     value = the same claim, found by the socket
 * (sock_release may not read a socket's port, but may read its cookie;
 * cookies never reach 2^63.)
 */
#define CLAIM_BIT (1ULL << 63)

struct srun_owner {
	__u64 cookie; /* the claiming socket */
	__u64 since;  /* CLOCK_BOOTTIME of the claim (the sweeper spares young claims) */
	__u32 ifindex;
	__u32 port;
	__u8 mac[6]; /* the VRF device's address: the frame must be for it */
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct srun_owner);
} pal_srun_ports SEC(".maps");

struct srun_lpm4 {
	__u32 prefixlen;
	__u32 addr;
};

struct srun_lpm6 {
	__u32 prefixlen;
	__u32 addr[4];
};

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

static __always_inline int in_range(__u32 port)
{
	return port >= port_min && port <= port_max;
}

static __always_inline int claim(struct bpf_sock *sk)
{
	struct srun_owner mine = { .ifindex = vrf_ifindex };
	__u64 key, ck;
	int i;

	if (sk->protocol != IPPROTO_TCP || !in_range(sk->src_port))
		return 1;
	key = sk->src_port;
	mine.port = sk->src_port;
	for (i = 0; i < 6; i++)
		mine.mac[i] = vrf_mac[i];
	mine.cookie = bpf_get_socket_cookie(sk);
	mine.since = bpf_ktime_get_boot_ns();
	/* Atomic: of two sockets binding the port at once, one claims it. */
	if (bpf_map_update_elem(&pal_srun_ports, &key, &mine, BPF_NOEXIST) != 0)
		return 0; /* another socket's Slurm port: EPERM */
	ck = CLAIM_BIT | mine.cookie;
	bpf_map_update_elem(&pal_srun_ports, &ck, &mine, BPF_ANY);
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
	if (o && o->cookie == c->cookie)
		bpf_map_delete_elem(&pal_srun_ports, &key);
	bpf_map_delete_elem(&pal_srun_ports, &ck);
	return 1;
}

SEC("tc")
int pal_uvn_srun_in(struct __sk_buff *skb)
{
	struct srun_owner *o;
	__u16 ports[2];
	__u64 dport;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		struct srun_lpm4 k = { .prefixlen = 32 };

		if (bpf_skb_load_bytes_relative(skb, 0, &ip, sizeof(ip), BPF_HDR_START_NET))
			return TC_ACT_OK;
		if (ip.protocol != IPPROTO_TCP || ip.ihl < 5 || (ip.frag_off & bpf_htons(0x1fff)))
			return TC_ACT_OK;
		if (bpf_skb_load_bytes_relative(skb, ip.ihl * 4, ports, sizeof(ports), BPF_HDR_START_NET))
			return TC_ACT_OK;
		dport = bpf_ntohs(ports[1]);
		if (!in_range(dport))
			return TC_ACT_OK;
		k.addr = ip.saddr;
		if (!bpf_map_lookup_elem(&pal_srun_src4, &k))
			return TC_ACT_OK;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		struct srun_lpm6 k = { .prefixlen = 128 };

		if (bpf_skb_load_bytes_relative(skb, 0, &ip6, sizeof(ip6), BPF_HDR_START_NET))
			return TC_ACT_OK;
		if (ip6.nexthdr != IPPROTO_TCP) /* Slurm sends no extension headers */
			return TC_ACT_OK;
		if (bpf_skb_load_bytes_relative(skb, sizeof(ip6), ports, sizeof(ports), BPF_HDR_START_NET))
			return TC_ACT_OK;
		dport = bpf_ntohs(ports[1]);
		if (!in_range(dport))
			return TC_ACT_OK;
		__builtin_memcpy(k.addr, &ip6.saddr, sizeof(k.addr));
		if (!bpf_map_lookup_elem(&pal_srun_src6, &k))
			return TC_ACT_OK;
	} else {
		return TC_ACT_OK;
	}
	o = bpf_map_lookup_elem(&pal_srun_ports, &dport);
	if (!o)
		return TC_ACT_OK;
	/* The VRF device takes the frame as its own (TCP drops any other
	 * packet type) only if it is addressed to it. Attached to Ethernet
	 * and loopback devices only: offset 0 is the destination address. */
	if (bpf_skb_store_bytes(skb, 0, o->mac, 6, 0))
		return TC_ACT_OK;
	skb->mark = srun_mark;
	return bpf_redirect(o->ifindex, BPF_F_INGRESS);
}
