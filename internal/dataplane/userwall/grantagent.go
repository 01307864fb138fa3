package userwall

import (
	"encoding/json"
	"errors"
	"os"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
)

// newGrants is the agent's grant store (grants.go), with the grants a
// previous agent left in the kernel adopted.
func (a *agent) newGrants() *grantStore {
	host, _ := os.Hostname()
	s := &grantStore{
		pol: func() *policy.Policy {
			if p := a.sitePolicy.Load(); p != nil {
				return p
			}
			return a.cfg.Policy
		},
		res:   identity.System(),
		node:  host,
		log:   a.log,
		write: a.dp.WriteGrants,
		now:   time.Now,
		listeners: func(port uint16) ([]uint32, error) {
			if a.flows == nil || a.flows.res == nil {
				return nil, errors.New("sock_diag unavailable")
			}
			return a.flows.res.ListenerUIDs(port)
		},
	}
	if a.sink != nil {
		s.logLine = a.sink.write
	}
	if gs, err := a.dp.ReadGrants(); err != nil {
		a.log.Warn("user grants left by the previous agent not read", "err", err)
	} else {
		s.adopt(gs)
	}
	a.grants = s
	return s
}

// runGrants sweeps the grants every second; the returned func stops it.
func (a *agent) runGrants() (stop func()) {
	done := make(chan struct{})
	return goJoined(func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				a.grants.sweep()
			}
		}
	}, func() { close(done) }, nil)
}

// grantFor describes the grant that admitted c (events, flows), or "".
func (a *agent) grantFor(c policy.Conn) string {
	if a.grants == nil {
		return ""
	}
	c.Grants, c.At = a.grants.active(), time.Now()
	c.Connector.Groups = a.dp.SiteMembers(c.Connector.UID)
	if g := a.grants.pol().GrantFor(c); g != nil {
		return g.Describe(a.grants.res)
	}
	return ""
}

// answerData serves the ident service's data queries from other nodes:
// flows and audit (the recorder), forwarded grant requests (the store).
func (a *agent) answerData(kind string, args json.RawMessage) (json.RawMessage, error) {
	if kind == ident.KindGrant {
		if a.grants == nil {
			return nil, errors.New("user grants: not ready")
		}
		return a.grants.answerForwarded(args)
	}
	return a.flows.answerData(kind, args)
}
