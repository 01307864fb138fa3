package userwall

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// User grants (`palisade share`): a user opens one of their TCP listeners'
// ports to another user or group, on this node, for a while. The agent is
// the only writer: it takes requests on the flows socket, where the kernel
// names the asker (SO_PEERCRED), and accepts a grant only on a port the
// asker holds a listener on (the kernel's record of the socket's creator,
// sock_diag). The kernel map (grants, bpf/userwall.c) is keyed on the
// listener's owner and port, so a grant never reaches another user's socket
// bound to the port later, and each slot carries its expiry, which the
// kernel checks itself. The agent removes expired grants and grants whose
// owner no longer listens on the port (sweep, every second).

// GrantRequest is a share, unshare or list request (FlowsRequest.Grant).
type GrantRequest struct {
	// Op is "share", "unshare" or "list".
	Op   string `json:"op"`
	Port uint16 `json:"port,omitempty"`
	// With are user names, uids, "@group" or "@gid"; unshare without
	// With removes every grant on the port.
	With []string `json:"with,omitempty"`
	// For is how long ("2h"); "" is the site's default.
	For string `json:"for,omitempty"`
}

// GrantInfo is a grant as `palisade share --list` shows it.
type GrantInfo struct {
	policy.Grant
	OwnerName   string    `json:"owner_name,omitempty"`
	GranteeName string    `json:"grantee_name,omitempty"`
	Created     time.Time `json:"created"`
	Node        string    `json:"node,omitempty"`
}

// GrantAnswer answers a GrantRequest.
type GrantAnswer struct {
	Grants  []GrantInfo `json:"grants"`
	Message string      `json:"message,omitempty"`
}

// ForwardedGrant is a grant request another node's agent forwards (ident
// KindGrant) for the user its flows socket authenticated.
type ForwardedGrant struct {
	Asker   uint32       `json:"asker"`
	Request GrantRequest `json:"request"`
}

// answerForwarded serves a forwarded request (the ident service's data
// queries: root on a cluster node, from a privileged port).
func (s *grantStore) answerForwarded(args json.RawMessage) (json.RawMessage, error) {
	var f ForwardedGrant
	if err := json.Unmarshal(args, &f); err != nil {
		return nil, err
	}
	a, err := s.handle(f.Asker, f.Request)
	if err != nil {
		return nil, err
	}
	return json.Marshal(a)
}

// grantStore is the node's grants, mirrored into the kernel map.
type grantStore struct {
	mu      sync.Mutex
	grants  []GrantInfo
	pol     func() *policy.Policy
	res     identity.Resolver
	node    string
	log     *slog.Logger
	logLine func(line []byte) // the event log (nil: none)
	// listeners returns the owners of the TCP listeners on a port.
	listeners func(port uint16) ([]uint32, error)
	write     func([]policy.Grant) error
	now       func() time.Time
	// ops bounds each user's share and unshare requests (each writes the
	// kernel map and an event line): 2 a second, bursts of 10.
	ops map[uint32]*rate.Limiter
}

// active returns the grants as policy.Grants.
func (s *grantStore) active() []policy.Grant {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]policy.Grant, len(s.grants))
	for i, g := range s.grants {
		out[i] = g.Grant
	}
	return out
}

// count is the number of active grants (metrics).
func (s *grantStore) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.grants)
}

// event logs a grant's life: agent log and event log.
func (s *grantStore) event(what string, g GrantInfo, by uint32) {
	s.log.Info("user grant "+what, "owner", g.OwnerName, "port", g.Port, "grantee", g.GranteeName,
		"group", g.Group, "expires", g.Expires.UTC().Format(time.RFC3339), "by", by)
	if s.logLine == nil {
		return
	}
	line, _ := json.Marshal(struct {
		Time     time.Time `json:"time"`
		Node     string    `json:"node"`
		Grant    string    `json:"grant"`
		Owner    string    `json:"owner"`
		OwnerUID uint32    `json:"owner_uid"`
		Port     uint16    `json:"port"`
		To       string    `json:"to"`
		ToID     uint32    `json:"to_id"`
		Expires  time.Time `json:"expires"`
		By       uint32    `json:"by"`
	}{s.now().UTC(), s.node, what, g.OwnerName, g.Owner, g.Port, grantee(g), g.Grantee, g.Expires.UTC(), by})
	s.logLine(line)
}

func grantee(g GrantInfo) string {
	if g.Group {
		return "@" + g.GranteeName
	}
	return g.GranteeName
}

