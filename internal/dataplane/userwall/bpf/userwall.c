// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade userwall: the identity firewall, in the kernel (data plane v2).
 *
 * The decision is taken where the kernel delivers: a cgroup_skb ingress
 * program runs with the very socket a packet is queued to (skb->sk), so no
 * lookup can disagree with delivery (device binds, link-local and multicast
 * addresses, SO_REUSEADDR, TIME_WAIT). The sender's identity travels in the
 * packet, stamped by tc egress on lo and the cluster interfaces and sealed
 * with a keyed MAC (SipHash-2-4, the cluster key), so it is trusted only if
 * the MAC verifies. The tc ingress program and the nft table only make a
 * refusal polite (RST / ICMP) before the stack sees the packet; safety does
 * not depend on them.
 *
 *   sock_create, post_bind4/6 remember each socket's owner (socket storage)
 *   iter/tcp, iter/udp        the same for sockets that predate the agent
 *   bind4/6                   no co-binding of another user's UDP port
 *   connect4/6, sendmsg4/6    note each UDP socket's peers (replies)
 *   tc egress                 stamp SYNs and datagrams to user ports
 *   cgroup_skb ingress        THE check: stamp → identity → rules → drop
 *   tc ingress                polite early refusal (mark → nft reject)
 *   lsm unix_*                abstract Unix sockets
 *
 * Which socket belongs to this namespace: every cgroup and LSM hook is shared
 * by all namespaces of the kernel, and a cgroup_skb program cannot read the
 * namespace cookie before 6.17. The socket-create, bind and iterator programs
 * run in this namespace only (cookie check) and give its sockets an owner
 * record; cgroup_skb acts only on sockets that have one.
 *
 * The rules are those of package policy (Decide); keep them in the same order.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "uapi.h" /* UAPI macros both planes use */

char LICENSE[] SEC("license") = "GPL";

/* Wire format of the identity stamp, version 2 (docs/userwall.md):
 *   IPv4 option  type 0x9e len 20 | ver meta uid(4) gid(4) mac(8)
 *   IPv6         destination-options header of 24 bytes holding option 0x1e
 *                len 20 with the same 20 bytes.
 * meta = key id (high 4 bits) | time window (low 4 bits). */
#define UW_STAMP_VER 2
#define UW_IPOPT_TYPE 0x9e
#define UW_IPOPT_LEN 20
#define UW_IP6OPT_TYPE 0x1e
#define UW_IP6OPT_LEN 20
#define UW_DSTOPT_LEN 24
#define UW_WINDOW_SHIFT 35 /* 2^35 ns ≈ 34 s */

/* Marks that the nft table turns into a TCP reset / ICMP admin-prohibited
 * (an enum, so that bpf2go gives the Go side the same numbers). */
enum uw_mark {
	UW_MARK_RST = 0x55424600,
	UW_MARK_ICMP = 0x55424601,
	/* A looped copy's sender token: tag in the high byte, token below. */
	UW_MARK_LOOP = 0x3a000000, /* bit 31 clear: lo tokens (UW_LO_TOKEN) have it */
	UW_MARK_LOOP_MASK = 0xff000000,
	UW_MARK_LOOP_TOKEN = 0x00ffffff,
};

#define MAX_GROUPS 128
#define PEER_TTL_S 120
/* Room the stamp takes (IPv4 option; IPv6 destination-options header). */
#define UW_ROOM4 UW_IPOPT_LEN
#define UW_ROOM6 UW_DSTOPT_LEN
/* Loopback tokens (skb->mark) carry the identity of what cannot be stamped
 * on lo: bit 31 is set in every token, never in the nft marks. */
#define UW_LO_TOKEN 0x80000000u
#define LO_IDS 8192
#define LO_ID_TTL_NS (10ULL * 1000000000ULL)
#define NPEERS 8
#define MAX_IFINDEX 16384

/* Rules; Go names them in userwall/rules.go (generated enum).
 * R_UNSTAMPED_FROM_CLUSTER: no valid identity from a source that is this
 * node, a cluster node or link-local, where a stamp should have been
 * (reported apart from off-cluster sources, which never have one).
 * R_UNSTAMPABLE: a user's datagram that could not carry a stamp to another
 * node (IP options, IPv6 extension headers), refused at send with EPERM. */
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
	R_UNVERIFIED = 12,
	R_UNCLASSIFIED = 13,
	R_COBIND = 14,
	R_FOREIGN_SOURCE = 15,
	R_UNSTAMPED_FROM_CLUSTER = 16,
	R_UNSTAMPABLE = 17,
	R_SITE_ALLOW = 18, /* a site rule ([[rule]]) decided */
	R_SITE_DENY = 19,
	R_USER_GRANT = 20, /* a user's grant (palisade share) on the listener's port */
	R_MAX = 21,
};

/* Where a decision was taken; counters are indexed path*R_MAX+rule. */
enum uw_path {
	P_LOCAL_TCP = 0,
	P_LOCAL_UDP = 1,
	P_REMOTE_TCP = 2,
	P_REMOTE_UDP = 3,
	P_UNIX = 4,
	P_LOCAL_OTHER = 5,
	P_REMOTE_OTHER = 6,
	P_BIND = 7,
	P_SOURCE = 8,
	P_MAX = 9,
};

/* What the stamp of a packet was worth. */
enum uw_stamp {
	S_NONE = 0,
	S_VALID = 1,
	S_BAD_MAC = 2,
	S_STALE = 3,
	S_UNKNOWN_KEY = 4,
	S_OLD_VERSION = 5,
	S_UNTRUSTED_SOURCE = 6,
};

struct uw_config {
	__u32 system_port_max;
	__u32 enabled;
	__u32 audit;   /* decide and report, never refuse */
	/* Allowed verdicts reported per second and CPU (the flows of
	 * `palisade flows`); the rest are only counted. 0: none. */
	__u32 allow_samples;
	__s64 clock_offset_ns; /* wall clock minus CLOCK_MONOTONIC, kept by the agent */
};

/* Slots of event_stats: what became of the reports and allowed samples. */
enum uw_estat {
	E_LOST = 0,      /* a report the ring buffer had no room for */
	E_SAMPLED = 1,   /* an allowed verdict reported */
	E_UNSAMPLED = 2, /* an allowed verdict over the second's budget */
	E_MAX = 4,
};

/* A cluster key: slot 0 stamps, slots 0 and 1 verify (rotation). */
struct uw_key {
	__u64 k0, k1;
	__u32 id;
	__u32 valid;
};

struct uw_lpm_key {
	__u32 prefixlen;
	__u8 addr[16]; /* IPv6, or IPv4-mapped IPv6 */
};

struct uw_owner {
	__u32 uid;
	__u32 gid;
	__u32 set;
	__u32 pad;
};

struct uw_member_key {
	__u32 uid;
	__u32 gid;
};

/* The peers a datagram socket sent to lately: their answers are replies. */
struct uw_peer {
	__u8 addr[16];
	__u16 port;
	__u16 pad;
	__u32 t; /* seconds of the program clock (now_s) */
};

struct uw_peers {
	struct uw_peer p[NPEERS];
	__u32 next;
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
	__u8 proto;   /* IP protocol, or 1 for unix */
	__u8 family;  /* 4, 6, 1 */
	__u8 rule;
	__u8 path;
	__u8 has_connector; /* 0: connector identity unknown */
	__u8 audit;         /* 1: refused in audit mode (let through) */
	__u8 stamp;         /* enum uw_stamp */
	__u8 polite;        /* 1: tc ingress (refused before the stack) */
	__u8 claim;         /* 1: allowed on the connector's carried gid alone, its
			     * groups not yet known here: the agent looks them up */
	char comm[16];
};

/* Set at load time: the namespace this copy enforces. */
volatile const __u64 netns_cookie = 0;
/* Set by the differential test only: socket facts come from test_sock. */
volatile const __u32 test_mode = 0;
/* How long a datagram socket's peer may answer after the socket last sent
 * to it (seconds); tests shorten it (PALISADE_TEST_UDP_PEER_TTL). */
volatile const __u32 peer_ttl_s = PEER_TTL_S;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_config);
} settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct uw_key);
} keys SEC(".maps");

/* L2 header length + 1 of each interface the agent manages (0: not ours). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_IFINDEX);
	__type(key, __u32);
	__type(value, __u8);
} ifaces SEC(".maps");

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

/* Cluster nodes not yet enforcing (staged rollout): their identity-less
 * traffic is admitted as "unverified" and reported. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__type(key, struct uw_lpm_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} unenforced_nets SEC(".maps");

/* Device MTU of each managed interface (0: not known), and this node's
 * IPv4 broadcast addresses: a datagram to a destination whose route keeps
 * the device's MTU (broadcast, multicast, IPv6 link-local) has no room for
 * the stamp near that MTU, and is refused at send (no_room, unstampable). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_IFINDEX);
	__type(key, __u32);
	__type(value, __u32);
} if_mtu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} bcast_addrs SEC(".maps");

/* The node's unicast addresses as a list (local_addrs is a trie, which a
 * program cannot walk): a user's wildcard bind is checked against another
 * user's socket on each of them (bind_check). n == 0: not written yet. */
#define MAX_NODE_ADDRS 128
struct uw_node_addrs {
	__u32 n;
	__u32 _pad;
	__u8 addr[MAX_NODE_ADDRS][16]; /* IPv6, or IPv4-mapped IPv6 */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_node_addrs);
} node_addrs SEC(".maps");

/* Bitmap of the ports off-cluster sources may reach: bit p%64 of word p/64. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} offc_ports SEC(".maps");

/* (uid, gid) present when uid is a member of gid (group rule). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__type(key, struct uw_member_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} members SEC(".maps");

/* Users whose every group is in members (see known_user). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} known_users SEC(".maps");

/* Owner (creator's uid/gid) of each inet socket of this namespace. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct uw_owner);
} sk_owners SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct uw_peers);
} udp_peers SEC(".maps");

/* Sockets without an owner record that are not decided here, found so at
 * their first packet (adopt_at_delivery): another namespace's, and this
 * namespace's kernel and system sockets (an exempt owner). Their packets
 * cost one lookup here, not two reads of kernel memory. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
} sk_foreign SEC(".maps");

/* The sender of a node's own looped multicast/broadcast copies, known from
 * the sending socket: its copies carry no stamp (the kernel clones them
 * before tc egress) and, for IPv4, see no cgroup egress program either (the
 * clone has no socket). So each user datagram socket gets, at creation, a
 * token — the low 24 bits of its cookie — as its socket mark, which the
 * kernel copies into every packet it sends, looped copies included; this map
 * holds the token's socket and owner from creation to release (exact: no
 * stale entry can stand for another socket). A token a live socket already
 * holds (2^24 sockets apart) leaves the new socket without one: its looped
 * copies are unattributed, refused at user sockets, never credited to
 * someone else. Users cannot set a socket mark (CAP_NET_ADMIN). */
struct uw_loop {
	__u64 cookie;
	__u32 uid;
	__u32 gid;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__type(key, __u32);
	__type(value, struct uw_loop);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} loop_senders SEC(".maps");

/*
 * Loopback datagrams that cannot carry a stamp (larger than an skb may grow
 * to, ~16 KB, or with IP options / extension headers): tc egress on lo, which
 * knows the sending socket, records its identity under a token it puts in
 * skb->mark (users cannot set marks: CAP_NET_ADMIN/NET_RAW), and the checks
 * on the receiving side take it back, bound to the packet's addresses, ports
 * and protocol. A token is the CPU (7 bits) and that CPU's count (24 bits):
 * unique among the packets in flight; the LRU forgets the oldest.
 */
struct uw_lo_id {
	__u8 src[16], dst[16];
	__u16 sport, dport;
	__u8 proto;
	__u8 pad[3];
	__u32 uid, gid;
	__u32 mark; /* the packet's mark before the token */
	__u64 t;    /* now_ns() at send */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, LO_IDS);
	__type(key, __u32);
	__type(value, struct uw_lo_id);
} lo_ids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} lo_seq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, P_MAX * R_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Refusals that audit mode let through, indexed as counters: kept apart so
 * that metrics never count a would-be refusal as a refusal. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, P_MAX * R_MAX);
	__type(key, __u32);
	__type(value, __u64);
} audit_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, E_MAX);
	__type(key, __u32);
	__type(value, __u64);
} event_stats SEC(".maps");

/* This CPU's budget of allowed samples: the second it counts, and how many
 * were reported in it. */
struct uw_budget {
	__u64 sec;
	__u64 n;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_budget);
} flow_budget SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

#define PACKET_LOOPBACK 5

/* User grants (`palisade share`, grants.go): per listener owner and TCP
 * port, the users and groups it opened the port to, each until a wall-clock
 * time. Keyed on the owner: a grant never applies to another user's socket
 * on the same port. An empty slot has expires_ns 0 (long past). */
#define GRANT_SLOTS 8
struct uw_grant_key {
	__u32 luid;
	__u32 port;
};

struct uw_grant_slot {
	__s64 expires_ns; /* wall clock (CLOCK_REALTIME) */
	__u32 id;         /* uid, or gid when group */
	__u32 group;
};

struct uw_grants {
	struct uw_grant_slot s[GRANT_SLOTS];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct uw_grant_key);
	__type(value, struct uw_grants);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} grants SEC(".maps");

