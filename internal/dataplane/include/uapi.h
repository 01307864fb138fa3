/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Constants of the Linux UAPI that vmlinux.h cannot carry: they are macros
 * (BTF records types and enums only). One copy for the programs of both
 * data planes built against vmlinux.h; include it after vmlinux.h. (An
 * identical redefinition is legal C: a file's own copy of one of these
 * still compiles, but has no reason to stay.) Values are the kernel's ABI,
 * the same on every architecture Palisade builds for.
 */
#ifndef PALISADE_UAPI_H
#define PALISADE_UAPI_H

/* linux/socket.h */
#define AF_UNIX 1
#define AF_INET 2
#define AF_INET6 10

/* linux/if_ether.h */
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD

/* linux/in6.h (IPPROTO_TCP, _UDP, ... are enums, in vmlinux.h) */
#define IPPROTO_ICMPV6 58
#define IPPROTO_DSTOPTS 60

/* asm-generic/socket.h, linux/in.h, linux/in6.h: socket options */
#define SOL_IP 0
#define SOL_SOCKET 1
#define SOL_IPV6 41
#define SO_BINDTODEVICE 25
#define SO_MARK 36
#define SO_BINDTOIFINDEX 62
#define IP_MULTICAST_IF 32
#define IP_UNICAST_IF 50
#define IPV6_MULTICAST_IF 17
#define IPV6_UNICAST_IF 76

/* linux/pkt_cls.h: what a tc program returns */
#define TC_ACT_OK 0
#define TC_ACT_SHOT 2

/* asm-generic/errno-base.h */
#define EPERM 1

#define PAGE_SIZE 4096
#define LOOPBACK_IFINDEX 1 /* lo, in every network namespace */

#endif
