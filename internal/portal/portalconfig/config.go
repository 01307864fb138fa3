// Package portalconfig is the [portal] section of the configuration,
// apart from the delegation itself (package portal) so that the
// configuration does not import it.
package portalconfig

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

// MaxSessionDuration is MaxSession parsed (validated).
func (c *Config) MaxSessionDuration() time.Duration {
	d, err := time.ParseDuration(c.MaxSession)
	if err != nil || d < time.Second {
		return 24 * time.Hour
	}
	return d
}