/* Differential test only (test_mode): the receiving socket's facts. */
struct uw_test_sock {
	__u32 uid, gid;
	__u32 tcp_listener; /* 1: a TCP listener, 0: a datagram socket */
	__u32 has_peer;
	__u8 peer[16];
	__u16 peer_port;
	__u16 pad;
	__u32 pad2;
	__s64 now_ns; /* the program clock to use (now_ns) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_test_sock);
} test_sock SEC(".maps");

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

/* Force BTF for the types Go decodes or generates. */
const struct uw_event *unused_event __attribute__((unused));
const struct uw_test_sock *unused_test_sock __attribute__((unused));
const enum uw_rule *unused_rule __attribute__((unused));
const enum uw_path *unused_path __attribute__((unused));
const enum uw_stamp *unused_stamp __attribute__((unused));
const enum uw_mark *unused_mark __attribute__((unused));
const enum uw_estat *unused_estat __attribute__((unused));

/* ---------------------------------------------------------------------------
 * Shared pieces.
 */

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
	return rule != R_DENIED && rule != R_OFFCLUSTER_DENIED && rule != R_UNCLASSIFIED &&
	       rule != R_COBIND && rule != R_FOREIGN_SOURCE && rule != R_UNSTAMPED_FROM_CLUSTER && rule != R_UNSTAMPABLE &&
	       rule != R_SITE_DENY;
}

static __always_inline void estat(__u32 k)
{
	__u64 *v = bpf_map_lookup_elem(&event_stats, &k);
	if (v)
		*v += 1;
}

/* count, except that a refusal audit mode lets through goes to
 * audit_counters. */
static __always_inline void tally(const struct uw_config *c, __u32 path, __u32 rule)
{
	if (!c->audit || allows(rule)) {
		count(path, rule);
		return;
	}
	__u32 k = path * R_MAX + rule;
	__u64 *v = bpf_map_lookup_elem(&audit_counters, &k);
	if (v)
		*v += 1;
}

static __always_inline int lpm_has(void *map, const __u8 *addr)
{
	struct uw_lpm_key k = {.prefixlen = 128};
	__builtin_memcpy(k.addr, addr, 16);
	return bpf_map_lookup_elem(map, &k) != 0;
}

static __always_inline void map4(__u8 *dst, __u32 addr)
{
	__builtin_memset(dst, 0, 10);
	dst[10] = 0xff;
	dst[11] = 0xff;
	__builtin_memcpy(&dst[12], &addr, 4);
}

static __always_inline int addr_eq(const __u8 *a, const __u8 *b)
{
	__u64 a0, a1, b0, b1;
	__builtin_memcpy(&a0, a, 8);
	__builtin_memcpy(&a1, a + 8, 8);
	__builtin_memcpy(&b0, b, 8);
	__builtin_memcpy(&b1, b + 8, 8);
	return a0 == b0 && a1 == b1;
}

static __always_inline int is_v4mapped(const __u8 *a)
{
	__u64 w0;
	__u32 w1;
	__builtin_memcpy(&w0, a, 8);
	__builtin_memcpy(&w1, &a[8], 4);
	return w0 == 0 && w1 == bpf_htonl(0x0000ffff);
}

/* Link-local unicast: fe80::/10 and 169.254/16. */
static __always_inline int link_local(const __u8 *a)
{
	if (is_v4mapped(a))
		return a[12] == 169 && a[13] == 254;
	return a[0] == 0xfe && (a[1] & 0xc0) == 0x80;
}

/* Multicast, or the IPv4 limited broadcast. */
static __always_inline int group_addr(const __u8 *a)
{
	if (is_v4mapped(a))
		return (a[12] & 0xf0) == 0xe0 || (a[12] == 255 && a[13] == 255 && a[14] == 255 && a[15] == 255);
	return a[0] == 0xff;
}

/* A source no cluster node (nor this node) uses: its datagrams never carry
 * a stamp, so identity-less is all they can be. */
static __always_inline int offcluster_src(const __u8 *a)
{
	return !lpm_has(&cluster_nets, a) && !lpm_has(&local_addrs, a) && !link_local(a);
}

static __always_inline int offcluster_port(__u16 port)
{
	__u32 w = port / 64;
	__u64 *bits = bpf_map_lookup_elem(&offc_ports, &w);
	return bits && (*bits >> (port % 64)) & 1;
}

static __always_inline int port_proto(__u8 p)
{
	return p == IPPROTO_TCP || p == IPPROTO_UDP || p == IPPROTO_UDPLITE || p == IPPROTO_SCTP ||
	       p == IPPROTO_DCCP;
}

static __always_inline int dgram_proto(__u8 p)
{
	return p == IPPROTO_UDP || p == IPPROTO_UDPLITE;
}

static __always_inline int member(__u32 uid, __u32 gid)
{
	struct uw_member_key mk = {.uid = uid, .gid = gid};
	return bpf_map_lookup_elem(&members, &mk) != 0;
}

/*
 * The policy core's order (policy.Decide) for a non-system port from a trusted
 * identity: same user, shared group, exempt connector, exempt listener.
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

/* Is every group of uid (its initgroups) in members? The agent keeps it so
 * for the node's own users and for connectors it has seen. */
static __always_inline int known_user(__u32 uid)
{
	return bpf_map_lookup_elem(&known_users, &uid) != 0;
}

/* ---------------------------------------------------------------------------
 * Site rules ([[rule]], policy.SiteRule), compiled by the agent (sitemaps.go)
 * into bitmaps with one bit per rule, in rule order. The rules a connection
 * matches are the AND of one mask per dimension (port, protocol, source,
 * connector, listener, relation, node); the lowest set bit decides. Per
 * packet: at most 9 map lookups and SITE_WORDS words of ANDs whatever the
 * number of rules (up to SITE_WORDS*64 = policy.MaxSiteRules).
 */
#define SITE_WORDS 16

struct uw_mask {
	__u64 w[SITE_WORDS];
};

/* Fixed masks (site_masks); SM_ZERO stays all zero (a missing lookup). */
enum uw_site_mask {
	SM_ZERO = 0,
	SM_HERE = 1,      /* rules that apply on this node (on_nodes) */
	SM_ANYNODE = 2,   /* rules without on_nodes (the UDP reply's reverse check) */
	SM_ALLOW = 3,     /* the rule allows (else it denies) */
	SM_ANY_FROM = 4,  /* no connector users/groups */
	SM_ANY_TO = 5,    /* no listener users/groups */
	SM_ANY_SRC = 6,   /* no sources: any trusted source */
	SM_UNTRUSTED = 7, /* may match an untrusted source: names sources, no identity asked */
	SM_TCP = 8,       /* proto tcp or any */
	SM_UDP = 9,       /* proto udp or any */
	SM_OTHER = 10,    /* proto any (UDP-Lite, SCTP, DCCP) */
	SM_NOREL = 11,    /* no relation */
	SM_SAMEUSER = 12, /* relation same-user */
	SM_SHARED = 13,   /* relation shared-group */
	SM_MAX = 14,
};
const enum uw_site_mask *unused_site_mask __attribute__((unused));

struct uw_site {
	__u32 n;        /* number of site rules; 0: none, nothing to look up */
	__u32 updating; /* the agent rewrites the masks: refuse (fail closed) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_site);
} site_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, SM_MAX);
	__type(key, __u32);
	__type(value, struct uw_mask);
} site_masks SEC(".maps");

/* Rules naming a uid (as a user, or through a group it is a member of) and
 * rules naming a gid (the effective/socket gid): connector and listener. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct uw_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} site_cuid SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct uw_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} site_cgid SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct uw_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} site_luid SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct uw_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} site_lgid SEC(".maps");

/* Source prefixes: each entry holds every rule whose sources contain it. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__type(key, struct uw_lpm_key);
	__type(value, struct uw_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} site_src SEC(".maps");

/* Ports in classes (intervals no rule's range boundary cuts), then a mask
 * per class: two lookups for any number of port ranges. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} site_port_class SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * SITE_WORDS * 64 + 2);
	__type(key, __u32);
	__type(value, struct uw_mask);
} site_port_mask SEC(".maps");

static __always_inline const struct uw_mask *site_fixed(__u32 i)
{
	return bpf_map_lookup_elem(&site_masks, &i);
}

static __always_inline const struct uw_mask *or_zero(const struct uw_mask *m, const struct uw_mask *zero)
{
	return m ? m : zero;
}

/* A site rule query (site_decide's argument: a global function takes at
 * most five, and a pointer to memory of a fixed size). */
struct uw_site_q {
	__u32 cuid, cgid, luid, lgid;
	__u8 src[16];
	__u32 port;
	__u32 proto;
	__u32 trusted; /* the connector's identity is proven */
	__u32 here;    /* the listener is on this node */
};

/*
 * site_decide: the first site rule matching the connection (policy.SiteRule
 * Matches, in order), as R_SITE_ALLOW / R_SITE_DENY, or R_NONE. Untrusted:
 * only rules naming the source and asking nothing of the identity can match.
 * Not here (the UDP reply's reverse check): only rules without on_nodes.
 * A global function: the verifier checks it once, not once per path of its
 * callers (inlined, it made uw_tc_ingress exceed the verifier's budget).
 */
__noinline __u32 site_decide(const struct uw_site_q *q)
{
	__u32 z = 0;
	if (!q)
		return R_NONE;
	struct uw_site *cfg = bpf_map_lookup_elem(&site_cfg, &z);
	if (!cfg || !cfg->n)
		return R_NONE;
	if (cfg->updating)
		return R_SITE_DENY;
	int trusted = q->trusted != 0;
	__u32 cuid = q->cuid, cgid = q->cgid, luid = q->luid, lgid = q->lgid;
	const struct uw_mask *zero = site_fixed(SM_ZERO);
	const struct uw_mask *node = site_fixed(q->here ? SM_HERE : SM_ANYNODE);
	const struct uw_mask *allow = site_fixed(SM_ALLOW);
	const struct uw_mask *anyfrom = site_fixed(SM_ANY_FROM);
	const struct uw_mask *anyto = site_fixed(SM_ANY_TO);
	const struct uw_mask *anysrc = site_fixed(trusted ? SM_ANY_SRC : SM_ZERO);
	const struct uw_mask *who = site_fixed(trusted ? SM_NOREL : SM_UNTRUSTED);
	__u32 pk = q->proto == IPPROTO_TCP ? SM_TCP : q->proto == IPPROTO_UDP ? SM_UDP : SM_OTHER;
	const struct uw_mask *pmask = site_fixed(pk);
	const struct uw_mask *rel = site_fixed(trusted && cuid == luid ? SM_SAMEUSER : SM_ZERO);
	/* As decide_ids: the carried effective gid counts only while this
	 * node does not know the connector's groups. */
	int known = trusted && known_user(cuid);
	int shared = trusted && lgid != (__u32)-1 && (member(cuid, lgid) || (cgid == lgid && !known));
	const struct uw_mask *shr = site_fixed(shared ? SM_SHARED : SM_ZERO);
	if (!zero || !node || !allow || !anyfrom || !anyto || !anysrc || !who || !pmask || !rel || !shr)
		return R_NONE;
	__u32 pi = q->port & 0xffff;
	__u32 *cls = bpf_map_lookup_elem(&site_port_class, &pi);
	const struct uw_mask *ports = zero;
	if (cls)
		ports = or_zero(bpf_map_lookup_elem(&site_port_mask, cls), zero);
	struct uw_lpm_key k = {.prefixlen = 128};
	__builtin_memcpy(k.addr, q->src, 16);
	const struct uw_mask *srcm = or_zero(bpf_map_lookup_elem(&site_src, &k), zero);
	const struct uw_mask *cu = zero, *cg = zero;
	if (trusted) {
		cu = or_zero(bpf_map_lookup_elem(&site_cuid, &cuid), zero);
		if (!known)
			cg = or_zero(bpf_map_lookup_elem(&site_cgid, &cgid), zero);
	}
	const struct uw_mask *lu = or_zero(bpf_map_lookup_elem(&site_luid, &luid), zero);
	const struct uw_mask *lg = or_zero(bpf_map_lookup_elem(&site_lgid, &lgid), zero);
	for (int i = 0; i < SITE_WORDS; i++) {
		__u64 m = node->w[i] & ports->w[i] & pmask->w[i] & (anysrc->w[i] | srcm->w[i]) &
			  (anyfrom->w[i] | cu->w[i] | cg->w[i]) & (anyto->w[i] | lu->w[i] | lg->w[i]);
		/* Trusted: no relation, or the relation holds. Untrusted: the
		 * rule asks nothing of the identity (SM_UNTRUSTED), and the
		 * source masks alone decide (anysrc is zero). */
		m &= who->w[i] | rel->w[i] | shr->w[i];
		if (m) {
			__u64 bit = m & -m;
			return (allow->w[i] & bit) ? R_SITE_ALLOW : R_SITE_DENY;
		}
	}
	return R_NONE;
}

static __always_inline __u32 site_query(__u32 cuid, __u32 cgid, __u32 luid, __u32 lgid, const __u8 *src, __u16 port,
					__u8 proto, int trusted, int here)
{
	struct uw_site_q q = {.cuid = cuid, .cgid = cgid, .luid = luid, .lgid = lgid, .port = port, .proto = proto,
			      .trusted = trusted, .here = here};
	__builtin_memcpy(q.src, src, 16);
	return site_decide(&q);
}

/* Remote group test: membership as this node knows it now. The connector's
 * carried effective gid is a claim: it counts only while this node does not
 * know the connector's groups (the first connections of a user whose primary
 * group is the listener's, which no member list names); once known, a user
 * removed from the group is refused however old his process (revocation
 * within group_refresh plus the directory cache). */
static __always_inline __u32 decide_ids(__u32 cuid, __u32 cgid, __u32 luid, __u32 lgid)
{
	int group_ok = cuid != luid && lgid != (__u32)-1 &&
		       (member(cuid, lgid) || (cgid == lgid && !known_user(cuid)));
	return decide_user(cuid, luid, group_ok);
}

static __always_inline void emit(struct uw_event *tmpl)
{
	struct uw_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		estat(E_LOST);
		return;
	}
	__builtin_memcpy(e, tmpl, sizeof(*e));
	e->ts = bpf_ktime_get_ns();
	bpf_ringbuf_submit(e, 0);
}

