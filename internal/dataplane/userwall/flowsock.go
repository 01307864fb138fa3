package userwall

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/policy"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
	"github.com/palisade-hpc/palisade/internal/sys/unixserve"
)

// The flows socket: the agent's local API for `palisade flows` and
// `palisade audit report`, open to every user (mode 0666): the asker is
// known from the socket (SO_PEERCRED), and anyone but root gets only the
// flows with themselves at one end — on this node and, asked through this
// agent, on the others (the agent passes the asker's uid on; other nodes
// trust it as they trust root's queries: privileged port, cluster source).

// FlowsSocketPath is the flows socket of the agent with this pid file.
func FlowsSocketPath(pidFile string) string {
	return strings.TrimSuffix(pidFile, ".pid") + ".flows.sock"
}

// FlowsRequest is one request on the flows socket (one JSON line).
type FlowsRequest struct {
	// Kind is ident.KindFlows or ident.KindAudit.
	Kind string `json:"kind"`
	// Nodes to ask: names of [cluster] nodes or addresses; empty: this
	// node; "all": every node of [cluster] nodes (this node if none).
	Nodes  []string   `json:"nodes,omitempty"`
	Filter FlowFilter `json:"filter"`
	Limit  int        `json:"limit,omitempty"`
	// Cursors are each node's cursor (FlowAnswer.Next), by node name.
	Cursors map[string]uint64 `json:"cursors,omitempty"`
	// Grant is a user grant request (Kind KindGrant).
	Grant *GrantRequest `json:"grant,omitempty"`
}

// KindGrant is the flows socket's request kind for user grants (palisade
// share, unshare, share --list): decided by this node's agent for the
// asker the kernel names.
const KindGrant = ident.KindGrant

// NodeFlows is one node's part of a FlowsResponse.
type NodeFlows struct {
	Name  string       `json:"name"`
	Addr  string       `json:"addr,omitempty"`
	Error string       `json:"error,omitempty"`
	Flows *FlowAnswer  `json:"flows,omitempty"`
	Audit *AuditAnswer `json:"audit,omitempty"`
	Grant *GrantAnswer `json:"grant,omitempty"`
}

// FlowsResponse answers a FlowsRequest.
type FlowsResponse struct {
	Error string      `json:"error,omitempty"`
	Nodes []NodeFlows `json:"nodes,omitempty"`
}

// flowTarget is a node to ask; local: this node's recorder.
type flowTarget struct {
	name  string
	addr  netip.Addr
	local bool
}

// flowServer serves the flows socket.
type flowServer struct {
	rec    *flowRecorder
	grants *grantStore
	l      *unixserve.Listener
	log    *slog.Logger
	cfg    func() *flowConfig // the main loop's: [cluster] nodes, ident port, subnets
	// remoteAsks bounds the requests that go to other nodes (each asks
	// every node named): a user's loop cannot make this agent flood the
	// cluster with ident queries.
	remoteAsks *rate.Limiter
}

// maxParallelAsks bounds the nodes asked at once (privileged source ports
// are 424).
const maxParallelAsks = 64

// serve accepts until the listener is closed (at most 16 clients at once).
func (s *flowServer) serve(ctx context.Context) {
	unixserve.Serve(s.l, unixserve.Options{Max: 16, Name: "flows", Log: s.log}, func(c *net.UnixConn, peer *unix.Ucred, _ func()) {
		s.serveConn(ctx, c, peer.Uid)
	})
}

func (s *flowServer) serveConn(ctx context.Context, c *net.UnixConn, uid uint32) {
	c.SetDeadline(time.Now().Add(30 * time.Second))
	r := bufio.NewReaderSize(c, 8192)
	line, err := r.ReadSlice('\n')
	if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
		return
	}
	var req FlowsRequest
	var resp FlowsResponse
	if err := json.Unmarshal(line, &req); err != nil {
		resp.Error = "malformed request: " + err.Error()
	} else {
		// Whatever the request says: a user sees their own flows only.
		req.Filter.AsUID = nil
		if uid != 0 {
			req.Filter.AsUID = &uid
		}
		if req.Kind == KindGrant {
			resp = s.answerGrant(ctx, uid, req)
		} else {
			resp = s.answer(ctx, req)
		}
	}
	b, _ := json.Marshal(resp)
	c.Write(append(b, '\n'))
}

func (s *flowServer) targets(want []string) ([]flowTarget, error) {
	fc := s.cfg()
	self := flowTarget{name: s.rec.node, local: true}
	var all []flowTarget
	haveSelf := false
	for _, n := range fc.nodes {
		t := flowTarget{name: n.Name, addr: n.Addr}
		if s.rec.local != nil && s.rec.local(n.Addr) {
			t.local = true
			haveSelf = true
		}
		all = append(all, t)
	}
	if !haveSelf {
		all = append([]flowTarget{self}, all...)
	}
	if len(want) == 0 {
		return []flowTarget{self}, nil
	}
	if len(want) == 1 && want[0] == "all" {
		return all, nil
	}
	var out []flowTarget
	for _, w := range want {
		found := false
		for _, t := range all {
			if w == t.name || (t.addr.IsValid() && w == t.addr.String()) || (t.local && w == s.rec.node) {
				out = append(out, t)
				found = true
				break
			}
		}
		if !found {
			a, err := netip.ParseAddr(w)
			if err != nil {
				return nil, fmt.Errorf("unknown node %q (not in [cluster] nodes, not an address)", w)
			}
			if fc.pol == nil || !fc.pol.InCluster(a) {
				return nil, fmt.Errorf("%v is not in a cluster subnet: no node to ask", a)
			}
			out = append(out, flowTarget{name: w, addr: a, local: s.rec.local != nil && s.rec.local(a)})
		}
	}
	return out, nil
}

