// Package fuzz is Palisade's attack fuzzer (`palisade-lab check --fuzz`):
// random programs of unprivileged system calls, run as the testbed's
// attackers (bob, carol) under every way they can start a process, against
// sentinel sockets of other users and groups on every node. A sentinel
// reports every byte it receives; any attacker's byte at a sentinel the
// mode's expectation (userwall: policy.Decide) refuses is a finding, printed
// with the seed and a delta-debugged minimal program. The same programs run
// as the sentinels' owner are the positive control.
//
// This file is the program model shared by the generator (host) and the
// executor (node); exec.go runs a program, gen.go draws one, run.go runs the
// fuzzer on a testbed.
package fuzz

import (
	"fmt"
	"strings"
)

// Program is what one attacker process does: Steps in order, each on one
// of a few socket slots. Wrap is how the process is started.
type Program struct {
	// Node is where the program's process is started; User who runs it.
	Node string `json:"node"`
	User string `json:"user"`
	// Wrap: "" (a plain process), "unshare-r" (a new user namespace
	// mapping the user to root), "unshare-rn" (and a new network
	// namespace), "sg" (sg proj1), "ssh" (ssh to Via first), "srun" (a
	// Slurm step on Via), "su" (su to the victim: must fail).
	Wrap string `json:"wrap,omitempty"`
	Via  string `json:"via,omitempty"` // ssh/srun: the node the program runs on
	// Peer (fd passing): a second process of user Peer on the same node
	// receives the sockets the program hands over ("passfd") and runs
	// PeerSteps on them (slot k of the peer is the k-th socket received).
	Peer      string `json:"peer,omitempty"`
	PeerSteps []Step `json:"peer_steps,omitempty"`
	Steps     []Step `json:"steps"`
}

// Step is one system call (or a short, fixed sequence the kernel needs,
// such as a non-blocking connect and its wait).
type Step struct {
	Op string `json:"op"` // socket, setsockopt, bind, connect, listen, accept, send, sendto, sendmsg, shutdown, close, recv, passfd
	S  int    `json:"s"`  // socket slot
	// socket
	Fam   int    `json:"fam,omitempty"`   // 4, 6
	Proto string `json:"proto,omitempty"` // tcp, mptcp, udp, udplite, sctp, sctp-seq, dccp
	// setsockopt: option name and value ("1", "eth0", hex bytes, "group%if")
	Opt string `json:"opt,omitempty"`
	Val string `json:"val,omitempty"`
	// bind, connect, sendto, sendmsg: "addr:port" ("[fe80::1%eth0]:p")
	Addr string `json:"addr,omitempty"`
	// send*: payload size (at least one nonce line), flags, control messages
	Size  int      `json:"size,omitempty"`
	Flags []string `json:"flags,omitempty"`
	Cmsgs []Cmsg   `json:"cmsgs,omitempty"`
}

// Cmsg is one control message of a sendmsg.
type Cmsg struct {
	Type string `json:"type"` // IP_PKTINFO, IPV6_PKTINFO, IP_TTL, IP_TOS, IP_RETOPTS, IPV6_HOPLIMIT, IPV6_TCLASS, IPV6_DSTOPTS, IPV6_HOPOPTS, IPV6_RTHDR, UDP_SEGMENT, SO_MARK, IPV6_DONTFRAG
	Val  string `json:"val"`
}

func (s Step) sends() bool {
	switch s.Op {
	case "send", "sendto", "sendmsg", "connect":
		// connect: TCP Fast Open data and SCTP/DCCP handshakes carry no
		// payload of ours, but a connect is where a stream's bytes start.
		return s.Op != "connect"
	}
	return false
}