/* ---------------------------------------------------------------------------
 * SipHash-2-4 over 64-bit words (the message is 8*n bytes, little-endian
 * words); userwall/stamp.go is the Go twin, checked against each other.
 */
#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                   \
	do {                                                                                       \
		v0 += v1;                                                                          \
		v1 = ROTL(v1, 13);                                                                 \
		v1 ^= v0;                                                                          \
		v0 = ROTL(v0, 32);                                                                 \
		v2 += v3;                                                                          \
		v3 = ROTL(v3, 16);                                                                 \
		v3 ^= v2;                                                                          \
		v0 += v3;                                                                          \
		v3 = ROTL(v3, 21);                                                                 \
		v3 ^= v0;                                                                          \
		v2 += v1;                                                                          \
		v1 = ROTL(v1, 17);                                                                 \
		v1 ^= v2;                                                                          \
		v2 = ROTL(v2, 32);                                                                 \
	} while (0)

#define MAC_WORDS 7

static __always_inline __u64 siphash(const struct uw_key *k, const __u64 *m)
{
	__u64 v0 = 0x736f6d6570736575ULL ^ k->k0;
	__u64 v1 = 0x646f72616e646f6dULL ^ k->k1;
	__u64 v2 = 0x6c7967656e657261ULL ^ k->k0;
	__u64 v3 = 0x7465646279746573ULL ^ k->k1;
#pragma unroll
	for (int i = 0; i < MAC_WORDS; i++) {
		v3 ^= m[i];
		SIPROUND;
		SIPROUND;
		v0 ^= m[i];
	}
	__u64 b = ((__u64)(MAC_WORDS * 8)) << 56;
	v3 ^= b;
	SIPROUND;
	SIPROUND;
	v0 ^= b;
	v2 ^= 0xff;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

/* The parsed facts of one IP packet. */
struct pkt {
	__u8 src[16], dst[16]; /* IPv4 as v4-mapped IPv6 */
	__u16 sport, dport;
	__u8 proto;
	__u8 v4;
	__u8 flags;     /* TCP flags */
	__u8 has_stamp; /* a v2 stamp is present (not yet verified) */
	__u8 old_stamp; /* a stamp of another version */
	__u8 ver, meta;
	__u8 frag;      /* the first fragment of a fragmented datagram */
	__u32 uid, gid;
	__u64 tag;
	__u32 l4off; /* from the network header */
	__u32 iphl;  /* IPv4 header length, or 40 + extension headers */
};

static __always_inline void mac_msg(const struct pkt *p, __u64 window, __u64 *m)
{
	m[0] = (window << 32) | ((__u64)p->ver << 24) | ((__u64)p->meta << 16) | ((__u64)p->proto << 8);
	m[1] = ((__u64)p->uid << 32) | p->gid;
	m[2] = ((__u64)p->sport << 16) | p->dport;
	__builtin_memcpy(&m[3], p->src, 16);
	__builtin_memcpy(&m[5], p->dst, 16);
}

/*
 * The programs' clock: CLOCK_MONOTONIC at tick resolution. The coarse read
 * is a few ns; the precise boot clock cost 40–80 ns per call in real
 * traffic, several times per datagram. A tick (≤ 4 ms) is nothing against
 * a 34 s stamp window or a 120 s peer lifetime; unlike the boot clock it
 * stops during a suspend, which the agent's offset (REALTIME − MONOTONIC,
 * refreshed) absorbs for stamps, and which lengthens a peer's lifetime by
 * the time suspended.
 */
static __always_inline __u64 now_ns(void)
{
	return bpf_ktime_get_coarse_ns();
}

static __always_inline __s64 wall_ns(const struct uw_config *c)
{
	if (test_mode) {
		__u32 z = 0;
		struct uw_test_sock *t = bpf_map_lookup_elem(&test_sock, &z);
		return t ? t->now_ns + c->clock_offset_ns : 0;
	}
	return (__s64)now_ns() + c->clock_offset_ns;
}

/* Differential test only: the sending socket's owner (test_sock). */
static __always_inline struct uw_owner *test_owner(struct uw_owner *o)
{
	__u32 z = 0;
	struct uw_test_sock *t = bpf_map_lookup_elem(&test_sock, &z);
	if (!t)
		return 0;
	o->uid = t->uid;
	o->gid = t->gid;
	o->set = 1;
	o->pad = 0;
	return o;
}

/*
 * grant_decide: does a grant of the listener's owner on this TCP port admit
 * the connector (policy.Decide's user-grant)? A group grant admits a member
 * as the shared-group rule does (membership, or the carried gid while this
 * node does not know the connector). Expired slots are skipped here, not
 * only removed by the agent: a stalled agent never extends a grant. One
 * lookup and at most GRANT_SLOTS slots (each at most two lookups), only for
 * a connection every other rule refused. A global function: verified once.
 */
__noinline __u32 grant_decide(__u32 cuid, __u32 cgid, __u32 luid, __u32 port)
{
	__u32 z = 0;
	struct uw_config *c = bpf_map_lookup_elem(&settings, &z);
	struct uw_grant_key k = {.luid = luid, .port = port & 0xffff};
	struct uw_grants *g = bpf_map_lookup_elem(&grants, &k);
	if (!c || !g)
		return 0;
	__s64 now = wall_ns(c);
	int known = known_user(cuid);
	for (int i = 0; i < GRANT_SLOTS; i++) {
		struct uw_grant_slot *s = &g->s[i];
		if (s->expires_ns <= now)
			continue;
		if (!s->group ? s->id == cuid : (member(cuid, s->id) || (cgid == s->id && !known)))
			return 1;
	}
	return 0;
}

/* stamp_key: the key a stamp names and the window it was sealed in, or why
 * not (S_NONE when they are usable). Cheap: no MAC. */
static __always_inline __u8 stamp_key(const struct uw_config *c, struct pkt *p, struct uw_key **kp,
				      __u64 *wp)
{
	if (!p->has_stamp)
		return p->old_stamp ? S_OLD_VERSION : S_NONE;
	__u32 slot = 0;
	struct uw_key *k = bpf_map_lookup_elem(&keys, &slot);
	if (!k || !k->valid || k->id != (p->meta >> 4)) {
		slot = 1;
		k = bpf_map_lookup_elem(&keys, &slot);
		if (!k || !k->valid || k->id != (p->meta >> 4))
			return S_UNKNOWN_KEY;
	}
	__u64 now = (__u64)wall_ns(c) >> UW_WINDOW_SHIFT;
	int found = 0;
	for (int d = -1; d <= 1; d++) {
		__u64 cand = now + d;
		if ((cand & 0xf) == (p->meta & 0xf)) {
			*wp = cand;
			found = 1;
		}
	}
	if (!found)
		return S_STALE;
	*kp = k;
	return S_NONE;
}

/* verify: S_VALID and p->uid/gid trusted, or why not. */
static __always_inline __u8 verify(const struct uw_config *c, struct pkt *p)
{
	struct uw_key *k = 0;
	__u64 w = 0;
	__u8 st = stamp_key(c, p, &k, &w);
	if (st != S_NONE || !k)
		return p->has_stamp ? st : (p->old_stamp ? S_OLD_VERSION : S_NONE);
	__u64 m[MAC_WORDS];
	mac_msg(p, w, m);
	if (siphash(k, m) != p->tag)
		return S_BAD_MAC;
	return S_VALID;
}

/* read_stamp: the 18 bytes common to both carriers (ver, meta, uid, gid,
 * tag), at b. */
static __always_inline void read_stamp(struct pkt *p, const __u8 *b)
{
	__u32 u, g;
	p->has_stamp = 1;
	p->ver = b[0];
	p->meta = b[1];
	__builtin_memcpy(&u, &b[2], 4);
	__builtin_memcpy(&g, &b[6], 4);
	p->uid = bpf_ntohl(u);
	p->gid = bpf_ntohl(g);
	__builtin_memcpy(&p->tag, &b[10], 8);
}

/*
 * ld: the n bytes at offset off of the packet into dst (4-aligned when n is
 * a multiple of 4), 0 on success: what bpf_skb_load_bytes copies, read in
 * place when they are in the linear area (every header a node builds, and
 * nearly every one it receives). In real traffic a helper call, cold and
 * behind a return thunk, costs more than the rest of a fast path.
 */
static __always_inline int ld(struct __sk_buff *skb, __u32 off, void *dst, __u32 n)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	if (off < 1024) {
		__u32 o = off;
		asm volatile("" : "+r"(o)); /* 6.1's verifier: see needs_look */
		o &= 0x3ff;
		__u8 *src = data + o;
		if ((void *)(src + n) <= end) {
			if (n % 4 == 0) {
#pragma unroll
				for (__u32 i = 0; i < n / 4; i++)
					((__u32 *)dst)[i] = ((__u32 *)src)[i];
			} else if (n % 2 == 0) {
#pragma unroll
				for (__u32 i = 0; i < n / 2; i++)
					((__u16 *)dst)[i] = ((__u16 *)src)[i];
			} else {
#pragma unroll
				for (__u32 i = 0; i < n; i++)
					((__u8 *)dst)[i] = src[i];
			}
			return 0;
		}
	}
	return bpf_skb_load_bytes(skb, off, dst, n);
}

/*
 * parse: the IP packet at offset l3 of the skb (tc: after the L2 header;
 * cgroup_skb: 0). Header bytes are read with ld (in place, or with
 * bpf_skb_load_bytes) so that the same code serves every hook and
 * BPF_PROG_TEST_RUN. Returns 0 if the packet is not IPv4/IPv6 or its
 * headers cannot be read.
 */
static __always_inline int parse(struct __sk_buff *skb, __u32 l3, struct pkt *p)
{
	__builtin_memset(p, 0, sizeof(*p));
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		if (ld(skb, l3, &ip, sizeof(ip)))
			return 0;
		p->v4 = 1;
		p->proto = ip.protocol;
		map4(p->src, ip.saddr);
		map4(p->dst, ip.daddr);
		p->iphl = ip.ihl * 4;
		p->l4off = p->iphl;
		if (ip.frag_off & bpf_htons(0x1fff))
			return 1; /* a later fragment: no ports */
		p->frag = (ip.frag_off & bpf_htons(0x2000)) != 0;
		if (ip.ihl >= 5 + UW_IPOPT_LEN / 4) {
			__u8 o[UW_IPOPT_LEN] __attribute__((aligned(4)));
			if (!ld(skb, l3 + 20, o, sizeof(o)) && o[0] == UW_IPOPT_TYPE) {
				if (o[1] == UW_IPOPT_LEN && o[2] == UW_STAMP_VER) {
					read_stamp(p, &o[2]);
				} else {
					p->old_stamp = 1;
				}
			}
		} else if (ip.ihl >= 8) {
			__u8 o[2] __attribute__((aligned(2)));
			if (!ld(skb, l3 + 20, o, sizeof(o)) && o[0] == UW_IPOPT_TYPE)
				p->old_stamp = 1;
		}
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		if (ld(skb, l3, &ip6, sizeof(ip6)))
			return 0;
		__builtin_memcpy(p->src, &ip6.saddr, 16);
		__builtin_memcpy(p->dst, &ip6.daddr, 16);
		__u8 nh = ip6.nexthdr;
		__u32 off = sizeof(ip6);
		for (int i = 0; i < 6; i++) {
			if (nh != 0 && nh != 43 && nh != 44 && nh != IPPROTO_DSTOPTS)
				break;
			if (nh == 44) { /* fragment */
				__u8 f[4] __attribute__((aligned(4)));
				if (ld(skb, l3 + off, f, sizeof(f)))
					return 0;
				nh = f[0];
				off += 8;
				if (((f[2] << 8) | f[3]) & 0xfff8) {
					p->proto = nh;
					p->iphl = off;
					p->l4off = off;
					return 1; /* a later fragment: no ports */
				}
				p->frag = 1;
				continue;
			}
			__u8 h[2] __attribute__((aligned(2)));
			if (ld(skb, l3 + off, h, sizeof(h)))
				return 0;
			if (i == 0 && nh == IPPROTO_DSTOPTS && h[1] == 2) {
				__u8 o[UW_DSTOPT_LEN] __attribute__((aligned(4)));
				if (!ld(skb, l3 + off, o, sizeof(o)) && o[2] == UW_IP6OPT_TYPE) {
					if (o[3] == UW_IP6OPT_LEN && o[4] == UW_STAMP_VER) {
						read_stamp(p, &o[4]);
					} else {
						p->old_stamp = 1;
					}
				}
			} else if (i == 0 && nh == IPPROTO_DSTOPTS) {
				__u8 o[4] __attribute__((aligned(4)));
				if (!ld(skb, l3 + off, o, sizeof(o)) && o[2] == UW_IP6OPT_TYPE)
					p->old_stamp = 1;
			}
			nh = h[0];
			off += (h[1] + 1) * 8;
		}
		p->proto = nh;
		p->iphl = off;
		p->l4off = off;
	} else {
		return 0;
	}
	if (port_proto(p->proto)) {
		__be16 ports[2] __attribute__((aligned(4)));
		if (ld(skb, l3 + p->l4off, ports, sizeof(ports)))
			return 0;
		p->sport = bpf_ntohs(ports[0]);
		p->dport = bpf_ntohs(ports[1]);
		if (p->proto == IPPROTO_TCP) {
			__u8 fl;
			if (ld(skb, l3 + p->l4off + 13, &fl, 1))
				return 0;
			p->flags = fl;
		}
	}
	return 1;
}

