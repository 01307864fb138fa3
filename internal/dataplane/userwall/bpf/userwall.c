// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade userwall: the identity firewall, in the kernel.
 *
 * One copy of these programs is loaded per network namespace (per node); every
 * program first compares the netns cookie of the socket or packet with the one
 * set at load time and does nothing for any other namespace, because the
 * cgroup and LSM hooks are shared by every namespace of the kernel.
 *
 *   connect4/6, sendmsg4/6   local TCP/UDP: caller's cred vs local listener
 *   sock_create              remember the creator's euid/egid per socket
 *   sock_ops                 stamp uid+egid in a TCP option on outgoing SYNs
 *   tc ingress               check SYNs and UDP datagrams from other nodes
 *   tc egress                stamp uid+egid in an IP option on UDP, note flows
 *   lsm unix_*               abstract Unix sockets
 *
 * The rules are those of package policy (Decide); keep them in the same order.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "GPL";

#define AF_INET 2
#define AF_INET6 10
#define AF_UNIX 1
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define IPPROTO_DSTOPTS 60
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#define TC_ACT_OK 0
#define TC_ACT_SHOT 2
#define EPERM 1

/* Wire formats of the carried identity (see docs/userwall.md). */
#define UW_TCPOPT_KIND 254   /* RFC 6994 shared experimental option */
#define UW_TCPOPT_LEN 12     /* kind, len, ExID(2), uid(4), gid(4) */
#define UW_EXID 0x5542       /* "UB" */
#define UW_IPOPT_TYPE 0x9e   /* RFC 4727 experimental, copied flag set */
#define UW_IPOPT_LEN 12
#define UW_IP6OPT_TYPE 0x1e  /* RFC 4727 experimental, skip if unknown */
#define UW_IP6OPT_LEN 12
#define UW_DSTOPT_LEN 16

/* Marks that the nft table turns into a TCP reset / ICMP admin-prohibited. */
#define UW_MARK_RST 0x55424600
#define UW_MARK_ICMP 0x55424601

#define MAX_GROUPS 128
#define UDP_REPLY_NS (120ULL * 1000000000ULL)

/* Rules; numbering shared with Go (userwall/rules.go). */
enum uw_rule {
	R_NONE = 0,
	R_SAME_USER = 1,
	R_SHARED_GROUP = 2,
	R_SYSTEM_PORT = 3,
	R_EXEMPT_CONNECTOR = 4,
	R_EXEMPT_LISTENER = 5,
	R_OFFCLUSTER_PORT = 6,
	R_OFFCLUSTER_DENIED = 7,
	R_DENIED = 8,
	R_UDP_REPLY = 9,
	R_NO_LISTENER = 10,
	R_UNIX_REPLY = 11,
	R_MAX = 16,
};

/* Paths (where a decision was taken); counters are indexed path*R_MAX+rule. */
enum uw_path {
	P_LOCAL_TCP = 0,
	P_LOCAL_UDP = 1,
	P_REMOTE_TCP = 2,
	P_REMOTE_UDP = 3,
	P_UNIX = 4,
	P_MAX = 5,
};

struct uw_config {
	__u32 system_port_max;
	__u32 enabled;
};

struct uw_lpm_key {
	__u32 prefixlen;
	__u8 addr[16]; /* IPv6, or IPv4-mapped IPv6 */
};

struct uw_owner {
	__u32 uid;
	__u32 gid;
};

struct uw_member_key {
	__u32 uid;
	__u32 gid;
};

struct uw_flow_key {
	__u8 peer[16];  /* the address the datagram was sent to */
	__u16 peer_port;
	__u16 local_port;
	__u32 pad;
};

struct uw_event {
	__u64 ts;
	__u32 cuid, cgid;  /* connector */
	__u32 luid, lgid;  /* listener */
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport, dport;
	__u32 pid;
	__u8 proto;   /* 6, 17, or 1 for unix */
	__u8 family;  /* 4, 6, 1 */
	__u8 rule;
	__u8 path;
	__u8 has_connector; /* 0: connector identity unknown (option-less) */
	__u8 pad[3];
	char comm[16];
};

/* Set at load time: the namespace this copy enforces. */
volatile const __u64 netns_cookie = 0;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_config);
} settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} exempt_conn SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} exempt_lis SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__type(key, struct uw_lpm_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} local_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__type(key, struct uw_lpm_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} cluster_nets SEC(".maps");

/* Bitmap of the ports off-cluster sources may reach: bit p%64 of word p/64. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} offc_ports SEC(".maps");

/* (uid, gid) present when uid is a member of gid in NSS (remote group check). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__type(key, struct uw_member_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} members SEC(".maps");

/* Creator's effective uid/gid of each inet socket of this namespace. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct uw_owner);
} sk_owners SEC(".maps");

/* Recent UDP flows sent from this node, so that replies get through. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct uw_flow_key);
	__type(value, __u64);
} udp_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, P_MAX * R_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

/* Abstract Unix datagrams: the receivers each socket sent to (inode numbers,
 * a few recent ones), so that their answers get through. */