// String renders the step as a system call.
func (s Step) String() string {
	sock := fmt.Sprintf("s%d", s.S)
	switch s.Op {
	case "socket":
		dom, typ, proto := sockArgs(s.Fam, s.Proto)
		return fmt.Sprintf("%s = socket(%s, %s, %s)", sock, dom, typ, proto)
	case "setsockopt":
		lvl := optLevel(s.Opt)
		return fmt.Sprintf("setsockopt(%s, %s, %s, %s)", sock, lvl, s.Opt, s.Val)
	case "bind", "connect":
		return fmt.Sprintf("%s(%s, %s)", s.Op, sock, s.Addr)
	case "listen", "accept", "shutdown", "close", "recv":
		return fmt.Sprintf("%s(%s)", s.Op, sock)
	case "passfd":
		return fmt.Sprintf("sendmsg(unix → peer, SCM_RIGHTS [%s])", sock)
	}
	var w []string
	w = append(w, sock, fmt.Sprintf("\"PALATK <nonce>…\" %d B", max(s.Size, payloadLine)))
	if s.Addr != "" {
		w = append(w, "to "+s.Addr)
	}
	if len(s.Cmsgs) > 0 {
		var cs []string
		for _, c := range s.Cmsgs {
			cs = append(cs, c.Type+"="+c.Val)
		}
		w = append(w, "cmsg{"+strings.Join(cs, ", ")+"}")
	}
	if len(s.Flags) > 0 {
		w = append(w, strings.Join(s.Flags, "|"))
	} else {
		w = append(w, "0")
	}
	return s.Op + "(" + strings.Join(w, ", ") + ")"
}

// String renders the program: who runs it, how, and its calls.
func (p *Program) String() string {
	var b strings.Builder
	where := p.Node
	switch p.Wrap {
	case "ssh":
		where = fmt.Sprintf("%s, via `ssh %s`", p.Node, p.Via)
	case "srun":
		where = fmt.Sprintf("%s, via `srun -w %s`", p.Node, p.Via)
	case "sg":
		where += ", under `sg proj1`"
	case "unshare-r":
		where += ", under `unshare -r` (user namespace)"
	case "unshare-rn":
		where += ", under `unshare -rn` (user and network namespace)"
	case "su":
		where += ", under `su alice`"
	}
	fmt.Fprintf(&b, "as %s on %s:\n", p.User, where)
	for i, s := range p.Steps {
		fmt.Fprintf(&b, "  %2d  %s\n", i, s)
	}
	if p.Peer != "" {
		fmt.Fprintf(&b, "  peer process of %s on the same node (receives the passed sockets as p0, p1, …):\n", p.Peer)
		for i, s := range p.PeerSteps {
			fmt.Fprintf(&b, "  p%-2d %s\n", i, strings.Replace(s.String(), fmt.Sprintf("s%d", s.S), fmt.Sprintf("p%d", s.S), 1))
		}
	}
	return b.String()
}

func sockArgs(fam int, proto string) (dom, typ, pr string) {
	dom = "AF_INET"
	if fam == 6 {
		dom = "AF_INET6"
	}
	switch proto {
	case "tcp":
		return dom, "SOCK_STREAM", "IPPROTO_TCP"
	case "mptcp":
		return dom, "SOCK_STREAM", "IPPROTO_MPTCP"
	case "sctp":
		return dom, "SOCK_STREAM", "IPPROTO_SCTP"
	case "sctp-seq":
		return dom, "SOCK_SEQPACKET", "IPPROTO_SCTP"
	case "dccp":
		return dom, "SOCK_DCCP", "IPPROTO_DCCP"
	case "udplite":
		return dom, "SOCK_DGRAM", "IPPROTO_UDPLITE"
	}
	return dom, "SOCK_DGRAM", "IPPROTO_UDP"
}

func optLevel(opt string) string {
	switch {
	case strings.HasPrefix(opt, "SO_"):
		return "SOL_SOCKET"
	case strings.HasPrefix(opt, "IPV6_"):
		return "IPPROTO_IPV6"
	case strings.HasPrefix(opt, "IP_"):
		return "IPPROTO_IP"
	case strings.HasPrefix(opt, "TCP_"):
		return "IPPROTO_TCP"
	case strings.HasPrefix(opt, "UDPLITE_"):
		return "IPPROTO_UDPLITE"
	case strings.HasPrefix(opt, "UDP_"):
		return "IPPROTO_UDP"
	}
	return "?"
}

// payloadLine is the length of one "PALATK <nonce>\n" line (16 hex digits).
const payloadLine = len("PALATK ") + 16 + 1