/* A pure SYN (no ACK) opens a TCP connection. */
#define TCP_SYN_ONLY(fl) (((fl) & 0x12) == 0x02)

/* ---------------------------------------------------------------------------
 * Socket owners: who created (or, for kernel sockets, bound) each socket of
 * this namespace, with the ids of that moment (what sg/newgrp set).
 */

/*
 * task_owner: THE identity of the current task, the one place it is decided
 * (docs/userwall.md, "Identity"). It is what the kernel acts with: the
 * filesystem ids, which the kernel records as a new socket's owner (sk_uid,
 * the socket inode's i_uid) and checks file access with — the effective ids
 * unless setfsuid() moved them. Never the real uid: a root daemon acting for
 * a user after seteuid() (slurmstepd opening a step's I/O connection, sshd's
 * privilege-separated children) is that user.
 *
 * Exemption is all-or-nothing: when the fs uid is an exempt connector (root,
 * a service) but another uid of the task (real, effective, saved) is not, the
 * task is that user — a set-uid-root program run by bob, or a daemon half-way
 * through dropping privileges, is bob, never root.
 */
static __always_inline void cred_owner(const struct cred *cr, struct uw_owner *o)
{
	__u32 uid = cr->fsuid.val, gid = cr->fsgid.val;
	if (bpf_map_lookup_elem(&exempt_conn, &uid)) {
		__u32 ruid = cr->uid.val, euid = cr->euid.val,
		      suid = cr->suid.val;
		if (!bpf_map_lookup_elem(&exempt_conn, &ruid)) {
			uid = ruid;
			gid = cr->gid.val;
		} else if (!bpf_map_lookup_elem(&exempt_conn, &euid)) {
			uid = euid;
			gid = cr->egid.val;
		} else if (!bpf_map_lookup_elem(&exempt_conn, &suid)) {
			uid = suid;
			gid = cr->sgid.val;
		}
	}
	o->uid = uid;
	o->gid = gid;
	o->set = 1;
	o->pad = 0;
}

/* The current task's credentials by task_owner's rule (cred_owner: the same
 * rule for the credentials a TCP socket's file keeps, tcp_owner). */
static __always_inline void task_owner(struct uw_owner *o)
{
	struct task_struct *t = bpf_get_current_task_btf();
	cred_owner(t->cred, o);
}

SEC("cgroup/sock_create")
int uw_sock_create(struct bpf_sock *ctx)
{
	/* A TCP socket gets no record: its owner is read at its SYN from the
	 * credentials its file keeps (tcp_owner). Allocating the storage was
	 * most of a connection's eBPF time. */
	if (ctx->type == SOCK_STREAM && ctx->protocol == IPPROTO_TCP)
		return 1;
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_owner init;
	task_owner(&init);
	struct uw_owner *o = bpf_sk_storage_get(&sk_owners, ctx, &init, BPF_SK_STORAGE_GET_F_CREATE);
	/* A user socket without an owner record would escape the check at
	 * delivery: refuse it (fail closed) rather than let it be created. */
	if (!o && init.uid != 0)
		return 0;
	if (ctx->type == SOCK_DGRAM && dgram_proto(ctx->protocol) && ctx->mark == 0) {
		/* The looped-copy token (loop_senders). */
		__u64 ck = bpf_get_socket_cookie(ctx);
		__u32 tok = ck & UW_MARK_LOOP_TOKEN;
		struct uw_loop v = {.cookie = ck, .uid = init.uid, .gid = init.gid};
		if (!bpf_map_update_elem(&loop_senders, &tok, &v, BPF_NOEXIST))
			ctx->mark = UW_MARK_LOOP | tok;
	}
	return 1;
}

/* A datagram socket's token dies with it (only its own entry is deleted). */
SEC("cgroup/sock_release")
int uw_sock_release(struct bpf_sock *ctx)
{
	if ((ctx->mark & UW_MARK_LOOP_MASK) != UW_MARK_LOOP)
		return 1;
	__u32 tok = ctx->mark & UW_MARK_LOOP_TOKEN;
	struct uw_loop *e = bpf_map_lookup_elem(&loop_senders, &tok);
	if (e && e->cookie == bpf_get_socket_cookie(ctx))
		bpf_map_delete_elem(&loop_senders, &tok);
	return 1;
}

/* Kernel-created sockets bound on a user's behalf (MPTCP subflows) get their
 * owner at bind time; a socket that has one keeps it. */
static __always_inline int post_bind(struct bpf_sock *ctx)
{
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_owner init;
	task_owner(&init);
	bpf_sk_storage_get(&sk_owners, ctx, &init, BPF_SK_STORAGE_GET_F_CREATE);
	return 1;
}

SEC("cgroup/post_bind4")
int uw_post_bind4(struct bpf_sock *ctx)
{
	return post_bind(ctx);
}

SEC("cgroup/post_bind6")
int uw_post_bind6(struct bpf_sock *ctx)
{
	return post_bind(ctx);
}

/* Sockets that predate the agent: the agent runs these iterators once, in
 * its namespace, after the create/bind hooks are attached. */
static __always_inline void adopt_owner(struct sock *sk, __u32 uid)
{
	if (BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie) != netns_cookie)
		return;
	struct uw_owner init = {.uid = uid, .gid = (__u32)-1, .set = 1};
	struct socket *so = BPF_CORE_READ(sk, sk_socket);
	if (so) {
		struct file *f = BPF_CORE_READ(so, file);
		if (f)
			init.gid = BPF_CORE_READ(f, f_cred, egid.val);
	}
	bpf_sk_storage_get(&sk_owners, sk, &init, BPF_SK_STORAGE_GET_F_CREATE);
}

SEC("iter/tcp")
int uw_iter_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (tp)
		adopt_owner((struct sock *)tp, ctx->uid);
	return 0;
}

SEC("iter/udp")
int uw_iter_udp(struct bpf_iter__udp *ctx)
{
	struct udp_sock *us = ctx->udp_sk;
	if (us)
		adopt_owner((struct sock *)us, ctx->uid);
	return 0;
}

/* Owner of the socket a packet is delivered to or sent from; 0 if it is not
 * a socket of this namespace. */
static __always_inline struct uw_owner *owner_of(struct bpf_sock *sk)
{
	return bpf_sk_storage_get(&sk_owners, sk, 0, 0);
}

/* ---------------------------------------------------------------------------
 * Binding: a user may not co-bind (SO_REUSEADDR) a datagram port another
 * user holds on the same address — the later socket would take the
 * earlier one's unicast traffic (a denial of service).
 */

/* Owner (uid) of a socket other than uid's that takes, on one of the
 * node's addresses (IPv4 ones if want4, IPv6 ones if want6), port's
 * datagrams from (s4 or s6, sport) — from anyone with a zero source. A
 * lookup of the wildcard alone finds only wildcard holders, yet bob's
 * wildcard socket, once connected to X, is rehashed onto the source
 * address the route picks and outscores alice's socket on that address for
 * X's datagrams (an exempt service answering her answers him).
 * (__u32)-1 when the list is missing or too long to check (fail closed);
 * uid when nobody else does. Ports in network order. */
static __always_inline __u32 node_holder(struct bpf_sock_addr *ctx, __u32 uid, int want4, int want6, __be32 s4,
					 const __u32 *s6, __be16 sport, __be16 port)
{
	__u32 k = 0;
	struct uw_node_addrs *l = bpf_map_lookup_elem(&node_addrs, &k);
	if (!l)
		return (__u32)-1;
	__u32 n = l->n;
	if (n == 0 || n > MAX_NODE_ADDRS)
		return (__u32)-1;
	for (__u32 i = 0; i < MAX_NODE_ADDRS; i++) {
		if (i >= n)
			break;
		const __u8 *a = l->addr[i];
		struct bpf_sock_tuple t = {};
		struct bpf_sock *sk;
		if (is_v4mapped(a)) {
			if (!want4)
				continue;
			t.ipv4.saddr = s4;
			t.ipv4.sport = sport;
			__builtin_memcpy(&t.ipv4.daddr, a + 12, 4);
			t.ipv4.dport = port;
			sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		} else {
			if (!want6)
				continue;
			__builtin_memcpy(t.ipv6.saddr, s6, 16);
			t.ipv6.sport = sport;
			__builtin_memcpy(t.ipv6.daddr, a, 16);
			t.ipv6.dport = port;
			sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		}
		if (!sk)
			continue;
		struct uw_owner *o = owner_of(sk);
		__u32 who = o ? o->uid : uid;
		bpf_sk_release(sk);
		if (who != uid)
			return who;
	}
	return uid;
}

/* A bind or connect refused for taking another user's port (R_COBIND). */
static __always_inline int cobind_refused(struct bpf_sock_addr *ctx, struct uw_config *c, __u32 uid, __u32 other,
					  __u16 port, int v4)
{
	tally(c, P_BIND, R_COBIND);
	struct uw_event e = {};
	e.cuid = uid;
	e.luid = other;
	e.lgid = (__u32)-1;
	e.dport = port;
	e.proto = ctx->protocol;
	e.family = v4 ? 4 : 6;
	e.rule = R_COBIND;
	e.path = P_BIND;
	e.has_connector = 1;
	e.audit = c->audit != 0;
	e.pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	emit(&e);
	return c->audit ? 1 : 0;
}

static __always_inline int bind_check(struct bpf_sock_addr *ctx, int v4)
{
	if (ctx->type != SOCK_DGRAM)
		return 1;
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	__u16 port = bpf_ntohs(ctx->user_port);
	if (port != 0 && port <= c->system_port_max)
		return 1;
	struct uw_owner me;
	task_owner(&me);
	__u32 uid = me.uid;
	if (bpf_map_lookup_elem(&exempt_conn, &uid))
		return 1;
	if (port == 0) {
		/* The kernel picks the port, and counts no holder with
		 * SO_REUSEADDR as in use when this socket has it too: cleared,
		 * so that the port it picks is nobody's. */
		int reuse = 0;
		if (bpf_getsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse)) || reuse) {
			reuse = 0;
			bpf_setsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse));
		}
		return 1;
	}
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 other = uid;
	if (ctx->protocol == IPPROTO_UDPLITE) {
		/* No lookup helper searches the UDP-Lite table: a user's
		 * UDP-Lite socket may not share ports at all (SO_REUSEADDR),
		 * so it cannot co-bind another's. */
		int reuse = 1;
		if (bpf_getsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse)) || reuse) {
			other = (__u32)-1;
			goto refuse;
		}
		return 1;
	}
	if (v4) {
		t.ipv4.daddr = ctx->user_ip4;
		t.ipv4.dport = ctx->user_port;
		sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else if (ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 && ctx->user_ip6[2] == bpf_htonl(0xffff)) {
		/* ::ffff:a.b.c.d binds an IPv4 address: the IPv4 table. */
		t.ipv4.daddr = ctx->user_ip6[3];
		t.ipv4.dport = ctx->user_port;
		sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else {
		t.ipv6.daddr[0] = ctx->user_ip6[0];
		t.ipv6.daddr[1] = ctx->user_ip6[1];
		t.ipv6.daddr[2] = ctx->user_ip6[2];
		t.ipv6.daddr[3] = ctx->user_ip6[3];
		t.ipv6.dport = ctx->user_port;
		sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk && !v4 && !(ctx->user_ip6[0] | ctx->user_ip6[1] | ctx->user_ip6[2] | ctx->user_ip6[3])) {
		/* [::] of a socket that takes IPv4 too (IPV6_V6ONLY off)
		 * receives IPv4 on every address: the IPv4 wildcard's holder
		 * is co-bound as well (the kernel's lookup can prefer bob's
		 * socket: SO_INCOMING_CPU). */
		struct udp6_sock *us = ctx->sk ? bpf_skc_to_udp6_sock(ctx->sk) : 0;
		if (us && !BPF_CORE_READ_BITFIELD_PROBED(&us->udp.inet.sk.__sk_common, skc_ipv6only)) {
			__builtin_memset(&t, 0, sizeof(t));
			t.ipv4.dport = ctx->user_port;
			sk = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		}
	}
	if (sk) {
		struct uw_owner *o = owner_of(sk);
		other = o ? o->uid : uid;
		bpf_sk_release(sk);
		if (other != uid)
			goto refuse;
	}
	/* A wildcard bind that may share the port (SO_REUSEADDR: without it
	 * the kernel refuses any overlap itself) must not cover another
	 * user's socket on a specific address of the node. */
	int want4 = 0, want6 = 0;
	if (v4) {
		want4 = ctx->user_ip4 == 0;
	} else if (ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 && ctx->user_ip6[2] == bpf_htonl(0xffff)) {
		want4 = ctx->user_ip6[3] == 0; /* ::ffff:0.0.0.0 is IPv4's wildcard */
	} else if (!(ctx->user_ip6[0] | ctx->user_ip6[1] | ctx->user_ip6[2] | ctx->user_ip6[3])) {
		want6 = 1;
		struct udp6_sock *us = ctx->sk ? bpf_skc_to_udp6_sock(ctx->sk) : 0;
		want4 = us && !BPF_CORE_READ_BITFIELD_PROBED(&us->udp.inet.sk.__sk_common, skc_ipv6only);
	}
	if (!want4 && !want6)
		return 1;
	int reuse = 0;
	if (bpf_getsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse)) == 0 && !reuse)
		return 1;
	__u32 zero6[4] = {};
	other = node_holder(ctx, uid, want4, want6, 0, zero6, 0, ctx->user_port);
	if (other == uid)
		return 1;