#define UNIX_PEERS 4
struct uw_unix_peers {
	__u64 ino[UNIX_PEERS];
	__u32 next;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct uw_unix_peers);
} unix_peers SEC(".maps");

/* Force BTF for the types Go decodes. */
const struct uw_event *unused_event __attribute__((unused));

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

static __always_inline struct uw_config *uw_cfg(void)
{
	__u32 k = 0;
	struct uw_config *c = bpf_map_lookup_elem(&settings, &k);
	if (!c || !c->enabled)
		return 0;
	return c;
}

static __always_inline void count(__u32 path, __u32 rule)
{
	__u32 k = path * R_MAX + rule;
	__u64 *v = bpf_map_lookup_elem(&counters, &k);
	if (v)
		*v += 1;
}

static __always_inline int allows(__u32 rule)
{
	return rule != R_DENIED && rule != R_OFFCLUSTER_DENIED;
}

static __always_inline void key4(struct uw_lpm_key *k, __u32 addr)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->prefixlen = 128;
	k->addr[10] = 0xff;
	k->addr[11] = 0xff;
	__builtin_memcpy(&k->addr[12], &addr, 4);
}

static __always_inline void key6(struct uw_lpm_key *k, const __u32 *addr)
{
	k->prefixlen = 128;
	__builtin_memcpy(k->addr, addr, 16);
}

static __always_inline int is_local(struct uw_lpm_key *k)
{
	return bpf_map_lookup_elem(&local_addrs, k) != 0;
}

static __always_inline int in_cluster(struct uw_lpm_key *k)
{
	return bpf_map_lookup_elem(&cluster_nets, k) != 0;
}

static __always_inline int offcluster_port(__u16 port)
{
	__u32 w = port / 64;
	__u64 *bits = bpf_map_lookup_elem(&offc_ports, &w);
	return bits && (*bits >> (port % 64)) & 1;
}

/*
 * The policy core's order (policy.Decide) for a non-system port from a trusted
 * source: same user, shared group, exempt connector, exempt listener.
 * group_ok is the caller's group test, done by the caller because it differs
 * locally (kernel cred) and remotely (carried egid + NSS membership).
 */
static __always_inline __u32 decide_user(__u32 cuid, __u32 luid, int group_ok)
{
	if (cuid == luid)
		return R_SAME_USER;
	if (group_ok)
		return R_SHARED_GROUP;
	if (bpf_map_lookup_elem(&exempt_conn, &cuid))
		return R_EXEMPT_CONNECTOR;
	if (bpf_map_lookup_elem(&exempt_lis, &luid))
		return R_EXEMPT_LISTENER;
	return R_DENIED;
}

/* Owner of a socket: the creator's euid/egid from sock_create, or else the
 * socket's file credentials (also taken at socket() time); never passwd. */
static __always_inline void sk_owner(struct bpf_sock *bsk, struct uw_owner *o)
{
	struct uw_owner *s = bpf_sk_storage_get(&sk_owners, bsk, 0, 0);
	if (s) {
		o->uid = s->uid;
		o->gid = s->gid;
		return;
	}
	/* Helper reads (not direct loads): the compiler would otherwise merge
	 * them with the map-value loads above, which the verifier refuses. */
	struct sock *sk = bpf_rdonly_cast(bsk, bpf_core_type_id_kernel(struct sock));
	o->uid = BPF_CORE_READ(sk, sk_uid.val);
	o->gid = (__u32)-1;
	struct file *f = BPF_CORE_READ(sk, sk_socket, file);
	if (f)
		o->gid = BPF_CORE_READ(f, f_cred, egid.val);
}

/* Is gid the caller's effective gid or one of its supplementary groups? */
static __always_inline int current_has_group(__u32 gid)
{
	struct task_struct *t = bpf_get_current_task_btf();
	const struct cred *cred = BPF_CORE_READ(t, cred);
	if (BPF_CORE_READ(cred, egid.val) == gid)
		return 1;
	struct group_info *gi = BPF_CORE_READ(cred, group_info);
	if (!gi)
		return 0;
	int n = BPF_CORE_READ(gi, ngroups);
	__u64 base = (__u64)gi + bpf_core_field_offset(struct group_info, gid);
	for (int i = 0; i < MAX_GROUPS; i++) {
		if (i >= n)
			break;
		__u32 g = 0;
		bpf_probe_read_kernel(&g, sizeof(g), (void *)(base + i * 4));
		if (g == gid)
			return 1;
	}
	return 0;
}

static __always_inline void current_ids(__u32 *uid, __u32 *gid)
{
	struct task_struct *t = bpf_get_current_task_btf();
	const struct cred *cred = BPF_CORE_READ(t, cred);
	*uid = BPF_CORE_READ(cred, euid.val);
	*gid = BPF_CORE_READ(cred, egid.val);
}

static __always_inline void emit(struct uw_event *tmpl)
{
	struct uw_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e)
		return;
	__builtin_memcpy(e, tmpl, sizeof(*e));
	e->ts = bpf_ktime_get_ns();
	bpf_ringbuf_submit(e, 0);
}

