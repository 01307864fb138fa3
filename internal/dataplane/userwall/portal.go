package userwall

import (
	"context"
	"fmt"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/portal"
)

func portalSettings(cfg *config.Config) portal.Settings {
	return portal.Settings{Config: cfg.Portal, Exempt: cfg.Policy.ExemptConnectors}
}

// servePortal serves [portal] socket, the delegation for web portals
// (internal/portal). Its server reads the data plane (own lock) and its
// settings (atomic, replaced by reload).
func (a *agent) servePortal(ctx context.Context) (stop func(), err error) {
	path := a.cfg.Portal.Socket
	if path == "" {
		return func() {}, nil
	}
	s := portal.NewServer(a.dp, identity.System(), portalSettings(a.cfg), a.log.With("service", "portal"))
	if err := s.Listen(path); err != nil {
		return nil, fmt.Errorf("portal socket %s: %w", path, err)
	}
	a.portal = s
	ctx, cancel := context.WithCancel(ctx)
	return goJoined(func() { s.Serve(ctx) }, func() { cancel(); s.Close() }, nil), nil
}

// reloadPortal applies a reloaded [portal] table (main loop).
func (a *agent) reloadPortal(old, cfg *config.Config) {
	if old.Portal.Socket != cfg.Portal.Socket {
		a.log.Warn("[portal] socket changed: applies at the next restart", "running", old.Portal.Socket, "configured", cfg.Portal.Socket)
		a.notes = append(a.notes, "[portal] socket changed: restart the agent to apply it")
	}
	if a.portal != nil {
		a.portal.SetSettings(portalSettings(cfg))
	}
}