refuse:
	return cobind_refused(ctx, c, uid, other, port, v4);
}

SEC("cgroup/bind4")
int uw_bind4(struct bpf_sock_addr *ctx)
{
	return bind_check(ctx, 1);
}

SEC("cgroup/bind6")
int uw_bind6(struct bpf_sock_addr *ctx)
{
	return bind_check(ctx, 0);
}

/* ---------------------------------------------------------------------------
 * Datagram peers: every destination a UDP socket of this namespace sends to
 * (sendmsg) or connects to is noted on that socket; an answer from exactly
 * that address and port may come back to it (R_UDP_REPLY), if the reverse
 * direction is allowed too. The permission lives and dies with the socket.
 */

/* The socket sent to addr:port now: its answers are replies for PEER_TTL.
 * A peer is in at most one slot (it is added only when absent), so the first
 * match is the match; a slot already noted this second is not written again
 * (connected sockets renew theirs on every datagram, cgroup egress). */
static __always_inline void sent_to_now(struct uw_peers *ps, const __u8 *addr, __u16 port)
{
	__u32 now = now_ns() >> 30;
	int hit = -1;
#pragma unroll
	for (int i = 0; i < NPEERS; i++) {
		if (ps->p[i].port == port && addr_eq(ps->p[i].addr, addr)) {
			hit = i;
			break;
		}
	}
	if (hit < 0) {
		hit = ps->next % NPEERS;
		ps->next = (ps->next + 1) % NPEERS;
	} else if (hit < NPEERS && ps->p[hit].t == now) {
		return;
	}
	if (hit >= 0 && hit < NPEERS) {
		__builtin_memcpy(ps->p[hit].addr, addr, 16);
		ps->p[hit].port = port;
		ps->p[hit].t = now;
	}
}

static __always_inline void note_peer(struct bpf_sock_addr *ctx, const __u8 *addr, __u16 port)
{
	/* Context fields first: a TCP connect leaves without a helper call. */
	if (ctx->type != SOCK_DGRAM || !ctx->sk)
		return;
	if (bpf_get_netns_cookie(ctx) != netns_cookie || !uw_cfg())
		return;
	/* A datagram socket created before the agent ran and bound only now,
	 * by this connect or send (autobind fires no bind hook, and the
	 * iterator sees only bound sockets), has no owner record: it gets the
	 * identity of the task that binds it, so that no socket of this
	 * namespace can receive without one. */
	if (!owner_of(ctx->sk)) {
		struct uw_owner init;
		task_owner(&init);
		bpf_sk_storage_get(&sk_owners, ctx->sk, &init, BPF_SK_STORAGE_GET_F_CREATE);
	}
	struct uw_peers *ps = bpf_sk_storage_get(&udp_peers, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (ps)
		sent_to_now(ps, addr, port);
}

static __always_inline void note4(struct bpf_sock_addr *ctx)
{
	__u8 a[16];
	map4(a, ctx->user_ip4);
	note_peer(ctx, a, bpf_ntohs(ctx->user_port));
}

static __always_inline void note6(struct bpf_sock_addr *ctx)
{
	__u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
	note_peer(ctx, (__u8 *)a, bpf_ntohs(ctx->user_port));
}

/* A connected datagram socket takes its peer's datagrams from every
 * unconnected socket on its address and port, and from one connected to
 * the same peer that was hashed before it. A user's socket bound to port P
 * may connect to X:Q only if the socket that gets X:Q's datagrams to its
 * address and P now is its user's or nobody's: bob's wildcard co-bound
 * over alice's *connected* socket (which no lookup without her peer finds,
 * so the bind check cannot) does not take her peer's answers. A socket not
 * yet bound is autobound after this hook: SO_REUSEADDR is cleared first,
 * so that the kernel never picks a port another user holds with it. */
static __always_inline int connect_check(struct bpf_sock_addr *ctx, int v4)
{
	if (ctx->type != SOCK_DGRAM || !ctx->sk)
		return 1;
	if (bpf_get_netns_cookie(ctx) != netns_cookie)
		return 1;
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	__u16 lport = sk->src_port;
	int reuse = 0;
	if (lport == 0 && bpf_getsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse)) == 0 &&
	    !reuse)
		return 1; /* the common client: nothing to share, nothing to check */
	if (lport != 0 && (lport <= c->system_port_max || ctx->protocol == IPPROTO_UDPLITE))
		return 1;
	struct uw_owner me;
	task_owner(&me);
	__u32 uid = me.uid;
	if (bpf_map_lookup_elem(&exempt_conn, &uid))
		return 1;
	if (lport == 0) {
		reuse = 0;
		bpf_setsockopt(ctx, 1 /* SOL_SOCKET */, 2 /* SO_REUSEADDR */, &reuse, sizeof(reuse));
		return 1;
	}
	__u32 x6[4] = {}, l6[4] = {};
	__be32 x4 = 0, l4 = 0;
	int fam4 = v4;
	if (v4) {
		x4 = ctx->user_ip4;
		l4 = sk->src_ip4;
	} else {
		x6[0] = ctx->user_ip6[0];
		x6[1] = ctx->user_ip6[1];
		x6[2] = ctx->user_ip6[2];
		x6[3] = ctx->user_ip6[3];
		l6[0] = sk->src_ip6[0];
		l6[1] = sk->src_ip6[1];
		l6[2] = sk->src_ip6[2];
		l6[3] = sk->src_ip6[3];
		if (x6[0] == 0 && x6[1] == 0 && x6[2] == bpf_htonl(0xffff)) {
			/* to an IPv4 peer: the IPv4 table, from the IPv4 side
			 * of the socket's address (:: and ::ffff:0.0.0.0: any) */
			fam4 = 1;
			x4 = x6[3];
			l4 = (l6[0] == 0 && l6[1] == 0 && l6[2] == bpf_htonl(0xffff)) ? l6[3] : 0;
		}
	}
	__be16 lp = bpf_htons(lport);
	__u32 other = uid;
	int any = fam4 ? l4 == 0 : !(l6[0] | l6[1] | l6[2] | l6[3]);
	if (any) {
		other = node_holder(ctx, uid, fam4, !fam4, x4, x6, ctx->user_port, lp);
	} else {
		struct bpf_sock_tuple t = {};
		struct bpf_sock *h;
		if (fam4) {
			t.ipv4.saddr = x4;
			t.ipv4.sport = ctx->user_port;
			t.ipv4.daddr = l4;
			t.ipv4.dport = lp;
			h = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		} else {
			__builtin_memcpy(t.ipv6.saddr, x6, 16);
			t.ipv6.sport = ctx->user_port;
			__builtin_memcpy(t.ipv6.daddr, l6, 16);
			t.ipv6.dport = lp;
			h = bpf_sk_lookup_udp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		}
		if (h) {
			struct uw_owner *o = owner_of(h);
			other = o ? o->uid : uid;
			bpf_sk_release(h);
		}
	}
	if (other == uid)
		return 1;
	return cobind_refused(ctx, c, uid, other, lport, fam4);
}

SEC("cgroup/connect4")
int uw_connect4(struct bpf_sock_addr *ctx)
{
	if (!connect_check(ctx, 1))
		return 0;
	note4(ctx);
	return 1;
}

SEC("cgroup/connect6")
int uw_connect6(struct bpf_sock_addr *ctx)
{
	if (!connect_check(ctx, 0))
		return 0;
	note6(ctx);
	return 1;
}

SEC("cgroup/sendmsg4")
int uw_sendmsg4(struct bpf_sock_addr *ctx)
{
	note4(ctx);
	return 1;
}

SEC("cgroup/sendmsg6")
int uw_sendmsg6(struct bpf_sock_addr *ctx)
{
	note6(ctx);
	return 1;
}

/* ---------------------------------------------------------------------------
 * Loopback tokens (lo_ids): the identity of a datagram lo could not stamp.
 */

/* lo_token_put (tc egress on lo): record p's identity under a new token and
 * put the token in the packet's mark. */
static __always_inline void lo_token_put(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 z = 0;
	__u32 *seq = bpf_map_lookup_elem(&lo_seq, &z);
	if (!seq)
		return;
	__u32 tok = UW_LO_TOKEN | (bpf_get_smp_processor_id() & 0x7f) << 24 | (*seq & 0xffffff);
	*seq += 1;
	struct uw_lo_id v = {};
	__builtin_memcpy(v.src, p->src, 16);
	__builtin_memcpy(v.dst, p->dst, 16);
	v.sport = p->sport;
	v.dport = p->dport;
	v.proto = p->proto;
	v.uid = p->uid;
	v.gid = p->gid;
	v.mark = skb->mark;
	v.t = now_ns();
	if (bpf_map_update_elem(&lo_ids, &tok, &v, BPF_ANY))
		return;
	skb->mark = tok;
}

/* lo_token: the identity recorded for this loopback packet by lo_token_put,
 * if its token is known, recent, and was made for exactly these addresses,
 * ports and protocol; 0 otherwise. */
static __always_inline struct uw_lo_id *lo_token(struct __sk_buff *skb, const struct pkt *p)
{
	if (skb->ifindex != 1 || !(skb->mark & UW_LO_TOKEN))
		return 0;
	__u32 k = skb->mark;
	struct uw_lo_id *v = bpf_map_lookup_elem(&lo_ids, &k);
	if (!v || v->sport != p->sport || v->dport != p->dport || v->proto != p->proto ||
	    !addr_eq(v->src, p->src) || !addr_eq(v->dst, p->dst) || now_ns() - v->t > LO_ID_TTL_NS)
		return 0;
	return v;
}

/* Did the socket send to src:sport lately? */
static __always_inline int sent_to_peer(struct bpf_sock *sk, const struct pkt *p)
{
	if (test_mode) {
		__u32 z = 0;
		struct uw_test_sock *t = bpf_map_lookup_elem(&test_sock, &z);
		return t && t->has_peer && t->peer_port == p->sport && addr_eq(t->peer, p->src);
	}
	struct uw_peers *ps = bpf_sk_storage_get(&udp_peers, sk, 0, 0);
	if (!ps)
		return 0;
	__u32 now = now_ns() >> 30;
	int hit = 0;
#pragma unroll
	for (int i = 0; i < NPEERS; i++) {
		if (ps->p[i].port == p->sport && now - ps->p[i].t <= peer_ttl_s &&
		    addr_eq(ps->p[i].addr, p->src))
			hit = 1;
	}
	return hit;
}

/* The UDP reply's reverse check: could the socket's owner reach the sender's
 * socket? Site rules first, from this node's address, on a node that is not
 * this one (rules limited to nodes do not apply), then the built-in rules. */
static __always_inline __u32 reverse_ids(const struct pkt *p, const struct uw_owner *l)
{
	__u32 rule = site_query(l->uid, l->gid, p->uid, p->gid, p->dst, p->sport, p->proto, 1, 0);
	if (rule != R_NONE)
		return rule;
	return decide_ids(l->uid, l->gid, p->uid, p->gid);
}

/*
 * decide: the verdict for packet p (stamp status st) delivered to a socket
 * owned by l. The order is policy.Decide's; a datagram the rules refuse is
 * still a reply if the socket sent to its source lately and the socket's
 * owner could reach the sender (the reverse direction is allowed).
 */
static __always_inline __u32 decide(struct uw_config *c, struct pkt *p, __u8 st, struct uw_owner *l,
				    struct bpf_sock *sk)
{
	if (p->dport <= c->system_port_max)
		return R_SYSTEM_PORT;
	__u32 rule;
	if (st == S_VALID) {
		rule = site_query(p->uid, p->gid, l->uid, l->gid, p->src, p->dport, p->proto, 1, 1);
		if (rule == R_NONE)
			rule = decide_ids(p->uid, p->gid, l->uid, l->gid);
		if (rule == R_DENIED && p->proto == IPPROTO_TCP && grant_decide(p->uid, p->gid, l->uid, p->dport))
			rule = R_USER_GRANT;
	} else if (!lpm_has(&local_addrs, p->src) && lpm_has(&unenforced_nets, p->src)) {
		rule = R_UNVERIFIED;
	} else {
		/* Site rules naming the source and asking nothing of the
		 * identity, then the off-cluster rules. */
		rule = site_query(0, 0, l->uid, l->gid, p->src, p->dport, p->proto, 0, 1);
		if (rule == R_NONE && offcluster_port(p->dport))
			rule = R_OFFCLUSTER_PORT;
		else if (rule == R_NONE)
			rule = offcluster_src(p->src) ? R_OFFCLUSTER_DENIED : R_UNSTAMPED_FROM_CLUSTER;
	}
	if (!allows(rule) && dgram_proto(p->proto) && sent_to_peer(sk, p)) {
		/* Reverse: the socket's owner reaching the sender's socket. */
		/* Anyone may reach a system port. An answer without a valid
		 * stamp is a reply only from off-cluster: from a cluster or
		 * local address it may be anyone's (IP options, fragments and
		 * spoofed sources leave a datagram unstamped). */
		int rev = p->sport <= c->system_port_max || (st == S_VALID ? allows(reverse_ids(p, l))
										   : offcluster_src(p->src));
		if (rev)
			rule = R_UDP_REPLY;
	}
	return rule;
}