/* ---------------------------------------------------------------------------
 * Local connections (cgroup sock_addr hooks on the cgroup2 root).
 */

static __always_inline int flow_seen(struct uw_flow_key *k)
{
	__u64 *ts = bpf_map_lookup_elem(&udp_flows, k);
	return ts && bpf_ktime_get_ns() - *ts < UDP_REPLY_NS;
}

/*
 * check_local: dst (mapped key) is a local address and port a user port.
 * v4 selects an IPv4 lookup (also for v4-mapped destinations of v6 sockets).
 */
static __always_inline int check_local(struct bpf_sock_addr *ctx, struct uw_lpm_key *dst,
				       __u16 port, int udp)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	int v4 = dst->addr[10] == 0xff && dst->addr[11] == 0xff && dst->addr[0] == 0 &&
		 dst->addr[8] == 0;
	__u32 path = udp ? P_LOCAL_UDP : P_LOCAL_TCP;
	__u16 myport = 0;

	if (udp && ctx->sk)
		myport = ctx->sk->src_port;

	if (v4) {
		__builtin_memcpy(&t.ipv4.daddr, &dst->addr[12], 4);
		t.ipv4.dport = bpf_htons(port);
		if (myport) {
			t.ipv4.saddr = t.ipv4.daddr;
			t.ipv4.sport = bpf_htons(myport);
		}
		if (udp)
			sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		else
			sk = bpf_sk_lookup_tcp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else {
		__builtin_memcpy(t.ipv6.daddr, dst->addr, 16);
		t.ipv6.dport = bpf_htons(port);
		if (myport) {
			__builtin_memcpy(t.ipv6.saddr, dst->addr, 16);
			t.ipv6.sport = bpf_htons(myport);
		}
		if (udp)
			sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		else
			sk = bpf_sk_lookup_tcp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk) {
		count(path, R_NO_LISTENER);
		return 1; /* the kernel answers ECONNREFUSED / port unreachable */
	}
	struct uw_owner l;
	sk_owner(sk, &l);
	/* A UDP socket connected to exactly this sender accepts its datagrams. */
	int connected_to_us = udp && myport && sk->dst_port != 0;
	bpf_sk_release(sk);

	__u32 cuid, cgid;
	current_ids(&cuid, &cgid);
	__u32 rule;
	if (connected_to_us) {
		rule = R_UDP_REPLY;
	} else {
		rule = decide_user(cuid, l.uid, cuid != l.uid && current_has_group(l.gid));
		if (!allows(rule) && udp && myport) {
			/* A reply to a datagram the destination socket sent to
			 * this one first (noted at lo egress with the address it
			 * was sent to: ours, bound or chosen by routing, which on
			 * one node is the destination's address family-wise). */
			struct uw_flow_key fk = {};
			__builtin_memcpy(fk.peer, dst->addr, 16);
			if (v4 && ctx->sk && ctx->sk->src_ip4) {
				__u32 sa = ctx->sk->src_ip4;
				__builtin_memcpy(&fk.peer[12], &sa, 4);
			} else if (!v4 && ctx->sk) {
				__u32 s6[4] = {ctx->sk->src_ip6[0], ctx->sk->src_ip6[1], ctx->sk->src_ip6[2],
					       ctx->sk->src_ip6[3]};
				if (s6[0] | s6[1] | s6[2] | s6[3])
					__builtin_memcpy(fk.peer, s6, 16);
			}
			fk.peer_port = myport;
			fk.local_port = port;
			if (flow_seen(&fk))
				rule = R_UDP_REPLY;
		}
	}
	count(path, rule);
	if (allows(rule))
		return 1;

	struct uw_event e = {};
	e.cuid = cuid;
	e.cgid = cgid;
	e.luid = l.uid;
	e.lgid = l.gid;
	__builtin_memcpy(e.daddr, dst->addr, 16);
	e.dport = port;
	e.sport = myport;
	e.proto = udp ? IPPROTO_UDP : IPPROTO_TCP;
	e.family = v4 ? 4 : 6;
	e.rule = rule;
	e.path = path;
	e.has_connector = 1;
	e.pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	emit(&e);
	return 0; /* EPERM */
}

static __always_inline int hook4(struct bpf_sock_addr *ctx, int udp)
{
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	__u16 port = bpf_ntohs(ctx->user_port);
	if (port <= c->system_port_max)
		return 1;
	struct uw_lpm_key k;
	key4(&k, ctx->user_ip4);
	if (!is_local(&k))
		return 1; /* another node: checked there, on arrival */
	return check_local(ctx, &k, port, udp);
}

static __always_inline int hook6(struct bpf_sock_addr *ctx, int udp)
{
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	__u16 port = bpf_ntohs(ctx->user_port);
	if (port <= c->system_port_max)
		return 1;
	struct uw_lpm_key k;
	__u32 a[4];
	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
	/* ::ffff:a.b.c.d goes through the IPv4 stack, where connect4 does not
	 * run: the mapped form is the IPv4 key of the local-address map. */
	key6(&k, a);
	if (!is_local(&k))
		return 1;
	return check_local(ctx, &k, port, udp);
}