// handle serves one request of asker (the kernel's SO_PEERCRED uid).
func (s *grantStore) handle(asker uint32, req GrantRequest) (GrantAnswer, error) {
	if (req.Op == "share" || req.Op == "unshare") && !s.allowOp(asker) {
		return GrantAnswer{}, errors.New("too many share/unshare requests: retry in a few seconds")
	}
	switch req.Op {
	case "share":
		return s.share(asker, req)
	case "unshare":
		return s.unshare(asker, req)
	case "list":
		return GrantAnswer{Grants: s.list(asker)}, nil
	}
	return GrantAnswer{}, fmt.Errorf("unknown grant operation %q (want share, unshare or list)", req.Op)
}

func (s *grantStore) allowOp(asker uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ops == nil || len(s.ops) > 4096 {
		s.ops = map[uint32]*rate.Limiter{} // forget idle users' budgets
	}
	l := s.ops[asker]
	if l == nil {
		l = rate.NewLimiter(2, 10)
		s.ops[asker] = l
	}
	return l.Allow()
}

// resolve turns --with into (id, group) pairs.
func (s *grantStore) resolve(with []string) ([]policy.Grant, error) {
	var out []policy.Grant
	for _, w := range with {
		w = strings.TrimSpace(w)
		var g policy.Grant
		var err error
		if name, ok := strings.CutPrefix(w, "@"); ok {
			g.Group = true
			g.Grantee, err = identity.GID(s.res, name)
		} else {
			g.Grantee, err = identity.UID(s.res, w)
		}
		if err != nil {
			return nil, fmt.Errorf("--with %q: %w", w, err)
		}
		if !slices.ContainsFunc(out, func(o policy.Grant) bool { return o.Grantee == g.Grantee && o.Group == g.Group }) {
			out = append(out, g)
		}
	}
	return out, nil
}

