package fuzz

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Known findings: leaks the fuzzer finds today that are already reported
// (issue numbers in docs/fuzz.md) and being fixed elsewhere. A finding that
// matches one is printed as "known finding" and does not fail the run, so
// that `make test` keeps guarding against every other class; remove an
// entry once its fix lands.
type known struct {
	name  string
	match func(w *World, fd *Finding) bool
}

var knownFindings = []known{
	{"looped broadcast/multicast credited to a receiving socket (issue 20 item 2)", func(w *World, fd *Finding) bool {
		// bob co-binds the port of alice's SO_REUSEADDR socket and
		// sends to a broadcast or multicast address: the node's own
		// looped copy is attributed by a receive-side lookup that finds
		// alice's socket. Every leak is a UDP sentinel on the sending
		// node, and the program has the co-bind and the send.
		run := fd.Program.runNode()
		cobind, group := false, false
		for _, s := range append(fd.Program.Steps, fd.Program.PeerSteps...) {
			ap, err := netip.ParseAddrPort(s.Addr)
			if err != nil {
				continue
			}
			if s.Op == "bind" && slices.ContainsFunc(w.Sentinels, func(x *Sentinel) bool {
				return x.Form == "reuse" && x.Node == run && x.Port == int(ap.Port())
			}) {
				cobind = true
			}
			a := ap.Addr().Unmap()
			if s.sends() && (a.IsMulticast() || a.Is4() && a.As4()[3] == 255) {
				group = true
			}
		}
		for _, l := range fd.Leaks {
			if !strings.HasPrefix(l.Sentinel, run+"/") || !strings.Contains(l.Sentinel, "/udp") {
				return false
			}
		}
		return cobind && group && len(fd.Leaks) > 0
	}},
	{"link-local source: data plane trusts it, policy core does not", func(_ *World, fd *Finding) bool {
		// A stamped datagram or SYN from another node's link-local
		// address: userwall verifies the stamp and applies the rules
		// (docs/userwall.md: "a valid MAC is trusted from link-local
		// sources too"), policy.InCluster counts fe80::/10 as off-cluster.
		// Only a finding where that disagreement alone refuses.
		for _, l := range fd.Leaks {
			a, err := netip.ParseAddrPort(l.From)
			if err != nil || !a.Addr().IsLinkLocalUnicast() || l.Rule != string(policy.RuleOffClusterDenied) || !l.InClusterAllowed {
				return false
			}
		}
		return len(fd.Leaks) > 0
	}},
}

func knownFinding(w *World, fd *Finding) string {
	for _, k := range knownFindings {
		if k.match(w, fd) {
			return k.name
		}
	}
	return ""
}