SEC("cgroup/connect4")
int uw_connect4(struct bpf_sock_addr *ctx)
{
	return hook4(ctx, ctx->type == SOCK_DGRAM);
}

SEC("cgroup/connect6")
int uw_connect6(struct bpf_sock_addr *ctx)
{
	return hook6(ctx, ctx->type == SOCK_DGRAM);
}

SEC("cgroup/sendmsg4")
int uw_sendmsg4(struct bpf_sock_addr *ctx)
{
	return hook4(ctx, 1);
}

SEC("cgroup/sendmsg6")
int uw_sendmsg6(struct bpf_sock_addr *ctx)
{
	return hook6(ctx, 1);
}

/* Remember who created each socket, with the effective ids of that moment
 * (what sg/newgrp set), for listeners and for the identity we carry. */
SEC("cgroup/sock_create")
int uw_sock_create(struct bpf_sock *ctx)
{
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_owner *o = bpf_sk_storage_get(&sk_owners, ctx, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (o)
		current_ids(&o->uid, &o->gid);
	return 1;
}

/* ---------------------------------------------------------------------------
 * Cross-node TCP: the sending node stamps the SYN (sock_ops).
 */

SEC("sockops")
int uw_sockops(struct bpf_sock_ops *skops)
{
	if (bpf_get_netns_cookie(skops) != netns_cookie)
		return 1;
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB: {
		if (!uw_cfg())
			return 1;
		struct uw_lpm_key k;
		if (skops->family == AF_INET) {
			key4(&k, skops->remote_ip4);
		} else if (skops->family == AF_INET6) {
			__u32 a[4] = {skops->remote_ip6[0], skops->remote_ip6[1], skops->remote_ip6[2],
				      skops->remote_ip6[3]};
			key6(&k, a);
		} else {
			return 1;
		}
		/* Identity goes only to cluster nodes, never to local peers
		 * (checked at connect) nor off-cluster hosts (no leak). */
		if (!in_cluster(&k) || is_local(&k))
			return 1;
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
							 BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		return 1;
	}
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		if ((skops->skb_tcp_flags & 0x12) == 0x02) /* SYN without ACK */
			bpf_reserve_hdr_opt(skops, UW_TCPOPT_LEN, 0);
		return 1;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB: {
		if ((skops->skb_tcp_flags & 0x12) != 0x02)
			return 1;
		struct bpf_sock *bsk = skops->sk;
		if (!bsk)
			return 1;
		struct uw_owner o;
		sk_owner(bsk, &o);
		__u8 opt[UW_TCPOPT_LEN];
		opt[0] = UW_TCPOPT_KIND;
		opt[1] = UW_TCPOPT_LEN;
		opt[2] = UW_EXID >> 8;
		opt[3] = UW_EXID & 0xff;
		__u32 u = bpf_htonl(o.uid), g = bpf_htonl(o.gid);
		__builtin_memcpy(&opt[4], &u, 4);
		__builtin_memcpy(&opt[8], &g, 4);
		bpf_store_hdr_opt(skops, opt, sizeof(opt), 0);
		return 1;
	}
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		if (skops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG)
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags &
								 ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		return 1;
	}
	return 1;
}

/* ---------------------------------------------------------------------------
 * Cross-node: tc ingress on the cluster interfaces checks SYNs and datagrams
 * against the local listener before the stack sees them; a denial marks the
 * packet and the nft table answers with a reset / admin-prohibited.
 */

struct pkt {
	struct uw_lpm_key src, dst;
	__u32 l3off;
	__u16 sport, dport;
	__u32 l4off;
	__u8 proto;
	__u8 v4;
	__u8 has_id;
	__u8 frag; /* first fragment of a fragmented datagram */
	__u32 uid, gid;
};

/* Find our TCP option among the SYN's options (one load per option: the
 * verifier refuses variable offsets into a stack copy). */
static __always_inline void tcp_option(struct __sk_buff *skb, struct pkt *p, __u32 doff)
{
	__u32 off = p->l4off + 20;
	__u32 end = p->l4off + doff;
	for (int i = 0; i < 20; i++) {
		if (off + 2 > end)
			return;
		__u8 kl[2];
		if (bpf_skb_load_bytes(skb, off, kl, 2))
			return;
		if (kl[0] == 0)
			return; /* end of options */
		if (kl[0] == 1) {
			off++;
			continue;
		}
		if (kl[1] < 2)
			return;
		if (kl[0] == UW_TCPOPT_KIND && kl[1] == UW_TCPOPT_LEN && off + UW_TCPOPT_LEN <= end) {
			__u8 o[UW_TCPOPT_LEN];
			if (bpf_skb_load_bytes(skb, off, o, sizeof(o)))
				return;
			if (o[2] == (UW_EXID >> 8) && o[3] == (UW_EXID & 0xff)) {
				__u32 u, g;
				__builtin_memcpy(&u, &o[4], 4);
				__builtin_memcpy(&g, &o[8], 4);
				p->uid = bpf_ntohl(u);
				p->gid = bpf_ntohl(g);
				p->has_id = 1;
				return;
			}
		}
		off += kl[1];
	}
}

