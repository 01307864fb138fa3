// Package portal lets a trusted web proxy (Open OnDemand's Apache,
// JupyterHub's proxy) open connections *as* the user it authenticated, so
// that the proxy account is never an exempt connector and reaches only what
// that user may reach. The agent (root) creates the socket with the user's
// filesystem ids — the identity the kernel and userwall record for a socket
// (docs/userwall.md, "Identity of each end") — connects it and hands the
// connected descriptor to the proxy (SCM_RIGHTS). It does so only for an
// account named in [portal] proxies, only for a user who has a session with
// that proxy (a process of the user registered it: kernel-authenticated
// evidence), never for root, system accounts or exempt accounts.
// docs/portals.md has the design and its threat model.
package portal

import (
	"errors"
	"path/filepath"
	"time"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Config is the [portal] table.
type Config struct {
	// Socket is the delegation socket ("" = off). Open to everyone
	// (0666): every request is authorised by its sender's credentials
	// (SO_PEERCRED).
	Socket string `toml:"socket"`
	// Proxies are the accounts (names or uids) that may ask for
	// connections on a user's behalf.
	Proxies []string `toml:"proxies"`
	// MinUID: no connection is made for a uid below it (system accounts).
	MinUID int64 `toml:"min_uid"`
	// MaxSession bounds a session's lifetime ("24h").
	MaxSession string `toml:"max_session"`
}

// Defaults.
const (
	DefaultSocket     = "/run/palisade/portal.sock"
	DefaultMinUID     = 1000
	DefaultMaxSession = "24h"
)

// SetDefaults fills in defaults before the file's values are decoded.
func (c *Config) SetDefaults() {
	*c = Config{Socket: DefaultSocket, MinUID: DefaultMinUID, MaxSession: DefaultMaxSession}
}

// Validate checks the table after decoding.
func (c *Config) Validate() error {
	var errs []error
	if c.Socket != "" && !filepath.IsAbs(c.Socket) {
		errs = append(errs, policy.KeyErrorf("socket", "%q: want an absolute path, or \"\" for off", c.Socket))
	}
	for _, p := range c.Proxies {
		if p == "" {
			errs = append(errs, policy.KeyErrorf("proxies", "an empty account name"))
		}
	}
	if c.MinUID < 1 || c.MinUID > 1<<32-1 {
		errs = append(errs, policy.KeyErrorf("min_uid", "%d: want 1..4294967295 (root is never acted for)", c.MinUID))
	}
	if d, err := time.ParseDuration(c.MaxSession); err != nil || d < time.Second {
		errs = append(errs, policy.KeyErrorf("max_session", "%q: want a duration of at least 1s (e.g. \"24h\")", c.MaxSession))
	}
	return errors.Join(errs...)
}

// maxSession is MaxSession parsed (validated).
func (c *Config) maxSession() time.Duration {
	d, err := time.ParseDuration(c.MaxSession)
	if err != nil || d < time.Second {
		return 24 * time.Hour
	}
	return d
}