/* ---------------------------------------------------------------------------
 * THE check: cgroup_skb ingress, with the socket the packet is queued to.
 * It runs for TCP in tcp_filter (a SYN on the listener, also after TIME_WAIT),
 * for UDP/UDP-Lite in the socket's receive path (each multicast/broadcast
 * copy on its own socket), and for every other protocol that reaches a
 * socket. 1 delivers, 0 drops.
 */

static __always_inline __u32 path_of(struct __sk_buff *skb, __u8 proto)
{
	int local = skb->ifindex == 1;
	if (proto == IPPROTO_TCP)
		return local ? P_LOCAL_TCP : P_REMOTE_TCP;
	if (dgram_proto(proto))
		return local ? P_LOCAL_UDP : P_REMOTE_UDP;
	return local ? P_LOCAL_OTHER : P_REMOTE_OTHER;
}

/* One more allowed verdict to report, if this CPU's budget for the current
 * second has room (a per-CPU array: no lock, no atomics). */
static __always_inline int sample_allowed(const struct uw_config *c)
{
	if (!c->allow_samples)
		return 0;
	__u32 z = 0;
	struct uw_budget *b = bpf_map_lookup_elem(&flow_budget, &z);
	if (!b)
		return 0;
	__u64 sec = now_ns() >> 30;
	if (b->sec != sec) {
		b->sec = sec;
		b->n = 0;
	}
	if (b->n >= c->allow_samples) {
		estat(E_UNSAMPLED);
		return 0;
	}
	b->n++;
	estat(E_SAMPLED);
	return 1;
}

static __always_inline void report(struct pkt *p, __u32 rule, __u32 path, __u8 st, struct uw_owner *l,
				   __u8 audit, __u8 polite, __u8 claim)
{
	struct uw_event e = {};
	e.cuid = p->uid;
	e.cgid = p->gid;
	e.has_connector = st == S_VALID;
	e.luid = l->uid;
	e.lgid = l->gid;
	__builtin_memcpy(e.saddr, p->src, 16);
	__builtin_memcpy(e.daddr, p->dst, 16);
	e.sport = p->sport;
	e.dport = p->dport;
	e.proto = p->proto;
	e.family = p->v4 ? 4 : 6;
	e.rule = rule;
	e.path = path;
	e.audit = audit;
	e.stamp = st;
	e.polite = polite;
	e.claim = claim;
	emit(&e);
}

/*
 * A TCP socket of this namespace without an owner record: one the kernel
 * created itself, without a bind on the user's behalf — the listening
 * subflow of an MPTCP socket that called listen() without bind(), or one
 * that predates the agent and escaped the iterator. Its namespace is read
 * through BTF; an MPTCP subflow takes its parent socket's record, any other
 * the socket's uid (no group: sharing needs a record).
 */
static __always_inline struct uw_owner *kernel_tcp_owner(struct bpf_sock *sk, struct uw_owner *o)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	struct sock *ks = (struct sock *)tp;
	if (BPF_CORE_READ(ks, __sk_common.skc_net.net, net_cookie) != netns_cookie)
		return 0;
	struct mptcp_sock *msk = bpf_skc_to_mptcp_sock(sk);
	if (msk) {
		struct uw_owner *po = bpf_sk_storage_get(&sk_owners, msk, 0, 0);
		if (po)
			return po;
	}
	o->uid = BPF_CORE_READ(ks, sk_uid.val);
	o->gid = (__u32)-1;
	o->set = 1;
	o->pad = 0;
	return o;
}

/*
 * tcp_owner: the owner of a TCP socket, 0 if it is not of this namespace.
 * TCP sockets keep no record (uw_sock_create): the kernel keeps the
 * creator's credentials with the socket's file (f_cred, taken by socket()
 * in the same call as the sock_create hook, and never changed), and
 * task_owner's rule is applied to them, so the owner is the one a record
 * made at socket() would hold; an accepted socket's file is its acceptor's
 * (no decision reads one: only pure SYNs are decided). A socket without a
 * file (kernel-created: MPTCP subflows, lockd's) takes its record (bound on
 * a user's behalf: post_bind) or kernel_tcp_owner's answer, as before.
 */
#define OWNER_FROM_FILE 2 /* uw_owner.set: a listener's owner kept from its file */

