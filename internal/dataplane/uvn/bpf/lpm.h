/* SPDX-License-Identifier: GPL-2.0 */
/* Keys of the cluster-prefix tries (LPM_TRIE) that srun.c and guard.c
 * share with Go (bpf2go -type srun_lpm4 -type srun_lpm6): prefix length,
 * then the address in network order. */
#ifndef PAL_UVN_LPM_H
#define PAL_UVN_LPM_H

struct srun_lpm4 {
	__u32 prefixlen;
	__u32 addr;
};

struct srun_lpm6 {
	__u32 prefixlen;
	__u32 addr[4];
};

#endif