func (s *grantStore) share(asker uint32, req GrantRequest) (GrantAnswer, error) {
	p := s.pol()
	if p.Grants.Disabled {
		return GrantAnswer{}, errors.New("user grants are disabled on this cluster (policy.user_grants = false)")
	}
	if req.Port <= p.SystemPortMax {
		return GrantAnswer{}, fmt.Errorf("port %d is a system port (<= %d): everyone reaches it already", req.Port, p.SystemPortMax)
	}
	if len(req.With) == 0 {
		return GrantAnswer{}, errors.New("share: --with names nobody")
	}
	// The kernel's record of who created the listeners on the port: the
	// asker must hold one (no one grants access to another user's port).
	owners, err := s.listeners(req.Port)
	if err != nil {
		return GrantAnswer{}, fmt.Errorf("share: the listeners on port %d cannot be read: %w", req.Port, err)
	}
	if !slices.Contains(owners, asker) {
		return GrantAnswer{}, fmt.Errorf("share: you hold no TCP listener on port %d on %s (only a listener's owner shares it)", req.Port, s.node)
	}
	d := p.Grants.Default
	if req.For != "" {
		var err error
		if d, err = time.ParseDuration(req.For); err != nil || d <= 0 {
			return GrantAnswer{}, fmt.Errorf("--for %q: want a positive duration (\"30m\", \"2h\")", req.For)
		}
	}
	if d > p.Grants.Max {
		return GrantAnswer{}, fmt.Errorf("--for %v exceeds this cluster's maximum of %v (policy.grant_max_duration)", d, p.Grants.Max)
	}
	want, err := s.resolve(req.With)
	if err != nil {
		return GrantAnswer{}, err
	}
	for _, g := range want {
		if !g.Group && g.Grantee == asker {
			return GrantAnswer{}, errors.New("share: you always reach your own listeners")
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	next := slices.Clone(s.grants)
	var made []GrantInfo
	for _, w := range want {
		g := GrantInfo{Grant: policy.Grant{Owner: asker, Port: req.Port, Grantee: w.Grantee, Group: w.Group, Expires: now.Add(d)},
			OwnerName: policy.UserName(s.res, asker), Created: now, Node: s.node}
		if g.Group {
			g.GranteeName = policy.GroupName(s.res, g.Grantee)
		} else {
			g.GranteeName = policy.UserName(s.res, g.Grantee)
		}
		if i := slices.IndexFunc(next, func(o GrantInfo) bool {
			return o.Owner == asker && o.Port == g.Port && o.Grantee == g.Grantee && o.Group == g.Group
		}); i >= 0 {
			next[i].Expires = g.Expires // renewed
			made = append(made, next[i])
			continue
		}
		next = append(next, g)
		made = append(made, g)
	}
	mine, onPort := 0, 0
	for _, g := range next {
		if g.Owner == asker {
			mine++
			if g.Port == req.Port {
				onPort++
			}
		}
	}
	if mine > p.Grants.MaxPerUser {
		return GrantAnswer{}, fmt.Errorf("share: %d grants would exceed this cluster's limit of %d per user (policy.grant_max): unshare some first", mine, p.Grants.MaxPerUser)
	}
	if onPort > policy.GrantsPerPort {
		return GrantAnswer{}, fmt.Errorf("share: at most %d grantees per port (share with a @group instead)", policy.GrantsPerPort)
	}
	if err := s.apply(next); err != nil {
		return GrantAnswer{}, err
	}
	for _, g := range made {
		s.event("created", g, asker)
	}
	return GrantAnswer{Grants: made}, nil
}

func (s *grantStore) unshare(asker uint32, req GrantRequest) (GrantAnswer, error) {
	want, err := s.resolve(req.With)
	if err != nil {
		return GrantAnswer{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var gone, keep []GrantInfo
	for _, g := range s.grants {
		mine := g.Owner == asker || asker == 0 // root revokes anyone's
		match := g.Port == req.Port && (len(want) == 0 || slices.ContainsFunc(want, func(w policy.Grant) bool {
			return w.Grantee == g.Grantee && w.Group == g.Group
		}))
		if mine && match {
			gone = append(gone, g)
		} else {
			keep = append(keep, g)
		}
	}
	if len(gone) == 0 {
		return GrantAnswer{}, fmt.Errorf("unshare: no grant of yours on port %d matches", req.Port)
	}
	if err := s.apply(keep); err != nil {
		return GrantAnswer{}, err
	}
	for _, g := range gone {
		s.event("revoked", g, asker)
	}
	return GrantAnswer{Grants: gone}, nil
}

// list: root sees every grant; a user the grants they made and those that
// admit them (to them, or to a group NSS says they are in).
func (s *grantStore) list(asker uint32) []GrantInfo {
	var groups []uint32
	if asker != 0 {
		if name, err := s.res.LookupUID(asker); err == nil {
			groups, _ = s.res.GroupsOf(name)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []GrantInfo{}
	for _, g := range s.grants {
		if asker == 0 || g.Owner == asker || (!g.Group && g.Grantee == asker) || (g.Group && slices.Contains(groups, g.Grantee)) {
			out = append(out, g)
		}
	}
	return out
}

// apply writes next to the kernel and, if that worked, keeps it (mu held).
func (s *grantStore) apply(next []GrantInfo) error {
	gs := make([]policy.Grant, len(next))
	for i, g := range next {
		gs[i] = g.Grant
	}
	if err := s.write(gs); err != nil {
		return fmt.Errorf("grants: %w", err)
	}
	s.grants = next
	return nil
}

// sweep removes expired grants, those whose owner holds no listener on the
// port any more, and every grant when the site disabled them.
func (s *grantStore) sweep() {
	s.mu.Lock()
	if len(s.grants) == 0 {
		s.mu.Unlock()
		return
	}
	grants := slices.Clone(s.grants)
	s.mu.Unlock()
	// Listeners are read without the lock (sock_diag).
	now := s.now()
	disabled := s.pol().Grants.Disabled
	owners := map[uint16][]uint32{}
	why := map[int]string{}
	for i, g := range grants {
		switch {
		case disabled:
			why[i] = "disabled"
		case !g.Expires.After(now):
			why[i] = "expired"
		default:
			o, ok := owners[g.Port]
			if !ok {
				var err error
				if o, err = s.listeners(g.Port); err != nil {
					continue // kept: the kernel checks the owner anyway
				}
				owners[g.Port] = o
			}
			if !slices.Contains(o, g.Owner) {
				why[i] = "closed"
			}
		}
	}
	if len(why) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var keep, gone []GrantInfo
	var reasons []string
	for _, g := range s.grants {
		i := slices.IndexFunc(grants, func(o GrantInfo) bool { return o.Grant == g.Grant })
		if r, ok := why[i]; i >= 0 && ok {
			gone, reasons = append(gone, g), append(reasons, r)
		} else {
			keep = append(keep, g)
		}
	}
	if err := s.apply(keep); err != nil {
		s.log.Warn("user grants not removed (the kernel still checks their expiry and owner)", "err", err)
		return
	}
	for i, g := range gone {
		s.event(reasons[i], g, 0)
	}
}

// adopt takes the grants a previous agent left in the kernel map (a
// restart keeps users' grants until they expire).
func (s *grantStore) adopt(gs []policy.Grant) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	for _, g := range gs {
		if !g.Expires.After(now) {
			continue
		}
		gi := GrantInfo{Grant: g, OwnerName: policy.UserName(s.res, g.Owner), Node: s.node}
		if g.Group {
			gi.GranteeName = policy.GroupName(s.res, g.Grantee)
		} else {
			gi.GranteeName = policy.UserName(s.res, g.Grantee)
		}
		s.grants = append(s.grants, gi)
	}
}
