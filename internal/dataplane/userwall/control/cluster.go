package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	ident "github.com/palisade-hpc/palisade/internal/sockowner"
)

// NodeReport is a node's answer to a status query over the ident service
// (`palisade status --all`): what `palisade status` says there, in short.
type NodeReport struct {
	Host string `json:"host"`
	Mode string `json:"mode"`
	// Enforcing: the programs refuse (enabled, not audit).
	Enforcing bool   `json:"enforcing"`
	Audit     bool   `json:"audit"`
	Version   string `json:"version"`
	Commit    string `json:"commit,omitempty"`
	// ConfigSHA is the running file's hash, SharedSHA the hash of its
	// cluster-wide tables (config.Config.SharedSHA256).
	ConfigSHA       string    `json:"config_sha256"`
	SharedSHA       string    `json:"shared_sha256"`
	Generation      uint64    `json:"generation"`
	Started         time.Time `json:"started"`
	LastReload      time.Time `json:"last_reload,omitzero"`
	LastReloadError string    `json:"last_reload_error,omitempty"`
	Links           int       `json:"links"`
	Warnings        []string  `json:"warnings,omitempty"`
	Errors          []string  `json:"errors,omitempty"`
}

// Node states in the cluster view.
const (
	NodeOK         = "ok"
	NodeWarnings   = "warnings"
	NodeErrors     = "errors" // enforcing, with what breaks users' traffic (no key, config ERRORs)
	NodeAudit      = "audit"
	NodeDown       = "down"  // no answer: agent (or node) down
	NodeDrift      = "drift" // another cluster-wide configuration
	NodeNotEnforce = "not-enforcing"
)

// NodeView is one node of the cluster view.
type NodeView struct {
	Name   string      `json:"name"`
	Addr   netip.Addr  `json:"addr"`
	State  string      `json:"state"`
	Error  string      `json:"error,omitempty"`
	Report *NodeReport `json:"report,omitempty"`
	err    error
}

// ClusterView asks every node's agent for its report, timeout per node
// (in parallel, at most 64 at once), and judges each against want, the
// cluster-wide configuration hash every node should run. Its only error:
// the caller may not ask at all (ident.ErrUnprivileged).
func ClusterView(ctx context.Context, nodes []config.Node, port uint16, timeout time.Duration, want string) ([]NodeView, error) {
	out := make([]NodeView, len(nodes))
	sem := make(chan struct{}, 64)
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			v := NodeView{Name: n.Name, Addr: n.Addr}
			raw, err := ident.Client{Port: port, Timeout: timeout}.Status(ctx, n.Addr)
			var r NodeReport
			if err == nil {
				err = json.Unmarshal(raw, &r)
			}
			if err != nil {
				v.State, v.Error, v.err = NodeDown, err.Error(), err
				out[i] = v
				return
			}
			v.Report = &r
			switch {
			case r.Mode != "userwall":
				v.State = NodeNotEnforce
			case r.SharedSHA != want:
				v.State = NodeDrift
				v.Error = fmt.Sprintf("runs cluster-wide configuration %.12s, expected %.12s", r.SharedSHA, want)
			case r.Audit:
				v.State = NodeAudit
			case !r.Enforcing:
				v.State = NodeNotEnforce
			case len(r.Errors) > 0:
				v.State = NodeErrors
			case len(r.Warnings) > 0:
				v.State = NodeWarnings
			default:
				v.State = NodeOK
			}
			out[i] = v
		})
	}
	wg.Wait()
	for _, v := range out {
		if v.err != nil && errors.Is(v.err, ident.ErrUnprivileged) {
			return nil, v.err
		}
	}
	return out, nil
}