/* Parse the IP header; returns 0 if the packet is not one we look at. */
static __always_inline int parse_ip(struct __sk_buff *skb, struct pkt *p)
{
	__builtin_memset(p, 0, sizeof(*p));
	/* L2 header length of this device (Ethernet, IPoIB, lo...). */
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	__u32 l3 = (__u32)(kskb->network_header - kskb->mac_header);
	if (l3 > 64)
		return 0;
	p->l3off = l3;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		if (bpf_skb_load_bytes(skb, l3, &ip, sizeof(ip)))
			return 0;
		if (ip.frag_off & bpf_htons(0x1fff))
			return 0; /* later fragments carry no ports */
		p->frag = (ip.frag_off & bpf_htons(0x2000)) != 0;
		p->v4 = 1;
		p->proto = ip.protocol;
		key4(&p->src, ip.saddr);
		key4(&p->dst, ip.daddr);
		p->l4off = l3 + ip.ihl * 4;
		if (ip.protocol == IPPROTO_UDP && ip.ihl >= 8) {
			__u8 o[UW_IPOPT_LEN];
			if (!bpf_skb_load_bytes(skb, l3 + 20, o, sizeof(o)) &&
			    o[0] == UW_IPOPT_TYPE && o[1] == UW_IPOPT_LEN &&
			    o[2] == (UW_EXID >> 8) && o[3] == (UW_EXID & 0xff)) {
				__u32 u, g;
				__builtin_memcpy(&u, &o[4], 4);
				__builtin_memcpy(&g, &o[8], 4);
				p->uid = bpf_ntohl(u);
				p->gid = bpf_ntohl(g);
				p->has_id = 1;
			}
		}
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		if (bpf_skb_load_bytes(skb, l3, &ip6, sizeof(ip6)))
			return 0;
		p->proto = ip6.nexthdr;
		key6(&p->src, (__u32 *)&ip6.saddr);
		key6(&p->dst, (__u32 *)&ip6.daddr);
		/* Walk the extension headers a sender may add without privilege
		 * (routing header, fragments) or with it; our stamp is a
		 * destination-options header right after the fixed header. */
		__u8 nh = ip6.nexthdr;
		__u32 off = l3 + sizeof(ip6);
		for (int i = 0; i < 6; i++) {
			if (nh == IPPROTO_TCP || nh == IPPROTO_UDP)
				break;
			if (nh == 44) { /* fragment */
				__u8 f[4];
				if (bpf_skb_load_bytes(skb, off, f, sizeof(f)))
					return 0;
				if (((f[2] << 8) | f[3]) & 0xfff8)
					return 0; /* later fragments carry no ports */
				p->frag = 1;
				nh = f[0];
				off += 8;
				continue;
			}
			if (nh != 0 && nh != 43 && nh != IPPROTO_DSTOPTS)
				return 0;
			__u8 h[2];
			if (bpf_skb_load_bytes(skb, off, h, sizeof(h)))
				return 0;
			if (i == 0 && nh == IPPROTO_DSTOPTS && h[1] == 1) {
				__u8 o[UW_DSTOPT_LEN];
				if (!bpf_skb_load_bytes(skb, off, o, sizeof(o)) && o[2] == UW_IP6OPT_TYPE &&
				    o[3] == UW_IP6OPT_LEN && o[4] == (UW_EXID >> 8) && o[5] == (UW_EXID & 0xff)) {
					__u32 u, g;
					__builtin_memcpy(&u, &o[6], 4);
					__builtin_memcpy(&g, &o[10], 4);
					p->uid = bpf_ntohl(u);
					p->gid = bpf_ntohl(g);
					p->has_id = 1;
				}
			}
			nh = h[0];
			off += (h[1] + 1) * 8;
		}
		p->proto = nh;
		p->l4off = off;
	} else {
		return 0;
	}
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return 0;
	__be16 ports[2];
	if (bpf_skb_load_bytes(skb, p->l4off, ports, sizeof(ports)))
		return 0;
	p->sport = bpf_ntohs(ports[0]);
	p->dport = bpf_ntohs(ports[1]);
	return 1;
}

/*
 * check_pkt: the listener check for a SYN or datagram p to a local user port.
 * local: a datagram from a connected UDP socket of this node seen on lo
 * (its connect() may predate the listener, and send() on a connected socket
 * runs no sendmsg hook); its identity, from the socket, is trusted.
 */
