// Package egress holds what the egress data plane's packages share: the
// [egress] table of the configuration (internal/config composes it); the
// gateway, client, relay and the rest live in its subpackages.
package egress

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Config is the [egress] table: the egress gateway (`palisade
// gateway`), its address pool and DNS, and the client's pin of the gateway
// key (`palisade egress`). Command-line flags override these values.
type Config struct {
	// StateDir holds the gateway key, leases, revocations and stats.
	StateDir string `toml:"state_dir"`
	// ListenPort is the WireGuard UDP port; joins use ListenPort+1.
	ListenPort int `toml:"listen_port"`
	// Endpoint is host:port of the join service as clients reach it; it is
	// written into the tokens the gateway issues.
	Endpoint string `toml:"endpoint"`
	// Pool is the client address pool; its first host is the gateway.
	Pool string `toml:"pool"`
	// Mode: "auto" (tun as root, netstack otherwise), "tun" or "netstack".
	Mode string `toml:"mode"`
	// TunName is the gateway's kernel tun in tun mode.
	TunName string `toml:"tun_name"`
	// Domain is the overlay DNS zone of <user>-<job>-<node> names.
	Domain string `toml:"domain"`
	// UpstreamDNS (ip:port) answers every other name; "" refuses them.
	UpstreamDNS string `toml:"upstream_dns"`
	MTU         int    `toml:"mtu"`
	// LeaseTTL and TokenTTL are Go durations ("1h").
	LeaseTTL string `toml:"lease_ttl"`
	TokenTTL string `toml:"token_ttl"`
	// UserRate and GlobalRate limit bandwidth in bytes/s (0 = unlimited).
	UserRate   int64 `toml:"user_rate"`
	GlobalRate int64 `toml:"global_rate"`
	// Deny lists CIDRs clients may not reach through the gateway (e.g. the
	// cluster's networks: the gateway would otherwise lend them its identity).
	Deny []string `toml:"deny"`
	// GatewayKey (client side) pins the gateway's public key (base64); a
	// token naming another key is refused.
	GatewayKey string `toml:"gateway_key"`
}

// SetDefaults fills in defaults before the file's values are decoded.
func (e *Config) SetDefaults() {
	*e = Config{
		StateDir:   "/var/lib/palisade/egress",
		ListenPort: 51820,
		Pool:       "100.64.0.0/16",
		Mode:       "auto",
		TunName:    "palgw0",
		Domain:     "egress.palisade",
		MTU:        1420,
		LeaseTTL:   "1h",
		TokenTTL:   "24h",
	}
}

// Validate checks the table after decoding.
func (e *Config) Validate() error {
	var errs []error
	if e.StateDir == "" {
		errs = append(errs, policy.KeyErrorf("state_dir", "must not be empty"))
	}
	if e.ListenPort < 1 || e.ListenPort > 65534 {
		errs = append(errs, policy.KeyErrorf("listen_port", "%d out of range 1-65534", e.ListenPort))
	}
	if e.Endpoint != "" {
		if _, _, err := net.SplitHostPort(e.Endpoint); err != nil {
			errs = append(errs, policy.KeyErrorf("endpoint", "want host:port: %v", err))
		}
	}
	if p, err := netip.ParsePrefix(e.Pool); err != nil || !p.Addr().Is4() || p.Bits() > 28 {
		errs = append(errs, policy.KeyErrorf("pool", "%q: want an IPv4 CIDR of /28 or larger", e.Pool))
	}
	if !slices.Contains([]string{"auto", "tun", "netstack"}, e.Mode) {
		errs = append(errs, policy.KeyErrorf("mode", "%q: want auto, tun or netstack", e.Mode))
	}
	if e.TunName == "" || len(e.TunName) > 15 {
		errs = append(errs, policy.KeyErrorf("tun_name", "%q: want 1-15 characters", e.TunName))
	}
	if e.UpstreamDNS != "" {
		if _, err := netip.ParseAddrPort(e.UpstreamDNS); err != nil {
			errs = append(errs, policy.KeyErrorf("upstream_dns", "%q: want ip:port", e.UpstreamDNS))
		}
	}
	if e.MTU < 576 || e.MTU > 9000 {
		errs = append(errs, policy.KeyErrorf("mtu", "%d out of range 576-9000", e.MTU))
	}
	for _, k := range []struct{ key, v string }{{"lease_ttl", e.LeaseTTL}, {"token_ttl", e.TokenTTL}} {
		if d, err := time.ParseDuration(k.v); err != nil || d < time.Minute {
			errs = append(errs, policy.KeyErrorf(k.key, "%q: want a duration of at least 1m", k.v))
		}
	}
	for _, d := range e.Deny {
		if _, err := netip.ParsePrefix(d); err != nil {
			errs = append(errs, &policy.KeyError{Key: "deny", Value: d, Err: errors.New("want a CIDR")})
		}
	}
	if e.UserRate < 0 {
		errs = append(errs, policy.KeyErrorf("user_rate", "must not be negative"))
	}
	if e.GlobalRate < 0 {
		errs = append(errs, policy.KeyErrorf("global_rate", "must not be negative"))
	}
	return errors.Join(errs...)
}