static __always_inline struct uw_owner *tcp_owner(struct bpf_sock *sk, struct uw_owner *o)
{
	/* A listener reads its file once, at its first SYN, and keeps the
	 * answer as its record (a record exists only for a socket this
	 * namespace's programs looked at); a record made otherwise (post_bind,
	 * the iterator) is replaced by it. */
	int lis = sk->state == TCP_LISTEN;
	struct uw_owner *r = 0;
	if (lis) {
		r = owner_of(sk);
		if (r && r->set == OWNER_FROM_FILE)
			return r;
	}
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return owner_of(sk);
	/* Direct loads through BTF (no helper call each): a faulting load
	 * reads 0. */
	struct sock *ks = &tp->inet_conn.icsk_inet.sk;
	struct net *net = ks->__sk_common.skc_net.net;
	if (!net || net->net_cookie != netns_cookie)
		return 0;
	struct socket *so = ks->sk_socket;
	struct file *f = so ? so->file : 0;
	const struct cred *cr = f ? f->f_cred : 0;
	if (cr) {
		cred_owner(cr, o);
		if (lis) {
			if (!r)
				r = bpf_sk_storage_get(&sk_owners, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
			if (r) {
				r->uid = o->uid;
				r->gid = o->gid;
				r->set = OWNER_FROM_FILE;
			}
		}
		return o;
	}
	if (!lis)
		r = owner_of(sk);
	return r ? r : kernel_tcp_owner(sk, o);
}

/*
 * A socket without an owner record that is not TCP (kernel_tcp_owner): a
 * datagram socket created before the agent and bound since by a send the
 * kernel refused before its sendmsg hook could run (inet_sendmsg autobinds
 * first: no destination, port 0, over 64 KiB, MSG_OOB), a UDP-Lite, SCTP or
 * DCCP socket older than the agent (no iterator sees them) — or another
 * namespace's socket. No record must never count as permission, so the
 * socket's namespace is read from the socket itself: a cgroup_skb program
 * cannot ask for the cookie before 6.17, and no BTF cast exists for an IPv4
 * datagram socket, so the net pointer is read from the start of the socket
 * (sock_common) and its cookie from there. This namespace's socket of a
 * user takes the kernel's own record of its owner (sk_uid: the creator's fs
 * uid; no group, as for TCP) and keeps it as its record; another
 * namespace's, and a kernel or system socket (exempt owner), are remembered
 * as not decided here (sk_foreign). tmp holds the record if storage cannot be had
 * (decided all the same: fail closed). sk_netns_cookie: the namespace of
 * skb's socket (0: unreadable), a global function so that its buffer is not
 * on the stack beside site_decide's.
 */
__noinline __u64 sk_netns_cookie(struct __sk_buff *skb)
{
	if (!skb)
		return 0;
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 0;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return 0;
	__u8 head[64];
	__u32 off = bpf_core_field_offset(struct sock, __sk_common.skc_net);
	__u64 net = 0, cookie = 0;
	if (off > sizeof(head) - 8 || bpf_probe_read_kernel(head, off + 8, sk))
		return 0;
	__builtin_memcpy(&net, &head[off & 0x3f], 8);
	if (!net || bpf_probe_read_kernel(&cookie, 8, (void *)(net + bpf_core_field_offset(struct net, net_cookie))))
		return 0;
	return cookie;
}

static __always_inline struct uw_owner *adopt_at_delivery(struct __sk_buff *skb, struct bpf_sock *sk,
							  struct uw_owner *tmp)
{
	if (bpf_sk_storage_get(&sk_foreign, sk, 0, 0))
		return 0;
	__u32 uid = bpf_get_socket_uid(skb);
	/* A kernel socket (lockd, a tunnel's) or root's or a service's socket
	 * older than the agent passes as it always has: never lock out the
	 * system (an exempt listener's socket would refuse identity-less
	 * datagrams once decided: NFS servers without the agent). */
	if (sk_netns_cookie(skb) != netns_cookie || bpf_map_lookup_elem(&exempt_lis, &uid)) {
		__u8 one = 1;
		bpf_sk_storage_get(&sk_foreign, sk, &one, BPF_SK_STORAGE_GET_F_CREATE);
		return 0;
	}
	tmp->uid = uid;
	tmp->gid = (__u32)-1;
	tmp->set = 1;
	tmp->pad = 0;
	struct uw_owner *o = bpf_sk_storage_get(&sk_owners, sk, tmp, BPF_SK_STORAGE_GET_F_CREATE);
	return o ? o : tmp;
}

SEC("cgroup_skb/ingress")
int uw_skb_ingress(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 1;

	/* Fast path (direct packet access, no helper call): a TCP segment that
	 * is not a pure SYN belongs to a handshake or connection whose SYN was
	 * checked. A pure SYN is checked whatever the socket's state (a listener,
	 * or a connecting socket in a simultaneous open). The differential test
	 * runs it too: speed must never change a verdict. */
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	if (data + 40 <= end) {
		__u8 *h = data;
		int v4 = (h[0] >> 4) == 4;
		__u8 proto = v4 ? h[9] : h[6];
		if (proto == IPPROTO_TCP) {
			__u32 hl = v4 ? (h[0] & 0xf) * 4 : 40;
			if (hl > 60)
				hl = 60;
			__u8 *th = h + hl;
			if ((void *)(th + 14) <= end && !TCP_SYN_ONLY(th[13]))
				return 1;
		}
	}

	struct uw_owner tl, *l;
	if (test_mode) {
		__u32 z = 0;
		struct uw_test_sock *t = bpf_map_lookup_elem(&test_sock, &z);
		if (!t)
			return 1;
		tl.uid = t->uid;
		tl.gid = t->gid;
		tl.set = 1;
		l = &tl;
	} else {
		sk = bpf_sk_fullsock(sk);
		if (!sk)
			return 1;
		if (sk->protocol == IPPROTO_TCP)
			l = tcp_owner(sk, &tl);
		else if (!(l = owner_of(sk)))
			l = adopt_at_delivery(skb, sk, &tl);
		if (!l)
			return 1; /* not a socket of this namespace */
	}
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;

	struct pkt p;
	if (!parse(skb, 0, &p)) {
		/* Cannot classify: only exempt listeners (root) receive it. */
		if (bpf_map_lookup_elem(&exempt_lis, &l->uid))
			return 1;
		tally(c, P_REMOTE_OTHER, R_UNCLASSIFIED);
		return c->audit ? 1 : 0;
	}
	if (p.proto == IPPROTO_TCP) {
		if (!TCP_SYN_ONLY(p.flags))
			return 1; /* the handshake's ACK, a cookie ACK, data, a RST */
	} else if (p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6) {
		/* Allow-list: ping sockets get only echo replies of their id. */
		return 1;
	} else if (!port_proto(p.proto)) {
		if (bpf_map_lookup_elem(&exempt_lis, &l->uid))
			return 1;
		tally(c, path_of(skb, p.proto), R_UNCLASSIFIED);
		report(&p, R_UNCLASSIFIED, path_of(skb, p.proto), S_NONE, l, c->audit, 0, 0);
		return c->audit ? 1 : 0;
	}

	if (p.dport <= c->system_port_max) {
		/* Everyone may reach a system port: no MAC to compute. */
		count(path_of(skb, p.proto), R_SYSTEM_PORT);
		return 1;
	}
	__u8 st = verify(c, &p);
	if (st == S_VALID && !lpm_has(&cluster_nets, p.src) && !lpm_has(&local_addrs, p.src) &&
	    !link_local(p.src))
		st = S_UNTRUSTED_SOURCE;
	if (st == S_NONE) {
		/* A loopback datagram too large (or with options) for a stamp:
		 * its sender's identity came with its token. */
		struct uw_lo_id *li = lo_token(skb, &p);
		if (li) {
			p.uid = li->uid;
			p.gid = li->gid;
			st = S_VALID;
			skb->mark = li->mark;
		}
	}
	if (st == S_NONE && !test_mode && skb->pkt_type == PACKET_LOOPBACK && dgram_proto(p.proto) &&
	    lpm_has(&local_addrs, p.src)) {
		/* A multicast/broadcast copy this node looped back to its own
		 * sockets: it was copied before tc egress and has no stamp. Its
		 * sender is named by the token its socket marks it with
		 * (loop_senders), never by a lookup on address and port, which
		 * returns the best receiving socket: possibly another user's. */
		if ((skb->mark & UW_MARK_LOOP_MASK) == UW_MARK_LOOP) {
			__u32 tok = skb->mark & UW_MARK_LOOP_TOKEN;
			struct uw_loop *snd = bpf_map_lookup_elem(&loop_senders, &tok);
			if (snd) {
				p.uid = snd->uid;
				p.gid = snd->gid;
				st = S_VALID;
			}
		}
	}
	__u32 rule = decide(c, &p, st, l, sk);
	__u32 path = path_of(skb, p.proto);
	tally(c, path, rule);
	/* Refusals and unverified admissions are always reported; other
	 * allowed verdicts within this CPU's budget (the flows). */
	int ok = allows(rule);
	/* Shared on the carried gid alone: reported every time until the
	 * agent knows the connector's groups (then membership decides). */
	__u8 claim = rule == R_SHARED_GROUP && p.gid == l->gid && !known_user(p.uid) && !member(p.uid, l->gid);
	/* A grant's admissions are reported every time (flows name the grant). */
	if (!ok || rule == R_UNVERIFIED || rule == R_USER_GRANT || claim || sample_allowed(c))
		report(&p, rule, path, st, l, ok ? 0 : c->audit, 0, claim);
	return ok || c->audit;
}

/*
 * A datagram on its way out, at the sending socket (cgroup egress, before
 * any fragmentation):
 *  - a connected socket's peer permission is renewed as the socket sends:
 *    send() on a connected socket runs no sendmsg hook, so without this its
 *    replies stopped peer_ttl_s after connect() however busy the exchange.
 *    The peer is the one the socket is connected to (the datagram's
 *    destination), so nothing is opened to anyone else;
 *  - a user's datagram that cannot carry a stamp to another node (IP
 *    options, IPv6 extension headers; or too large for the stamp's room
 *    toward a broadcast, multicast or IPv6 link-local destination, whose
 *    route keeps the device's MTU) is refused here with EPERM, at once,
 *    instead of being dropped by the receiver without a word.
 * Returns 0 to refuse.
 */
/* A connected datagram socket renews its peer (its answers stay replies) as
 * it sends. The headers are plain (20 bytes IPv4, 40 IPv6): the destination
 * address, then the UDP destination port right after. Read with the helper,
 * not in place: 6.1's verifier loses the bound of a header that may be 20 or
 * 40 bytes ("invalid access to packet"). */
static __always_inline void renew_peer(struct __sk_buff *skb, struct bpf_sock *sk, int v4)
{
	__u8 dst[16];
	__be16 dport;
	if (v4) {
		__u32 d;
		if (ld(skb, 16, &d, 4) || ld(skb, 22, &dport, 2))
			return;
		map4(dst, d);
	} else if (ld(skb, 24, dst, 16) || ld(skb, 42, &dport, 2)) {
		return;
	}
	struct uw_peers *ps = bpf_sk_storage_get(&udp_peers, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (ps)
		sent_to_now(ps, dst, bpf_ntohs(dport));
}

/* Would a plain datagram leave without room for the stamp where its route
 * keeps the device's MTU? Its length (or a GSO segment's) plus the room
 * against the MTU of the interface it goes out of (if_mtu): a larger one is
 * sent in fragments of that MTU, the first of them full. */
static __always_inline int no_room(struct __sk_buff *skb, int v4)
{
	__u32 idx = skb->ifindex;
	__u32 *mtu = bpf_map_lookup_elem(&if_mtu, &idx);
	if (!mtu || !*mtu)
		return 0;
	__u32 len = skb->gso_size ? (v4 ? 20 : 40) + 8 + skb->gso_size : skb->len;
	return len + (v4 ? UW_ROOM4 : UW_ROOM6) > *mtu;
}

/* Destinations whose route the agent cannot lower by the stamp's room
 * (routemtu.go): IPv4 broadcast (the local table's routes; the limited
 * broadcast and 224.0.0.0/24 take no route at all), multicast, IPv6
 * link-local (fe80::/64 exists once per interface and cannot be singled
 * out). */
static __always_inline int device_mtu_dst(const __u8 *dst)
{
	if (group_addr(dst))
		return 1;
	if (!is_v4mapped(dst))
		return link_local(dst);
	__u32 a;
	__builtin_memcpy(&a, &dst[12], 4);
	return bpf_map_lookup_elem(&bcast_addrs, &a) != 0;
}

static __always_inline int egress_dgram(struct __sk_buff *skb, struct bpf_sock *sk, __u8 *h, void *end, int v4)
{
	__u32 hl = v4 ? (h[0] & 0xf) * 4 : 40;
	__u8 nh = v4 ? h[9] : h[6];
	int plain = v4 ? hl == 20 : dgram_proto(nh);
	if (plain && !dgram_proto(nh))
		return 1;
	if (!plain && v4 && !dgram_proto(nh))
		return 1;
	if (!plain && !v4 && nh != 0 && nh != 43 && nh != IPPROTO_DSTOPTS)
		return 1; /* TCP, ICMPv6, ...: not a datagram */
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return 1;
	/* A plain datagram too large for a stamp toward a broadcast, multicast
	 * or link-local destination (checked below). */
	int big = plain && skb->ifindex != 1 && no_room(skb, v4);
	if (plain && !big && sk->state != 1 /* TCP_ESTABLISHED: a connected socket */)
		return 1;
	struct uw_owner *o = owner_of(sk);
	if (!o)
		return 1; /* not a socket of this namespace */
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	if (plain && !big) {
		renew_peer(skb, sk, v4);
		return 1;
	}
	/* Options or extension headers, or too large: could it be stamped
	 * where it goes? */
	struct pkt p;
	if (bpf_map_lookup_elem(&exempt_conn, &o->uid) || !parse(skb, 0, &p) || !port_proto(p.proto) ||
	    p.proto == IPPROTO_TCP || p.dport <= c->system_port_max ||
	    (plain ? !device_mtu_dst(p.dst)
		   : skb->ifindex == 1 || (!lpm_has(&cluster_nets, p.dst) && !link_local(p.dst) && !group_addr(p.dst)))) {
		/* lo carries a token instead; off-cluster gets no stamp; a
		 * large datagram to a cluster node is fragmented with room
		 * (the route's MTU is lowered). */
		if (plain && sk->state == 1)
			renew_peer(skb, sk, v4);
		return 1;
	}
	count(P_SOURCE, R_UNSTAMPABLE);
	struct uw_event e = {};
	e.cuid = o->uid;
	e.cgid = o->gid;
	e.has_connector = 1;
	e.luid = (__u32)-1;
	e.lgid = (__u32)-1;
	__builtin_memcpy(e.saddr, p.src, 16);
	__builtin_memcpy(e.daddr, p.dst, 16);
	e.sport = p.sport;
	e.dport = p.dport;
	e.proto = p.proto;
	e.family = p.v4 ? 4 : 6;
	e.rule = R_UNSTAMPABLE;
	e.path = P_SOURCE;
	e.audit = c->audit;
	emit(&e); /* no pid/comm: cgroup_skb may lack those helpers (6.1) */
	return c->audit ? 1 : 0;
}

/*
 * cgroup_skb egress: a user's packet must leave from one of the node's own
 * addresses. IP_FREEBIND / IPV6_FREEBIND let an unprivileged user send from
 * any IPv6 address; tc egress would then seal the user's identity over a
 * forged source (and an identity-less one could pose as a node of the staged
 * rollout or an off-cluster peer). A TCP segment that is not a pure SYN
 * leaves at once: its connection's SYN was checked here.
 *
 * IPv4 needs no list: the output route refuses a source that is not local
 * unless the socket has IP_TRANSPARENT (CAP_NET_ADMIN or CAP_NET_RAW: root,
 * exempt) — __ip_route_output_key — so an address just added, which the
 * agent's list (a netlink event away) may not hold yet, is not refused.
 * IPv6 checks a source only when it is set (bind, IPV6_PKTINFO): a socket
 * bound with FREEBIND that clears the flag again, or bound to an address
 * removed since, sends from it. So an IPv6 source must be in local_addrs,
 * which the agent fills from the first RTM_NEWADDR, while the address is
 * still tentative (DAD); only an address added with nodad or optimistic DAD
 * can be refused for the few milliseconds before the agent lists it.
 */
SEC("cgroup_skb/egress")
int uw_skb_egress(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	__u8 *h = data;
	if (!sk || (void *)(h + 20) > end)
		return 1;
	if ((void *)(h + 40) > end) {
		/* An IPv4 datagram shorter than 40 bytes (a payload of under 12):
		 * only its peer to renew, read with the helper (6.1's verifier
		 * cannot follow a bound of 20 or 40 bytes chosen by family). */
		__u8 b[10];
		if (ld(skb, 0, b, 10) || b[0] != 0x45 || !dgram_proto(b[9]))
			return 1;
		sk = bpf_sk_fullsock(sk);
		if (sk && sk->state == 1 /* connected */ && owner_of(sk) && uw_cfg())
			renew_peer(skb, sk, 1);
		return 1;
	}
	int v4 = (h[0] >> 4) == 4;
	__u8 proto = v4 ? h[9] : h[6];
	if (proto == IPPROTO_TCP) {
		__u32 hl = v4 ? (h[0] & 0xf) * 4 : 40;
		if (hl > 60)
			hl = 60;
		__u8 *th = h + hl;
		if ((void *)(th + 14) <= end && !TCP_SYN_ONLY(th[13]))
			return 1;
	} else if (!egress_dgram(skb, sk, h, end, v4)) {
		return 0;
	}
	if (v4)
		return 1; /* the kernel checked the source (above) */
	__u8 src[16];
	__builtin_memcpy(src, &h[8], 16);
	if (lpm_has(&local_addrs, src))
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return 1;
	struct uw_owner to, *o = sk->protocol == IPPROTO_TCP ? tcp_owner(sk, &to) : owner_of(sk);
	if (!o || bpf_map_lookup_elem(&exempt_conn, &o->uid))
		return 1; /* not this namespace's, or root/services (IP_TRANSPARENT proxies) */
	struct uw_config *c = uw_cfg();
	if (!c)
		return 1;
	tally(c, P_SOURCE, R_FOREIGN_SOURCE);
	return c->audit ? 1 : 0;
}

/* ---------------------------------------------------------------------------
 * tc: direct packet access for the per-packet fast path. The L2 header length
 * of each managed interface comes from the ifaces map (set by the agent).
 */

/* l3 offset of a managed interface, or -1. */
static __always_inline int l3_offset(struct __sk_buff *skb)
{
	__u32 idx = skb->ifindex;
	__u8 *v = bpf_map_lookup_elem(&ifaces, &idx);
	if (!v || !*v)
		return -1;
	return *v - 1;
}

/* Fast test: the IP protocol and, for TCP, whether it is a pure SYN.
 * Returns 0 when the packet needs no further look (established TCP, ICMP,
 * ...), 1 when it does, 2 when the headers are not in the linear area. */
static __always_inline int needs_look(struct __sk_buff *skb, int l3)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	if (l3 < 0 || l3 > 64)
		return 0;
	/* 6.1's verifier loses the range check above on the sign-extended
	 * copy clang adds to the packet pointer: mask an opaque copy. */
	__u32 off = l3;
	asm volatile("" : "+r"(off));
	off &= 0x7f;
	__u8 *ip = data + off;
	if ((void *)(ip + 40) > end)
		return 2;
	__u8 proto;
	__u32 hl;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		proto = ip[9];
		hl = (ip[0] & 0xf) * 4;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		proto = ip[6];
		hl = 40;
	} else {
		return 0;
	}
	if (proto == IPPROTO_TCP) {
		if (hl > 60)
			return 2;
		__u8 *th = ip + hl;
		if ((void *)(th + 14) > end)
			return 2;
		return TCP_SYN_ONLY(th[13]);
	}
	if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6)
		return 0;
	return 1;
}

/*
 * Flows tc ingress found allowed lately: the polite path's second
 * decision, paid once per flow and second instead of once per datagram (in
 * real traffic the socket lookup and decision cost ~300 ns a datagram, more
 * than the check at the socket) — and, for TCP, once per connector, listener
 * and second instead of once per connection: a SYN's flow has no source port
 * (each connection has a new one). Only an allowed verdict is kept, and only
 * for a stamp whose key and window are good: a hit only skips the marking
 * of a refusal, never a decision — uw_skb_ingress still decides every
 * datagram and SYN at the socket. A flow refused since (a group revoked,
 * another user's socket on the port) is dropped there without its ICMP or
 * reset for at most POLITE_TTL_NS (a SYN's retransmission, a second later,
 * gets its reset).
 */
#define POLITE_TTL_NS 1000000000ULL
struct uw_flow_key {
	__u8 src[16], dst[16];
	__u16 sport, dport;
	__u32 uid, gid;
	__u32 proto;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct uw_flow_key);
	__type(value, __u64);
} polite_ok SEC(".maps");

static __always_inline void flow_key(struct uw_flow_key *k, const struct pkt *p)
{
	__builtin_memcpy(k->src, p->src, 16);
	__builtin_memcpy(k->dst, p->dst, 16);
	k->sport = p->proto == IPPROTO_TCP ? 0 : p->sport;
	k->dport = p->dport;
	k->uid = p->uid;
	k->gid = p->gid;
	k->proto = p->proto;
}

/* The key lives only in these two (its stack slot is shared with others:
 * uw_tc_ingress and site_decide are near the verifier's 512 bytes). */
static __always_inline int polite_seen(const struct pkt *p, __u64 now)
{
	struct uw_flow_key k = {};
	flow_key(&k, p);
	__u64 *seen = bpf_map_lookup_elem(&polite_ok, &k);
	return seen && now - *seen <= POLITE_TTL_NS;
}

static __always_inline void polite_note(const struct pkt *p, __u64 now)
{
	struct uw_flow_key k = {};
	flow_key(&k, p);
	bpf_map_update_elem(&polite_ok, &k, &now, BPF_ANY);
}

/*
 * tc ingress (every managed interface, lo included): the polite path. A SYN
 * or datagram to a local unicast user port that the rules refuse for the
 * identity it claims is marked, and the nft table answers with a reset or
 * ICMP admin-prohibited before the stack sees it. The stamp is not verified
 * here: a forged one can only turn this early refusal into a later drop.
 */
