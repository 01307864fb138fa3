package check

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	uw "github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// AuditLogged and AuditMissing are Case.AuditEvent's values.
const (
	AuditLogged  = "logged"
	AuditMissing = "missing"
)

// RuleUnenforcedNode is the verdict rule for a listener on a node without
// the agent (staged rollout): nothing there decides.
const RuleUnenforcedNode = "unenforced-node"

// RuleUnverified is the data plane's rule for identity-less traffic from a
// node that does not enforce yet ([cluster] unenforced_nodes): admitted.
const RuleUnverified = "unverified"

// ExpectAudit is mode audit (testbed up --mode userwall --audit): every
// connection goes through, and every one the policy refuses must be
// reported as an audit event by the listener's node.
func ExpectAudit(c *Case) Verdict {
	v := ExpectPolicy(c)
	return Verdict{Allow: true, Rule: v.Rule, Audit: !v.Allow}
}

// unverified reports whether c comes from a node that does not enforce yet
// as its listener's node is configured: its traffic carries no identity and
// is admitted.
func unverified(c *Case) bool {
	if c.Local() || c.Policy == nil || !c.Src.IsValid() {
		return false
	}
	for _, p := range c.Policy.UnenforcedNodes {
		if p.Contains(c.Src.Unmap()) {
			return true
		}
	}
	return false
}

// checkAuditEvents sets AuditEvent on every case that expects one, from
// the listener nodes' event logs (events since the run started only).
func checkAuditEvents(tb *testbed.Testbed, since time.Time, cases []*Case) {
	logs := map[string]string{}
	for _, n := range tb.Nodes {
		if cfg, err := config.Load(tb.ConfigPath(n.Name)); err == nil {
			logs[n.Name] = cfg.Agent.EventLog
		}
	}
	matchAuditEvents(logs, since, 10*time.Second, cases)
}

// matchAuditEvents matches cases with the event logs (node → path). Events
// reach a log asynchronously (ring buffer), so it waits up to wait for the
// last ones.
func matchAuditEvents(logs map[string]string, since time.Time, wait time.Duration, cases []*Case) {
	var want []*Case
	for _, c := range cases {
		if c.Expected.Audit {
			want = append(want, c)
		}
	}
	if len(want) == 0 {
		return
	}
	deadline := time.Now().Add(wait)
	for {
		events := map[string][]uw.Event{}
		for node, path := range logs {
			events[node] = readEvents(path, since)
		}
		missing := 0
		for _, c := range want {
			c.AuditEvent = AuditMissing
			for _, e := range events[c.Listener.Node] {
				if auditMatches(c, e) {
					c.AuditEvent = AuditLogged
					break
				}
			}
			if c.AuditEvent == AuditMissing {
				missing++
			}
		}
		if missing == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func readEvents(path string, since time.Time) []uw.Event {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []uw.Event
	for _, l := range strings.Split(string(b), "\n") {
		var e uw.Event
		if json.Unmarshal([]byte(l), &e) == nil && !e.Time.Before(since) {
			out = append(out, e)
		}
	}
	return out
}

// auditMatches: an audit event for c's listener and port, from c's
// connector (by user when the event carries an identity, else by source
// address).
func auditMatches(c *Case, e uw.Event) bool {
	if e.Verdict != "audit" || !strings.EqualFold(e.Proto, c.Proto.String()) || e.Listener.User != c.Listener.User {
		return false
	}
	if i := strings.LastIndex(e.Dst, ":"); i < 0 || e.Dst[i+1:] != strconv.Itoa(int(c.Dst.Port())) {
		return false
	}
	if e.Connector != nil {
		return e.Connector.User == c.Connector.User
	}
	src := e.Src
	if i := strings.LastIndex(src, ":"); i >= 0 {
		src = strings.Trim(src[:i], "[]")
	}
	return c.Src.IsValid() && src == c.Src.Unmap().String()
}
