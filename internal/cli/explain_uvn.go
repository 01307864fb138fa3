package cli

import (
	"fmt"
	"os"
	"slices"
	"strconv"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/slurmconf"
)

// uvnExplain says what uvn does with c (explain's "uvn" line on a node with
// [uvn] enable): uvn carries only a user's own connections and Slurm's
// callbacks into a user's VRF, and applies the site rules to those
// (docs/policy.md, "Enforcement").
func uvnExplain(cfg *config.Config, res identity.Resolver, c policy.Conn) string {
	p := cfg.Policy
	srun := cfg.UVN.SrunRange
	sc, _ := readSlurmConf(cfg.UVN.SlurmConf)
	if sc == nil {
		sc, _ = slurmconf.Read(slurmconf.DefaultPath)
	}
	if srun == (policy.PortRange{}) && sc != nil && sc.SrunPortRange != "" {
		srun = policy.PortRange{First: sc.SrunFirst, Last: sc.SrunLast}
	}
	exempt := []uint32{0}
	names := principals(cfg.UVN.ExemptUsers)
	if sc != nil {
		names = append(names, sc.Accounts()...)
	}
	for _, n := range names {
		if uid, err := identity.UID(res, n); err == nil {
			exempt = append(exempt, uid)
		}
	}
	inVRF := func(uid uint32) bool { return int64(uid) >= cfg.UVN.MinUID && !slices.Contains(exempt, uid) }
	node := c.Node
	if node == "" {
		node, _ = os.Hostname()
	}
	site := func(u uint32, srunPath bool, what string) string {
		allow, rule := uvn.SiteVerdict(p, node, srun, uvn.SiteUserOf(p, u, groupsOfUID(res)), srunPath, c.Proto, c.Port, c.Source)
		word := "DENY"
		if allow {
			word = "ALLOW"
		}
		if rule == "" {
			return fmt.Sprintf("ALLOW (%s; no site rule decides it)", what)
		}
		return fmt.Sprintf("%s (site rule %s; %s)", word, rule, what)
	}
	name := func(u uint32) string {
		if n, err := res.LookupUID(u); err == nil {
			return n
		}
		return strconv.FormatUint(uint64(u), 10)
	}
	switch {
	case c.Port <= p.SystemPortMax:
		return "ALLOW (system port: system services in the default VRF serve every VRF)"
	case !inVRF(c.Listener.UID):
		if inVRF(c.Connector.UID) && (p.Trusted(c.Source) || cfg.UVN.NATPrefix.Contains(c.Source.Unmap())) {
			return site(c.Connector.UID, false, "a default-VRF service, reached from "+name(c.Connector.UID)+"'s VRF: that VRF's rules apply")
		}
		return "ALLOW (a default-VRF service serves every VRF)"
	case !p.Trusted(c.Source) && !cfg.UVN.NATPrefix.Contains(c.Source.Unmap()):
		return "DENY (off-cluster hosts never reach a user's VRF)"
	case inVRF(c.Connector.UID) && c.Connector.UID != c.Listener.UID:
		return fmt.Sprintf("DENY (%s's connections never reach %s's VRF: VRFs do not share, whatever a rule allows)", name(c.Connector.UID), name(c.Listener.UID))
	case inVRF(c.Connector.UID):
		// Also from the user's NAT address (nat_pool, not a cluster
		// address): the VRF proves who sends, so the deny rules apply.
		return site(c.Listener.UID, false, "the user's own VRF")
	case !p.Trusted(c.Source):
		return "DENY (a NAT address is a user's own; only that user's VRF sends from it)"
	case srun != (policy.PortRange{}) && srun.Contains(c.Port) && c.Proto == policy.TCP && c.Source.IsValid():
		return site(c.Listener.UID, true, "Slurm's callback path from a default VRF into SrunPortRange "+srun.String())
	}
	return fmt.Sprintf("DENY (the default VRF reaches %s's listeners only on SrunPortRange, Slurm's callbacks)", name(c.Listener.UID))
}