static __always_inline int check_pkt(struct __sk_buff *skb, struct pkt *p, int local)
{
	int udp = p->proto == IPPROTO_UDP;
	__u32 path = local ? P_LOCAL_UDP : (udp ? P_REMOTE_UDP : P_REMOTE_TCP);

	/*
	 * TCP: look up the listener itself (zero source). With the full
	 * 4-tuple a SYN that matches a TIME_WAIT socket finds no full socket,
	 * yet the kernel hands it to the listener (tcp_timewait_state_process):
	 * that was a bypass. Reuseport groups share one owner, so the listener
	 * picked for a zero source has the same identity.
	 * UDP: the full tuple, so that a socket connected to the sender is found.
	 */
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 tlen;
	if (p->v4) {
		if (udp) {
			__builtin_memcpy(&t.ipv4.saddr, &p->src.addr[12], 4);
			t.ipv4.sport = bpf_htons(p->sport);
		}
		__builtin_memcpy(&t.ipv4.daddr, &p->dst.addr[12], 4);
		t.ipv4.dport = bpf_htons(p->dport);
		tlen = sizeof(t.ipv4);
	} else {
		if (udp) {
			__builtin_memcpy(t.ipv6.saddr, p->src.addr, 16);
			t.ipv6.sport = bpf_htons(p->sport);
		}
		__builtin_memcpy(t.ipv6.daddr, p->dst.addr, 16);
		t.ipv6.dport = bpf_htons(p->dport);
		tlen = sizeof(t.ipv6);
	}
	if (udp)
		sk = bpf_sk_lookup_udp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_tcp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	if (!sk) {
		count(path, R_NO_LISTENER);
		return TC_ACT_OK;
	}
	struct uw_owner l;
	sk_owner(sk, &l);
	int connected_to_us = udp && sk->dst_port != 0;
	bpf_sk_release(sk);

	if (!udp) {
		__u8 doff;
		if (bpf_skb_load_bytes(skb, p->l4off + 12, &doff, 1))
			return TC_ACT_OK;
		tcp_option(skb, p, (doff >> 4) * 4);
	}

	__u32 rule;
	int trusted = local || (p->has_id && in_cluster(&p->src));
	if (connected_to_us) {
		rule = R_UDP_REPLY;
	} else if (!trusted) {
		/* No trusted identity: the off-cluster policy applies. */
		rule = offcluster_port(p->dport) ? R_OFFCLUSTER_PORT : R_OFFCLUSTER_DENIED;
	} else {
		int group_ok = 0;
		if (p->uid != l.uid) {
			struct uw_member_key mk = {.uid = p->uid, .gid = l.gid};
			group_ok = p->gid == l.gid || bpf_map_lookup_elem(&members, &mk) != 0;
		}
		rule = decide_user(p->uid, l.uid, group_ok);
	}
	if (!allows(rule) && udp) {
		struct uw_flow_key fk = {};
		__builtin_memcpy(fk.peer, p->src.addr, 16);
		fk.peer_port = p->sport;
		fk.local_port = p->dport;
		if (flow_seen(&fk))
			rule = R_UDP_REPLY;
	}
	count(path, rule);
	if (allows(rule))
		return TC_ACT_OK;

	skb->mark = udp ? UW_MARK_ICMP : UW_MARK_RST;
	struct uw_event e = {};
	e.cuid = p->uid;
	e.cgid = p->gid;
	e.has_connector = trusted;
	e.luid = l.uid;
	e.lgid = l.gid;
	__builtin_memcpy(e.saddr, p->src.addr, 16);
	__builtin_memcpy(e.daddr, p->dst.addr, 16);
	e.sport = p->sport;
	e.dport = p->dport;
	e.proto = p->proto;
	e.family = p->v4 ? 4 : 6;
	e.rule = rule;
	e.path = path;
	emit(&e);
	/* A refused fragment is dropped: the mark may not survive reassembly,
	 * and without the first fragment nothing is delivered. */
	return p->frag ? TC_ACT_SHOT : TC_ACT_OK;
}

SEC("tc")
int uw_tc_ingress(struct __sk_buff *skb)
{
	struct uw_config *c = uw_cfg();
	if (!c)
		return TC_ACT_OK;
	struct pkt p;
	if (!parse_ip(skb, &p))
		return TC_ACT_OK;
	if (p.dport <= c->system_port_max)
		return TC_ACT_OK;
	if (p.proto == IPPROTO_TCP) {
		__u8 fl[2];
		if (bpf_skb_load_bytes(skb, p.l4off + 12, fl, 2))
			return TC_ACT_OK;
		if ((fl[1] & 0x12) != 0x02) /* only SYN without ACK opens a connection */
			return TC_ACT_OK;
	}
	if (!is_local(&p.dst))
		return TC_ACT_OK;
	return check_pkt(skb, &p, 0);
}

/*
 * tc egress (cluster interfaces and lo): note UDP flows (replies to them are
 * allowed) and stamp the sender's identity on datagrams to other nodes' user
 * ports: an IPv4 option or an IPv6 destination option.
 */
