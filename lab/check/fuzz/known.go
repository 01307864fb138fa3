package fuzz

// Known findings: leaks the fuzzer finds today that are already reported
// (issue numbers in docs/fuzz.md) and being fixed elsewhere. A finding that
// matches one is printed as "known finding" and does not fail the run, so
// that `make test` keeps guarding against every other class; remove an
// entry once its fix lands.
type known struct {
	name  string
	match func(w *World, fd *Finding) bool
}

// None today: the link-local disagreement (docs/fuzz.md, finding 2) was
// closed in the policy core (policy.Trusted).
var knownFindings = []known{}

func knownFinding(w *World, fd *Finding) string {
	for _, k := range knownFindings {
		if k.match(w, fd) {
			return k.name
		}
	}
	return ""
}

// Regressions are findings fixed since (docs/fuzz.md): their minimal
// programs, replayed by TestRegressions, must leak nothing while the same
// programs as alice still reach her sockets.
var Regressions = []struct {
	Name    string
	Program Program
}{
	{"looped multicast, wildcard co-bound with SO_REUSEADDR (issue 20 item 2)", Program{Node: "node1", User: "bob", Steps: []Step{
		{Op: "socket", Fam: 4, Proto: "udp"}, {Op: "setsockopt", Opt: "SO_REUSEADDR", Val: "1"},
		{Op: "bind", Addr: "0.0.0.0:47014"}, {Op: "sendto", Addr: "224.0.0.1:47007"}}}},
	{"looped multicast, port taken on the subnet broadcast address", Program{Node: "node1", User: "carol", Steps: []Step{
		{Op: "socket", Fam: 4, Proto: "udp"}, {Op: "bind", Addr: "198.18.0.255:47014"}, {Op: "sendto", Addr: "224.0.0.1:47007"}}}},
	{"looped limited broadcast, port taken on the subnet broadcast address", Program{Node: "node1", User: "carol", Steps: []Step{
		{Op: "socket", Fam: 4, Proto: "udp"}, {Op: "setsockopt", Opt: "SO_BROADCAST", Val: "1"},
		{Op: "bind", Addr: "198.18.0.255:47014"}, {Op: "connect", Addr: "255.255.255.255:47007"}, {Op: "send"}}}},
	// Finding 2's program as carol (no group): from a link-local source the
	// identity rules still apply, now that the policy core trusts it too.
	{"link-local source, all-nodes multicast, sender in no group", Program{Node: "node1", User: "carol", Steps: []Step{
		{Op: "socket", Fam: 6, Proto: "udp"}, {Op: "sendto", Addr: "[ff02::1%eth0]:47108"}}}},
}

// byDesign are sentinel forms a mode refuses their own owner, as
// documented: that mode's run leaves them out (their owner's probes would
// only prove the refusal again, and no attacker reaches a socket that
// cannot exist), saying why.
var byDesign = []struct{ mode, form, why string }{
	// The uvn run of 19:09 (product before 7a20abe) lost alice's TCP to her
	// own listener at node2's eth0 link-local address (send: EPIPE): her
	// bind(fe80::…%eth0) had moved the socket from her VRF to eth0 (the
	// kernel sets the device from the scope), so the device guard dropped
	// its packets. eth0 and its link-local address are the default VRF's;
	// since 7a20abe a session's link-local bind is refused up front (EPERM:
	// the bind hook cannot see the scope). Her own link-local path is her
	// VXLAN's address (attack case uvn-link-local's control).
	{"uvn", "ll", "a session cannot bind a link-local address (EPERM; eth0's is the default VRF's, docs/uvn.md Limits)"},
}

// ForMode drops the sentinels mode refuses by design; left maps each
// dropped form to why.
func ForMode(all []*Sentinel, mode string) (kept []*Sentinel, left map[string]string) {
	left = map[string]string{}
	for _, s := range all {
		why := ""
		for _, d := range byDesign {
			if d.mode == mode && d.form == s.Form {
				why = d.why
			}
		}
		if why != "" {
			left[s.Form] = why
			continue
		}
		kept = append(kept, s)
	}
	return kept, left
}
