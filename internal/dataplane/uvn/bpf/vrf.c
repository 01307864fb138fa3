// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade uvn: what puts a user's session into the user's VRF.
 *
 * Loaded once per session cgroup (the agent sets the constants below) and
 * attached to that cgroup with BPF_F_ALLOW_MULTI; the programs stay attached
 * for as long as the cgroup exists.
 *
 *   cgroup/sock_create  pal_uvn_vrf
 *       Every new AF_INET/AF_INET6 socket is bound to the VRF device (what
 *       `ip vrf exec` does). A user cannot undo it: changing SO_BINDTODEVICE
 *       on a bound socket needs CAP_NET_RAW. MPTCP sockets are refused
 *       (EPERM): their TCP subflows are kernel sockets that do not inherit
 *       the binding, so an MPTCP listener would sit in the default VRF,
 *       reachable by everyone (Go >= 1.24 listens with MPTCP by default);
 *       programs fall back to TCP.
 *   cgroup/connect4     pal_uvn_conn4
 *   cgroup/sendmsg4     pal_uvn_send4
 *       Traffic to underlay_ports of a cluster node (an address in
 *       pal_uvn_nets4, the IPv4 underlay prefixes) takes the underlay instead
 *       of the overlay: the socket gets the user's NAT address as its source
 *       (bpf_bind for connect, msg_src_ip4 for unconnected UDP). Node rules
 *       998/999 route that source by the local and main tables and the
 *       node's SNAT makes it the node's own address; replies come back into
 *       the VRF like off-subnet replies. Everything else is left alone
 *       (overlay). A connection that takes
 *       the underlay this way is marked nat_mark: rules 998/999 route only
 *       marked sockets (and UDP to underlay ports) by the main table, never
 *       a socket merely bound to a NAT address (a user may bind his own);
 *       a marked socket's datagrams to any other destination are refused
 *       (EPERM).
 *
 * The boundary where packets flow is the node's device guard (bpf/guard.c,
 * at the cgroup2 root, for every socket); the session adds:
 *   cgroup/bind6        pal_uvn_bind6
 *       Refuses binds to link-local addresses (fe80::/10, ff01::/16, ff02::/16): the
 *       program cannot see sin6_scope_id, and the kernel would take the
 *       scope as the socket's device even when the bind then fails.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "uapi.h" /* UAPI macros both planes use */

char LICENSE[] SEC("license") = "GPL";

/* What a cgroup sock or sock_addr program returns. */
enum uvn_verdict {
	UVN_REFUSE = 0, /* the syscall fails with EPERM */
	UVN_ALLOW = 1,
};

/* Sizes the agent must respect when it fills the constants and the map. */
enum uvn_limit {
	UVN_MAX_PORT_RANGES = 8, /* [uvn] underlay_ports */
	UVN_MAX_NETS4 = 64,      /* IPv4 prefixes of all [[uvn.underlay]] */
};
/* Puts enum uvn_limit into the BTF, for bpf2go -type (the Go side reads
 * the limits from there). */
const enum uvn_limit uvn_limit_btf = UVN_MAX_PORT_RANGES;

/* An inclusive range of destination ports, host byte order. */
struct uvn_port_range {
	__u16 first;
	__u16 last;
};

/* Key of pal_uvn_nets4: an IPv4 prefix, address in network byte order. */
struct uvn_lpm4 {
	__u32 prefixlen;
	__be32 addr;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, UVN_MAX_NETS4);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct uvn_lpm4);
	__type(value, __u8);
} pal_uvn_nets4 SEC(".maps");

/* Set at load time. */
volatile const __u32 vrf_ifindex; /* pal_uvn_vrf: the user's VRF device */
volatile const struct uvn_port_range underlay_ports[UVN_MAX_PORT_RANGES];
volatile const __u32 n_underlay_ports; /* used entries of underlay_ports */
volatile const __be32 nat_addr;        /* the user's NAT address */
volatile const __u32 nat_mark;         /* marks underlay-port sockets */

SEC("cgroup/sock_create")
int pal_uvn_vrf(struct bpf_sock *sk)
{
	if (sk->protocol == IPPROTO_MPTCP)
		return UVN_REFUSE;
	sk->bound_dev_if = vrf_ifindex;
	return UVN_ALLOW;
}

static __always_inline int underlay_port(__u16 port)
{
	int i;

	for (i = 0; i < UVN_MAX_PORT_RANGES; i++) {
		if (i >= n_underlay_ports)
			break;
		if (port >= underlay_ports[i].first && port <= underlay_ports[i].last)
			return 1;
	}
	return 0;
}

/* Whether the destination is an underlay port of a cluster node. */
static __always_inline int to_underlay(struct bpf_sock_addr *ctx)
{
	struct uvn_lpm4 k = { .prefixlen = 32 };

	if (!underlay_port(bpf_ntohs((__u16)ctx->user_port)))
		return 0;
	k.addr = ctx->user_ip4;
	return bpf_map_lookup_elem(&pal_uvn_nets4, &k) != NULL;
}

SEC("cgroup/connect4")
int pal_uvn_conn4(struct bpf_sock_addr *ctx)
{
	struct sockaddr_in src = { .sin_family = AF_INET };

	__u32 mark = 0;
	struct bpf_sock *sk = ctx->sk;

	if (to_underlay(ctx)) {
		src.sin_addr.s_addr = nat_addr;
		/* Port 0: the kernel picks one. Should the bind fail (the
		 * socket was bound already), the connection takes the
		 * underlay only if it was bound to this user's own NAT
		 * address; otherwise it simply takes the overlay. */
		if (bpf_bind(ctx, (struct sockaddr *)&src, sizeof(src)) == 0 ||
		    (sk && sk->src_ip4 == nat_addr))
			mark = nat_mark;
	}
	/* Set, or clear our own (a UDP socket may connect again
	 * elsewhere); another mark (root's) is left alone. */
	if (sk && (mark ? sk->mark != mark : sk->mark == nat_mark))
		bpf_setsockopt(ctx, SOL_SOCKET, SO_MARK, &mark, sizeof(mark));
	return UVN_ALLOW;
}

SEC("cgroup/sendmsg4")
int pal_uvn_send4(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;

	if (to_underlay(ctx)) {
		ctx->msg_src_ip4 = nat_addr;
		return UVN_ALLOW;
	}
	/* A socket marked for the underlay (connected to an underlay port,
	 * then sendto() elsewhere, or disconnected with AF_UNSPEC, which
	 * runs no program) sends only there: the mark would route any
	 * destination by the main table, out of the VRF. */
	if (sk && sk->mark == nat_mark)
		return UVN_REFUSE;
	return UVN_ALLOW;
}

SEC("cgroup/bind6")
int pal_uvn_bind6(struct bpf_sock_addr *ctx)
{
	__u32 w0 = bpf_ntohl(ctx->user_ip6[0]);

	if ((w0 & 0xffc00000) == 0xfe800000) /* fe80::/10 */
		return UVN_REFUSE;
	/* Interface- and link-scope multicast (ff01::/16, ff02::/16, any
	 * flags): the kernel takes their scope id as the device too. */
	if ((w0 & 0xff0f0000) == 0xff010000 || (w0 & 0xff0f0000) == 0xff020000)
		return UVN_REFUSE;
	return UVN_ALLOW;
}