SEC("tc")
int uw_tc_egress(struct __sk_buff *skb)
{
	struct uw_config *c = uw_cfg();
	if (!c)
		return TC_ACT_OK;
	struct pkt p;
	if (!parse_ip(skb, &p) || p.proto != IPPROTO_UDP)
		return TC_ACT_OK;

	int lo = skb->ifindex == 1;
	struct uw_flow_key fk = {};
	__builtin_memcpy(fk.peer, p.dst.addr, 16);
	fk.peer_port = p.dport;
	fk.local_port = p.sport;
	__u64 now = bpf_ktime_get_ns();
	__u64 *ts = bpf_map_lookup_elem(&udp_flows, &fk);
	if (!ts || now - *ts > 1000000000ULL)
		bpf_map_update_elem(&udp_flows, &fk, &now, BPF_ANY);

	if (p.has_id || p.dport <= c->system_port_max)
		return TC_ACT_OK;
	if (lo) {
		/* Connected UDP sockets on this node: checked per datagram (the
		 * denial mark makes the nft table answer ICMP on lo input). */
		struct bpf_sock *ls = skb->sk;
		if (ls)
			ls = bpf_sk_fullsock(ls);
		if (ls && ls->dst_port != 0) {
			struct uw_owner lo_o;
			sk_owner(ls, &lo_o);
			p.uid = lo_o.uid;
			p.gid = lo_o.gid;
			p.has_id = 1;
			return check_pkt(skb, &p, 1);
		}
		return TC_ACT_OK;
	}
	if (!in_cluster(&p.dst) || is_local(&p.dst))
		return TC_ACT_OK;
	if (skb->gso_segs > 1)
		return TC_ACT_OK; /* UDP GSO: not stamped (documented limit) */
	struct bpf_sock *bsk = skb->sk;
	if (!bsk)
		return TC_ACT_OK;
	bsk = bpf_sk_fullsock(bsk);
	if (!bsk)
		return TC_ACT_OK;
	struct uw_owner o;
	sk_owner(bsk, &o);
	__u32 u = bpf_htonl(o.uid), g = bpf_htonl(o.gid);

	if (p.v4) {
		struct iphdr ip;
		if (bpf_skb_load_bytes(skb, p.l3off, &ip, sizeof(ip)) || ip.ihl != 5)
			return TC_ACT_OK;
		__u32 mtu = 0;
		if (bpf_check_mtu(skb, 0, &mtu, UW_IPOPT_LEN, 0))
			return TC_ACT_OK; /* would exceed the MTU: leave unstamped */
		if (bpf_skb_adjust_room(skb, UW_IPOPT_LEN, BPF_ADJ_ROOM_NET, 0))
			return TC_ACT_OK;
		__u8 o4[UW_IPOPT_LEN];
		o4[0] = UW_IPOPT_TYPE;
		o4[1] = UW_IPOPT_LEN;
		o4[2] = UW_EXID >> 8;
		o4[3] = UW_EXID & 0xff;
		__builtin_memcpy(&o4[4], &u, 4);
		__builtin_memcpy(&o4[8], &g, 4);
		if (bpf_skb_store_bytes(skb, p.l3off + 20, o4, sizeof(o4), 0))
			return TC_ACT_OK;
		__u16 oldw, neww;
		/* First 16-bit word: version/ihl/tos. */
		oldw = *(__u16 *)&ip;
		ip.ihl = 5 + UW_IPOPT_LEN / 4;
		neww = *(__u16 *)&ip;
		__be16 oldlen = ip.tot_len;
		__be16 newlen = bpf_htons(bpf_ntohs(oldlen) + UW_IPOPT_LEN);
		bpf_skb_store_bytes(skb, p.l3off, &neww, 2, 0);
		bpf_skb_store_bytes(skb, p.l3off + 2, &newlen, 2, 0);
		/* The header checksum covers the option too. */
		__u32 off = p.l3off + 10;
		bpf_l3_csum_replace(skb, off, oldw, neww, 2);
		bpf_l3_csum_replace(skb, off, oldlen, newlen, 2);
		__s64 d = bpf_csum_diff(0, 0, (__be32 *)o4, sizeof(o4), 0);
		bpf_l3_csum_replace(skb, off, 0, d, 0);
	} else {
		struct ipv6hdr ip6;
		if (bpf_skb_load_bytes(skb, p.l3off, &ip6, sizeof(ip6)) || ip6.nexthdr != IPPROTO_UDP)
			return TC_ACT_OK;
		__u32 mtu = 0;
		if (bpf_check_mtu(skb, 0, &mtu, UW_DSTOPT_LEN, 0))
			return TC_ACT_OK;
		if (bpf_skb_adjust_room(skb, UW_DSTOPT_LEN, BPF_ADJ_ROOM_NET, 0))
			return TC_ACT_OK;
		__u8 o6[UW_DSTOPT_LEN];
		o6[0] = IPPROTO_UDP;
		o6[1] = 1; /* (1+1)*8 = 16 bytes */
		o6[2] = UW_IP6OPT_TYPE;
		o6[3] = UW_IP6OPT_LEN;
		o6[4] = UW_EXID >> 8;
		o6[5] = UW_EXID & 0xff;
		__builtin_memcpy(&o6[6], &u, 4);
		__builtin_memcpy(&o6[10], &g, 4);
		o6[14] = 1; /* PadN, 0 bytes of data */
		o6[15] = 0;
		if (bpf_skb_store_bytes(skb, p.l3off + sizeof(ip6), o6, sizeof(o6), 0))
			return TC_ACT_OK;
		__u8 nh = IPPROTO_DSTOPTS;
		__be16 plen = bpf_htons(bpf_ntohs(ip6.payload_len) + UW_DSTOPT_LEN);
		bpf_skb_store_bytes(skb, p.l3off + 4, &plen, 2, 0);
		bpf_skb_store_bytes(skb, p.l3off + 6, &nh, 1, 0);
	}
	return TC_ACT_OK;
}