// answerGrant serves a grant request of asker (SO_PEERCRED): on this node,
// or on the nodes req.Nodes names (hostlist syntax), whose agents each
// decide it for asker (forwarded over the ident service, as root's flow
// queries are: privileged port, cluster source).
func (s *flowServer) answerGrant(ctx context.Context, asker uint32, req FlowsRequest) FlowsResponse {
	if s.grants == nil || req.Grant == nil {
		return FlowsResponse{Error: "user grants: no grant store (or no request)"}
	}
	if len(req.Nodes) == 0 {
		a, err := s.grants.handle(asker, *req.Grant)
		if err != nil {
			return FlowsResponse{Error: err.Error()}
		}
		return FlowsResponse{Nodes: []NodeFlows{{Name: s.grants.node, Grant: &a}}}
	}
	var names []string
	for _, n := range req.Nodes {
		hs, err := policy.ExpandHostlist(n)
		if err != nil {
			return FlowsResponse{Error: fmt.Sprintf("--node %q: %v", n, err)}
		}
		names = append(names, hs...)
	}
	port := s.cfg().identPort
	return s.askEach(names, func(t flowTarget) NodeFlows {
		nf := NodeFlows{Name: t.name}
		var a GrantAnswer
		var err error
		if t.local {
			a, err = s.grants.handle(asker, *req.Grant)
		} else {
			raw, _ := json.Marshal(ForwardedGrant{Asker: asker, Request: *req.Grant})
			var data json.RawMessage
			if data, err = (ident.Client{Port: port, Timeout: 2 * time.Second}).Data(ctx, t.addr, ident.KindGrant, raw); err == nil {
				err = json.Unmarshal(data, &a)
			}
		}
		if err != nil {
			nf.Error = err.Error()
		} else {
			nf.Grant = &a
		}
		return nf
	})
}

// askEach asks every node named (targets) with ask, at most
// maxParallelAsks at once; asking other nodes is rate-limited
// (remoteAsks).
func (s *flowServer) askEach(names []string, ask func(flowTarget) NodeFlows) FlowsResponse {
	ts, err := s.targets(names)
	if err != nil {
		return FlowsResponse{Error: err.Error()}
	}
	if slices.ContainsFunc(ts, func(t flowTarget) bool { return !t.local }) && !s.remoteAsks.Allow() {
		return FlowsResponse{Error: "too many requests to other nodes: retry in a second"}
	}
	out := make([]NodeFlows, len(ts))
	sem := make(chan struct{}, maxParallelAsks)
	var wg sync.WaitGroup
	for i, t := range ts {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			out[i] = ask(t)
		})
	}
	wg.Wait()
	return FlowsResponse{Nodes: out}
}

// answer asks every target node, in parallel (1 s each).
func (s *flowServer) answer(ctx context.Context, req FlowsRequest) FlowsResponse {
	if req.Kind != ident.KindFlows && req.Kind != ident.KindAudit {
		return FlowsResponse{Error: fmt.Sprintf("unknown kind %q (want %s or %s)", req.Kind, ident.KindFlows, ident.KindAudit)}
	}
	port := s.cfg().identPort
	return s.askEach(req.Nodes, func(t flowTarget) NodeFlows {
		nf := NodeFlows{Name: t.name}
		if t.addr.IsValid() {
			nf.Addr = t.addr.String()
		}
		var args any
		if req.Kind == ident.KindFlows {
			args = FlowQuery{Filter: req.Filter, After: req.Cursors[t.name], Limit: req.Limit}
		} else {
			args = AuditQuery{Filter: req.Filter, Limit: req.Limit}
		}
		if t.local {
			switch q := args.(type) {
			case FlowQuery:
				a := s.rec.Flows(q, 0)
				nf.Flows = &a
			case AuditQuery:
				a := s.rec.Audit(q, 0)
				nf.Audit = &a
			}
			return nf
		}
		raw, _ := json.Marshal(args)
		data, err := ident.Client{Port: port, Timeout: time.Second}.Data(ctx, t.addr, req.Kind, raw)
		if err == nil {
			if req.Kind == ident.KindFlows {
				nf.Flows = &FlowAnswer{}
				err = json.Unmarshal(data, nf.Flows)
			} else {
				nf.Audit = &AuditAnswer{}
				err = json.Unmarshal(data, nf.Audit)
			}
		}
		if err != nil {
			nf.Flows, nf.Audit, nf.Error = nil, nil, err.Error()
		}
		return nf
	})
}

// AskFlows sends req to the agent's flows socket at path and returns its
// answer.
func AskFlows(ctx context.Context, path string, req FlowsRequest) (*FlowsResponse, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("flows: no agent answers on %s: %w", path, err)
	}
	defer conn.Close()
	deadline := time.Now().Add(10 * time.Second)
	if d, ok := ctx.Deadline(); ok {
		deadline = d
	}
	conn.SetDeadline(deadline)
	b, _ := json.Marshal(req)
	if _, err := conn.Write(append(b, '\n')); err != nil {
		return nil, err
	}
	var resp FlowsResponse
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		return nil, fmt.Errorf("flows: %w", err)
	}
	if resp.Error != "" {
		return &resp, errors.New(resp.Error)
	}
	return &resp, nil
}
