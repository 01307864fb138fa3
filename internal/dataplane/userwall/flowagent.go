package userwall

import (
	"context"
	"net/netip"
	"os"
	"time"

	"golang.org/x/time/rate"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/policy"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
	"github.com/palisade-hpc/palisade/internal/sys/unixserve"
)

// flowConfig is what the flow recorder and the flows socket read of the
// running configuration.
type flowConfig struct {
	nodes     []config.Node
	identPort uint16
	pol       *policy.Policy // cluster subnets: the only addresses asked
}

// newFlows is the agent's flow recorder (flows.go).
func (a *agent) newFlows() *flowRecorder {
	res, err := ident.NewResolver()
	if err != nil {
		a.log.Warn("flows: processes will not be named (sock_diag unavailable)", "err", err)
		res = nil
	}
	host, _ := os.Hostname()
	r := newFlowRecorder(a.cfg.Agent.FlowHistory, a.log, host, res, a.isLocalAddr)
	r.remote = func(ctx context.Context, node netip.Addr, target, peer netip.AddrPort, proto policy.Proto) (ident.Owner, error) {
		fc := a.flowCfg.Load()
		if fc == nil || fc.identPort == 0 {
			return ident.Owner{}, ident.ErrTimeout
		}
		return ident.Client{Port: fc.identPort, Timeout: 500 * time.Millisecond}.Query(ctx, node, target, peer, proto)
	}
	r.lost = func() (uint64, error) {
		st, err := a.dp.ReadEventStats()
		return st.Lost, err
	}
	if st, err := a.dp.ReadEventStats(); err == nil {
		r.lastLost = st.Lost // an adopted data plane's earlier losses
	}
	a.flows = r
	a.setFlowConfig()
	return r
}

// setFlowConfig hands the running configuration to the flow recorder and
// the flows socket (main loop: start and reload).
func (a *agent) setFlowConfig() {
	a.flowCfg.Store(&flowConfig{nodes: a.cfg.Nodes, identPort: uint16(a.cfg.Agent.IdentPort), pol: a.cfg.Policy})
	if a.flows == nil {
		return
	}
	names := map[netip.Addr]string{}
	for _, n := range a.cfg.Nodes {
		names[n.Addr.Unmap()] = n.Name
	}
	a.flows.setNodes(names)
	a.flows.resize(a.cfg.Agent.FlowHistory)
	a.flows.audit.Store(a.cfg.Agent.Audit)
}

// isLocalAddr: loopback or one of this node's addresses (as last synced).
func (a *agent) isLocalAddr(x netip.Addr) bool {
	x = x.Unmap()
	if x.IsLoopback() {
		return true
	}
	m := a.localAddrs.Load()
	return m != nil && (*m)[x]
}

// serveFlows serves the flows socket; the returned func stops it.
func (a *agent) serveFlows(ctx context.Context) (stop func(), err error) {
	path := FlowsSocketPath(a.cfg.Agent.PidFile)
	// Open to every user: who may see what is decided per asker.
	l, err := unixserve.Listen(path, 0o666, -1)
	if err != nil {
		return nil, err
	}
	s := &flowServer{rec: a.flows, grants: a.grants, l: l, log: a.log, cfg: a.flowCfg.Load, remoteAsks: rate.NewLimiter(20, 20)}
	ctx, cancel := context.WithCancel(ctx)
	return goJoined(func() { s.serve(ctx) }, func() { cancel(); l.Close() }, nil), nil
}

// close releases the recorder's socket lookups (after run returned).
func (r *flowRecorder) close() {
	if r.res != nil {
		r.res.Close()
	}
}