/* ---------------------------------------------------------------------------
 * Abstract Unix sockets (BPF LSM). Pathname sockets are guarded by file
 * permissions; abstract names by nothing else.
 */

static __always_inline int abstract_unix(struct sock *other)
{
	struct unix_sock *u = (struct unix_sock *)other;
	struct unix_address *a = BPF_CORE_READ(u, addr);
	if (!a)
		return 0;
	char first = 1;
	bpf_probe_read_kernel(&first, 1, (void *)a + bpf_core_field_offset(struct unix_address, name) + 2);
	return first == 0;
}

static __always_inline __u64 sock_ino(struct sock *sk)
{
	return BPF_CORE_READ(sk, sk_socket, file, f_inode, i_ino);
}

/* Did dst (a datagram socket) send to the socket with inode ino lately? */
static __always_inline int sent_to(struct sock *dst, __u64 ino)
{
	struct uw_unix_peers *p = bpf_sk_storage_get(&unix_peers, dst, 0, 0);
	if (!p || !ino)
		return 0;
	for (int i = 0; i < UNIX_PEERS; i++)
		if (p->ino[i] == ino)
			return 1;
	return 0;
}

/* Remember on the sender that it sent to the socket with inode ino. */
static __always_inline void note_sent(struct sock *src, __u64 ino)
{
	if (!ino)
		return;
	struct uw_unix_peers *p = bpf_sk_storage_get(&unix_peers, src, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!p)
		return;
	for (int i = 0; i < UNIX_PEERS; i++)
		if (p->ino[i] == ino)
			return;
	p->ino[p->next % UNIX_PEERS] = ino;
	p->next = (p->next + 1) % UNIX_PEERS;
}

/* sk connects or sends to other. Returns 0 or -EPERM. */
static __always_inline int check_unix(struct sock *sk, struct sock *other, int stream)
{
	if (BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie) != netns_cookie)
		return 0;
	if (!uw_cfg())
		return 0;
	if (!abstract_unix(other))
		return 0;
	/* A datagram socket connected to the sender accepts its replies. */
	if (!stream && BPF_CORE_READ((struct unix_sock *)other, peer) == sk)
		return 0;
	__u32 luid = BPF_CORE_READ(other, sk_uid.val);
	__u32 lgid = (__u32)-1;
	struct socket *so = BPF_CORE_READ(other, sk_socket);
	if (so)
		lgid = BPF_CORE_READ(so, file, f_cred, egid.val);
	__u32 cuid, cgid;
	current_ids(&cuid, &cgid);
	__u32 rule = decide_user(cuid, luid, cuid != luid && current_has_group(lgid));
	/* The answer of a datagram server to a client that wrote to it (the
	 * client's autobound or named socket belongs to the client, whom the
	 * server may not otherwise reach, e.g. with a shared group). */
	if (!stream && !allows(rule) && sent_to(other, sock_ino(sk)))
		rule = R_UNIX_REPLY;
	count(P_UNIX, rule);
	if (allows(rule)) {
		if (!stream)
			note_sent(sk, sock_ino(other));
		return 0;
	}
	struct uw_event e = {};
	e.cuid = cuid;
	e.cgid = cgid;
	e.luid = luid;
	e.lgid = lgid;
	e.proto = 1;
	e.family = 1;
	e.rule = rule;
	e.path = P_UNIX;
	e.has_connector = 1;
	e.pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	/* The abstract name (without the leading NUL) goes in daddr. */
	struct unix_address *a = BPF_CORE_READ((struct unix_sock *)other, addr);
	bpf_probe_read_kernel(e.daddr, sizeof(e.daddr),
			      (void *)a + bpf_core_field_offset(struct unix_address, name) + 3);
	emit(&e);
	return -EPERM;
}

SEC("lsm/unix_stream_connect")
int BPF_PROG(uw_unix_stream_connect, struct sock *sock, struct sock *other, struct sock *newsk, int ret)
{
	if (ret)
		return ret;
	return check_unix(sock, other, 1);
}

SEC("lsm/unix_may_send")
int BPF_PROG(uw_unix_may_send, struct socket *sock, struct socket *other, int ret)
{
	if (ret)
		return ret;
	/* Direct loads (not probe reads): socket-local storage needs the
	 * verifier to know these are struct sock pointers. */
	struct sock *sk = sock->sk, *osk = other->sk;
	if (!sk || !osk)
		return 0;
	return check_unix(sk, osk, 0);
}