SEC("tc")
int uw_tc_ingress(struct __sk_buff *skb)
{
	int l3 = l3_offset(skb);
	int look = needs_look(skb, l3);
	if (!look)
		return TC_ACT_OK;
	struct uw_config *c = uw_cfg();
	if (!c || c->audit)
		return TC_ACT_OK;
	struct pkt p;
	if (!parse(skb, l3, &p) || !(p.proto == IPPROTO_TCP || dgram_proto(p.proto)))
		return TC_ACT_OK;
	if (p.proto == IPPROTO_TCP && !TCP_SYN_ONLY(p.flags))
		return TC_ACT_OK;
	if (p.dport <= c->system_port_max || group_addr(p.dst))
		return TC_ACT_OK;
	int udp = p.proto != IPPROTO_TCP;
	/* The claimed identity stands in for a verified one here when its key
	 * and window are good (no MAC: a forged stamp can only turn this early
	 * refusal into a drop at the socket); a stamp of an unknown key or a
	 * stale one is refused early, as it will be at the socket. */
	struct uw_key *k = 0;
	__u64 w = 0;
	__u8 st = stamp_key(c, &p, &k, &w);
	st = (p.has_stamp && st == S_NONE) ? S_VALID : (st == S_NONE ? S_NONE : st);
	__u64 now = 0;
	if (st == S_VALID && !test_mode) {
		now = now_ns();
		if (polite_seen(&p, now))
			return TC_ACT_OK;
	}
	if (!lpm_has(&local_addrs, p.dst))
		return TC_ACT_OK;

	/* TCP: the listener itself (zero source: a SYN matching a TIME_WAIT
	 * socket goes to the listener). Datagrams: the full tuple, so that a
	 * socket connected to the sender is found, as delivery does. */
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 tlen;
	if (p.proto == IPPROTO_UDPLITE)
		return TC_ACT_OK; /* no lookup helper: decided at delivery */
	if (p.v4) {
		if (udp) {
			__builtin_memcpy(&t.ipv4.saddr, &p.src[12], 4);
			t.ipv4.sport = bpf_htons(p.sport);
		}
		__builtin_memcpy(&t.ipv4.daddr, &p.dst[12], 4);
		t.ipv4.dport = bpf_htons(p.dport);
		tlen = sizeof(t.ipv4);
	} else {
		if (udp) {
			__builtin_memcpy(t.ipv6.saddr, p.src, 16);
			t.ipv6.sport = bpf_htons(p.sport);
		}
		__builtin_memcpy(t.ipv6.daddr, p.dst, 16);
		t.ipv6.dport = bpf_htons(p.dport);
		tlen = sizeof(t.ipv6);
	}
	if (udp)
		sk = bpf_sk_lookup_udp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_tcp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return TC_ACT_OK;
	struct uw_owner lo, *l = udp ? owner_of(sk) : tcp_owner(sk, &lo);
	if (!l) {
		bpf_sk_release(sk);
		return TC_ACT_OK;
	}
	lo = *l;
	if (st == S_NONE) {
		struct uw_lo_id *li = lo_token(skb, &p);
		if (li) {
			p.uid = li->uid;
			p.gid = li->gid;
			st = S_VALID;
		}
	}
	__u32 rule = decide(c, &p, st, &lo, sk);
	bpf_sk_release(sk);
	if (allows(rule)) {
		if (now)
			polite_note(&p, now);
		return TC_ACT_OK;
	}
	__u32 path = path_of(skb, p.proto);
	count(path, rule);
	report(&p, rule, path, st, &lo, 0, 1, 0);
	skb->mark = udp ? UW_MARK_ICMP : UW_MARK_RST;
	return TC_ACT_OK;
}

/*
 * tc egress (every managed interface, lo included): stamp the sender's
 * identity on each SYN and datagram to a user port — always on lo, and on
 * other interfaces only toward cluster subnets, link-local, multicast and
 * broadcast destinations (no identity leaves for off-cluster hosts).
 *
 * The stamp needs room: the agent lowers the MTU of the cluster's routes by
 * the stamp's size (routemtu.go), so the stack fragments a datagram (or
 * refuses it with EMSGSIZE, or a UDP_SEGMENT size with EINVAL) with the room
 * left, and a Fast Open SYN carries that much less data. A fragmented
 * datagram is stamped on its first fragment (IPv6: the destination options
 * go before the fragment header), which is the one whose headers the
 * receiver's reassembly keeps; a UDP GSO packet is stamped once and each
 * segment carries the copy. On lo, what cannot be stamped (larger than an
 * skb may grow, or with IP options / extension headers) gets a token
 * instead (lo_token_put).
 */
SEC("tc")
int uw_tc_egress(struct __sk_buff *skb)
{
	/* A loop token (the socket mark, loop_senders) is for this node's own copies: the packet
	 * leaves with the mark it had before. */
	if ((skb->mark & UW_MARK_LOOP_MASK) == UW_MARK_LOOP)
		skb->mark = 0;
	int l3 = l3_offset(skb);
	int look = needs_look(skb, l3);
	if (!look)
		return TC_ACT_OK;
	struct uw_config *c = uw_cfg();
	if (!c)
		return TC_ACT_OK;
	struct pkt p;
	if (!parse(skb, l3, &p) || !port_proto(p.proto))
		return TC_ACT_OK;
	if (p.proto == IPPROTO_TCP && !TCP_SYN_ONLY(p.flags))
		return TC_ACT_OK;
	if (p.dport <= c->system_port_max || p.has_stamp || p.old_stamp)
		return TC_ACT_OK;
	int lo = skb->ifindex == 1;
	if (!lo && !lpm_has(&cluster_nets, p.dst) && !link_local(p.dst) && !group_addr(p.dst))
		return TC_ACT_OK;

	struct bpf_sock *bsk = skb->sk;
	if (!bsk)
		return TC_ACT_OK;
	bsk = bpf_sk_fullsock(bsk);
	if (!bsk)
		return TC_ACT_OK;
	struct uw_owner to, *o = test_mode                        ? test_owner(&to)
				 : bsk->protocol == IPPROTO_TCP ? tcp_owner(bsk, &to)
								: owner_of(bsk);
	if (o) {
		p.uid = o->uid;
		p.gid = o->gid;
	} else {
		p.uid = bpf_get_socket_uid(skb);
		p.gid = (__u32)-1;
	}
	/* This node seals only a gid it can vouch for: a user it knows (its
	 * own users: known_users) carries his gid only while he is a member of
	 * it now. A process that kept a group's gid after its user left the
	 * group (sg before the removal) sends "no group", so a receiver that
	 * has not looked him up yet does not take the gid on his word (policy
	 * SealedGID). */
	if (p.gid != (__u32)-1 && known_user(p.uid) && !member(p.uid, p.gid))
		p.gid = (__u32)-1;
	__u32 slot = 0;
	struct uw_key *k = bpf_map_lookup_elem(&keys, &slot);
	if (!k || !k->valid)
		return TC_ACT_OK;
	p.ver = UW_STAMP_VER;
	__u64 w = (__u64)wall_ns(c) >> UW_WINDOW_SHIFT;
	p.meta = (k->id << 4) | (w & 0xf);
	__u64 m[MAC_WORDS];
	mac_msg(&p, w, m);
	__u64 tag = siphash(k, m);
	__u32 u = bpf_htonl(p.uid), g = bpf_htonl(p.gid);
	/* A UDP GSO packet's segments must each fit the MTU with the stamp
	 * (bpf_check_mtu passes any GSO packet). */
	__u32 seg = skb->gso_size ? p.l4off + 8 + skb->gso_size : 0;

	/* The IP header is read in place when it can be; after the room is
	 * made, the header and the stamp are written with one store (one
	 * helper call instead of seven: calls are most of what this path
	 * costs in real traffic, where caches are cold). */
	if (p.v4) {
		if (p.iphl != 20)
			goto unstamped;
		__u8 hdr[20 + UW_IPOPT_LEN] __attribute__((aligned(4)));
		if (ld(skb, l3, hdr, 20))
			goto unstamped;
		__u32 mtu = 0;
		if (!lo && (bpf_check_mtu(skb, 0, &mtu, UW_IPOPT_LEN, 0) || seg + UW_IPOPT_LEN > mtu))
			goto unstamped; /* would exceed the MTU: unstamped, refused there */
		if (bpf_skb_adjust_room(skb, UW_IPOPT_LEN, BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_FIXED_GSO))
			goto unstamped;
		__u8 *o4 = &hdr[20];
		o4[0] = UW_IPOPT_TYPE;
		o4[1] = UW_IPOPT_LEN;
		o4[2] = p.ver;
		o4[3] = p.meta;
		__builtin_memcpy(&o4[4], &u, 4);
		__builtin_memcpy(&o4[8], &g, 4);
		__builtin_memcpy(&o4[12], &tag, 8);
		/* ihl 5 → 10, total length + 20, and the checksum updated for
		 * those two words and the option's ten (RFC 1624, as the
		 * kernel's csum_replace2 does it). */
		__u16 oldw, neww, oldlen, newlen, check;
		__builtin_memcpy(&oldw, &hdr[0], 2);
		__builtin_memcpy(&oldlen, &hdr[2], 2);
		__builtin_memcpy(&check, &hdr[10], 2);
		hdr[0] = (hdr[0] & 0xf0) | (5 + UW_IPOPT_LEN / 4);
		newlen = bpf_htons(bpf_ntohs(oldlen) + UW_IPOPT_LEN);
		__builtin_memcpy(&neww, &hdr[0], 2);
		__builtin_memcpy(&hdr[2], &newlen, 2);
		__u32 sum = (__u16)~check;
		sum += (__u16)~oldw;
		sum += neww;
		sum += (__u16)~oldlen;
		sum += newlen;
#pragma unroll
		for (int i = 0; i < UW_IPOPT_LEN; i += 2) {
			__u16 w;
			__builtin_memcpy(&w, &o4[i], 2);
			sum += w;
		}
		sum = (sum & 0xffff) + (sum >> 16);
		sum = (sum & 0xffff) + (sum >> 16);
		check = ~(__u16)sum;
		__builtin_memcpy(&hdr[10], &check, 2);
		if (bpf_skb_store_bytes(skb, l3, hdr, sizeof(hdr), 0))
			return TC_ACT_SHOT;
	} else {
		/* No extension header, or only the fragment header of a first
		 * fragment (the stamp goes in front of it). */
		if (p.iphl != 40 && !(p.frag && p.iphl == 48))
			goto unstamped;
		__u8 hdr[40 + UW_DSTOPT_LEN] __attribute__((aligned(4)));
		if (ld(skb, l3, hdr, 40))
			goto unstamped;
		if (p.iphl == 48 && hdr[6] != 44)
			goto unstamped;
		__u32 mtu = 0;
		if (!lo && (bpf_check_mtu(skb, 0, &mtu, UW_DSTOPT_LEN, 0) || seg + UW_DSTOPT_LEN > mtu))
			goto unstamped;
		if (bpf_skb_adjust_room(skb, UW_DSTOPT_LEN, BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_FIXED_GSO))
			goto unstamped;
		__u8 *o6 = &hdr[40];
		o6[0] = hdr[6]; /* the upper layer, or the fragment header */
		o6[1] = 2;      /* (2+1)*8 = 24 bytes */
		o6[2] = UW_IP6OPT_TYPE;
		o6[3] = UW_IP6OPT_LEN;
		o6[4] = p.ver;
		o6[5] = p.meta;
		__builtin_memcpy(&o6[6], &u, 4);
		__builtin_memcpy(&o6[10], &g, 4);
		__builtin_memcpy(&o6[14], &tag, 8);
		o6[22] = 1; /* PadN, 0 bytes of data */
		o6[23] = 0;
		__be16 plen;
		__builtin_memcpy(&plen, &hdr[4], 2);
		plen = bpf_htons(bpf_ntohs(plen) + UW_DSTOPT_LEN);
		__builtin_memcpy(&hdr[4], &plen, 2);
		hdr[6] = IPPROTO_DSTOPTS;
		if (bpf_skb_store_bytes(skb, l3, hdr, sizeof(hdr), 0))
			return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
unstamped:
	/* Another node refuses it (rule unstamped-from-cluster); what uw_skb_egress
	 * can foresee was refused at send. On lo the sender is known here:
	 * its identity goes with a token. */
	if (lo)
		lo_token_put(skb, &p);
	return TC_ACT_OK;
}

/* ---------------------------------------------------------------------------
 * Abstract Unix sockets (BPF LSM). Pathname sockets are guarded by file
 * permissions; abstract names by nothing else. The caller's credentials come
 * from its task (BTF).
 */

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
	struct uw_config *c = uw_cfg();
	if (!c)
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
	struct uw_owner me;
	task_owner(&me);
	cuid = me.uid;
	cgid = me.gid;
	__u32 rule = decide_user(cuid, luid, cuid != luid && current_has_group(lgid));
	/* The answer of a datagram server to a client that wrote to it (the
	 * client's autobound or named socket belongs to the client, whom the
	 * server may not otherwise reach, e.g. with a shared group). */
	if (!stream && !allows(rule) && sent_to(other, sock_ino(sk)))
		rule = R_UNIX_REPLY;
	tally(c, P_UNIX, rule);
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
	e.audit = c->audit != 0;
	e.pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	/* The abstract name (without the leading NUL) goes in daddr. */
	struct unix_address *a = BPF_CORE_READ((struct unix_sock *)other, addr);
	bpf_probe_read_kernel(e.daddr, sizeof(e.daddr),
			      (void *)a + bpf_core_field_offset(struct unix_address, name) + 3);
	emit(&e);
	return c->audit ? 0 : -EPERM;
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
