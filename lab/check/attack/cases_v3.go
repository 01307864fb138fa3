package attack

import "fmt"

// Cases of round 3 (issue 20): identity is what the kernel acts with.
func casesV3() []*Case {
	var cs []*Case
	for _, proto := range []string{"tcp", "udp"} {
		for _, local := range []bool{true, false} {
			cs = append(cs, deputy("seteuid", proto, local))
		}
	}
	cs = append(cs, deputy("setuid-root", "tcp", false), deputy("saved-uid", "udp", false))
	return cs
}

// deputyCreds are the ids of a root process acting for uid: how slurmstepd
// opens a step's I/O connection (seteuid), how a set-uid-root program run by
// uid looks (real uid the user, effective root), or a file server's
// setfsuid (simulated here as real+effective root, saved the user: every uid
// but one exempt).
func deputyCreds(kind string, uid int) *Creds {
	switch kind {
	case "setuid-root":
		return &Creds{RUID: uid, EUID: 0, SUID: 0, GID: uid}
	case "saved-uid":
		return &Creds{RUID: 0, EUID: 0, SUID: uid, GID: uid}
	}
	return &Creds{RUID: 0, EUID: uid, SUID: 0, GID: uid}
}

func deputy(kind, proto string, local bool) *Case {
	return &Case{Name: fmt.Sprintf("deputy-%s-%s-%s", kind, proto, where(local)), Class: "identity",
		Why: "a root process acting for bob (" + kind + ": slurmstepd calls back to the port bob's srun names after seteuid(bob)) connects to alice's listener: it must count as bob, not as root",
		Run: func(e *Env, r *Run) error {
			node, dst := e.path(local, 4)
			if local {
				dst = lo(4)
			}
			sink := SinkSpec{Sock: Sock{Proto: proto, Family: 4, Bind: ap(wild(4), e.Port)}}
			s, err := e.Sink(r, e.A.Name, Victim, sink)
			if err != nil {
				return err
			}
			to := ap(dst, e.Port)
			att := ActSpec{Sock: sock(proto, 4), Dst: to, Creds: deputyCreds(kind, attackerUID)}
			ctl := ActSpec{Sock: sock(proto, 4), Dst: to, Creds: deputyCreds(kind, victimUID)}
			r.Attack(e, s, node, "root", proto+" as root acting for bob ("+kind+") → "+to, att)
			r.Control(e, s, node, "root", proto+" as root acting for alice ("+kind+") → "+to, ctl)
			return nil
		}}
}
